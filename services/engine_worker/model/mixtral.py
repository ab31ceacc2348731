"""Mixtral (8x7B, 8x22B): GQA without q/k norms; the router ``block_sparse_moe.gate``
keeps the top k logits and softmaxes over them (the same as softmax, top-k, renormalize);
SwiGLU experts named w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

import torch

from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.hf_layers import Attention, DecoderLayer, DecoderModel, SparseMoE
from services.engine_worker.model.moe import AllToAll


def build(cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
          device: str | torch.device) -> DecoderModel:
    layers = [DecoderLayer(Attention(cfg, None, dtype, device),
                           SparseMoE(cfg, rank, world_size, comm, dtype, device, names=("w1", "w3", "w2")),
                           cfg, dtype, device)
              for _ in range(cfg.n_layers)]
    return DecoderModel(cfg, layers, "block_sparse_moe", dtype, device)
