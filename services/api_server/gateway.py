"""The api-server's side of Redis: submit requests, route token deltas back to the
waiting HTTP handlers, abort requests whose client went away.

Writes from concurrent handlers are coalesced: one pipelined round trip is in flight at
a time; a write with none in flight starts one at once (no added latency when idle),
writes that arrive meanwhile go out together in the next, so a burst costs a few round
trips, not one per request.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any, Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.api_server import lost_watch
from services.api_server.alive_keeper import ALIVE_TTL_MS, AliveKeeper
from services.api_server.recent_admissions import RecentAdmissions, bucket_of
from shared import cancels
from shared import keys as K
from shared.bus import decode_entries, same_data, server_run_id
from shared.replies import as_str
from shared.messages import FIELD, Abort, Delta, MessageError, Request, Resume, Retire, encode, output_entry
from shared.policy.base import RequestInfo
from shared.stats import Snapshot
from shared.wake import wake_if_paused
from shared import trace


HEARTBEAT_S = 1.0
QUEUE_VIEW_FRESH_S = 5.0     # an older queue figure is no figure (the scheduler stopped publishing)
ADMITTED_TTL_MS = int(QUEUE_VIEW_FRESH_S * 1000) + 5_000   # a count no figure could miss any more
FOLLOW_BACKOFF_MIN_S = 0.1   # snapshot follower: first retry after a lost connection
FOLLOW_BACKOFF_MAX_S = 5.0   # ... doubling up to this
# A gap in a request's token stream (deltas lost in a Redis failover: written to the old
# primary after its replica was chosen) is mended by resuming the request from what the
# client has; a request that keeps losing deltas ends in an error after this many
MAX_GAP_RESUMES = 3
# After an outage that kept the data set (a failover, a restart from a snapshot): how long
# the requests in flight may stay silent before each is checked for writes the outage lost
# (a decode step is milliseconds; a request still queued is found on its stream and left be)
OUTAGE_CHECK_S = 5.0
SUBMIT_RETRY_S = 3.0         # a submission is tried again through a short outage for this long
SUBMIT_RETRYABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)


class RequestChannel:
    """Tokens of one request as they arrive; ``pos`` in each delta drops duplicates."""

    __slots__ = ("id", "tokens", "finish", "error", "code", "prompt_tokens", "event", "rank", "first_t", "last_t",
                 "req", "epoch", "logprobs", "prompt_lp", "gaps", "gap_epoch", "entry", "sent", "reasoning_tokens",
                 "quiet_t")

    def __init__(self, rid: str) -> None:
        self.id = rid
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.code = "engine_error"         # the error code the client gets if it ends in an error
        self.prompt_tokens = 0
        self.rank = -1
        self.event = asyncio.Event()
        self.first_t = 0.0
        self.last_t = 0.0
        self.req: Request | None = None    # kept to resubmit it if its rank dies
        self.epoch = 0
        # Only when the request asked: one entry per token (None where a resume lost it),
        # and prompt_lp[i] for prompt position i + 1.
        self.logprobs: list | None = None
        self.prompt_lp: list | None = None
        self.gaps = 0           # resumes asked for because deltas were lost
        self.gap_epoch = -1     # the epoch whose stream had a gap (its later deltas are dropped)
        self.entry: tuple[str, bytes] | None = None   # (stream, id) of its last submission
        self.quiet_t = 0.0      # monotonic: its submission came back, or lost_watch.py last looked it up
        self.sent = asyncio.Event()     # its submission's write came back (taken, or failed: then finish is set)
        self.reasoning_tokens = 0       # with a reasoning parser: the thinking's tokens, once its choice is whole

    def _prompt_lp(self, entries: list, pos: int) -> None:
        have = self.prompt_lp if self.prompt_lp is not None else []
        self.prompt_lp = have
        if pos <= len(have) + 1:           # a recompute repeats what is here: keep the first
            have.extend(entries[len(have) + 1 - pos:])

    def feed(self, d: Delta, now: float) -> bool:
        """Take one delta; True when the stream has a gap that a resume can mend (the caller
        resumes the request from the tokens here)."""
        if self.finish is not None or d.epoch < self.epoch or d.epoch == self.gap_epoch:
            return False   # finished, late from a rank the request moved away from, or past a gap
        have = len(self.tokens)
        if d.pos <= have:
            new = d.tokens[have - d.pos:]
            if d.prompt_lp is not None:
                self._prompt_lp(d.prompt_lp, d.prompt_lp_pos)
            if new and (d.logprobs is not None or self.logprobs is not None):
                lps = self.logprobs if self.logprobs is not None else [None] * have
                self.logprobs = lps
                lps.extend(d.logprobs[have - d.pos:] if d.logprobs is not None else [None] * len(new))
            if new:
                self.tokens.extend(new)
                if not self.first_t:
                    self.first_t = now
                self.last_t = now
        # A gap (pos > have): one rank's ordered stream has none, and a resumed request
        # restarts at what was streamed, but a Redis failover can lose the deltas written to
        # the old primary. The tokens past it are dropped rather than shown out of order, and
        # the request resumes from what the client has (a few times; then it ends in an error).
        elif self.req is not None and self.gaps < MAX_GAP_RESUMES:
            self.gaps += 1
            self.gap_epoch = self.epoch
            return True
        else:
            d = Delta(d.id, d.pos, [], "error", d.prompt_tokens, d.rank, "token stream gap")
        self.rank = d.rank
        if d.finish is not None:
            self.finish = d.finish
            self.error = d.error
            self.prompt_tokens = d.prompt_tokens
        self.event.set()
        return False

    def fail(self, message: str, code: str = "engine_error") -> None:
        if self.finish is None:
            self.finish, self.error, self.code = "error", message, code
            self.event.set()


def submit_failure(exc: BaseException) -> str:
    """Why Redis did not take a request, in words for the client's 503: a full Redis (its
    maxmemory reached, under noeviction) is not a Redis that is down, and the operator's
    remedy differs (docs/operations.md)."""
    if isinstance(exc, OutOfMemoryError):
        return "Redis is out of memory (its maxmemory is reached)"
    return f"Redis is unavailable ({str(exc)[:120]})" if str(exc) else "Redis is unavailable"


def queue_wait_s(wait_ms: Any, at: Any, now: float) -> float | None:
    """The scheduler's published queue wait in seconds, or None when it is missing or older
    than ``QUEUE_VIEW_FRESH_S`` (then admission falls back to the in-flight bound alone)."""
    try:
        wait, t = float(wait_ms), float(at)
    except (TypeError, ValueError):
        return None
    return wait / 1000.0 if now - t <= QUEUE_VIEW_FRESH_S else None


def rate_or_zero(raw: Any) -> float:
    """The scheduler's ``prefill_tps`` as a number (0.0: none, or not a finite positive one)."""
    try:
        v = float(raw or 0)
    except (TypeError, ValueError):
        return 0.0
    return v if math.isfinite(v) and v > 0 else 0.0


def client_policy(settings: Any, api_id: str) -> Any:
    """The policy a replica dispatches with in client-dispatch mode (None otherwise).
    Its dispatcher id carries the replica's incarnation (``api_id`` is per process)."""
    if settings.dispatch != "client":
        return None
    from shared.policy.registry import make_policy
    return make_policy(settings.policy, dispatcher_id=f"api-{api_id}", client_mode=True,
                       num_api_servers=settings.num_api_servers)


def engine_down_message(live: int, ranks: int, for_s: float, namespace: str) -> str:
    """Why the engine group cannot serve: it steps only with every one of its ranks."""
    if live <= 0:
        why = f"no engine rank of cluster {namespace!r} has been live for {for_s:.0f} s (all down, or still starting"
    else:
        why = (f"only {live} of the {ranks} engine ranks of cluster {namespace!r} have been live for {for_s:.0f} s, "
               "and the group steps only with all of them (a rank is down and not replaced: start it, or a hot spare")
    return why + f"; `{K.admin_command('status', namespace)}` shows them)"


class Gateway:
    def __init__(self, r: Any, keys: K.Keys, api_id: str, *, dispatch: str = "scheduler",
                 policy: Any = None, log: Any = None, metrics: Any = None, engine_down_timeout_s: float = 0.0,
                 redis_url: str | None = None, replicas: int = 1) -> None:
        self.r, self.keys, self.api_id, self.log, self.metrics = r, keys, api_id, log, metrics
        # the heartbeat key from a thread too, while the loop goes round (None: the loop's beat alone)
        self.alive = AliveKeeper(redis_url, keys.api_alive(api_id), log) if redis_url else None
        self._stop_alive: Callable[[], None] | None = None
        self.engine_down_timeout_s = engine_down_timeout_s   # 0: wait for the group however long
        self.client_dispatch = dispatch == "client"
        if self.client_dispatch and policy is not None and not hasattr(policy, "choose"):
            # (Settings validation refuses this first; never answer every request with 500.)
            raise ValueError(f"policy {getattr(policy, 'name', policy)!r} cannot place requests one by one "
                             "(client dispatch); use dispatch 'scheduler' for it")
        self.policy = policy
        self.channels: dict[str, RequestChannel] = {}
        self.rank_of: dict[str, int] = {}
        self.closing_at = math.inf   # monotonic: when what is in flight must end (begin_close)
        self._writes: list[tuple[str, bytes, str | None, int | None]] = []
        self._flusher: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self.num_ranks = 1
        self.run_id = ""
        self.queue_wait_s: float | None = None   # a new request's wait before its prefill starts, as of the last heartbeat
        self.prefill_tps = 0.0                    # the most prompt tokens/s the ranks take (0: not measured)
        self.seq_rps = 0.0                        # the most requests/s their slots let them finish (0: alike)
        # admitted since queue_wait_s was measured; ``replicas`` until the cluster record says (heartbeat)
        self.admitted = RecentAdmissions(QUEUE_VIEW_FRESH_S, replicas)
        self.ranks_live: int | None = None        # ranks with a heartbeat, as of the last one (None: unknown)
        self.redis_refusal: str | None = None     # why the last heartbeat's write failed (a full Redis answers PING)
        self.down_since: float | None = None      # monotonic: since when fewer than every rank has been live
        self.was_whole = False                    # the group had every rank once since this replica started
        self.silent_check_s = lost_watch.SILENT_CHECK_S   # (a test shortens it)

    async def start(self) -> None:
        self.run_id = await server_run_id(self.r, self.keys.dataset)
        info = await self.r.hgetall(self.keys.cluster)
        self.num_ranks = int(info.get(b"ranks", 1)) if info else 1
        if self.policy is not None:
            self.policy.set_ranks(list(range(self.num_ranks)))
        self._tasks.append(asyncio.create_task(self._read_outputs()))
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        if self.alive is not None:
            self._stop_alive = self.alive.start()
        self._tasks.append(asyncio.create_task(self._watch_lost()))
        if self.client_dispatch:
            # Only a replica that picks ranks needs every snapshot; the others read the
            # latest one when /metrics is scraped (a snapshot per step is a flood at high
            # step rates).
            self._tasks.append(asyncio.create_task(self._follow_snapshots()))

    async def stop(self) -> None:
        if self._flusher is not None:
            self._tasks.append(self._flusher)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._stop_alive is not None:   # before the key goes: the thread would write it again
            await asyncio.to_thread(self._stop_alive)
        try:   # nobody will read this replica's stream again
            await self.r.delete(self.keys.out(self.api_id), self.keys.api_alive(self.api_id))
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        for ch in self.channels.values():
            ch.fail("the api-server is shutting down")

    def begin_close(self, grace_s: float) -> None:
        """Shutdown began: requests in flight have ``grace_s`` more to finish, then end
        with a 503 that says to retry (streams with an error event and ``[DONE]``, not a cut
        connection); new ones get that 503 at once. Wakes every waiter to see the deadline."""
        if self.closing_at == math.inf:
            self.closing_at = time.monotonic() + max(0.0, grace_s)
            for ch in self.channels.values():
                ch.event.set()

    @property
    def closing(self) -> bool:
        return self.closing_at < math.inf

    def until(self, deadline: float) -> float:
        """A request's own deadline, or the shutdown's where that comes first."""
        return min(deadline, self.closing_at)

    # ------------------------------------------------------------------ requests
    def submit(self, req: Request) -> RequestChannel:
        ch = self.channels[req.id] = RequestChannel(req.id)
        ch.req = req
        if self.client_dispatch and self.policy is not None:
            info = RequestInfo(req.id, req.prompt_tokens, req.params.max_tokens, req.arrival)
            if req.rank is None:
                a = self.policy.choose(info, req.arrival)
                if self.metrics is not None:
                    self.metrics.dispatch.labels(str(a.rank)).inc()
            else:   # pinned by the client: still part of this replica's local view
                a = self.policy.note_explicit(info, req.rank, req.arrival)
            req.rank, req.dispatcher, req.dispatch_seq = a.rank, a.dispatcher, a.seq
        if req.rank is not None and self.client_dispatch:
            self.rank_of[req.id] = req.rank
            self._enqueue(self.keys.inbox(req.rank), encode(req), req.id)
        else:
            self._enqueue(self.keys.requests, encode(req), req.id)
        return ch

    def abort(self, rid: str, reason: str = "client_disconnected") -> None:
        ch = self.channels.pop(rid, None)
        if ch is None or ch.finish is not None:
            self.rank_of.pop(rid, None)
            return
        self._send_abort(rid, self.rank_of.pop(rid, None), reason)

    def _send_abort(self, rid: str, rank: int | None, reason: str) -> None:
        """To the rank this replica placed it on (client dispatch), else to the scheduler."""
        stream = self.keys.inbox(rank) if rank is not None else self.keys.requests
        self._enqueue(stream, encode(Abort(rid, rank, reason)), None, cancel_rank=rank)

    def release(self, rid: str) -> None:
        self.channels.pop(rid, None)
        self.rank_of.pop(rid, None)

    def _enqueue(self, stream: str, blob: bytes, rid: str | None, cancel_rank: int | None = None) -> None:
        """Queue one stream write for the next flush. ``cancel_rank``: ``blob`` is an abort
        or a retirement for that rank's inbox, pushed to its cancels list too (shared/cancels.py)."""
        self._writes.append((stream, blob, rid, cancel_rank))
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush_all())

    async def _flush_all(self) -> None:
        try:
            while self._writes:
                writes, self._writes = self._writes, []
                await self._flush(writes)
        finally:
            self._flusher = None

    async def _flush(self, writes: list[tuple[str, bytes, str | None, int | None]]) -> None:
        if trace.ENABLED:
            trace.mark("submit_sent")
        # Client dispatch writes inboxes: in a transaction with the wake-up of a sleeping
        # engine group, which the ranks then read together (shared/wake.py).
        to_inbox = self.client_dispatch and any(rid is not None and stream != self.keys.requests
                                                for stream, _, rid, _ in writes)
        at: list[int] = []     # each write's xadd among the pipeline's replies
        # what this replica admitted, added to every replica's count (recent_admissions.py)
        admitted = self.admitted.take_unsent()
        bucket = bucket_of(time.time())

        def build() -> Any:
            pipe = self.r.pipeline(transaction=to_inbox)
            at.clear()
            n = 0
            for stream, blob, _, cancel_rank in writes:
                if cancel_rank is not None:
                    cancels.push(pipe, self.keys, cancel_rank, blob)
                    n += 3
                pipe.xadd(stream, {FIELD: blob})
                at.append(n)
                n += 1
            if to_inbox:
                wake_if_paused(pipe, self.keys)
            if admitted[1]:   # last: its three replies at the end
                key = self.keys.admitted(bucket)
                pipe.hincrby(key, "tokens", admitted[0])
                pipe.hincrby(key, "requests", admitted[1])
                pipe.pexpire(key, ADMITTED_TTL_MS)
            return pipe

        try:
            # Outside a transaction each write lands or not on its own (a full Redis refused
            # the second of two: the first ran while its client got a 503, and a retry ran
            # it twice): each request is judged by its own write's reply.
            replies = await self._execute_submit(build, raise_on_error=to_inbox)
        except Exception as exc:  # noqa: BLE001 - the requests fail, the server stays up
            replies = [exc] * (at[-1] + 1 if at else 0)
        totals = tuple(replies[-3:-1]) if admitted[1] and len(replies) >= 3 else ()
        self.admitted.sent(admitted, bucket, totals if all(isinstance(v, int) for v in totals) and totals else None)
        refused = [r for r in (replies[i] for i in at) if isinstance(r, Exception)]
        if refused:
            if self.metrics is not None:
                self.metrics.redis_errors.inc()
            if self.log is not None:
                self.log.error("submit_failed", error=str(refused[0]), n=len(refused), of=len(writes))
        for (stream, _, rid, _), i in zip(writes, at):
            if rid is None or (ch := self.channels.get(rid)) is None:
                continue
            if isinstance(replies[i], Exception):
                ch.fail(f"could not queue the request: {submit_failure(replies[i])}", "redis_unavailable")
            else:
                ch.entry = (stream, replies[i])
                ch.quiet_t = time.monotonic()
            ch.sent.set()

    async def _execute_submit(self, build: Callable[[], Any], raise_on_error: bool = True) -> list[Any]:
        """The submit pipeline, tried again through a dropped connection or a short outage
        (a Redis restart, a failover) for ``SUBMIT_RETRY_S``: each request failed at once
        with a 503 before. A write that landed before the connection dropped is sent twice;
        the second copy is dropped where it arrives (the scheduler, or a rank, keeps one
        request per id and epoch). A full Redis (OOM) is not waited out: it fails at once.
        Without ``raise_on_error`` a connection lost while reading the replies comes back as
        each reply (a Cluster pipeline whose primary was killed: 12 requests failed with a
        503 in one of three failovers): tried again the same way."""
        deadline = time.monotonic() + SUBMIT_RETRY_S
        wait = 0.05
        while True:
            try:
                replies = await build().execute(raise_on_error=raise_on_error)   # (emptied by its execute)
                if not any(isinstance(r, SUBMIT_RETRYABLE) for r in replies):
                    return replies
                if time.monotonic() + wait > deadline or self.closing:
                    return replies
            except SUBMIT_RETRYABLE:
                if time.monotonic() + wait > deadline or self.closing:
                    raise
            await asyncio.sleep(wait)
            wait = min(0.5, wait * 2)

    # ------------------------------------------------------------------ outputs
    async def _read_outputs(self) -> None:
        stream = self.keys.out(self.api_id)
        # Start at the current tail (before any request of ours exists), then follow ids.
        tail = await self.r.xrevrange(stream, count=1)
        last: bytes | str = tail[0][0] if tail else "0-0"
        # The requests in flight when this reader lost Redis: checked once it is back. The
        # reader's own state: a flag the submits shared was set again by a submit to the
        # restarted server first (the check was then skipped, and those requests waited for ever).
        outage: set[str] | None = None
        while True:
            try:
                if outage is not None:
                    await self._after_outage(outage)
                    outage = None
                resp = await self.r.xread({stream: last}, block=1000, count=1024)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reconnect with backoff
                if outage is None:
                    if self.log is not None:
                        self.log.warning("redis_unavailable", what="outputs", error=str(exc))
                    outage = set(self.channels)
                await asyncio.sleep(0.2 + random.random() * 0.3)
                continue
            now = time.monotonic()
            gapped: list[str] = []
            for _, eid, doc in decode_entries(resp):
                last = eid
                try:
                    msg = output_entry(doc)
                except MessageError as exc:   # skipped, never fatal: every request's tokens come here
                    self._salvage(eid, doc, exc, now)
                    continue
                if type(msg) is Resume:
                    self._resume(msg.ids)
                    continue
                if trace.ENABLED:
                    trace.mark("api_read")
                for d in msg.ds:
                    ch = self.channels.get(d.id)
                    if ch is not None and ch.feed(d, now):
                        gapped.append(d.id)
            if gapped:
                self._mend_gaps(gapped)

    def _salvage(self, eid: bytes, doc: dict[str, Any], exc: MessageError, now: float) -> None:
        """A malformed output entry: log it, and feed what deltas in it are whole (one
        bad delta must not become a token gap for the other requests of its step)."""
        if self.log is not None:
            self.log.error("bad_output_entry", entry=eid.decode(), error=str(exc)[:300])
        ds = doc.get("ds") if doc.get("k") == "out" else None
        for raw in ds if isinstance(ds, list) else ():
            try:
                d = Delta.from_dict(raw)
            except MessageError:
                continue
            ch = self.channels.get(d.id)
            if ch is not None and ch.feed(d, now):
                self._mend_gaps([d.id])

    def _mend_gaps(self, ids: list[str]) -> None:
        """Deltas of these requests were lost (a Redis failover): resume each from the
        tokens the client has, as for a dead rank's."""
        if self.log is not None:
            self.log.warning("token_stream_gap", n=len(ids), ids=ids[:8])
        self._resume(ids)

    def _resume(self, ids: Any) -> None:
        """Resubmit each of these requests with the tokens the client already has (the
        scheduler found them on a dead rank; their deltas had a gap; Redis lost them): the
        new rank continues exactly where the stream stopped.
        A rank taken for dead may only have stalled (its heartbeat lapsed): the rank that
        streamed a request is told to retire its copy, which would otherwise run on, its
        deltas ignored, until it ends."""
        for rid in ids:
            ch = self.channels.get(rid)
            if ch is None or ch.finish is not None or ch.req is None:
                continue
            rank = ch.rank if ch.rank >= 0 else self.rank_of.get(rid)   # (placed here, no token yet)
            if rank is not None:
                self._enqueue(self.keys.inbox(rank), encode(Retire(rid, rank, ch.epoch)), None, cancel_rank=rank)
            ch.epoch += 1
            req = ch.req
            req.generated = list(ch.tokens)
            req.epoch = ch.epoch
            req.rank = req.dispatcher = req.batch = req.batch_counts = None
            req.dispatch_seq = 0
            self.rank_of.pop(rid, None)
            self._enqueue(self.keys.requests, encode(req), rid)
            if self.metrics is not None:
                self.metrics.resumed.inc()
        if ids and self.log is not None:
            self.log.warning("requests_resumed", n=len(ids))

    async def _after_outage(self, in_flight: set[str]) -> None:
        """Back from a Redis outage. A restarted server without persistence has lost the
        request, inbox and output streams: an entry not yet read and deltas not yet read are
        gone, and a request waiting on them would wait for tokens that never come. So each
        request in flight when it went (``in_flight``) is resumed from the tokens its client
        has, as for a dead rank's: a new epoch, placed again, and the copy still running (if
        its rank kept it) retired. One submitted since went to the server that is back: it
        runs as it is."""
        run_id = await server_run_id(self.r, self.keys.dataset)
        lost = not same_data(self.run_id, run_id)   # a failover keeps the data; an empty restart does not
        if self.log is not None:
            self.log.info("redis_reconnected", what="outputs", restarted=lost)
        self.run_id = run_id
        if lost:
            ids = [rid for rid in in_flight if (ch := self.channels.get(rid)) is not None and ch.finish is None]
            if ids and self.log is not None:
                self.log.warning("redis_data_lost", n=len(ids), action="resume")
            self._resume(ids)
        elif in_flight:
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.create_task(self._check_after_outage(in_flight, time.monotonic())))

    async def _check_after_outage(self, in_flight: set[str], back_at: float) -> None:
        """The data set survived the outage, but maybe not its last writes: a replica that
        took over had not received them (Redis replicates asynchronously), or a restart
        loaded a snapshot older than them. A request whose submission was lost waits for a
        dispatch that never comes; one whose last deltas were lost, for an end its rank
        already wrote. So the requests in flight that stay silent ``OUTAGE_CHECK_S`` after
        the reconnect are looked up, in one round trip, and resumed from the tokens their
        clients have where the outage lost them: their submission is gone from its stream
        and no dispatch recorded, or their record says finished. One still queued (its
        entry is there) or dispatched and running is left be."""
        await asyncio.sleep(OUTAGE_CHECK_S)
        silent = [ch for rid in in_flight if (ch := self.channels.get(rid)) is not None
                  and ch.finish is None and ch.last_t < back_at and ch.entry is not None]
        if not silent:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for ch in silent:
                stream, eid = ch.entry
                pipe.xrange(stream, eid, eid, count=1)
                pipe.hget(self.keys.req(ch.id), "state")
            res = await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - another outage: its own check follows
            if self.log is not None:
                self.log.warning("outage_check_failed", error=str(exc))
            return
        lost = [ch.id for i, ch in enumerate(silent)
                if (not res[2 * i] and res[2 * i + 1] is None) or res[2 * i + 1] == b"finished"]
        if self.log is not None:
            self.log.info("outage_check", silent=len(silent), lost=len(lost))
        if lost:
            if self.log is not None:
                self.log.warning("redis_writes_lost", n=len(lost), ids=lost[:8], action="resume")
            self._resume(lost)

    async def _watch_lost(self) -> None:
        """Every third of ``silent_check_s``: the requests silent that long that no service
        holds (lost_watch.py) are resumed, in one round trip."""
        while True:
            await asyncio.sleep(self.silent_check_s / 3)
            now = time.monotonic()
            checked = lost_watch.due(self.channels.values(), now, self.keys.requests, self.silent_check_s)
            if not checked:
                continue
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.xinfo_groups(self.keys.requests)
                for ch in checked:
                    eid = ch.entry[1]
                    pipe.xpending_range(self.keys.requests, K.SCHEDULER_GROUP, min=eid, max=eid, count=1)
                    pipe.hmget(self.keys.req(ch.id), "state", "epoch")
                groups, *rest = await pipe.execute()
            except Exception as exc:  # noqa: BLE001 - Redis trouble: looked up again next round
                if self.log is not None:
                    self.log.warning("lost_check_failed", error=str(exc)[:200])
                continue
            delivered = next((g.get("last-delivered-id") for g in groups
                              if as_str(g.get("name")) == K.SCHEDULER_GROUP), None)
            gone = lost_watch.lost(checked, delivered, rest[0::2], rest[1::2])
            for ch in checked:
                ch.quiet_t = now
            if gone:
                if self.log is not None:
                    self.log.error("requests_lost", n=len(gone), ids=gone[:8], action="resume",
                                   hint="the scheduler acked them with no dispatch: please report it")
                self._resume(gone)

    async def _heartbeat(self) -> None:
        """Once a second, in one round trip: this replica's heartbeat, how long the
        scheduler's oldest unplaced request has waited (the admission bound's input), the
        group's size and which of its ranks have a heartbeat (a group short of a rank for
        long ends the requests waiting)."""
        while True:
            if self.alive is not None:
                self.alive.mark_progress()
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.set(self.keys.api_alive(self.api_id), str(time.time()), px=ALIVE_TTL_MS)
                pipe.hmget(self.keys.snapshot, "queue_eta_ms", "queue_wait_ms", "queue_at", "prefill_tps", "seq_rps")
                now = time.time()   # every replica's admissions in the last QUEUE_VIEW_FRESH_S
                buckets = list(range(bucket_of(now - QUEUE_VIEW_FRESH_S), bucket_of(now) + 1))
                for b in buckets:
                    pipe.hmget(self.keys.admitted(b), "tokens", "requests")
                pipe.hmget(self.keys.cluster, "ranks", "api_servers")   # written after this replica started, maybe
                for rank in range(self.num_ranks):   # one key each: their slots differ on Redis Cluster
                    pipe.exists(self.keys.rank_alive(rank))
                _, (eta_ms, wait_ms, at, tps, rps), *rest = await pipe.execute()
                group, ((ranks, replicas), *alive) = rest[:len(buckets)], rest[len(buckets):]
                if replicas and int(replicas) > 0:
                    self.admitted.replicas = int(replicas)
                self.redis_refusal = None
                self.admitted.group_read({b: (int(t or 0), int(n or 0)) for b, (t, n) in zip(buckets, group)
                                          if n is not None}, now)
                # a new request's expected wait; the head's own wait from a scheduler older than the ETA
                self.queue_wait_s = queue_wait_s(eta_ms if eta_ms is not None else wait_ms, at, time.time())
                if self.queue_wait_s is not None:
                    self.admitted.measured(float(at))
                self.prefill_tps = rate_or_zero(tps)
                self.seq_rps = rate_or_zero(rps)
                if ranks and int(ranks) != self.num_ranks:
                    self.num_ranks = int(ranks)
                else:
                    self.observe_ranks(sum(alive), time.monotonic())
            except Exception as exc:  # noqa: BLE001 - an outage: no figures (the requests fail on their own)
                self.queue_wait_s = None
                self.ranks_live = None
                self.redis_refusal = submit_failure(exc)
            await asyncio.sleep(HEARTBEAT_S)

    def observe_ranks(self, live: int, now: float) -> None:
        """``live`` of the group's ranks have a heartbeat at monotonic ``now``. The group
        steps only with every rank (each step is a collective of all), so once one has been
        missing for ``engine_down_timeout_s`` (down and not replaced, or never started) the
        requests in flight cannot go on: each is aborted (a rank that comes back must not
        run it for nobody) and ends with a clear, retryable error."""
        self.ranks_live = live
        if live >= self.num_ranks:
            if self.down_since is not None and self.log is not None:
                self.log.info("engine_group_complete", ranks=live, after_s=round(now - self.down_since, 1))
            self.down_since = None
            self.was_whole = True
            return
        if self.down_since is None:
            self.down_since = now
            if self.log is not None:   # at start-up the ranks join after the api-servers: no warning then
                (self.log.warning if self.was_whole else self.log.info)(
                    "engine_group_incomplete", ranks_live=live, ranks=self.num_ranks, starting=not self.was_whole)
        if not self.engine_down_timeout_s or now - self.down_since <= self.engine_down_timeout_s:
            return
        waiting = [ch for ch in self.channels.values() if ch.finish is None]
        if not waiting:
            return
        message = engine_down_message(live, self.num_ranks, now - self.down_since, self.keys.ns)
        for ch in waiting:
            self._send_abort(ch.id, self.rank_of.get(ch.id), "engine_down")
            ch.fail(message, "engine_unavailable")
        if self.log is not None:
            self.log.error("requests_failed_engine_down", n=len(waiting), ranks_live=live,
                           for_s=round(now - self.down_since, 1))

    def down_for(self, now: float) -> float:
        """Seconds (monotonic ``now``) that the group has been short of a rank; 0 while whole."""
        return 0.0 if self.down_since is None else now - self.down_since

    async def _follow_snapshots(self) -> None:
        """Feed each published snapshot to this replica's policy (client dispatch) and to
        its /metrics gauges (the load view this replica sees).

        Survives Redis errors: after a lost connection (a restart, a failover, a killed
        client) it subscribes again with backoff, and reads the latest snapshot after each
        subscription (so none published meanwhile is missed for long). Without this a
        client-dispatch replica's view would only grow: no snapshot would clear what it
        dispatched since the last one."""
        backoff = FOLLOW_BACKOFF_MIN_S
        while True:
            pubsub = self.r.pubsub()
            try:
                await pubsub.subscribe(self.keys.snapshot)
                blob = await self.r.hget(self.keys.snapshot, "json")
                if blob:
                    self._on_snapshot(blob)
                backoff = FOLLOW_BACKOFF_MIN_S
                async for msg in pubsub.listen():
                    if msg.get("type") == "message":
                        self._on_snapshot(msg["data"])
                raise ConnectionError("the snapshot subscription ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - resubscribe with backoff
                if self.log is not None:
                    self.log.warning("snapshot_follower_reconnecting", error=str(exc)[:200], retry_in_s=round(backoff, 2))
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(FOLLOW_BACKOFF_MAX_S, backoff * 2)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001 - the connection may be gone already
                    pass

    async def refresh_snapshot(self) -> None:
        """For /metrics in scheduler-dispatch mode: observe the latest published snapshot."""
        blob = await self.r.hget(self.keys.snapshot, "json")
        if blob:
            self._on_snapshot(blob)

    def _on_snapshot(self, blob: bytes) -> None:
        try:
            snap = Snapshot.decode(blob)
        except MessageError as exc:   # skipped: the next one comes a step later
            if self.log is not None:
                self.log.error("bad_snapshot", error=str(exc)[:300])
            return
        if self.client_dispatch and self.policy is not None:
            self.policy.on_snapshot(snap)
        if self.metrics is not None:
            self.metrics.observe_snapshot(snap)

