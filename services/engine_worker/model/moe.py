"""The MoE layer with expert-parallel dispatch and combine.

Rank r of W holds experts [r*E/W, (r+1)*E/W). Per layer, every rank makes exactly three
``all_to_all_single`` calls, in the same order, whether it has tokens or not:

1. counts:  each rank sends every peer how many of its (token, expert) assignments go to
            each of that peer's experts (E int64 values, E/W per peer);
2. dispatch: the token rows themselves, sorted by expert (hence by destination rank),
            with uneven split sizes derived from step 1;
3. combine: the expert outputs travel back with the splits reversed.

An idle rank (zero tokens) sends zero rows but still takes part in all three, and still
runs its experts on whatever the other ranks sent it. The combine sums each token's k
expert outputs in a fixed (token, k) order, so the result does not depend on where an
expert lives.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from services.engine_worker.lockstep import collective
from services.engine_worker.model.config import MoEConfig
from services.engine_worker.model.layers import ExpertFFN, Router


class AllToAll:
    """Thin wrapper around ``all_to_all_single`` that counts calls and time spent inside.

    On CUDA the timer only sees launch time unless ``sync_timing`` is set, which adds a
    device synchronize around each call (for benchmarks, not for serving)."""

    def __init__(self, group=None, sync_timing: bool = False) -> None:
        self.group = group
        self.sync_timing = sync_timing
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, out: torch.Tensor, inp: torch.Tensor,
                 out_splits: list[int] | None = None, in_splits: list[int] | None = None) -> None:
        cuda = self.sync_timing and inp.is_cuda
        if cuda:
            torch.cuda.synchronize(inp.device)
        t0 = time.perf_counter()
        collective(dist.all_to_all_single, out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                   group=self.group)
        if cuda:
            torch.cuda.synchronize(inp.device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


class ExpertParallelMoE(nn.Module):
    """The dispatch/combine around any router (x -> (weights [T, k], ids [T, k])) and this
    rank's experts (``experts[i]`` is global expert ``first_expert + i``)."""

    def __init__(self, router: nn.Module, experts: nn.ModuleList, n_experts: int, top_k: int,
                 first_expert: int, world_size: int, comm: AllToAll | None) -> None:
        super().__init__()
        if world_size > 1 and comm is None:
            raise ValueError("an expert-parallel MoE layer needs a communicator when world_size > 1")
        self.top_k = top_k
        self.n_experts = n_experts
        self.world_size = world_size
        self.n_local = len(experts)
        self.first_expert = first_expert
        self.comm = comm
        self.router = router
        self.experts = experts

    def _run_local_experts(self, x: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """x holds rows grouped by local expert, ``per_expert[i]`` rows for expert i."""
        outs = [self.experts[i](part) for i, part in enumerate(torch.split(x, per_expert)) if per_expert[i]]
        return torch.cat(outs) if outs else x.new_empty(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, d = x.shape
        k, E, W, El = self.top_k, self.n_experts, self.world_size, self.n_local
        weights, ids = self.router(x)                              # [T, k]
        flat = ids.reshape(-1)                                      # assignment a = t*k + j
        order = torch.argsort(flat, stable=True)                    # grouped by expert = by rank
        counts = torch.bincount(flat, minlength=E)                  # [E]
        send = x[order // k]                                        # [T*k, d]

        if W == 1:
            y_sorted = self._run_local_experts(send, counts.tolist())
        else:
            recv_counts = torch.empty_like(counts)
            self.comm(recv_counts, counts)                          # [W, El] after the exchange
            recv_counts = recv_counts.view(W, El)
            in_splits = counts.view(W, El).sum(1).tolist()
            out_splits = recv_counts.sum(1).tolist()
            recv = send.new_empty(sum(out_splits), d)
            self.comm(recv, send, out_splits, in_splits)
            # recv: per source rank, per local expert, in order. Regroup by local expert.
            expert_of_row = torch.repeat_interleave(
                torch.arange(El, device=x.device).repeat(W), recv_counts.reshape(-1))
            perm = torch.argsort(expert_of_row, stable=True)
            y = torch.empty_like(recv)
            y[perm] = self._run_local_experts(recv[perm], recv_counts.sum(0).tolist())
            y_sorted = send.new_empty(send.shape)
            self.comm(y_sorted, y, in_splits, out_splits)

        y_assign = torch.empty_like(y_sorted)
        y_assign[order] = y_sorted
        return (y_assign.view(T, k, d) * weights.to(x.dtype)[..., None]).sum(1)


class MoELayer(ExpertParallelMoE):
    """The bundled model's MoE layer: seeded router and experts."""

    def __init__(self, cfg: MoEConfig, prefix: str, rank: int, world_size: int,
                 comm: AllToAll | None, device: str | torch.device = "cpu") -> None:
        local = cfg.experts_of_rank(rank, world_size)
        # Only this rank's experts are materialized, under their global names.
        super().__init__(Router(cfg, prefix, device),
                         nn.ModuleList(ExpertFFN(cfg, f"{prefix}.experts.{e}", device) for e in local),
                         cfg.n_experts, cfg.top_k, local.start, world_size, comm)
