"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM, GLM-4.5-Air too): GQA with biased q/k/v
projections (attention_bias), per-head q/k RMSNorm when use_qk_norm, and RoPE on the first
head_dim x partial_rotary_factor dimensions of each head only (rotate-half form). The MoE
is DeepSeek-V3's: sigmoid scores, a per-expert bias in the choice (e_score_correction_bias),
group-limited top-k, renormalized and scaled by routed_scaling_factor, plus shared experts
every token runs; the first first_k_dense_replace layers have a dense MLP. The next-token
prediction layer a checkpoint ships past num_hidden_layers is not read."""

from __future__ import annotations

import torch

from services.engine_worker.model.deepseek_v2 import DeepseekMoE
from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.hf_layers import Attention, DecoderModel, moe_decoder
from services.engine_worker.model.moe import AllToAll


def build(cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
          device: str | torch.device) -> DecoderModel:
    return moe_decoder(cfg, lambda: Attention(cfg, cfg.qk_norm, dtype, device),
                       lambda: DeepseekMoE(cfg, rank, world_size, comm, dtype, device), dtype, device)
