"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with biased q/k/v projections, no q/k
norms; softmax router, top-k (renormalized when norm_topk_prob, off in the released
checkpoints); SwiGLU experts under ``mlp``, and one shared SwiGLU expert that every token
runs, its output scaled by sigmoid(shared_expert_gate(x)). Layers in mlp_only_layers (or
off the decoder_sparse_step) have a dense SwiGLU MLP instead."""

from __future__ import annotations

import torch

from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.hf_layers import Attention, DecoderModel, Linear, SparseMoE, SwiGLU, moe_decoder
from services.engine_worker.model.moe import AllToAll


class GatedSharedMoE(SparseMoE):
    def __init__(self, cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        super().__init__(cfg, rank, world_size, comm, dtype, device)
        self.shared_expert = SwiGLU(cfg.d_model, cfg.d_ff_shared, dtype, device)
        self.shared_expert_gate = Linear(1, cfg.d_model, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def checkpoint_names(self, prefix: str) -> dict[str, torch.Tensor]:
        out = super().checkpoint_names(prefix)
        out.update({f"{prefix}.shared_expert.{n}": p for n, p in self.shared_expert.named_parameters()})
        out[f"{prefix}.shared_expert_gate.weight"] = self.shared_expert_gate.weight
        return out


def build(cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
          device: str | torch.device) -> DecoderModel:
    return moe_decoder(cfg, lambda: Attention(cfg, None, dtype, device),
                       lambda: GatedSharedMoE(cfg, rank, world_size, comm, dtype, device), dtype, device)
