"""DeepSeek-V2 (V2, V2-Lite, V2.5) and DeepSeek-V3 (V3, R1, and Kimi-K2 of the same
architecture): multi-head latent attention (MLA) and MoE layers with shared experts; V3
differs in its router only (DeepseekRouter).

MLA: each token's keys and values are a low-rank latent (kv_lora_rank, RMS-normalized) plus
one rotary key shared by all heads (qk_rope_head_dim); the paged cache stores that latent
row (576 numbers a token for V2, not 2 x heads x head_dim; its first half in the cache's K
tensor, the rest in its V tensor), and each step expands the
context's latents through kv_b_proj into per-head keys (no-rope part) and values. RoPE
here is the interleaved (complex-pair) form, on the rotary parts only; the softmax scale
is qk_head_dim^-0.5, times mscale^2 under YaRN. Queries come from q_proj, or through a
low-rank q_a_proj -> norm -> q_b_proj (q_lora_rank).

MoE: softmax router over the routed experts, top-k (greedy, or group-limited: the best
topk_group groups of n_group first), weights times routed_scaling_factor (renormalized
instead when norm_topk_prob, as DeepSeek's own code does); the shared experts (one SwiGLU
of n_shared_experts x moe_intermediate_size) see every token, on every rank. The first
first_k_dense_replace layers have a dense MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.hf_layers import (DecoderModel, Linear, RMSNorm, SparseMoE, SwiGLU, empty,
                                                    moe_decoder)
from services.engine_worker.model.kv_cache import BatchLayout
from services.engine_worker.model.moe import AllToAll


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE: (x[2i], x[2i+1]) turned by angle i. x [T, H, D]; cos/sin [T, 1, D/2]."""
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves (a V3 config with rope_interleave false): (x[i], x[i + D/2]) turned by angle i."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


class MLAttention(nn.Module):
    def __init__(self, cfg: HFConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        m, d, H = cfg.mla, cfg.d_model, cfg.n_heads
        self.H, self.nope, self.rope, self.vd, self.lora = (H, m["qk_nope_head_dim"], cfg.rope_dim, m["v_head_dim"],
                                                            m["kv_lora_rank"])
        qk = self.nope + self.rope
        self.q_lora = m["q_lora_rank"]
        if self.q_lora:
            self.q_a_proj = Linear(self.q_lora, d, dtype, device)
            self.q_a_layernorm = RMSNorm(self.q_lora, 1e-6, dtype, device)
            self.q_b_proj = Linear(H * qk, self.q_lora, dtype, device)
        else:
            self.q_proj = Linear(H * qk, d, dtype, device)
        self.kv_a_proj_with_mqa = Linear(self.lora + self.rope, d, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.lora, 1e-6, dtype, device)
        self.kv_b_proj = Linear(H * (self.nope + self.vd), self.lora, dtype, device)
        self.o_proj = Linear(d, H * self.vd, dtype, device)
        self.scale = qk ** -0.5
        self.rotate = rotate_pairs if m.get("rope_interleave", True) else rotate_halves
        r = cfg.rope
        if r["rope_type"] != "default" and r.get("mscale_all_dim"):
            factor = float(r["factor"])
            ms = 0.1 * float(r["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            self.scale *= ms * ms

    def forward(self, x: torch.Tensor, layout: BatchLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        if T == 0:
            return x
        H, nope, rope, lora = self.H, self.nope, self.rope, self.lora
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(T, H, nope + rope).split([nope, rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([lora, rope], dim=-1)
        cos, sin = (t[..., : rope // 2].float() for t in cos_sin)      # the halves of cat(f, f) are equal
        q = torch.cat((q_nope, self.rotate(q_pe, cos, sin)), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), self.rotate(k_pe[:, None, :], cos, sin)[:, 0]), dim=-1)
        half = k_cache.shape[-1]                       # the latent row: first half in K, the rest in V
        k_slots, v_slots = k_cache.view(-1, half), v_cache.view(-1, half)
        k_slots[layout.slot_mapping] = latent[:, :half]
        v_slots[layout.slot_mapping, : lora + rope - half] = latent[:, half:]
        ctx = torch.cat((k_slots[layout.ctx_slots], v_slots[layout.ctx_slots][..., : lora + rope - half]), dim=-1)
        B, L = ctx.shape[:2]
        kv = self.kv_b_proj(ctx[..., :lora]).view(B, L, H, nope + self.vd)
        k = torch.cat((kv[..., :nope], ctx[..., None, lora:].expand(B, L, H, rope)), dim=-1).transpose(1, 2)
        v = kv[..., nope:].transpose(1, 2)
        qp = q[layout.q_index].transpose(1, 2)                          # [B, H, Qmax, qk]
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=layout.attn_mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2)[layout.q_valid].reshape(T, H * self.vd))


class DeepseekRouter(nn.Module):
    """V2: softmax, top-k (greedy or group-limited), renormalized or scaled. V3
    (``noaux_tc``): sigmoid scores; the choice adds a per-expert bias (its load balancing,
    ``e_score_correction_bias``) and keeps the topk_group groups whose best two biased
    scores sum highest; the weights are the unbiased scores, renormalized when
    norm_topk_prob, then scaled."""

    def __init__(self, cfg: HFConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        m = cfg.routing
        self.top_k, self.E, self.renorm = cfg.top_k, cfg.n_experts, cfg.norm_topk_prob and cfg.top_k > 1
        self.scaling, self.method = m["routed_scaling_factor"], m["topk_method"]
        self.n_group, self.topk_group = m["n_group"], m["topk_group"]
        self.weight = empty(cfg.n_experts, cfg.d_model, dtype=dtype, device=device)
        if self.method == "noaux_tc":
            self.renorm = cfg.norm_topk_prob
            self.e_score_correction_bias = empty(cfg.n_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        if self.method == "noaux_tc":
            return self._noaux_tc(logits.sigmoid())
        scores = torch.softmax(logits, dim=-1)
        if self.method == "group_limited_greedy":
            g = scores.view(-1, self.n_group, self.E // self.n_group)
            keep = torch.zeros_like(g[..., 0]).scatter_(1, g.amax(-1).topk(self.topk_group, dim=-1).indices, 1.0)
            scores = (g * keep[..., None]).view(-1, self.E)
        w, ids = scores.topk(self.top_k, dim=-1)
        return (w / w.sum(-1, keepdim=True) if self.renorm else w * self.scaling), ids

    def _noaux_tc(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = scores + self.e_score_correction_bias.float()
        g = choice.view(-1, self.n_group, self.E // self.n_group)
        best = g.topk(min(2, g.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.bool()[..., None].expand_as(g).reshape(-1, self.E), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scaling, ids


class DeepseekMoE(SparseMoE):
    def __init__(self, cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        super().__init__(cfg, rank, world_size, comm, dtype, device)
        self.router = DeepseekRouter(cfg, dtype, device)
        self.shared_experts = SwiGLU(cfg.d_model, cfg.d_ff_shared, dtype, device) if cfg.d_ff_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + self.shared_experts(x) if self.shared_experts is not None else y

    def checkpoint_names(self, prefix: str) -> dict[str, torch.Tensor]:
        out = super().checkpoint_names(prefix)
        if hasattr(self.router, "e_score_correction_bias"):
            out[f"{prefix}.gate.e_score_correction_bias"] = self.router.e_score_correction_bias
        if self.shared_experts is not None:
            out.update({f"{prefix}.shared_experts.{n}": p for n, p in self.shared_experts.named_parameters()})
        return out


def build(cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
          device: str | torch.device) -> DecoderModel:
    return moe_decoder(cfg, lambda: MLAttention(cfg, dtype, device),
                       lambda: DeepseekMoE(cfg, rank, world_size, comm, dtype, device), dtype, device)
