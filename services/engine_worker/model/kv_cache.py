"""The paged KV cache and how one batch of chunks addresses it.

Per layer, K and V are each ``[num_blocks, block_size, n_kv_heads, head_dim]``. Token at
position p of a sequence lives in block ``block_table[p // block_size]``, row
``p % block_size``; flattened, that is the *slot* ``block * block_size + row``. Which
blocks a sequence owns is decided by the engine's block manager, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine_worker.batch import ChunkInput
from services.engine_worker.model.config import MoEConfig
from services.engine_worker.model.hf_config import HFConfig


class PagedKVCache:
    def __init__(self, config: MoEConfig | HFConfig, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.n_layers, 2, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.data = torch.zeros(shape, device=device, dtype=dtype)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) tensors of layer i, each [num_blocks, block_size, n_heads, head_dim]."""
        return self.data[i, 0], self.data[i, 1]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(slots=True)
class BatchLayout:
    """Everything attention needs to know about one step's batch, as tensors.

    Tokens of all chunks are flattened in chunk order into T rows. For the padded
    per-chunk attention, ``q_index`` [B, Qmax] picks each chunk's rows out of the flat
    tokens (padding points at row 0) and ``ctx_slots`` [B, Lmax] lists the cache slots of
    each chunk's whole context, its own new tokens included.
    """

    num_tokens: int
    positions: torch.Tensor      # [T] absolute position of every token
    slot_mapping: torch.Tensor   # [T] cache slot each token's K/V is written to
    q_index: torch.Tensor        # [B, Qmax] flat row of each chunk's i-th token
    q_valid: torch.Tensor        # [B, Qmax] bool, False on padding
    ctx_slots: torch.Tensor      # [B, Lmax] cache slot of context position j
    attn_mask: torch.Tensor      # [B, 1, Qmax, Lmax] bool, True where query may see key
    last_index: torch.Tensor     # [B] flat row of each chunk's last token

    @staticmethod
    def empty(device: str | torch.device) -> "BatchLayout":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return BatchLayout(0, z, z, z.view(0, 0), z.view(0, 0).bool(), z.view(0, 0),
                           z.view(0, 1, 0, 0).bool(), z)


def build_layout(chunks: list[ChunkInput], block_size: int, num_blocks: int, max_position: int,
                 device: str | torch.device) -> BatchLayout:
    """Validate the chunks against the cache and lay them out for one forward."""
    if not chunks:
        return BatchLayout.empty(device)
    n_tok = [c.num_tokens for c in chunks]
    ctx = [c.context_len for c in chunks]
    for c in chunks:
        if c.num_tokens == 0:
            raise ValueError(f"chunk of {c.seq_id!r} has no tokens")
        if c.start_pos < 0 or c.context_len > max_position:
            raise ValueError(f"chunk of {c.seq_id!r} spans positions {c.start_pos}..{c.context_len - 1}, "
                             f"outside 0..{max_position - 1}")
        need = -(-c.context_len // block_size)
        if len(c.block_table) < need:
            raise ValueError(f"block_table of {c.seq_id!r} has {len(c.block_table)} blocks, "
                             f"{need} needed for {c.context_len} tokens")
        if any(not 0 <= b < num_blocks for b in c.block_table[:need]):
            raise ValueError(f"block_table of {c.seq_id!r} names a block outside 0..{num_blocks - 1}")

    q_max, l_max = max(n_tok), max(ctx)
    n_blk = -(-l_max // block_size)
    # Only the blocks covering each chunk's context are read; the rest is padding (block 0),
    # masked out of attention below.
    rows = [c.block_table[:-(-c.context_len // block_size)] for c in chunks]
    tables = torch.tensor([r + [0] * (n_blk - len(r)) for r in rows], dtype=torch.long)  # [B, n_blk]
    j = torch.arange(l_max)
    ctx_slots = tables[:, j // block_size] * block_size + (j % block_size)           # [B, Lmax]

    start = torch.tensor([c.start_pos for c in chunks], dtype=torch.long)
    n_tok_t = torch.tensor(n_tok, dtype=torch.long)
    ctx_t = torch.tensor(ctx, dtype=torch.long)
    offsets = torch.cumsum(n_tok_t, 0) - n_tok_t                                     # first flat row per chunk
    i = torch.arange(q_max)
    q_valid = i[None, :] < n_tok_t[:, None]                                          # [B, Qmax]
    q_index = torch.where(q_valid, offsets[:, None] + i[None, :], 0)
    q_pos = start[:, None] + i[None, :]                                              # [B, Qmax]
    # Key j is visible to a query at position p when j <= p (causal) and j is in context.
    # Padding queries sit past the context, so they still see key 0: no all-masked rows.
    attn_mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < ctx_t[:, None, None])

    positions = q_pos[q_valid]                                                       # [T], chunk order
    slot_mapping = ctx_slots.gather(1, q_pos.clamp(max=l_max - 1))[q_valid]
    return BatchLayout(
        num_tokens=sum(n_tok),
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        ctx_slots=ctx_slots.to(device),
        attn_mask=attn_mask[:, None].to(device),
        last_index=(offsets + n_tok_t - 1).to(device),
    )
