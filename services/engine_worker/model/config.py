"""The shape of the small MoE transformer the torch backend serves."""

from __future__ import annotations

from dataclasses import dataclass

from shared.tokenizer import VOCAB_SIZE


@dataclass(frozen=True, slots=True)
class MoEConfig:
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 128                 # hidden width of one expert's SwiGLU FFN
    vocab_size: int = VOCAB_SIZE
    max_position: int = 4096
    seed: int = 0                   # every weight derives from (seed, parameter name)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be within 1..n_experts ({self.n_experts})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    def experts_of_rank(self, rank: int, world_size: int) -> range:
        """Experts are sharded contiguously; rank r holds [r*E/W, (r+1)*E/W).

        An uneven split is refused rather than padded: every rank must hold the same
        number of experts, or the busiest rank sets every step's time (the very imbalance
        lockstep exists to remove)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not within world_size {world_size}")
        if self.n_experts % world_size:
            raise ValueError(
                f"n_experts {self.n_experts} is not divisible by world_size {world_size}; "
                "choose an expert count that is a multiple of the EP group size")
        per = self.n_experts // world_size
        return range(rank * per, (rank + 1) * per)
