"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA with biases on all four projections, a learned
sink logit per head in every softmax, a sliding window (128 positions) on alternate layers
(``layer_types``), YaRN RoPE. The router (``mlp.router``, with a bias) keeps the k largest
logits and softmaxes over them. Experts are stored fused, one tensor per layer for all of
them: ``gate_up_proj`` [E, d, 2f] with gate and up interleaved (even / odd columns) and
``down_proj`` [E, f, d], each with a bias; the activation is (up + 1) x gate x
sigmoid(alpha x gate), gate clamped to <= limit and up to +-limit. Each rank reads only its
own experts' rows of the fused tensors; gpt-oss's own MXFP4 experts are dequantized on load
(loader.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.hf_layers import Attention, DecoderLayer, DecoderModel, empty
from services.engine_worker.model.loader import Rows
from services.engine_worker.model.moe import AllToAll, ExpertParallelMoE


class TopKSoftmaxRouter(nn.Module):
    def __init__(self, cfg: HFConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.weight = empty(cfg.n_experts, cfg.d_model, dtype=dtype, device=device)
        self.bias = empty(cfg.n_experts, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = F.linear(x, self.weight, self.bias).topk(self.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids


class FusedExperts(nn.Module):
    """This rank's experts as slices of the fused tensors; ``experts[i](x)`` runs local expert i."""

    def __init__(self, n_local: int, cfg: HFConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        d, f = cfg.d_model, cfg.d_ff_expert
        self.n_local, self.limit, self.alpha = n_local, cfg.swiglu_limit, cfg.swiglu_alpha
        self.gate_up_proj = empty(n_local, d, 2 * f, dtype=dtype, device=device)
        self.gate_up_proj_bias = empty(n_local, 2 * f, dtype=dtype, device=device)
        self.down_proj = empty(n_local, f, d, dtype=dtype, device=device)
        self.down_proj_bias = empty(n_local, d, dtype=dtype, device=device)

    def __len__(self) -> int:
        return self.n_local

    def __getitem__(self, i: int):
        return lambda x: self.run(i, x)

    def run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj[i] + self.gate_up_proj_bias[i]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ self.down_proj[i] + self.down_proj_bias[i]


class GptOssMoE(ExpertParallelMoE):
    def __init__(self, cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        local = cfg.experts_of_rank(rank, world_size)
        super().__init__(TopKSoftmaxRouter(cfg, dtype, device), FusedExperts(len(local), cfg, dtype, device),
                         cfg.n_experts, cfg.top_k, local.start, world_size, comm)

    def checkpoint_names(self, prefix: str) -> dict[str, torch.Tensor | Rows]:
        """The router whole; of each fused expert tensor, only this rank's rows."""
        first, last = self.first_expert, self.first_expert + self.n_local
        out: dict[str, torch.Tensor | Rows] = {f"{prefix}.router.weight": self.router.weight,
                                               f"{prefix}.router.bias": self.router.bias}
        for n, p in self.experts.named_parameters():
            out[f"{prefix}.experts.{n}"] = Rows(p, first, last)
        return out


def build(cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
          device: str | torch.device) -> DecoderModel:
    layers = [DecoderLayer(Attention(cfg, None, dtype, device, cfg.sliding_window if i in cfg.sliding_layers else 0),
                           GptOssMoE(cfg, rank, world_size, comm, dtype, device), cfg, dtype, device)
              for i in range(cfg.n_layers)]
    return DecoderModel(cfg, layers, "mlp", dtype, device)
