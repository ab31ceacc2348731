"""The transformer: embeddings, n_layers × (attention + MoE), final norm, LM head.

Everything but the experts is replicated on every rank (data-parallel attention)."""

from __future__ import annotations

import torch
from torch import nn

from services.engine_worker.model.config import MoEConfig
from services.engine_worker.model.kv_cache import BatchLayout, PagedKVCache
from services.engine_worker.model.layers import Attention, RMSNorm, Rotary, seeded_weight
from services.engine_worker.model.moe import AllToAll, MoELayer


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, index: int, rank: int, world_size: int,
                 comm: AllToAll | None, device: str | torch.device) -> None:
        super().__init__()
        prefix = f"layers.{index}"
        self.index = index
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device)
        self.attn = Attention(cfg, f"{prefix}.attn", device)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device)
        self.moe = MoELayer(cfg, f"{prefix}.moe", rank, world_size, comm, device)

    def forward(self, x: torch.Tensor, layout: BatchLayout, cache: PagedKVCache, rotary: Rotary) -> torch.Tensor:
        k_cache, v_cache = cache.layer(self.index)
        x = x + self.attn(self.attn_norm(x), layout, k_cache, v_cache, rotary)
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig, rank: int = 0, world_size: int = 1,
                 comm: AllToAll | None = None, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.embed = seeded_weight(cfg.seed, "embed", (cfg.vocab_size, d), 1.0, device)
        self.rotary = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta, device)
        self.layers = nn.ModuleList(Block(cfg, i, rank, world_size, comm, device) for i in range(cfg.n_layers))
        self.norm = RMSNorm(d, cfg.norm_eps, device)
        self.lm_head = seeded_weight(cfg.seed, "lm_head", (cfg.vocab_size, d), d ** -0.5, device)

    def forward(self, input_ids: torch.Tensor, layout: BatchLayout, cache: PagedKVCache) -> torch.Tensor:
        """input_ids: [T] (T may be 0: an idle forward that still joins every collective).
        Returns the final hidden states [T, d]."""
        x = self.embed[input_ids]
        for block in self.layers:
            x = block(x, layout, cache, self.rotary)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.T
