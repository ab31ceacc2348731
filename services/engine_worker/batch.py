"""What the engine's scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ChunkInput:
    """A run of consecutive tokens of one sequence to compute this step.

    Prefill chunks cover part of the prompt (chunked prefill); a decode chunk is the one
    last token. ``sample`` is True when the chunk ends at the sequence's last known token,
    so the runner must return the next token for it.
    """

    seq_id: str
    token_ids: list[int]          # the tokens to compute, positions start_pos .. start_pos+len-1
    start_pos: int
    block_table: list[int]        # KV blocks of the sequence, covering start_pos+len tokens
    sample: bool
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    prompt_len: int = 0           # sampling seeds derive from (seed, position)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)
