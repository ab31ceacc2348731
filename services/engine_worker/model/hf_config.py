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
    rope_dim: int = 0               # rotary width per head (0: head_dim); DeepSeek: qk_rope_head_dim
    # DeepSeek-V2 (MLA + shared experts): q_lora_rank, kv_lora_rank, qk_nope_head_dim, v_head_dim,
    # n_shared_experts, routed_scaling_factor, topk_method, n_group, topk_group. Its KV cache
    # row is the compressed latent (kv_lora_rank + qk_rope_head_dim), split over the K and V
    # halves of the cache: n_kv_heads 1, head_dim half the latent (rounded up).
    mla: dict[str, Any] = field(default_factory=dict)
    # FP8 weights in tiles of (rows, cols), each with a float scale (quantization_config fp8,
    # DeepSeek-V3's own checkpoints): dequantized to the serving dtype on load
    fp8_block: tuple[int, int] | None = None

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "HFConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch or '(none)'!r} is not supported; "
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
        name = ARCHITECTURES[arch]
        fp8_block = quantization_block(d.get("quantization_config"))
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
        else:
            norm_topk = bool(d.get("norm_topk_prob", False))
            d_ff_expert = int(d.get("moe_intermediate_size") or d["intermediate_size"])
        dense: set[int] = set()
        if name == "qwen3_moe":
            step = int(d.get("decoder_sparse_step", 1) or 1)
            dense = {i for i in range(n_layers)
                     if i in set(d.get("mlp_only_layers") or []) or (i + 1) % step != 0}
        if name == "deepseek_v2":
            return _deepseek_v2(d, n_heads, n_layers, n_experts, max_position, v3=arch == "DeepseekV3ForCausalLM",
                                fp8_block=fp8_block)
        window = d.get("sliding_window")
        if window and (name == "mixtral" or d.get("use_sliding_window")):
            # Sliding-window attention equals full attention while the context fits the window.
            max_position = min(max_position, int(window))
        eos = d.get("eos_token_id")
        return HFConfig(
            architecture=name, vocab_size=int(d["vocab_size"]), d_model=d_model, n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=int(d.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            n_experts=n_experts, top_k=int(d["num_experts_per_tok"]), d_ff_expert=d_ff_expert,
            d_ff_dense=int(d.get("intermediate_size") or d_ff_expert), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position=max_position, rope=rope_parameters(d), norm_topk_prob=norm_topk,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), dense_layers=frozenset(dense),
            clip_qkv=d.get("clip_qkv"), fp8_block=fp8_block,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]))

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
        d, hd = self.d_model, self.head_dim
        if self.mla:
            return self._mla_param_bytes(world_size, bytes_per_param)
        qk_norm = {"qwen3_moe": 2 * hd, "olmoe": (self.n_heads + self.n_kv_heads) * hd}.get(self.architecture, 0)
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 2 * d + qk_norm
        moe_layers = self.n_layers - len(self.dense_layers)
        shared = (self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
                  + self.n_layers * attn + moe_layers * self.n_experts * d
                  + len(self.dense_layers) * 3 * d * self.d_ff_dense)
        experts = moe_layers * (self.n_experts // world_size) * 3 * d * self.d_ff_expert
        return {"shared": shared * bytes_per_param, "experts": experts * bytes_per_param}

    def _mla_param_bytes(self, world_size: int, bytes_per_param: int) -> dict[str, int]:
        m, d, H = self.mla, self.d_model, self.n_heads
        qk = m["qk_nope_head_dim"] + self.rope_dim
        q = d * H * qk if not m["q_lora_rank"] else d * m["q_lora_rank"] + m["q_lora_rank"] * (1 + H * qk)
        attn = (q + d * (m["kv_lora_rank"] + self.rope_dim) + m["kv_lora_rank"] * (1 + H * (m["qk_nope_head_dim"]
                + m["v_head_dim"])) + H * m["v_head_dim"] * d + 2 * d)
        moe_layers = self.n_layers - len(self.dense_layers)
        shared = (self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d + self.n_layers * attn
                  + moe_layers * (self.n_experts * d + 3 * d * self.d_ff_expert * m["n_shared_experts"])
                  + len(self.dense_layers) * 3 * d * self.d_ff_dense)
        experts = moe_layers * (self.n_experts // world_size) * 3 * d * self.d_ff_expert
        return {"shared": shared * bytes_per_param, "experts": experts * bytes_per_param}

    def kv_bytes_per_token(self, bytes_per_elem: int) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * bytes_per_elem


def quantization_block(qc: dict[str, Any] | None) -> tuple[int, int] | None:
    """The FP8 tile of a ``quantization_config`` (None: not quantized); any other
    quantization is refused, with what to use instead."""
    if not qc:
        return None
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method == "fp8" and block and len(block) == 2 and qc.get("fmt", "e4m3") == "e4m3":
        return int(block[0]), int(block[1])
    raise ValueError(f"quantization {method!r} ({qc}) is not supported: lockstep loads bf16/fp32 checkpoints and "
                     "block-scaled FP8 (quant_method fp8 with weight_block_size, as DeepSeek-V3's); use one of those")


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
        fp8_block=fp8_block,
        mla={"q_lora_rank": d.get("q_lora_rank"), "kv_lora_rank": kv_lora,
             "qk_nope_head_dim": int(d["qk_nope_head_dim"]), "v_head_dim": int(d["v_head_dim"]),
             "n_shared_experts": int(d.get("n_shared_experts") or 0),
             "routed_scaling_factor": float(d.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
             "topk_method": method, "n_group": d.get("n_group", 8 if v3 else None),
             "topk_group": d.get("topk_group", 4 if v3 else None),
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
