"""The Redis key schema: every key lockstep reads or writes is named here and only here.

Keys are prefixed with a namespace (``ls`` by default) so several clusters can share one
Redis. docs/redis-keys.md documents each key (type, writer, reader, TTL); a test checks
that every key built here appears there.

Redis Cluster: the keys that meet in one atomic operation carry the hash tag ``{<ns>}``
(the dispatch slot): the request stream, the rank inboxes, the wake stream, the pause
marker and the admitted-token counters. The scheduler acks a request in the same
MULTI/EXEC that writes it to an inbox, the wake script reads ``paused`` and writes
``wave`` in that transaction, a paused rank reads its inbox and ``wave`` in one XREAD,
and client dispatch counts its admissions in its inbox transaction: Cluster refuses
each of these across slots. Every other key has no tag, so the busy independent streams (``out``, ``stats``,
``steps``) and the per-request and per-rank keys spread over the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

# Consumer-group names.
SCHEDULER_GROUP = "scheduler"
ENGINE_GROUP = "engine"

# Stream trimming and TTLs. Streams are trimmed approximately (MAXLEN ~), which is cheap.
OUT_STREAM_MAXLEN = 100_000
OUT_STREAM_TTL_S = 3_600
STATS_STREAM_MAXLEN = 20_000
WAVE_STREAM_MAXLEN = 1_000
STEP_HASH_TTL_S = 120
REQ_HASH_TTL_S = 600      # default of the request_record_ttl_s setting (shared/settings.py)
BATCH_HASH_TTL_S = 600


DEFAULT_NAMESPACE = "ls"


def admin_command(command: str, namespace: str, redis_url: str | None = None) -> str:
    """The admin CLI command that acts on this namespace's cluster, as a hint to print:
    ``lockstep status`` hints at the default cluster, not this one. ``redis_url``: the URL
    the command line named (an external Redis), repeated so the hint reaches the same one;
    a password in it is shown as ``***``."""
    import shlex

    from shared.bus import redact_url
    return (f"lockstep {command}" + ("" if namespace == DEFAULT_NAMESPACE else f" -n {shlex.quote(namespace)}")
            + (f" --redis-url {shlex.quote(redact_url(redis_url))}" if redis_url else ""))


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one namespace."""

    ns: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        # A brace in the namespace would move the hash tag (Cluster hashes the first {...}).
        if "{" in self.ns or "}" in self.ns:
            raise ValueError(f"namespace {self.ns!r}: braces are not allowed in a namespace")

    @property
    def dispatch_tag(self) -> str:
        """The hash tag of the dispatch slot (module docstring)."""
        return "{" + self.ns + "}"

    # --- request path -------------------------------------------------------------
    @property
    def requests(self) -> str:
        """Stream: new requests and aborts from api-servers (group ``scheduler``)."""
        return f"{self.dispatch_tag}:requests"

    def inbox(self, rank: int) -> str:
        """Stream: work for one DP rank (group ``engine``)."""
        return f"{self.dispatch_tag}:rank:{rank}:inbox"

    def cancels(self, rank: int) -> str:
        """List: the aborts and retirements sent to one rank's inbox, pushed here too
        (shared/cancels.py). The rank pops it every step: its inbox stays unread while its
        waiting queue is full, and an abort behind the backlog would wait there."""
        return f"{self.dispatch_tag}:rank:{rank}:cancels"

    def admitted(self, bucket: int) -> str:
        """String counter with PX TTL: the prompt tokens every api-server admitted in one
        quarter second (bucket = epoch s // 0.25; services/api_server/recent_admissions.py),
        INCRBY'd in each submit round trip: what a burst added since the scheduler last
        measured its queue. Tagged: it rides in the submit transaction of client dispatch."""
        return f"{self.dispatch_tag}:admitted:{bucket}"

    def out(self, api_id: str) -> str:
        """Stream: token deltas for the requests of one api-server."""
        return f"{self.ns}:out:{api_id}"

    def req(self, request_id: str) -> str:
        """Hash: one request's state, rank, batch and timestamps (TTL)."""
        return f"{self.ns}:req:{request_id}"

    # --- step statistics and the load view ----------------------------------------
    def step_reports(self, wave: int, step: int) -> str:
        """Hash: rank -> its report of one (wave, step), short TTL: the raw reports by step,
        for operators (no service reads it). Finalized steps are ``steps``."""
        return f"{self.ns}:step:{wave}:{step}"

    @property
    def stats(self) -> str:
        """Stream: one entry per (wave, step, rank) report, stats inline."""
        return f"{self.ns}:stats"

    @property
    def snapshot(self) -> str:
        """Hash: the last finalized step-consistent load view; also the pub/sub channel
        each new one is published on (channels and keys are separate names in Redis)."""
        return f"{self.ns}:snapshot"

    @property
    def steps(self) -> str:
        """Stream: finalized steps (per-rank rows), for ``lockstep steps``."""
        return f"{self.ns}:steps"

    def batch(self, batch_id: str) -> str:
        """Hash: a staggered batch's per-rank counts and release reason (TTL)."""
        return f"{self.ns}:batch:{batch_id}"

    # --- membership, lockstep and leadership -------------------------------------
    def rank_alive(self, rank: int) -> str:
        """String with PX TTL: heartbeat and claim of one rank slot (value: owner token)."""
        return f"{self.ns}:rank:{rank}:alive"

    def rank_info(self, rank: int) -> str:
        """Hash: pid, host, backend and last stats of one rank."""
        return f"{self.ns}:rank:{rank}:info"

    def spare(self, token: str) -> str:
        """String with PX TTL: a hot-spare engine process waiting for a free rank slot."""
        return f"{self.ns}:spare:{token}"

    @property
    def vacancies(self) -> str:
        """List: ranks whose process just died (the supervisor pushes; a hot spare pops
        and claims the slot at once instead of at its next poll)."""
        return f"{self.ns}:vacancies"

    @property
    def dist(self) -> str:
        """Hash: rendezvous of the engine group (address, port, world size, generation)."""
        return f"{self.ns}:dist"

    def exiting(self, host: str, pid: int) -> str:
        """String: an engine process that gave its rank slot back and is on its way out
        (its group closing, its interpreter ending): not wedged, whatever that takes."""
        return f"{self.ns}:exiting:{host}:{pid}"

    def supervisor(self, host: str) -> str:
        """String with PX TTL: the pid of the supervisor (`lockstep up` / `lockstep engine`)
        on ``host``, written with each of its looks at the rank slots: a look whose write
        Redis refuses (full, or pausing writes) judges no rank wedged."""
        return f"{self.ns}:supervisor:{host}"

    @property
    def dist_open(self) -> str:
        """String: the generation whose rendezvous still has time to be joined (PX)."""
        return f"{self.ns}:dist:open"

    @property
    def wave(self) -> str:
        """Stream: wake-up notices that start wave W after all ranks paused (from the
        dispatcher that ended the pause, or else the rank that found the work)."""
        return f"{self.dispatch_tag}:wave"

    @property
    def paused(self) -> str:
        """String: the wave a paused engine group starts at its next wake (rank 0 sets it
        as the group pauses; the dispatch or notice that ends the pause deletes it)."""
        return f"{self.dispatch_tag}:paused"

    @property
    def leader(self) -> str:
        """String NX PX: the scheduler leadership lease."""
        return f"{self.ns}:leader"

    @property
    def incarnation(self) -> str:
        """String counter: each scheduler leader INCRs it and dispatches as
        ``scheduler.<n>`` (dispatcher id, batch ids ``scheduler.<n>-<k>``)."""
        return f"{self.ns}:incarnation"

    @property
    def scheduler(self) -> str:
        """Hash: the leading scheduler's state and counters."""
        return f"{self.ns}:scheduler"

    def api_alive(self, api_id: str) -> str:
        """String with PX TTL: heartbeat of one api-server replica."""
        return f"{self.ns}:api:{api_id}:alive"

    @property
    def cluster(self) -> str:
        """Hash: cluster-wide configuration (ranks, api-servers, policy, dispatch mode)."""
        return f"{self.ns}:cluster"

    @property
    def dataset(self) -> str:
        """String: a random id stored once (SET NX) by the first service that reads it; a
        server that restarted empty has lost it (shared/bus.py ``server_run_id``)."""
        return f"{self.ns}:dataset"

    @property
    def drained(self) -> str:
        """Set: ranks that get no new work (``lockstep drain``)."""
        return f"{self.ns}:drained"

    def all_patterns(self) -> list[str]:
        """Every key shape, with placeholders, for docs and ``lockstep`` inspection."""
        return [
            self.requests, self.inbox("{r}"), self.cancels("{r}"), self.admitted("{bucket}"), self.out("{api}"), self.req("{id}"),  # type: ignore[arg-type]
            self.step_reports("{wave}", "{step}"), self.stats, self.snapshot, self.steps,  # type: ignore[arg-type]
            self.batch("{id}"), self.rank_alive("{r}"), self.rank_info("{r}"),  # type: ignore[arg-type]
            self.spare("{token}"), self.vacancies, self.dist, self.wave, self.paused, self.leader, self.incarnation, self.scheduler, self.api_alive("{api}"),
            self.cluster, self.drained, self.dataset, self.dist_open,
            self.exiting("{host}", "{pid}"), self.supervisor("{host}"),  # type: ignore[arg-type]
        ]
