"""One typed settings object per service, read from LOCKSTEP_* environment variables and
overridden by CLI flags. ``docs/configuration.md`` is generated from these classes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from shared.reasoning import check_parser

NAMESPACE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")

T = TypeVar("T", bound="Settings")

ENV_PREFIX = "LOCKSTEP_"


class _MappingEnv(EnvSettingsSource):
    """pydantic-settings' env source over a given mapping instead of os.environ, so
    ``from_env`` can read the environment a parent builds for its child."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._mapping = env
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k.lower(): v for k, v in self._mapping.items() if k.upper().startswith(ENV_PREFIX)}


def _formerly(name: str, *old: str) -> AliasChoices:
    """A renamed setting, still read under its old names (arguments and LOCKSTEP_*
    variables; pydantic-settings puts no env prefix on an alias, so each is listed with it)."""
    names = (name, *old)
    return AliasChoices(*names, *(ENV_PREFIX.lower() + n for n in names))


def names_of(cls: type[BaseModel], field: str) -> list[str]:
    """The names a setting is read under: its own, then the old ones it still accepts."""
    alias = cls.model_fields[field].validation_alias
    old = alias.choices if isinstance(alias, AliasChoices) else ()
    return [field, *(c for c in old if isinstance(c, str) and c != field and not c.startswith(ENV_PREFIX.lower()))]


# What a value of each kind may be, added to pydantic's message.
_ALLOWED = {"bool_parsing": "use 1/0, true/false, yes/no or on/off",
            "int_parsing": "use a whole number", "float_parsing": "use a number"}


class SettingsError(ValueError):
    """Settings a service cannot start with; the message names each bad field (or its
    LOCKSTEP_* variable, when it came from the environment) and what it may be."""

    def __init__(self, errors: list[Any], env: Mapping[str, str] | None = None) -> None:
        self.errors = errors
        msgs = []
        for e in errors:
            name = str(e["loc"][0]) if e["loc"] else ""
            what = e["msg"].removeprefix("Value error, ")
            if e["type"] in _ALLOWED:
                what += f" ({_ALLOWED[e['type']]})"
            if env is not None and ENV_PREFIX + name.upper() in env:
                msgs.append(f"{ENV_PREFIX}{name.upper()}={env[ENV_PREFIX + name.upper()]!r}: {what}")
            else:
                msgs.append(f"{name}={e['input']!r}: {what}" if name else what)
        super().__init__("; ".join(msgs))


LOG_LEVELS = ("debug", "info", "warning", "error")


class Settings(BaseSettings):
    """Base: fields shared by every service. Constructing one reads only its arguments (a
    test's or the simulator's settings never pick up the process's env); ``from_env`` reads
    LOCKSTEP_* variables."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    redis_url: str = Field("", description="Redis URL (redis://, rediss:// for TLS, user:password@ for ACL).")
    namespace: str = Field("ls", description="Key prefix, so several clusters can share one Redis.")
    log_level: str = Field("info", description="debug, info, warning or error.")
    redis_wait_s: float = Field(0.0, ge=0, description="At start-up, wait this long for an unreachable Redis (retrying with backoff) before exiting with code 2; 0 (default) checks once, so a wrong URL fails fast; inf waits until it is reachable. `lockstep up` and `lockstep engine` start their processes with inf: they checked the URL themselves, so a process restarted during a Redis outage rides it out like the running ones.")

    @field_validator("namespace")
    @classmethod
    def _no_pattern_characters(cls, v: str) -> str:
        # the services find a namespace's keys by SCAN patterns (spares, ranks): a namespace
        # with glob characters matched none of its own, and `up` waited for spares for ever;
        # a brace would move the keys' Redis Cluster hash tag (shared/keys.py)
        bad = sorted(set(v) & set("*?[]\\{}"))
        if bad:
            raise ValueError(f"must not contain {' '.join(bad)} (Redis key patterns read them as wildcards, "
                             "Redis Cluster braces as a hash tag); use letters, digits and - _ . : /")
        # ... and it names files (`up`'s state, <state dir>/<namespace>.json, and logs): a
        # space or a control character, an empty name or a ../ left or escaped that directory
        other = sorted(set(v) - NAMESPACE_CHARS)
        if not v or other or v.startswith("/") or ".." in v.split("/"):
            what = ("must not be empty" if not v else f"must not contain {' '.join(map(repr, other))}" if other
                    else "must not begin with / or have a .. part (it names files under the state directory)")
            raise ValueError(f"{what}; use letters, digits and - _ . : /")
        return v

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, v: str) -> str:
        # an unknown level made the service log at info without a word (shared/logging.py)
        if v.lower() not in LOG_LEVELS:
            raise ValueError(f"must be {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}")
        return v.lower()

    def __init__(self, **values: Any) -> None:
        # The arguments only, validated as a plain model: BaseSettings.__init__ would read
        # the process env (and build its unused sources: 0.7 ms a call against 10 us).
        try:
            BaseModel.__init__(self, **values)
        except ValidationError as exc:
            raise SettingsError(exc.errors()) from None

    @classmethod
    def from_env(cls: type[T], env: Mapping[str, str] | None = None, **overrides: Any) -> T:
        """Defaults, then LOCKSTEP_* variables of ``env`` (os.environ when None), then the
        non-None ``overrides``; a value a field does not take raises SettingsError."""
        env = os.environ if env is None else env
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return cls(**{**_MappingEnv(cls, env)(), **given})
        except SettingsError as exc:
            raise SettingsError(exc.errors, {k: v for k, v in env.items() if k[len(ENV_PREFIX):].lower() not in given}) from None

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        d = self.model_dump()
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


class ApiServerSettings(Settings):
    api_id: str = Field("", description="This replica's id (its output stream is <ns>:out:<api_id>); random when empty.")
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, description="Port; every replica binds it with SO_REUSEPORT.")
    model: str = Field("lockstep-moe", description="Model name served at /v1/models, or a checkpoint directory (Hugging Face layout): its tokenizer and chat template are used and it is served under the directory's name.")
    max_model_len: int = Field(4096, ge=1, description="Prompt + output tokens per request.")
    max_body_bytes: int = Field(0, ge=0, description="Largest request body accepted (413 above); 0 = max(1 MiB, 32 bytes x max_model_len), so that a whole context fits sent as token ids or as escaped text.")
    max_inflight: int = Field(4096, ge=1, description="Requests in flight per replica before 429.")
    max_queue_wait_s: float = Field(60.0, ge=0, description="429 (with Retry-After) while a new request would wait longer than this before its prefill starts (its estimate: the prompt tokens ahead, in the scheduler and on the ranks, over the rate the ranks take them): above capacity TTFT stays near this bound instead of growing with the queue (0 = off; docs/operations.md, Overload).")
    request_timeout_s: float = Field(600.0, gt=0, description="Longest a request may wait for its tokens.")
    read_timeout_s: float = Field(30.0, gt=0, description="A client must send a request's headers within this many seconds of connecting (or of the request's first byte on a kept-alive connection), and then its body within as long again: a connection that stalls is dropped (a stalled body gets a 408), so idle and half-sent connections cannot pile up outside max_inflight.")
    engine_down_timeout_s: float = Field(30.0, ge=0, description="While the engine group has been short of a rank for longer than this (it steps only with all of them: a rank down and not replaced, all down, or still starting), new requests get a 503 (code engine_unavailable, with Retry-After) and those in flight end with a 503 that says to retry, instead of waiting out request_timeout_s (0 = wait however long).")
    shutdown_grace_s: float = Field(5.0, ge=0, description="On SIGTERM/SIGINT: how long the requests in flight may still run; then each ends with a 503 that says to retry (a stream: an error event and [DONE], not a cut connection). New requests get that 503 at once.")
    # A comma list in the environment (pydantic-settings would read a list as JSON).
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Accepted API keys (comma list); empty = no auth.")
    allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["*"], description="Origins a browser may call the API from (CORS, comma list; * = any, as vLLM's default); empty = no CORS headers, browsers refuse cross-origin calls.")
    dispatch: str = Field("scheduler", description="'scheduler' or 'client' (the replica picks ranks itself).")
    policy: str = Field("waterfill", description="Dispatch policy in client-dispatch mode (waterfill, round_robin, least_score, least_tokens; staggered needs dispatch 'scheduler': refused at start). waterfill places at once here: holding needs the one scheduler.")
    num_api_servers: int = Field(1, description="Replicas in the cluster (scales the local bump in client mode).")
    generation_config: Literal["auto", "none"] = Field("auto", description="Sampling defaults for what a request leaves out: 'auto' = a served checkpoint's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens as max_tokens), as vLLM's --generation-config auto; 'none' = OpenAI's (temperature 1, no cut). The bundled model has none.")
    reasoning_parser: str = Field("", description="Tell a reasoning model's thinking from its answer in chat and Responses output, as vLLM's --reasoning-parser: deepseek_r1, qwen3, glm45 or deepseek_v3 (<think>...</think>; the thinking goes to 'reasoning' and 'reasoning_content'), or openai_gptoss (gpt-oss's harmony channels, and its tool calls); empty = the checkpoint's own (openai_gptoss for gpt-oss), else off: the thinking stays in the content.")

    @property
    def body_limit(self) -> int:
        """max_body_bytes, or what 0 means: a long-context checkpoint's prompt as token ids
        (up to 8 bytes each in JSON) or as \\u-escaped text fits with room to spare."""
        return self.max_body_bytes or max(1 << 20, 32 * self.max_model_len)

    @field_validator("api_keys", "allowed_origins", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        return [k.strip() for k in v.split(",") if k.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _servable(self) -> ApiServerSettings:
        # The policy is this replica's only in client dispatch (else the scheduler's).
        if self.dispatch != "scheduler":
            check_policy_dispatch(self.policy, self.dispatch)
        check_parser(self.reasoning_parser)
        return self


class SchedulerSettings(Settings):
    policy: str = Field("waterfill", description="Dispatch policy (waterfill, round_robin, least_score, least_tokens, staggered); see lockstep up --help.")
    level_tokens: int = Field(0, ge=0, description="waterfill: a rank with less prefill pending than this gets the oldest unplaced request. 0 (default): 2 x the engines' max_num_batched_tokens, as the ranks report it (4096 until one does).")
    collect_ms: float = Field(2.0, ge=0, description="waterfill: a new request waits this long unplaced, so the requests arriving with it (an offline batch, a burst) are placed together (docs/benchmarks.md). 0 = place each at once.")
    together_ms: float = Field(50.0, ge=0, description="waterfill: requests that arrived within this of the oldest unplaced one are placed longest prompt first, while they all fit in the group's free sequence slots; 0 = arrival order always.")
    dispatch: str = Field("scheduler", description="'scheduler' or 'client' (api-servers pick ranks; refused with policy staggered).")
    num_api_servers: int = Field(1, description="api-server replicas (for the local-view bump).")
    ranks: int = Field(4, ge=1, description="DP ranks expected in the engine group.")
    read_count: int = Field(512, ge=1, description="Requests read per stream round trip.")
    grace_ms: float = Field(50.0, description="Wait this long for missing ranks before finalizing a step.")
    snapshot_min_interval_ms: float = Field(5.0, description="Publish snapshots at most this often (newer steps coalesce; at real step times every step is published).")
    max_wait_ms: float = Field(0.0, description="Staggered: longest a request waits unplaced; 0 = learned (about two steps).")
    request_record_ttl_s: int = Field(600, ge=1, description="Lifetime of a request record <ns>:req:<id>, refreshed at each write (memory: about 350 bytes x request rate x this; docs/operations.md).")
    lease_ms: int = Field(1000, ge=30, description="Leadership lease (renewed every third of it); a standby takes over after it lapses.")
    metrics_port: int = Field(0, description="Serve Prometheus metrics (lockstep_*) on this port while this scheduler leads (a standby that takes the lead serves them on the same port); 0 = off.")
    metrics_host: str = Field("0.0.0.0", description="Address the metrics port listens on (lockstep up: its --host).")

    def waterfill_kwargs(self) -> dict[str, float]:
        """The waterfill constructor arguments these settings give (the scheduler's, and the
        simulator's ``default`` entry: the same numbers)."""
        return {"collect_s": self.collect_ms / 1000.0, "together_s": self.together_ms / 1000.0}

    @model_validator(mode="after")
    def _servable(self) -> SchedulerSettings:
        check_policy_dispatch(self.policy, self.dispatch)
        return self


class EngineSettings(Settings):
    rank: int = Field(-1, description="DP rank; -1 claims the first free slot in Redis.")
    spare: bool = Field(False, description="Hot spare: start up, then wait (any time) for a rank slot to free and take it over at once; a dead rank is replaced without a process start.")
    ranks: int = Field(4, ge=1, description="DP ranks in the engine group (world size).")
    backend: str = Field("sim", description="'sim' (device cost model) or 'torch' (a real MoE).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="'cpu' (gloo) or 'cuda' (NCCL).")
    model: str = Field("", description="torch: a local checkpoint directory (Hugging Face layout: config.json, *.safetensors, tokenizer.json); empty or 'lockstep-moe' = the bundled model (trained by scripts/train-bundled-model), 'random' = seeded random weights of the same shape. Nothing is downloaded.")
    dtype: str = Field("auto", description="torch with --model: 'auto' (bfloat16 on cuda, float32 on cpu), 'bfloat16' or 'float32'.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step.")
    max_num_seqs: int = Field(128, ge=1, description="Most sequences running on the rank.")
    num_kv_blocks: int = Field(4096, ge=1, description="KV-cache blocks on the rank.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    max_model_len: int = Field(4096, ge=1, description="Prompt + output tokens per request.")
    time_scale: float = Field(1.0, ge=0, allow_inf_nan=False, description="sim: multiply modeled device time (0 = no device time), and the waits tuned to it (the coordinated prefill's delays and busy window, the staggered gate's timeout): the same group in slow motion.")
    cost_model: str = Field("", description="sim: JSON file with calibrated cost-model constants.")
    request_record_ttl_s: int = Field(600, ge=1, description="Lifetime of a request record <ns>:req:<id>, refreshed at each write (memory: about 350 bytes x request rate x this; docs/operations.md).")
    heartbeat_ms: int = Field(1000, ge=1, description="Heartbeat period; the alive key lives 3x this.")
    collective_timeout_s: float = Field(5.0, gt=0, description="A collective that takes longer means a rank died (keep it above the longest step).")
    reform_timeout_s: float = Field(60.0, gt=0, description="A rank that cannot rejoin its engine group within this exits (code 4) to be replaced.")
    group_host: str = Field("127.0.0.1", description="Address other ranks reach this one at, and where its group sockets listen (engine-group rendezvous); 'auto': the address this host reaches Redis from (containers).")
    seed: int = Field(0, description="Weight seed of model 'random' (identical on every rank).")
    align_tokens: bool = Field(True, description="Coordinated prefill: every rank caps its prefill at one shared budget per step (docs/benchmarks.md); applied when every rank has it.")
    align_min_balance: float = Field(0.94, description="Coordinated prefill under a backlog: the largest budget that keeps a step at least this balanced (sum of what the ranks compute / ranks x the busiest): at 0.94 a prefill step runs only when nearly every rank fills it (in 16 ranks, one with only its decodes is 15/16, below it); 0.9 lost throughput near and above capacity (0 = the older water-level rule, docs/benchmarks.md).")
    align_company_prompts: float = Field(0.25, ge=0, description="Coordinated prefill: align_min_balance holds in full only while at least this many prompts reach the group per rank per full-step time, and in proportion less below: a step then holds back for the ranks without prefill only where company comes soon (or where a rank cannot start the prefill it holds: its room freeing is company that will come). Prompts of many steps each arrive about once a step, and waiting for one idled every other rank through the wait (fixed:16000:16 on 8 ranks ran at 0.88 of ideal; docs/benchmarks.md). 0 = align_min_balance always.")
    align_max_capped_steps: int = Field(32, validation_alias=_formerly("align_max_capped_steps", "align_max_hold_steps"), description="Coordinated prefill: a rank whose prefill the shared budget capped this many steps in a row runs it in full (no starvation). Its old name align_max_hold_steps (LOCKSTEP_ALIGN_MAX_HOLD_STEPS) is still read.")
    align_max_delay_steps: float = Field(23.0, ge=0, description="Coordinated prefill: the longest a prefill waits for a balanced step, in full-step times (what a max_num_batched_tokens step takes on this engine, measured: ~3 s on the simulator's default profile), scaled by the prefill pending on the other ranks (in units of align_backlog_steps full steps, capped at 1); 0 = align_max_delay_ms always.")
    align_max_delay_ms: float = Field(3000.0, ge=0, description="Coordinated prefill: align_max_delay_steps in milliseconds, in force until the engine has measured a full step (or always, when align_max_delay_steps is 0).")
    align_min_delay_steps: float = Field(1.5, ge=0, description="Coordinated prefill: a prefill may wait this many full-step times for others to share its step even with nothing pending elsewhere (~200 ms on the simulator's default profile; docs/benchmarks.md), and where no rank decodes it waits no longer, backlog or not (a step of prefill alone stalls no decode there); 0 = align_min_delay_ms always.")
    align_min_delay_ms: float = Field(200.0, ge=0, description="Coordinated prefill: align_min_delay_steps in milliseconds, in force until the engine has measured a full step (or always, when align_min_delay_steps is 0; both 0 = start at once).")
    align_idle_wait_ms: float = Field(30.0, ge=0, description="Coordinated prefill: the longest a prefill waits for company in an idle group (no rank decodes, no other rank has prefill pending): a lone prefill step there delays no decode, so it only waits for requests sent with it to reach the other ranks (docs/benchmarks.md).")
    align_idle_hold_ms: float = Field(5.0, ge=0, description="Coordinated prefill: with no rank decoding, a prefill that arrived less than this ago holds (no forward) until every rank has a full step of prefill or this has passed, so that requests sent together start in one step instead of one rank's lone step delaying the rest (0 = off).")
    align_backlog_steps: float = Field(0.5, description="Coordinated prefill: the group is backlogged when its pending prefill, each rank's counted up to one full step and on two ranks at least, fills this fraction of a full group step; then only balance and align_max_capped_steps start prefills. The wait for company grows with the other ranks' pending prefill in the same unit (docs/benchmarks.md).")
    align_busy_tokens: float = Field(307.0, ge=0, description="Coordinated prefill: the group is busy when its pending prefill, averaged over align_busy_window_s, reaches this many prompt tokens a rank (0.15 of a 2,048-token step, about one prompt queued on every rank, whatever max_num_batched_tokens is); busy, it runs throughput-first with align_busy_backlog_steps and align_busy_capped_steps (0 = never busy; docs/benchmarks.md).")
    align_busy_level: float | None = Field(None, ge=0, description="Deprecated: the busy threshold in full steps, as it was set until 2026-12-04. When given (and align_busy_tokens is not), align_busy_tokens = this x max_num_batched_tokens, so an old setting keeps its meaning.")
    align_busy_window_s: float = Field(2.0, description="Coordinated prefill: the averaging time of the busy measure (align_busy_tokens).")
    align_busy_backlog_steps: float = Field(0.25, description="Coordinated prefill, busy group: align_backlog_steps in force while busy (a prefill waits longer for company).")
    align_busy_capped_steps: int = Field(64, description="Coordinated prefill, busy group: align_max_capped_steps in force while busy.")
    align_lone_share: float = Field(0.2, ge=0, description="Coordinated prefill: a prefill waits for company only while the group's prefill would take at least this share of its time if every prompt prefilled alone (the prompt tokens/s reaching the group x the measured ms per token), the whole wait from align_lone_share_full; below, a lone prefill costs the decodes little and it starts at once, TTFT first (0 = always wait; docs/benchmarks.md).")
    align_lone_share_full: float = Field(0.3, ge=0, description="Coordinated prefill: the lone-prefill share (align_lone_share) from which the whole wait for company is in force; between the two it grows in proportion.")
    align_lone_window_s: float = Field(10.0, gt=0, description="Coordinated prefill: the averaging time of the prompt tokens/s behind align_lone_share.")
    align_grow_share: float = Field(1.0, ge=0, description="Coordinated prefill: the wait for company grows with the other ranks' pending prefill (toward align_max_delay_steps) only while the lone-prefill share (align_lone_share's measure) is at least this, or the group is busy (align_busy_tokens); below 1 every prompt prefilled alone would still fit in the group's time, so there is headroom and a longer wait only delays first tokens (docs/benchmarks.md).")
    align_grow_share_full: float = Field(2.0, ge=0, description="Coordinated prefill: the lone-prefill share from which the wait's whole growth (align_grow_share) is in force; between the two it grows in proportion (0 = always in force).")
    align_tail_steps: float = Field(4.0, ge=0, description="Coordinated prefill: when a busy group's backlog ends on every rank alike (each has prefill left, none half a full step), its last prefill rides on about this many of the decode steps that follow, each step the same 1/align_tail_steps share of what remained where it began, at least max_num_batched_tokens/16, instead of one long step that every decode waits through (0 = the last step runs whole; applies with align_min_balance > 0; docs/benchmarks.md).")
    align_lull_prompts: float = Field(16.0, ge=0, description="Coordinated prefill: a lull is a time in which no prompt reached any rank while this many were due at the group's recent rate (its prompt tokens/s over align_lull_window_s, over the mean prompt); in a lull a step is balanced among the ranks that have prefill queued, and those with none are not waited for: company that has not arrived is not coming (a benchmark's last requests, the end of a burst). 16 prompts' time passes without one in a steady stream about once in 9 million gaps (0 = always wait; docs/benchmarks.md).")
    align_blocked_tokens: int = Field(192, ge=0, description="Coordinated prefill, busy group: while some rank holds prefill that it cannot start (its KV or sequence slots are full), the shared budget is at most the largest decode plus this many tokens. That rank's room frees only as its sequences finish, one token a step, so short steps bring the company the balance rule waits for sooner: on the ramp workload at 1.0-1.5x, 0.938 -> 0.945 of ideal on average over seeds 1-3 (docs/benchmarks.md; 0 = no cap).")
    align_long_prompt_quantile: float = Field(0.99, ge=0, lt=1, description="Coordinated prefill: which of the group's recent prompts count as long (this quantile of the last align_long_prompt_window, which every rank reports in its step row). While the group is not busy, a shorter prompt may wait for company until align_long_prompt_share of the time a long one takes to prefill at full rate, less its own: its first token still comes before theirs, so the TTFT tail stays theirs, and the longer wait lets more ranks' prefill share steps. Heavy-tailed prompts at 32 ranks: 0.912 / 0.892 -> 0.923 / 0.904 of ideal at 0.8 / 1.0x; where prompts are log-normal it stays under the 1.5-full-step wait (docs/benchmarks.md, item 3; 0 = off).")
    align_long_prompt_share: float = Field(0.8, ge=0, description="Coordinated prefill: the share of a long prompt's full-rate prefill time (align_long_prompt_quantile) that a shorter prompt may wait for company.")
    align_long_prompt_window: int = Field(1024, ge=1, description="Coordinated prefill: how many of the group's last prompts align_long_prompt_quantile is taken over (no such wait until 100 have arrived, or the whole window where it is smaller).")
    align_lull_window_s: float = Field(2.0, gt=0, description="Coordinated prefill: the averaging time of the prompt rate behind align_lull_prompts (short, so that a falling rate is not taken for a lull).")
    gate_timeout_ms: float = Field(100.0, description="Staggered batches: rank 0 releases a batch whose shares did not all arrive within this.")
    metrics_port: int = Field(0, description="Serve Prometheus metrics (lockstep_engine_*) on this port (a spare: this port + the rank it takes); 0 = off.")
    metrics_host: str = Field("0.0.0.0", description="Address the metrics port listens on (lockstep up: its --host).")

    @model_validator(mode="after")
    def _lone_share_span(self) -> "EngineSettings":
        if self.align_lone_share_full < self.align_lone_share:
            raise ValueError(f"align_lone_share_full ({self.align_lone_share_full}) must be at least "
                             f"align_lone_share ({self.align_lone_share}): the whole wait starts there")
        if 0 < self.align_grow_share_full < self.align_grow_share:
            raise ValueError(f"align_grow_share_full ({self.align_grow_share_full}) must be at least "
                             f"align_grow_share ({self.align_grow_share}), or 0 to keep the whole growth")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            need = -(-self.max_model_len // self.block_size)
            raise ValueError(f"the KV cache ({self.num_kv_blocks} blocks x {self.block_size} tokens) cannot hold one "
                             f"request of max_model_len ({self.max_model_len}) tokens: set LOCKSTEP_NUM_KV_BLOCKS to "
                             f"{need} or more, or LOCKSTEP_MAX_MODEL_LEN to {self.num_kv_blocks * self.block_size} "
                             "or less")
        if self.align_busy_level is not None and "align_busy_tokens" not in self.model_fields_set:
            self.align_busy_tokens = self.align_busy_level * self.max_num_batched_tokens
        return self

    @property
    def wait_scale(self) -> float:
        """What the waits tuned to the device's step time are multiplied by: the sim
        backend's ``time_scale`` (a device n times slower keeps its waits n steps long, so a
        slowed-down cluster behaves as the simulator at scale 1), else 1."""
        return self.time_scale if self.backend == "sim" and self.time_scale > 0 else 1.0


ALL_SETTINGS: list[type[Settings]] = [ApiServerSettings, SchedulerSettings, EngineSettings]
