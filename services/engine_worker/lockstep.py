"""The per-step collective that keeps DP ranks in lockstep.

Every step starts with one small all-gather in which each rank contributes its own row
of a ``[world, FIELDS]`` int64 tensor: so every rank learns every rank's scheduled tokens and
flags at once, and all take the same decision (run, idle forward or pause) from the same
numbers. Decisions made from shared numbers cannot diverge, which is what keeps ranks
from deadlocking (one in a collective, another asleep).
"""

from __future__ import annotations

import datetime
import gc
from typing import Any, Callable

import torch
import torch.distributed as dist

from services.engine_worker.step_view import FIELDS, Action, StepView

# The row layout and the decision are pure (step_view); Action stays importable from here.
__all__ = ["FIELDS", "Action", "StepView", "GroupBroken", "collective", "LockstepGroup", "rank_device", "cuda_index"]


# torch.distributed's one-tensor all-gather (output, input): all_gather_single from torch
# 2.13, all_gather_into_tensor before it (the same call). The pin is 2.13, but a machine's
# own torch (a GPU image's) is often older, and the group must still form there.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GroupBroken(RuntimeError):
    """A collective failed: a peer died, hung past the timeout, or left the group."""


def collective(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one torch.distributed collective; a failure raises GroupBroken carrying only the
    message. The original exception's traceback holds c10d's frames, and they hold the
    process group: while it is referenced, destroying the group leaves its connections
    open, and a peer blocked on this rank (not wired to the dead one) waits out its whole
    collective timeout instead of failing at once.

    Every failure maps to GroupBroken, not only c10d's RuntimeErrors: a group destroyed
    under the call (a re-formation, a stop) raises ValueError, and the caller's answer is
    the same in every case: leave the group and meet again (or exit)."""
    error = None
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        error = f"{exc.__class__.__name__}: {exc}"
    raise GroupBroken(error)


def cuda_index(rank: int, device_count: int) -> int:
    """The GPU a rank runs on: ranks are numbered contiguously per host (``lockstep up``
    starts ranks 0..N-1 on one machine), so rank modulo the host's GPUs."""
    if device_count < 1:
        raise RuntimeError("--device cuda but no CUDA device is visible (check CUDA_VISIBLE_DEVICES)")
    return rank % device_count


def rank_device(device: str, rank: int) -> str:
    """``device`` for this rank: "cpu", or "cuda:<i>" with that GPU made current (NCCL and
    every tensor created on plain "cuda" then use it, not all on GPU 0)."""
    if device != "cuda":
        return device
    i = cuda_index(rank, torch.cuda.device_count())
    torch.cuda.set_device(i)
    return f"cuda:{i}"


# gloo binds the address its own hostname resolves to unless told otherwise (and
# GLOO_SOCKET_IFNAME names an interface, whose first address is not a rank's advertised
# one when several share it: 127.0.0.2 and .3 on lo). Ranks on many hosts must listen where
# they advertise, so the group is made through this backend: gloo on a device bound to
# the rank's own address (settings.group_host), set just before each init.
BOUND_GLOO = "lockstep_gloo"
_bind = {"addr": ""}


def _bound_gloo(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_bind["addr"])]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def gloo_backend(bind: str | None) -> str:
    """The backend name for a CPU group whose sockets listen on ``bind``: plain gloo (its
    own choice of address) when no specific address is given."""
    if not bind or bind in ("0.0.0.0", "::", "*"):
        return "gloo"
    if BOUND_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(BOUND_GLOO, _bound_gloo, devices=["cpu"])
    _bind["addr"] = bind
    return BOUND_GLOO


class LockstepGroup:
    """The engine group's step collective over torch.distributed (gloo or NCCL)."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu") -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self._buf = torch.zeros((world_size, FIELDS), dtype=torch.int64, device=rank_device(device, rank))

    @staticmethod
    def init(rank: int, world_size: int, addr: str, port: int, timeout_s: float, device: str = "cpu",
             bind: str | None = None) -> "LockstepGroup":
        """Join the group that meets at ``addr:port`` (rank 0's store); on CPU this rank's
        gloo sockets listen on ``bind``, the address the other ranks reach it at."""
        if world_size > 1 and not dist.is_initialized():
            # The group's store keys carry a per-process counter (/default_pg/<n>/...). A
            # failed init counts its group but leaves nothing to destroy (the destroy is
            # what resets the counter), so after one missed rendezvous this process named
            # every later group one above its peers, and both sides waited for keys the
            # other never wrote, forever. Every formation starts from 0, as every peer does.
            dist.distributed_c10d._world.group_count = 0
            rank_device(device, rank)   # NCCL binds the current GPU
            dist.init_process_group(
                backend="nccl" if device == "cuda" else gloo_backend(bind),
                init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s))
        return LockstepGroup(rank, world_size, device)

    def exchange(self, row: list[int]) -> StepView:
        """Blocking: every rank calls this once per step with its own row.

        An all-gather of the rows, not an all-reduce of a zeroed matrix: the same result
        in half the messages (gloo on a 2-core box: 0.45 ms against 0.95 ms for 2 ranks,
        3.7 ms against 6.0 ms for 4)."""
        if len(row) != FIELDS:   # a local bug, not a group failure: must not look like one
            raise ValueError(f"step row has {len(row)} fields, expected {FIELDS}")
        if self.world_size == 1:
            return StepView([[int(v) for v in row]])
        mine = torch.tensor(row, dtype=torch.int64, device=self._buf.device)
        collective(_all_gather, self._buf.view(-1), mine)
        return StepView(self._buf.tolist())

    def gather(self, values: list[int]) -> list[list[int]]:
        """Blocking: every rank's ``values`` (same length everywhere), in rank order. Used
        once per formation, to agree on the group's state (its (wave, step) counters)."""
        if self.world_size == 1:
            return [[int(v) for v in values]]
        buf = torch.zeros((self.world_size, len(values)), dtype=torch.int64, device=self._buf.device)
        mine = torch.tensor(values, dtype=torch.int64, device=self._buf.device)
        collective(_all_gather, buf.view(-1), mine)
        return buf.tolist()

    def close(self) -> None:
        if self.world_size > 1:
            self.close_default()

    @staticmethod
    def close_default() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
            # Free the group now, in case a reference cycle still holds it (see collective).
            gc.collect()
