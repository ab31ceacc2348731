"""OLMoE (allenai/OLMoE-1B-7B): GQA with RMSNorm over the whole q and k projections
(before the heads are split), optional clip_qkv; softmax router, top-k, renormalized
only when norm_topk_prob (off in the released checkpoints); SwiGLU experts under ``mlp``."""

from __future__ import annotations

import torch

from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.hf_layers import Attention, DecoderLayer, DecoderModel, SparseMoE
from services.engine_worker.model.moe import AllToAll


def build(cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
          device: str | torch.device) -> DecoderModel:
    layers = [DecoderLayer(Attention(cfg, "full", dtype, device), SparseMoE(cfg, rank, world_size, comm, dtype, device),
                           cfg, dtype, device)
              for _ in range(cfg.n_layers)]
    return DecoderModel(cfg, layers, "mlp", dtype, device)
