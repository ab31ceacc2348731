"""The building blocks: seeded weights, RMSNorm, rotary embeddings, paged attention,
the router and one expert's FFN."""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from services.engine_worker.model.config import MoEConfig
from services.engine_worker.model.kv_cache import BatchLayout


def seeded_weight(seed: int, name: str, shape: tuple[int, ...], std: float,
                  device: str | torch.device = "cpu") -> nn.Parameter:
    """A weight that is a function of (seed, name) only, so any rank can materialize any
    parameter (in particular only its own experts) and get bit-identical values."""
    g = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (1 << 63))
    w = torch.randn(shape, generator=g, dtype=torch.float32) * std
    return nn.Parameter(w.to(device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Rotary position embeddings (rotate-half form), tables precomputed to max_position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, device: str | torch.device = "cpu") -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().float().to(device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; positions: [T]."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Multi-head attention over a paged KV cache.

    Every chunk's new K/V is written to its slots first; then each chunk gathers its whole
    context through its block table and attends causally. Chunks are padded to the
    longest chunk / context of the batch: simple, vectorized, fine for a small model."""

    def __init__(self, cfg: MoEConfig, prefix: str, device: str | torch.device = "cpu") -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.w_qkv = seeded_weight(cfg.seed, f"{prefix}.w_qkv", (3 * d, d), d ** -0.5, device)
        self.w_o = seeded_weight(cfg.seed, f"{prefix}.w_o", (d, d), d ** -0.5, device)

    def forward(self, x: torch.Tensor, layout: BatchLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rotary: Rotary) -> torch.Tensor:
        T = x.shape[0]
        if T == 0:
            return x
        H, D = self.n_heads, self.head_dim
        q, k, v = (x @ self.w_qkv.T).view(T, 3, H, D).unbind(1)
        q, k = rotary(q, layout.positions), rotary(k, layout.positions)
        k_slots, v_slots = k_cache.view(-1, H, D), v_cache.view(-1, H, D)
        k_slots[layout.slot_mapping] = k
        v_slots[layout.slot_mapping] = v
        kc = k_slots[layout.ctx_slots].transpose(1, 2)          # [B, H, Lmax, D]
        vc = v_slots[layout.ctx_slots].transpose(1, 2)
        qp = q[layout.q_index].transpose(1, 2)                   # [B, H, Qmax, D]
        out = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=layout.attn_mask)
        out = out.transpose(1, 2)[layout.q_valid]                # [T, H, D], chunk order
        return out.reshape(T, H * D) @ self.w_o.T


class Router(nn.Module):
    """Top-k gating: softmax over all experts, keep the k largest, renormalize."""

    def __init__(self, cfg: MoEConfig, prefix: str, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.weight = seeded_weight(cfg.seed, f"{prefix}.router", (cfg.n_experts, cfg.d_model),
                                    cfg.d_model ** -0.5, device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, d] -> (weights [T, k] float, expert ids [T, k] long)."""
        probs = torch.softmax((x @ self.weight.T).float(), dim=-1)
        w, ids = probs.topk(self.top_k, dim=-1)
        return w / w.sum(-1, keepdim=True), ids


class ExpertFFN(nn.Module):
    """One expert: a SwiGLU feed-forward network."""

    def __init__(self, cfg: MoEConfig, prefix: str, device: str | torch.device = "cpu") -> None:
        super().__init__()
        d, f = cfg.d_model, cfg.d_ff
        self.w_gate = seeded_weight(cfg.seed, f"{prefix}.w_gate", (f, d), d ** -0.5, device)
        self.w_up = seeded_weight(cfg.seed, f"{prefix}.w_up", (f, d), d ** -0.5, device)
        self.w_down = seeded_weight(cfg.seed, f"{prefix}.w_down", (d, f), f ** -0.5, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w_gate.T) * (x @ self.w_up.T)) @ self.w_down.T
