"""One typed settings object per service, read from LOCKSTEP_* environment variables and
overridden by CLI flags. ``docs/configuration.md`` is generated from these classes."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T", bound="Settings")

ENV_PREFIX = "LOCKSTEP_"


def _coerce(value: str, typ: Any) -> Any:
    if typ is bool:
        return value.strip().lower() in ("1", "true", "yes", "on")
    if typ is int:
        return int(value)
    if typ is float:
        return float(value)
    if typ in (list[str], "list[str]"):
        return [v.strip() for v in value.split(",") if v.strip()]
    if typ == (int | None):
        return None if value == "" else int(value)
    if typ == (str | None):
        return value or None
    return value


@dataclass
class Settings:
    """Base: fields shared by every service."""

    redis_url: str = field(default="", metadata={"help": "Redis URL (redis://, rediss:// for TLS, user:password@ for ACL)."})
    namespace: str = field(default="ls", metadata={"help": "Key prefix, so several clusters can share one Redis."})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error."})

    @classmethod
    def from_env(cls: type[T], env: dict[str, str] | None = None, **overrides: Any) -> T:
        env = os.environ if env is None else env
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                try:
                    values[f.name] = _coerce(raw, hints[f.name])
                except ValueError as exc:
                    raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {exc}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if redact:
            from shared.bus import redact_url
            d["redis_url"] = redact_url(d["redis_url"])
            if "api_keys" in d:
                d["api_keys"] = ["***"] * len(d["api_keys"])
        return d


DISPATCH_MODES = ("scheduler", "client")


def check_policy_dispatch(policy: str, dispatch: str) -> None:
    """Refuse, with a message that says what to use instead, a dispatch mode or policy
    that cannot be served. Every combination this accepts is served (tests/test_combinations.py)."""
    from shared.policy.registry import policy_names

    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch must be 'scheduler' or 'client', not {dispatch!r}")
    if policy not in policy_names():
        raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(policy_names())}")
    if policy == "staggered" and dispatch == "client":
        others = ", ".join(p for p in policy_names() if p != "staggered")
        raise ValueError(
            "policy 'staggered' needs dispatch 'scheduler': a staggered batch is formed and tagged by the one "
            "scheduler (api-servers choosing on their own would each split the traffic into batches no rank "
            "could gate together). Use --dispatch scheduler --policy staggered, or keep --dispatch client with "
            f"one of: {others}.")


@dataclass
class ApiServerSettings(Settings):
    api_id: str = field(default="", metadata={"help": "This replica's id (its output stream is <ns>:out:<api_id>); random when empty."})
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=8000, metadata={"help": "Port; every replica binds it with SO_REUSEPORT."})
    model: str = field(default="lockstep-moe", metadata={"help": "Model name served at /v1/models, or a checkpoint directory (Hugging Face layout): its tokenizer and chat template are used and it is served under the directory's name."})
    max_model_len: int = field(default=4096, metadata={"help": "Prompt + output tokens per request."})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "Largest request body accepted (413 above)."})
    max_inflight: int = field(default=4096, metadata={"help": "Requests in flight per replica before 429."})
    request_timeout_s: float = field(default=600.0, metadata={"help": "Longest a request may wait for its tokens."})
    api_keys: list[str] = field(default_factory=list, metadata={"help": "Accepted API keys (comma list); empty = no auth."})
    dispatch: str = field(default="scheduler", metadata={"help": "'scheduler' or 'client' (the replica picks ranks itself)."})
    policy: str = field(default="waterfill", metadata={"help": "Dispatch policy in client-dispatch mode (waterfill, round_robin, least_score, least_tokens; staggered needs dispatch 'scheduler': refused at start). waterfill places at once here: holding needs the one scheduler."})
    num_api_servers: int = field(default=1, metadata={"help": "Replicas in the cluster (scales the local bump in client mode)."})

    def __post_init__(self) -> None:
        # The policy is this replica's only in client dispatch (else the scheduler's).
        if self.dispatch != "scheduler":
            check_policy_dispatch(self.policy, self.dispatch)


@dataclass
class SchedulerSettings(Settings):
    policy: str = field(default="waterfill", metadata={"help": "Dispatch policy (waterfill, round_robin, least_score, least_tokens, staggered); see lockstep up --help."})
    level_tokens: int = field(default=4096, metadata={"help": "waterfill: a rank with less prefill pending than this gets the oldest held request (2 x the engines' max_num_batched_tokens)."})
    dispatch: str = field(default="scheduler", metadata={"help": "'scheduler' or 'client' (api-servers pick ranks; refused with policy staggered)."})
    num_api_servers: int = field(default=1, metadata={"help": "api-server replicas (for the local-view bump)."})
    ranks: int = field(default=4, metadata={"help": "DP ranks expected in the engine group."})
    read_count: int = field(default=512, metadata={"help": "Requests read per stream round trip."})
    grace_ms: float = field(default=50.0, metadata={"help": "Wait this long for missing ranks before finalizing a step."})
    snapshot_min_interval_ms: float = field(default=5.0, metadata={"help": "Publish snapshots at most this often (newer steps coalesce; at real step times every step is published)."})
    max_wait_ms: float = field(default=0.0, metadata={"help": "Staggered: longest a request is held; 0 = learned (about two steps)."})
    request_record_ttl_s: int = field(default=600, metadata={"help": "Lifetime of a request record <ns>:req:<id>, refreshed at each write (memory: about 350 bytes x request rate x this; docs/operations.md)."})
    lease_ms: int = field(default=1000, metadata={"help": "Leadership lease (renewed every third of it); a standby takes over after it lapses."})
    metrics_port: int = field(default=0, metadata={"help": "Serve Prometheus metrics (lockstep_*) on this port; 0 = off."})

    def __post_init__(self) -> None:
        check_policy_dispatch(self.policy, self.dispatch)


@dataclass
class EngineSettings(Settings):
    rank: int = field(default=-1, metadata={"help": "DP rank; -1 claims the first free slot in Redis."})
    spare: bool = field(default=False, metadata={"help": "Hot spare: start up, then wait (any time) for a rank slot to free and take it over at once; a dead rank is replaced without a process start."})
    ranks: int = field(default=4, metadata={"help": "DP ranks in the engine group (world size)."})
    backend: str = field(default="sim", metadata={"help": "'sim' (device cost model) or 'torch' (a real MoE)."})
    device: str = field(default="cpu", metadata={"help": "'cpu' (gloo) or 'cuda' (NCCL)."})
    model: str = field(default="", metadata={"help": "torch: a local checkpoint directory (Hugging Face layout: config.json, *.safetensors, tokenizer.json); empty or 'lockstep-moe' = the bundled model (trained by scripts/train-bundled-model), 'random' = seeded random weights of the same shape. Nothing is downloaded."})
    dtype: str = field(default="auto", metadata={"help": "torch with --model: 'auto' (bfloat16 on cuda, float32 on cpu), 'bfloat16' or 'float32'."})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "Token budget of one step."})
    max_num_seqs: int = field(default=128, metadata={"help": "Most sequences running on the rank."})
    num_kv_blocks: int = field(default=4096, metadata={"help": "KV-cache blocks on the rank."})
    block_size: int = field(default=16, metadata={"help": "Tokens per KV block."})
    max_model_len: int = field(default=4096, metadata={"help": "Prompt + output tokens per request."})
    time_scale: float = field(default=1.0, metadata={"help": "sim: multiply modeled device time (0 = no device time)."})
    cost_model: str = field(default="", metadata={"help": "sim: JSON file with calibrated cost-model constants."})
    request_record_ttl_s: int = field(default=600, metadata={"help": "Lifetime of a request record <ns>:req:<id>, refreshed at each write (memory: about 350 bytes x request rate x this; docs/operations.md)."})
    heartbeat_ms: int = field(default=1000, metadata={"help": "Heartbeat period; the alive key lives 3x this."})
    collective_timeout_s: float = field(default=5.0, metadata={"help": "A collective that takes longer means a rank died (keep it above the longest step)."})
    reform_timeout_s: float = field(default=60.0, metadata={"help": "A rank that cannot rejoin its engine group within this exits (code 4) to be replaced."})
    group_host: str = field(default="127.0.0.1", metadata={"help": "Address other ranks reach this one at (engine-group rendezvous)."})
    seed: int = field(default=0, metadata={"help": "Weight seed of model 'random' (identical on every rank)."})
    align_tokens: bool = field(default=True, metadata={"help": "Coordinated prefill: every rank caps its prefill at one shared budget per step (docs/benchmarks.md); applied when every rank has it."})
    align_min_balance: float = field(default=0.9, metadata={"help": "Coordinated prefill under a backlog: the largest budget that keeps a step at least this balanced (0 = the older water-level rule, docs/benchmarks.md)."})
    align_max_hold_steps: int = field(default=32, metadata={"help": "Coordinated prefill: a rank whose prefill was held back this many steps in a row runs it (no starvation)."})
    align_max_delay_ms: float = field(default=3000.0, metadata={"help": "Coordinated prefill: the longest a prefill waits for a balanced step, scaled by the prefill pending on the other ranks (in units of align_backlog_steps full steps, capped at 1)."})
    align_min_delay_ms: float = field(default=200.0, metadata={"help": "Coordinated prefill: a prefill may wait this long for others to share its step even with nothing pending elsewhere (0 = start at once; docs/benchmarks.md)."})
    align_backlog_steps: float = field(default=0.5, metadata={"help": "Coordinated prefill: the group is backlogged when its pending prefill fills this many full steps; then only balance and the hold bound start prefills (docs/benchmarks.md)."})
    gate_timeout_ms: float = field(default=100.0, metadata={"help": "Staggered batches: rank 0 releases a batch whose shares did not all arrive within this."})
    metrics_port: int = field(default=0, metadata={"help": "Serve Prometheus metrics (lockstep_engine_*) on this port (a spare: this port + the rank it takes); 0 = off."})


ALL_SETTINGS: list[type[Settings]] = [ApiServerSettings, SchedulerSettings, EngineSettings]
