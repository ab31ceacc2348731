"""Building blocks of the Hugging Face-format models: parameters that a checkpoint fills,
RMSNorm as HF computes it, GQA paged attention, the SwiGLU MLP, the softmax top-k router
and the decoder stack the per-architecture files (qwen3_moe.py, mixtral.py, olmoe.py,
qwen2_moe.py, glm4_moe.py, gpt_oss.py) assemble. Every parameter is registered under the
checkpoint's own tensor name, so the loader needs no per-architecture table beyond
``weight_names``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.kv_cache import BatchLayout, PagedKVCache
from services.engine_worker.model.moe import AllToAll, ExpertParallelMoE
from services.engine_worker.model.rope import RotaryEmbedding, apply_rotary


def empty(*shape: int, dtype: torch.dtype, device: str | torch.device) -> nn.Parameter:
    """Uninitialized: the loader overwrites every parameter (a missing tensor is an error)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """As HF computes it: normalize in float32, cast back, then scale by the weight
    (``fp32_weight``: scale first, then cast back, as gpt-oss does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: str | torch.device,
                 fp32_weight: bool = False) -> None:
        super().__init__()
        self.eps, self.fp32_weight = eps, fp32_weight
        self.weight = empty(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype) if self.fp32_weight else self.weight * h.to(x.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, window: int = 0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (already rotated). Writes k/v to their slots, then
    each chunk attends causally over its whole cached context (``window``: only its last
    ``window`` positions, the query's own included). ``sinks`` [H]: a logit per head that
    joins every softmax's denominator and contributes no value (gpt-oss). Returns [T, H*D]."""
    T, H, D = q.shape
    Hkv = k.shape[1]
    k_slots, v_slots = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    k_slots[layout.slot_mapping] = k
    v_slots[layout.slot_mapping] = v
    kc = k_slots[layout.ctx_slots].transpose(1, 2)              # [B, Hkv, Lmax, D]
    vc = v_slots[layout.ctx_slots].transpose(1, 2)
    if Hkv != H:                                                # GQA: each KV head serves H/Hkv query heads
        kc, vc = kc.repeat_interleave(H // Hkv, 1), vc.repeat_interleave(H // Hkv, 1)
    qp = q[layout.q_index].transpose(1, 2)                       # [B, H, Qmax, D]
    mask = layout.attn_mask
    if window:
        q_pos = layout.positions[layout.q_index]                  # [B, Qmax]
        j = torch.arange(kc.shape[2], device=q.device)
        # padding queries keep the causal mask alone, so no row is all masked
        near = (j[None, None, :] > q_pos[:, :, None] - window) | ~layout.q_valid[:, :, None]
        mask = mask & near[:, None]
    if sinks is None:
        out = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=mask)
    else:
        scores = (qp.float() @ kc.float().transpose(-1, -2)) * D ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.float().view(1, H, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        out = (probs @ vc.float()).to(q.dtype)
    return out.transpose(1, 2)[layout.q_valid].reshape(T, H * D)


class Attention(nn.Module):
    """GQA attention with the q/k normalization an architecture asks for:
    ``qk_norm`` None (Mixtral), "head" (Qwen3: per head, over head_dim) or "full"
    (OLMoE: over the whole projection, before the heads are split); biases, a partial
    rotary width (GLM-4.5), sinks and a sliding ``window`` (gpt-oss) as the config says."""

    def __init__(self, cfg: HFConfig, qk_norm: str | None, dtype: torch.dtype, device: str | torch.device,
                 window: int = 0) -> None:
        super().__init__()
        d, H, Hkv, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.H, self.Hkv, self.D, self.clip = H, Hkv, D, cfg.clip_qkv
        self.rot, self.window = cfg.rotary_dim, window
        self.q_proj = Linear(H * D, d, dtype, device, cfg.qkv_bias)
        self.k_proj = Linear(Hkv * D, d, dtype, device, cfg.qkv_bias)
        self.v_proj = Linear(Hkv * D, d, dtype, device, cfg.qkv_bias)
        self.o_proj = Linear(d, H * D, dtype, device, cfg.o_bias)
        if cfg.attn_sinks:
            self.sinks = empty(H, dtype=dtype, device=device)
        self.qk_norm = qk_norm
        if qk_norm is not None:
            qn, kn = (D, D) if qk_norm == "head" else (H * D, Hkv * D)
            self.q_norm = RMSNorm(qn, cfg.norm_eps, dtype, device)
            self.k_norm = RMSNorm(kn, cfg.norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, layout: BatchLayout, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        if T == 0:
            return x
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(T, self.H, self.D), k.view(T, self.Hkv, self.D), v.view(T, self.Hkv, self.D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rot < self.D:           # partial rotary: the rest of each head passes unrotated
            r = self.rot
            q = torch.cat((apply_rotary(q[..., :r], *cos_sin), q[..., r:]), dim=-1)
            k = torch.cat((apply_rotary(k[..., :r], *cos_sin), k[..., r:]), dim=-1)
        else:
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        return self.o_proj(paged_attention(q, k, v, layout, k_cache, v_cache, self.window,
                                           getattr(self, "sinks", None)))


class Linear(nn.Module):
    """A projection whose parameters are named ``weight`` and ``bias`` (the checkpoint's names)."""

    def __init__(self, out_dim: int, in_dim: int, dtype: torch.dtype, device: str | torch.device,
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = empty(out_dim, in_dim, dtype=dtype, device=device)
        self.bias = empty(out_dim, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); ``names`` are the checkpoint's (gate, up, down) names."""

    def __init__(self, d: int, f: int, dtype: torch.dtype, device: str | torch.device,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        self.names = names
        for n, shape in zip(names, ((f, d), (f, d), (d, f))):
            self.add_module(n, Linear(*shape, dtype, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, dn = (getattr(self, n) for n in self.names)
        return dn(F.silu(g(x)) * u(x))


class SoftmaxTopKRouter(nn.Module):
    """Softmax over all experts (float32), keep the k largest, renormalize when the
    architecture does (Mixtral always; Qwen3/OLMoE per norm_topk_prob)."""

    def __init__(self, cfg: HFConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.top_k, self.renorm = cfg.top_k, cfg.norm_topk_prob
        self.weight = empty(cfg.n_experts, cfg.d_model, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        w, ids = probs.topk(self.top_k, dim=-1)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        return w, ids


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module, cfg: HFConfig, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device, cfg.norm_fp32_weight)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device, cfg.norm_fp32_weight)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, layout: BatchLayout, kv: tuple[torch.Tensor, torch.Tensor],
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layout, *kv, cos_sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class SparseMoE(ExpertParallelMoE):
    """A router named ``gate`` and this rank's SwiGLU experts, dispatched expert-parallel."""

    def __init__(self, cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None,
                 dtype: torch.dtype, device: str | torch.device,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        local = cfg.experts_of_rank(rank, world_size)
        experts = nn.ModuleList(SwiGLU(cfg.d_model, cfg.d_ff_expert, dtype, device, names) for _ in local)
        super().__init__(SoftmaxTopKRouter(cfg, dtype, device), experts, cfg.n_experts, cfg.top_k,
                         local.start, world_size, comm)

    def checkpoint_names(self, prefix: str) -> dict[str, torch.Tensor]:
        """{checkpoint tensor name: our parameter} for the router and this rank's experts only."""
        out = {f"{prefix}.gate.weight": self.router.weight}
        for i, e in enumerate(self.experts):
            for n in e.names:
                out[f"{prefix}.experts.{self.first_expert + i}.{n}.weight"] = getattr(e, n).weight
        return out


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm -> lm_head, with the checkpoint's names
    (``model.`` prefix for the body, ``lm_head`` beside it)."""

    def __init__(self, cfg: HFConfig, layers: list[DecoderLayer], moe_attr: str, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.moe_attr = moe_attr      # where a layer's MoE sits in the checkpoint ("mlp" or "block_sparse_moe")
        self.embed_tokens = empty(cfg.vocab_size, cfg.d_model, dtype=dtype, device=device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device, cfg.norm_fp32_weight)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else \
            empty(cfg.vocab_size, cfg.d_model, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, device)

    def forward(self, input_ids: torch.Tensor, layout: BatchLayout, cache: PagedKVCache) -> torch.Tensor:
        x = self.embed_tokens[input_ids]
        cos_sin = self.rotary.cos_sin(layout.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, layout, cache.layer(i), cos_sin)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    def weight_names(self) -> dict[str, torch.Tensor]:
        """Every tensor this rank reads from the checkpoint, by its checkpoint name: the
        shared weights and this rank's experts (other ranks' experts are never read)."""
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed_tokens,
                                        "model.norm.weight": self.norm.weight}
        if not self.cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            moe = hasattr(layer.mlp, "checkpoint_names")   # names its own tensors: only this rank's experts
            for name, t in layer.named_parameters():
                if name.startswith("mlp.") and moe:
                    continue
                out[f"{p}.{name}"] = t
            if moe:
                out.update(layer.mlp.checkpoint_names(f"{p}.{self.moe_attr}"))
        return out


def moe_decoder(cfg: HFConfig, attention: Callable[[], nn.Module], moe: Callable[[], nn.Module],
                dtype: torch.dtype, device: str | torch.device) -> DecoderModel:
    """The stack Qwen3-MoE and DeepSeek-V2 share: ``attention()`` in every layer, a dense
    SwiGLU MLP on ``cfg.dense_layers`` and ``moe()`` on the others, under ``mlp``."""
    layers = [DecoderLayer(attention(), SwiGLU(cfg.d_model, cfg.d_ff_dense, dtype, device)
                           if i in cfg.dense_layers else moe(), cfg, dtype, device)
              for i in range(cfg.n_layers)]
    return DecoderModel(cfg, layers, "mlp", dtype, device)
