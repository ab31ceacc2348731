"""KV-cache block budget of one rank: fixed-size blocks handed to sequences.

A sequence's ``block_table`` lists its blocks in order; block i holds the KV of tokens
i*block_size .. (i+1)*block_size-1. Tables grow incrementally (``allocate`` up to N
tokens) and are released whole (``free``). No prefix caching.

``free`` rebinds ``seq.block_table`` to a new empty list instead of clearing it, so a
model runner still holding the previous step's ChunkInput (which shares the list) never
sees it change under it; growth only appends, which leaves earlier prefixes intact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.engine_worker.sequence import Sequence


class BlockManager:
    __slots__ = ("num_blocks", "block_size", "_free")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low block ids go out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    # -- counts ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Most tokens one sequence could ever hold on this rank."""
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # -- per sequence ------------------------------------------------------------------

    def blocks_missing(self, seq: "Sequence", num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_tokens`` tokens (0 when it has them)."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: "Sequence", num_tokens: int) -> bool:
        return self.blocks_missing(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: "Sequence", num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens; raises if the pool is
        short (check ``can_allocate`` first)."""
        need = self.blocks_missing(seq, num_tokens)
        if need == 0:
            return
        free = self._free
        if need > len(free):
            raise RuntimeError(f"KV pool short: {seq.id} needs {need} blocks, {len(free)} free")
        table = seq.block_table
        for _ in range(need):
            table.append(free.pop())

    def free(self, seq: "Sequence") -> int:
        """Return all of ``seq``'s blocks to the pool; the number freed."""
        table = seq.block_table
        if not table:
            return 0
        self._free.extend(reversed(table))
        seq.block_table = []
        return len(table)
