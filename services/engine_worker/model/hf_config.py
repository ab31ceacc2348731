"""The shape of a Hugging Face MoE checkpoint, read from its config.json (pure: a dict in,
a frozen object out). One object for every supported architecture; the fields an
architecture does not use keep their neutral value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# config.json "architectures"[0] -> our model file (services/engine_worker/model/<file>.py)
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v2",   # V2's attention; its router: deepseek_v2.DeepseekRouter
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Glm4MoeForCausalLM": "glm4_moe",         # GLM-4.5 / 4.6: DeepSeek-V3's router and shared experts
    "GptOssForCausalLM": "gpt_oss",
}


@dataclass(frozen=True, slots=True)
class HFConfig:
    architecture: str               # our model file's name (a value of ARCHITECTURES)
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    d_ff_expert: int                # hidden width of one expert
    d_ff_dense: int                 # hidden width of a dense MLP layer (Qwen3's mlp_only_layers)
    norm_eps: float
    max_position: int
    rope: dict[str, Any]            # rope_type, rope_theta and the scaling parameters
    norm_topk_prob: bool            # renormalize the k kept router probabilities to sum to 1
    tie_word_embeddings: bool = False
    dense_layers: frozenset[int] = field(default_factory=frozenset)   # layers with a dense MLP, no experts
    clip_qkv: float | None = None   # OLMoE: clamp q, k, v to +-clip_qkv
    eos_token_ids: tuple[int, ...] = ()
    rope_dim: int = 0               # rotary width per head (0: head_dim); DeepSeek: qk_rope_head_dim,
                                    # GLM-4.5: head_dim x partial_rotary_factor (the rest passes unrotated)
    qk_norm: str | None = None      # RMSNorm of q and k: "head" (per head: Qwen3, GLM-4.5 use_qk_norm) or
                                    # "full" (over the whole projection: OLMoE); None: none
    qkv_bias: bool = False          # q/k/v projections with a bias (Qwen2-MoE, GLM-4.5 attention_bias, gpt-oss)
    o_bias: bool = False            # the output projection too (gpt-oss)
    attn_sinks: bool = False        # gpt-oss: a learned per-head logit in every softmax's denominator
    sliding_window: int = 0         # gpt-oss: keys within the last sliding_window positions, on sliding_layers
    sliding_layers: frozenset[int] = field(default_factory=frozenset)
    norm_fp32_weight: bool = False  # gpt-oss: RMSNorm scales by its weight before the cast back, not after
    d_ff_shared: int = 0            # hidden width of the shared expert(s) every token also runs (0: none)
    shared_gate: bool = False       # Qwen2-MoE: the shared expert's output times sigmoid(shared_expert_gate(x))
    swiglu_limit: float = 0.0       # gpt-oss experts: gate clamped to <= limit, up to +-limit,
    swiglu_alpha: float = 0.0       # then (up + 1) x gate x sigmoid(alpha x gate)
    # DeepSeek-style routing (DeepSeek-V2/V3, GLM-4.5): topk_method, routed_scaling_factor,
    # n_group, topk_group (deepseek_v2.DeepseekRouter)
    routing: dict[str, Any] = field(default_factory=dict)
    # DeepSeek-V2 (MLA): q_lora_rank, kv_lora_rank, qk_nope_head_dim, v_head_dim. Its KV cache
    # row is the compressed latent (kv_lora_rank + qk_rope_head_dim), split over the K and V
    # halves of the cache: n_kv_heads 1, head_dim half the latent (rounded up).
    mla: dict[str, Any] = field(default_factory=dict)
    # FP8 weights in tiles of (rows, cols), each with a float scale (quantization_config fp8,
    # DeepSeek-V3's own checkpoints): dequantized to the serving dtype on load
    fp8_block: tuple[int, int] | None = None
    # MXFP4 experts (quantization_config mxfp4, gpt-oss's own checkpoints): <name>_blocks of
    # 4-bit values and <name>_scales, one power of two per 32, dequantized on load
    mxfp4: bool = False

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "HFConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch or '(none)'!r} is not supported; "
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
        name = ARCHITECTURES[arch]
        fp8_block, mxfp4 = quantization(d.get("quantization_config"), name)
        n_heads = int(d["num_attention_heads"])
        d_model = int(d["hidden_size"])
        head_dim = int(d.get("head_dim") or d_model // n_heads)
        n_layers = int(d["num_hidden_layers"])
        n_experts = int(d.get("num_local_experts") or d.get("num_experts") or d.get("n_routed_experts") or 0)
        if not n_experts:
            raise ValueError("config.json names no experts (num_experts / num_local_experts)")
        max_position = int(d.get("max_position_embeddings", 4096))
        if name == "mixtral":
            norm_topk, d_ff_expert = True, int(d["intermediate_size"])   # softmax over the top k
        elif name == "gpt_oss":
            norm_topk, d_ff_expert = True, int(d["intermediate_size"])   # softmax over the top k logits
        else:
            norm_topk = bool(d.get("norm_topk_prob", False))
            d_ff_expert = int(d.get("moe_intermediate_size") or d["intermediate_size"])
        dense: set[int] = set()
        if name in ("qwen3_moe", "qwen2_moe"):
            step = int(d.get("decoder_sparse_step", 1) or 1)
            dense = {i for i in range(n_layers)
                     if i in set(d.get("mlp_only_layers") or []) or (i + 1) % step != 0}
        if name == "deepseek_v2":
            return _deepseek_v2(d, n_heads, n_layers, n_experts, max_position, v3=arch == "DeepseekV3ForCausalLM",
                                fp8_block=fp8_block)
        window = d.get("sliding_window")
        if window and name != "gpt_oss" and (name == "mixtral" or d.get("use_sliding_window")):
            # Sliding-window attention equals full attention while the context fits the window.
            max_position = min(max_position, int(window))
        rope = rope_parameters(d)
        extra: dict[str, Any] = {"qk_norm": {"qwen3_moe": "head", "olmoe": "full"}.get(name)}
        if name == "qwen2_moe":
            extra.update(qkv_bias=bool(d.get("qkv_bias", True)), shared_gate=True,
                         d_ff_shared=int(d.get("shared_expert_intermediate_size") or 0))
        elif name == "glm4_moe":
            first_dense = int(d.get("first_k_dense_replace", 1))
            dense = set(range(min(first_dense, n_layers)))
            extra.update(qk_norm="head" if d.get("use_qk_norm") else None, qkv_bias=bool(d.get("attention_bias", False)),
                         d_ff_shared=d_ff_expert * int(d.get("n_shared_experts") or 0),
                         rope_dim=int(head_dim * float(rope.pop("partial_rotary_factor", 1.0))),
                         routing=dict(topk_method="noaux_tc",
                                      routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                                      n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1)))
        elif name == "gpt_oss":
            types = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                             for i in range(n_layers)]
            bias = bool(d.get("attention_bias", True))
            extra.update(qkv_bias=bias, o_bias=bias, attn_sinks=True, norm_fp32_weight=True,
                         sliding_window=int(window or 0),
                         sliding_layers=frozenset(i for i, t in enumerate(types) if t == "sliding_attention"
                                                  and window),
                         swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))
        eos = d.get("eos_token_id")
        return HFConfig(
            architecture=name, vocab_size=int(d["vocab_size"]), d_model=d_model, n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=int(d.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            n_experts=n_experts, top_k=int(d["num_experts_per_tok"]), d_ff_expert=d_ff_expert,
            d_ff_dense=int(d.get("intermediate_size") or d_ff_expert), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position=max_position, rope=rope, norm_topk_prob=norm_topk,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), dense_layers=frozenset(dense),
            clip_qkv=d.get("clip_qkv"), fp8_block=fp8_block, mxfp4=mxfp4,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]), **extra)

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads {self.n_heads} is not a multiple of "
                             f"num_key_value_heads {self.n_kv_heads}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be within 1..{self.n_experts}")

    def experts_of_rank(self, rank: int, world_size: int) -> range:
        """Contiguous expert shards, as MoEConfig.experts_of_rank (an uneven split is refused)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not within world_size {world_size}")
        if self.n_experts % world_size:
            raise ValueError(f"the checkpoint's {self.n_experts} experts are not divisible by "
                             f"{world_size} ranks; use a rank count that divides {self.n_experts}")
        per = self.n_experts // world_size
        return range(rank * per, (rank + 1) * per)

    def param_bytes(self, world_size: int, bytes_per_param: int) -> dict[str, int]:
        """Weight memory of one rank: what every rank holds, and its share of the experts."""
        d, hd, H, Hkv = self.d_model, self.head_dim, self.n_heads, self.n_kv_heads
        if self.mla:
            m = self.mla
            qk = m["qk_nope_head_dim"] + self.rope_dim
            q = d * H * qk if not m["q_lora_rank"] else d * m["q_lora_rank"] + m["q_lora_rank"] * (1 + H * qk)
            attn = (q + d * (m["kv_lora_rank"] + self.rope_dim) + m["kv_lora_rank"] * (1 + H * (m["qk_nope_head_dim"]
                    + m["v_head_dim"])) + H * m["v_head_dim"] * d + 2 * d)
        else:
            qk_norm = {"full": (H + Hkv) * hd, "head": 2 * hd}.get(self.qk_norm or "", 0)
            attn = (d * hd * (2 * H + 2 * Hkv) + 2 * d + qk_norm + (H + 2 * Hkv) * hd * self.qkv_bias
                    + d * self.o_bias + H * self.attn_sinks)
        moe_layers = self.n_layers - len(self.dense_layers)
        router = self.n_experts * (d + (self.architecture == "gpt_oss"))      # gpt-oss's router has a bias
        shared_expert = 3 * d * self.d_ff_shared + d * self.shared_gate
        shared = (self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
                  + self.n_layers * attn + moe_layers * (router + shared_expert)
                  + len(self.dense_layers) * 3 * d * self.d_ff_dense)
        per_expert = 3 * d * self.d_ff_expert + (2 * self.d_ff_expert + d) * (self.architecture == "gpt_oss")
        experts = moe_layers * (self.n_experts // world_size) * per_expert
        return {"shared": shared * bytes_per_param, "experts": experts * bytes_per_param}

    def kv_bytes_per_token(self, bytes_per_elem: int) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * bytes_per_elem


def quantization(qc: dict[str, Any] | None, architecture: str) -> tuple[tuple[int, int] | None, bool]:
    """(the FP8 tile, MXFP4 experts) of a ``quantization_config``; (None, False): not
    quantized. Any other quantization is refused, with what to use instead."""
    if not qc:
        return None, False
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method == "fp8" and block and len(block) == 2 and qc.get("fmt", "e4m3") == "e4m3":
        return (int(block[0]), int(block[1])), False
    if method == "mxfp4" and architecture == "gpt_oss":
        return None, True
    raise ValueError(f"quantization {method!r} ({qc}) is not supported: lockstep loads bf16/fp32 checkpoints, "
                     "block-scaled FP8 (quant_method fp8 with weight_block_size, as DeepSeek-V3's) and gpt-oss's "
                     "MXFP4 experts; use one of those")


def _deepseek_v2(d: dict[str, Any], n_heads: int, n_layers: int, n_experts: int, max_position: int,
                 v3: bool = False, fp8_block: tuple[int, int] | None = None) -> HFConfig:
    """DeepSeek-V2 and -V3 (and V3's descendants: Kimi-K2, DeepSeek-R1): the same attention;
    V3 routes by sigmoid scores, a per-expert bias in the choice only (``noaux_tc``), and
    both renormalizes and scales the kept weights (transformers' defaults where the
    config is silent)."""
    first_dense = int(d.get("first_k_dense_replace", 3 if v3 else 0))
    freq = int(d.get("moe_layer_freq", 1) or 1)
    kv_lora, rope_dim = int(d["kv_lora_rank"]), int(d["qk_rope_head_dim"])
    method = "noaux_tc" if v3 else d.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"DeepSeek topk_method {method!r} is not supported (greedy, group_limited_greedy, noaux_tc)")
    if v3 and d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"DeepSeek-V3 scoring_func {d.get('scoring_func')!r} is not supported (sigmoid)")
    eos = d.get("eos_token_id")
    return HFConfig(
        architecture="deepseek_v2", vocab_size=int(d["vocab_size"]), d_model=int(d["hidden_size"]), n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=1, head_dim=-(-(kv_lora + rope_dim) // 2), n_experts=n_experts,
        top_k=int(d["num_experts_per_tok"]), d_ff_expert=int(d["moe_intermediate_size"]),
        d_ff_dense=int(d["intermediate_size"]), norm_eps=float(d.get("rms_norm_eps", 1e-6)), max_position=max_position,
        rope=rope_parameters(d), norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        dense_layers=frozenset(i for i in range(n_layers) if i < first_dense or i % freq),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]), rope_dim=rope_dim,
        fp8_block=fp8_block, d_ff_shared=int(d["moe_intermediate_size"]) * int(d.get("n_shared_experts") or 0),
        routing={"routed_scaling_factor": float(d.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
                 "topk_method": method, "n_group": d.get("n_group", 8 if v3 else None),
                 "topk_group": d.get("topk_group", 4 if v3 else None)},
        mla={"q_lora_rank": d.get("q_lora_rank"), "kv_lora_rank": kv_lora,
             "qk_nope_head_dim": int(d["qk_nope_head_dim"]), "v_head_dim": int(d["v_head_dim"]),
             # V3: rotary pairs interleaved (DeepSeek's layout) unless the config says otherwise
             "rope_interleave": bool(d.get("rope_interleave", True))})


def rope_parameters(d: dict[str, Any]) -> dict[str, Any]:
    """Both spellings: older configs carry rope_theta + rope_scaling, newer rope_parameters."""
    rp = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    out = {**scaling, **rp}
    out.setdefault("rope_theta", float(d.get("rope_theta", 10000.0)))
    kind = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = kind
    if kind in ("yarn", "llama3"):
        out.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    if "partial_rotary_factor" in d:
        out.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    return out
