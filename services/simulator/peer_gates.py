"""Engine-side hooks the peers run inside their executors, modeled from their current code
(our own code; facts and file names in each docstring).

* :class:`GroupGate` — a group-wide prefill gate whose verdict every rank reaches from the
  same all-gathered numbers (so it acts as one decision per step; ``vetoed_steps`` counts the
  steps it said no while some rank had a new prefill to start):
  :class:`AdpBalanceGate` (TensorRT-LLM ADP Balance) and :class:`PrefillDelayer` (SGLang).
* Late binding — :class:`TrtllmAdpRouter` keeps TensorRT-LLM's global request queue and binds
  requests to ranks only at a step boundary, when the group has room (``bind``).

The simulator builds a :class:`GateView` before each step's schedule and asks ``allow``;
False means no rank admits a NEW prefill this step (continuing chunks and decodes run).
It calls ``bind`` at every step boundary with exact :class:`RankLoad` rows.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from shared.policy.base import Assignment, RequestInfo
from shared.stats import Snapshot


@dataclass(slots=True)
class GateView:
    """The group before this step's schedule, one entry per rank."""

    now: float                  # seconds (virtual clock)
    has_ctx: list[bool]         # rank has a waiting request it could admit now (slot + KV room)
    n_gen: list[int]            # sequences decoding on the rank
    n_running: list[int]        # admitted sequences (decoding + prefilling)
    n_waiting: list[int]        # queued, not admitted
    max_num_seqs: int
    kv_usage: list[float]       # used / total KV blocks, 0..1


class GroupGate(Protocol):
    def allow(self, v: GateView) -> bool: ...

    def counters(self) -> dict[str, int]: ...


# ----------------------------------------------------------------------------- TensorRT-LLM

class AdpBalanceGate:
    """TensorRT-LLM ADP Balance (``attention_dp_config.enable_balance``), after
    ``PyExecutor._balance_adp_requests`` (tensorrt_llm/_torch/pyexecutor/py_executor.py; newer
    trees move the same logic into the scheduler module as ``balance_adp_requests``).

    Every iteration the ranks all-gather (scheduled context requests, scheduled generation
    requests, tokens) and each computes, from the same numbers:

    * ``all_free``  — every rank has fewer generation requests than ``max_batch_size``;
    * ``all_ctx``   — every rank has a context request scheduled;
    * ``all_gen``   — every rank has a generation request.

    If ``all_free and all_ctx``: the waiting counter resets; when also ``all_gen`` the context
    requests wait ``batching_wait_iters`` iterations (counter, then released and reset).
    Otherwise the waiting counter is incremented and context requests wait, unless the
    counter reached ``timeout_iters`` or some rank has no generation request (then released
    and the counter reset). The code increments the waiting counter on EVERY such iteration,
    also when no rank has context work, so a counter already part-way can shorten the next
    hold — modeled as in the code. Defaults: ``timeout_iters=50``, ``batching_wait_iters=10``
    (AttentionDpConfig, tensorrt_llm/llmapi/llm_args.py).

    Deviation: the real gate empties the whole scheduled context list, continuing chunks
    included; our hook only withholds NEW prefills (GroupGate contract).
    """

    def __init__(self, timeout_iters: int = 50, batching_wait_iters: int = 10) -> None:
        self.timeout_iters = timeout_iters
        self.batching_wait_iters = batching_wait_iters
        self._waiting = 0
        self._batching = 0
        self.vetoed_steps = 0
        self.released_timeout = 0
        self.released_batched = 0

    def allow(self, v: GateView) -> bool:
        all_free = all(g < v.max_num_seqs for g in v.n_gen)
        all_ctx = all(v.has_ctx)
        all_gen = all(g > 0 for g in v.n_gen)
        any_ctx = any(v.has_ctx)
        if all_free and all_ctx:
            self._waiting = 0
            if all_gen:
                if self._batching < self.batching_wait_iters:
                    self._batching += 1
                    self.vetoed_steps += 1
                    return False
                self._batching = 0
                self.released_batched += 1
            return True
        self._waiting += 1
        if self._waiting >= self.timeout_iters or not all_gen:
            if self._waiting >= self.timeout_iters and any_ctx:
                self.released_timeout += 1
            self._waiting = 0
            return True
        if any_ctx:
            self.vetoed_steps += 1
        return False

    def counters(self) -> dict[str, int]:
        return {"vetoed_steps": self.vetoed_steps, "released_timeout": self.released_timeout,
                "released_batched": self.released_batched}


class TrtllmAdpRouter:
    """TensorRT-LLM attention-DP request placement with late binding.

    Models ``ExecutorRequestQueue`` (tensorrt_llm/_torch/pyexecutor/executor_request_queue.py)
    and ``DefaultADPRouter`` (the ADP router of tensorrt_llm/_torch/pyexecutor/scheduler/):

    * Requests wait in ONE global queue inside the executor. Each iteration rank 0 takes at
      most ``tp_size * max_num_active_requests - sum(active)`` of them, in arrival order
      (``_fetch_new_requests`` / ``get_from_waiting_queue``); the rest stay unbound.
    * Active counts and tokens are all-gathered (``RankState``: active requests, and the sum of
      ``py_orig_prompt_len`` of the rank's active requests).
    * Target per rank ``expected = min(max(ceil((sum(active) + new) / ranks), max(active)),
      max_num_active_requests)`` (``_expected_num_active_requests``, multiplier 1).
    * Min-heap of the ranks below ``expected`` keyed on (active prompt tokens, active requests,
      rank); new requests sorted by prompt length, longest first; each pops the lightest
      rank, adds its prompt and one request, and pushes it back while still below
      ``expected`` (``_balance_requests_across_ranks``).

    Explicit ``attention_dp_rank`` requests (strict, placed first while the rank is below
    ``max_num_active_requests``) go through ``note_explicit``. ``max_num_active_requests`` is
    the rank's ``max_num_seqs`` (the executor's max batch size).
    """

    name = "trtllm_adp_router"

    def __init__(self, *, dispatcher_id: str, num_api_servers: int = 1, client_mode: bool = False,
                 ranks: list[int]) -> None:
        self.dispatcher_id = dispatcher_id
        self._seqs: dict[int, int] = {}
        self.queue: deque[RequestInfo] = deque()
        self.bound = 0
        self.set_ranks(ranks)

    def set_ranks(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)

    def on_snapshot(self, snap: Snapshot) -> None:
        pass  # placement uses the exact per-iteration all-gather (bind), not a published view

    def _assign(self, req: RequestInfo, rank: int, reason: str = "dispatch") -> Assignment:
        seq = self._seqs.get(rank, 0) + 1
        self._seqs[rank] = seq
        return Assignment(request_id=req.id, rank=rank, reason=reason,
                          dispatcher=self.dispatcher_id, seq=seq)

    def submit(self, req: RequestInfo, now: float) -> list[Assignment]:
        self.queue.append(req)
        return []

    def poll(self, now: float) -> list[Assignment]:
        return []

    def next_deadline(self) -> float | None:
        return None

    def note_explicit(self, req: RequestInfo, rank: int, now: float) -> Assignment:
        return self._assign(req, rank, "explicit")

    def bind(self, now: float, ranks: list[RankLoad]) -> list[Assignment]:
        live = [r for r in ranks if r.rank in set(self.ranks)] or list(ranks)
        if not self.queue or not live:
            return []
        active = [r.num_waiting + r.num_running for r in live]
        cap_rank = min(r.max_num_seqs for r in live)
        room = sum(r.max_num_seqs for r in live) - sum(active)
        take = min(max(room, 0), len(self.queue))
        if take == 0:
            return []
        new = [self.queue.popleft() for _ in range(take)]
        n = len(live)
        fair = (sum(active) + len(new) + n - 1) // n
        expected = min(max(fair, max(active)), cap_rank)
        heap = [(r.active_prompt_tokens, a, r.rank) for r, a in zip(live, active) if a < expected]
        heapq.heapify(heap)
        out: list[Assignment] = []
        left: list[RequestInfo] = []
        for req in sorted(new, key=lambda q: q.prompt_tokens, reverse=True):  # stable
            if not heap:
                left.append(req)
                continue
            tok, cnt, rank = heapq.heappop(heap)
            tok, cnt = tok + req.prompt_tokens, cnt + 1
            out.append(self._assign(req, rank))
            if cnt < expected:
                heapq.heappush(heap, (tok, cnt, rank))
        if left:  # keep arrival order at the head of the queue
            left.sort(key=lambda q: q.arrival)
            self.queue.extendleft(reversed(left))
        self.bound += len(out)
        return out


@dataclass(slots=True)
class RankLoad:
    rank: int
    num_waiting: int            # queued on the rank, not admitted
    num_running: int            # admitted
    active_prompt_tokens: int   # sum of prompt tokens of the rank's waiting + running requests
    max_num_seqs: int
    kv_free_tokens: int


# ----------------------------------------------------------------------------- SGLang

class PrefillDelayer:
    """SGLang's PrefillDelayer (python/sglang/srt/managers/prefill_delayer.py,
    ``_negotiate_should_allow_prefill_pure``; enabled by ``--enable-prefill-delayer`` with DP
    attention, server_args.py).

    Every pass all ranks all-gather (prefillable, token-watermark force-allow):

    * all prefillable or none → allow, state reset;
    * mixed → allow if some prefillable rank's token usage is below
      ``token_usage_watermark`` (``--prefill-delayer-token-usage-low-watermark``, default
      None = off); else delay while the delayed count is below ``max_delay_passes - 1``
      (``--prefill-delayer-max-delay-passes``, default 30), so at most 29 consecutive vetoes,
      then allow (``wait_timeout``) and reset.

    ``max_delay_ms``: upstream's ``--prefill-delayer-max-delay-ms`` (5000 when unset) caps only
    the opt-in queue trigger (``--prefill-delayer-queue-min-ratio``, default off), which we do
    not model; default None here = upstream's default path. Set it to cap a mixed-state delay
    streak by wall clock (our generalisation, labeled). Also not modeled: the "all"-branch
    slot condition (``max_running_requests - running < max_prefill_bs``, #17456/#32880).
    """

    def __init__(self, max_delay_passes: int = 30, max_delay_ms: float | None = None,
                 token_usage_watermark: float | None = None) -> None:
        self.max_delay_passes = max_delay_passes
        self.max_delay_ms = max_delay_ms
        self.token_usage_watermark = token_usage_watermark
        self._delayed: int | None = None     # None: no wait in progress
        self._start = 0.0
        self.vetoed_steps = 0
        self.released_timeout = 0
        self.released_watermark = 0
        self.released_all = 0

    def allow(self, v: GateView) -> bool:
        n_pre = sum(1 for c in v.has_ctx if c)
        if n_pre == len(v.has_ctx) or n_pre == 0:
            if n_pre and self._delayed is not None:
                self.released_all += 1
            self._delayed = None
            return True
        wm = self.token_usage_watermark
        if wm is not None and any(c and u < wm for c, u in zip(v.has_ctx, v.kv_usage)):
            self._delayed = None
            self.released_watermark += 1
            return True
        count = self._delayed if self._delayed is not None else 0
        if self._delayed is None:
            self._start = v.now
        timed_out = self.max_delay_ms is not None and (v.now - self._start) * 1000.0 >= self.max_delay_ms
        if count < self.max_delay_passes - 1 and not timed_out:
            self._delayed = count + 1
            self.vetoed_steps += 1
            return False
        self._delayed = None
        self.released_timeout += 1
        return True

    def counters(self) -> dict[str, int]:
        return {"vetoed_steps": self.vetoed_steps, "released_timeout": self.released_timeout,
                "released_watermark": self.released_watermark, "released_all": self.released_all}
