"""Rotary position embeddings as a checkpoint's config defines them: the inverse
frequencies of each rope_type (default, linear, llama3, yarn) and the rotate-half form.

cos/sin are computed per step from the positions (a few multiplies) rather than tabled up
to max_position: real checkpoints allow 32k-128k positions, a table that large is memory
spent on positions a request rarely reaches."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inv_freq_and_scale(rope: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float32, factor applied to cos and sin)."""
    base = float(rope["rope_theta"])
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if dim != head_dim:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    kind = rope["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(rope["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, rope), 1.0
    if kind == "yarn":
        return _yarn(inv, rope, dim, base)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3, yarn)")


def _llama3(inv: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths are divided by factor, short ones kept, the band between blended."""
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def _yarn(inv: torch.Tensor, rope: dict[str, Any], dim: int, base: float) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, keep the high ones, a linear ramp between;
    cos/sin grow by the attention factor (0.1 ln(factor) + 1 unless the config says)."""
    old = float(rope["original_max_position_embeddings"])
    factor = float(rope["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.get("attention_factor")
    if attn is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:     # the dimension that turns `rotations` times over `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                              # 1: extrapolate (high frequency), 0: interpolate
    return inv / factor * (1 - keep) + inv * keep, float(attn)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: dict[str, Any], head_dim: int, device: str | torch.device = "cpu") -> None:
        super().__init__()
        inv, self.scale = inv_freq_and_scale(rope, head_dim)
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] each (the head axis broadcasts), computed in float32 then cast."""
        f = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)[:, None, :]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] -> x rotated by each token's angles (rotate-half form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
