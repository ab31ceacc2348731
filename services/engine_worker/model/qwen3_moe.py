"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with per-head RMSNorm on q and k
before RoPE; softmax router, top-k, renormalized when norm_topk_prob; SwiGLU experts
(gate_proj/up_proj/down_proj) under ``mlp``; layers in mlp_only_layers (or off the
decoder_sparse_step) have a dense SwiGLU MLP instead."""

from __future__ import annotations

import torch

from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.hf_layers import Attention, DecoderModel, SparseMoE, moe_decoder
from services.engine_worker.model.moe import AllToAll


def build(cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
          device: str | torch.device) -> DecoderModel:
    return moe_decoder(cfg, lambda: Attention(cfg, "head", dtype, device),
                       lambda: SparseMoE(cfg, rank, world_size, comm, dtype, device), dtype, device)
