"""`lockstep`: run, inspect and steer a lockstep cluster."""

from __future__ import annotations

import asyncio
import math
import os
import sys
from typing import Optional

import orjson
import typer

from services.admin import local_state
from services.admin.cmd_common import console as out_console, log_level_known
from shared.policy.registry import DEFAULT_POLICY, PURPOSE, policy_names


def _flags_take_no_value() -> None:
    """typer 0.2x prints a type beside every option, flags too (``--help <bool>``); a flag
    takes no value, so its help row shows none (older typers have no such column)."""
    from typer.core import TyperOption
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_take_no_value", False):
        return

    def display_type_rich(self: TyperOption, ctx: typer.Context) -> str | None:
        return None if self.is_flag else shown(self, ctx)
    display_type_rich.flags_take_no_value = True   # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich   # type: ignore[method-assign]


_flags_take_no_value()

app = typer.Typer(
    name="lockstep", no_args_is_help=True, add_completion=False, rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    help="Load balancer and step scheduler for DP+EP mixture-of-experts serving.\n\n"
         "Start a local cluster with [bold]lockstep up[/bold], then point any OpenAI client at it.")

NS_OPT = typer.Option("ls", "--namespace", "-n", envvar="LOCKSTEP_NAMESPACE", help="Key prefix of the cluster.")
URL_OPT = typer.Option(None, "--redis-url", help="Redis URL (default: LOCKSTEP_REDIS_URL, else the local cluster's).")


def _fail(msg: str, code: int = 1) -> None:
    typer.secho(f"lockstep: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def up(
    ranks: int = typer.Option(4, "--ranks", min=1, envvar="LOCKSTEP_RANKS", help="DP engine ranks."),
    api_servers: int = typer.Option(2, "--api-servers", min=1, envvar="LOCKSTEP_NUM_API_SERVERS",
                                    help="api-server replicas (all serve --port)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, envvar="LOCKSTEP_PORT",
                             help="HTTP port of the OpenAI-compatible API."),
    host: str = typer.Option("127.0.0.1", "--host", envvar="LOCKSTEP_HOST", help="Address to listen on."),
    backend: str = typer.Option("torch", "--backend", envvar="LOCKSTEP_BACKEND",
                                help="torch (a real MoE on CPU/GPU) or sim (device cost model)."),
    policy: str = typer.Option(DEFAULT_POLICY, "--policy", envvar="LOCKSTEP_POLICY", help="Dispatch policy. " + "; ".join(
        f"{n}: {PURPOSE.get(n, '')}" for n in policy_names()) + "."),
    dispatch: str = typer.Option("scheduler", "--dispatch", envvar="LOCKSTEP_DISPATCH",
                                 help="scheduler (one decision maker) or client (api-servers pick)."),
    namespace: str = NS_OPT,
    redis_url: Optional[str] = typer.Option(None, "--redis-url", envvar="LOCKSTEP_REDIS_URL",
                                            help="Use this Redis instead of starting a private one: redis://, rediss://, "
                                                 "redis+cluster://HOST:PORT, redis+sentinel://HOST:PORT/SERVICE."),
    persist: Optional[str] = typer.Option(None, "--persist", help="Keep the embedded Redis data in this directory."),
    time_scale: float = typer.Option(1.0, "--time-scale", envvar="LOCKSTEP_TIME_SCALE",
                                     help="sim backend: scale modeled device time (0 = none)."),
    max_wait_ms: Optional[float] = typer.Option(None, "--max-wait-ms", min=0.0, envvar="LOCKSTEP_MAX_WAIT_MS",
                                                help="staggered: longest a request waits unplaced before its batch goes out "
                                                     "(default, or 0: learned, about two steps)."),
    align_tokens: bool = typer.Option(True, "--align-tokens/--no-align-tokens", envvar="LOCKSTEP_ALIGN_TOKENS",
                                      help="Coordinated prefill across ranks (each step's prefill capped at one "
                                           "shared budget most ranks can fill; see docs/benchmarks.md)."),
    schedulers: int = typer.Option(1, "--schedulers", min=1,
                                   help="Scheduler processes: one leads, the others stand by and take over."),
    spares: int = typer.Option(1, "--spares", min=0,
                               help="Hot-spare engine processes: started and waiting, one takes over a dead "
                                    "rank at once (0: a dead rank's process is started again instead)."),
    log_level: str = typer.Option("info", "--log-level", envvar="LOCKSTEP_LOG_LEVEL", help="debug, info, warning, error."),
    model: Optional[str] = typer.Option(None, "--model", envvar="LOCKSTEP_MODEL",
                                        help="A local Hugging Face checkpoint directory (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, "
                                             "DeepSeek-V2 and -V3, GLM-4.5, gpt-oss) "
                                             "to serve with its own tokenizer and chat template; default: the "
                                             "bundled model. Nothing is downloaded (README: Real checkpoints)."),
    dtype: str = typer.Option("auto", "--dtype", envvar="LOCKSTEP_DTYPE", help="With --model: auto (bfloat16 on cuda, float32 on cpu), "
                                                      "bfloat16 or float32."),
    reasoning_parser: Optional[str] = typer.Option(
        None, "--reasoning-parser", envvar="LOCKSTEP_REASONING_PARSER",
        help="A reasoning model's thinking (<think>...</think>) goes to the chat answer's 'reasoning', not its "
             "content, as vLLM's flag: deepseek_r1, qwen3, glm45 or deepseek_v3 (gpt-oss: openai_gptoss, "
             "its harmony channels and calls, the default for a gpt-oss checkpoint)."),
) -> None:
    """Start a local cluster: Redis (embedded unless --redis-url), scheduler, engine ranks, api-servers."""
    from services.admin.up import ClusterRunning, LocalCluster, UpOptions, banner, check_options, persist_problem
    from shared.bus import RedisUnreachable
    from shared.redis_server import ServerNotFound

    if backend not in ("sim", "torch"):
        _fail(f"--backend must be 'sim' or 'torch', not {backend!r}", 2)
    if policy not in policy_names():
        _fail(f"unknown --policy {policy!r}; choose one of: {', '.join(policy_names())}", 2)
    if dispatch not in ("scheduler", "client"):
        _fail(f"--dispatch must be 'scheduler' or 'client', not {dispatch!r}", 2)
    if not log_level_known(log_level):
        _fail(f"--log-level must be debug, info, warning or error, not {log_level!r}", 2)
    from shared.reasoning import check_parser
    try:
        check_parser(reasoning_parser or "")
    except ValueError as exc:
        _fail(f"--reasoning-parser: {exc}", 2)
    # Options that only one path uses: refused on the others instead of silently ignored.
    if persist and redis_url:
        _fail("--persist keeps the data of the embedded Redis that `up` starts; with --redis-url (or "
              "LOCKSTEP_REDIS_URL) that server keeps its own: configure persistence there, or drop --redis-url", 2)
    if persist:   # (after the check above: it creates the directory)
        problem = persist_problem(persist)
        if problem:
            _fail(problem, 2)
    if max_wait_ms is not None and policy != "staggered":
        _fail(f"--max-wait-ms (or LOCKSTEP_MAX_WAIT_MS) bounds the wait of a staggered batch; policy {policy!r} does "
              "not read it (use --policy staggered --max-wait-ms MS, or drop --max-wait-ms / unset "
              "LOCKSTEP_MAX_WAIT_MS)", 2)
    if not math.isfinite(time_scale) or time_scale < 0:   # (checked here: typer's bound said "nan < 0")
        _fail(f"--time-scale must be a finite number >= 0 (0 = no modeled device time), not {time_scale}"
              + (": at inf no step would ever end" if time_scale == math.inf else ""), 2)
    if time_scale != 1.0 and backend != "sim":
        _fail("--time-scale scales the sim backend's modeled device time; --backend torch runs the real model "
              "(use --backend sim --time-scale X, or drop --time-scale)", 2)
    from services.engine_worker.model.factory import (check_backend, check_bundled, check_checkpoint, check_dtype,
                                                      is_checkpoint)
    try:
        check_backend(model or "", backend)
        check_dtype(model or "", dtype)
        if backend == "torch" and not (model and is_checkpoint(model)):
            check_bundled(ranks, int(os.environ.get("LOCKSTEP_MAX_MODEL_LEN", "4096")))
    except ValueError as exc:
        _fail(str(exc), 2)
    model_env = {"LOCKSTEP_MODEL": model} if model else {}    # 'lockstep-moe' (the default) or 'random'
    if model and is_checkpoint(model):
        model = os.path.abspath(model)   # the children may start elsewhere
        try:
            check_checkpoint(model, ranks, int(os.environ.get("LOCKSTEP_MAX_MODEL_LEN", "4096")))
        except (OSError, ValueError) as exc:
            _fail(str(exc), 2)
        model_env = {"LOCKSTEP_MODEL": model, "LOCKSTEP_DTYPE": dtype}
    if local_state.read(namespace):
        _fail(f"a local cluster already runs in namespace {namespace!r}; stop it first or use --namespace", 2)
    from services.admin.up import port_taken
    taken = port_taken(host, port)
    if taken:
        _fail(f"cannot serve on {host}:{port}: {taken}", 2)
    opts = UpOptions(ranks=ranks, api_servers=api_servers, port=port, host=host, backend=backend, policy=policy,
                     dispatch=dispatch, namespace=namespace, redis_url=redis_url, persist_dir=persist,
                     time_scale=time_scale, log_level=log_level, schedulers=schedulers, spares=spares,
                     extra_env={**({"LOCKSTEP_MAX_WAIT_MS": f"{max_wait_ms:g}"} if max_wait_ms is not None else {}),
                                "LOCKSTEP_ALIGN_TOKENS": "1" if align_tokens else "0", **model_env,
                                **({"LOCKSTEP_REASONING_PARSER": reasoning_parser} if reasoning_parser else {})})
    try:
        check_options(opts)
    except ValueError as exc:
        _fail(str(exc), 2)
    cluster = LocalCluster(opts, out=lambda m: typer.echo(m, err=True))
    try:
        cluster.start()
    except (RedisUnreachable, ServerNotFound, ClusterRunning) as exc:
        _fail(str(exc), 2)
    except KeyboardInterrupt:   # Ctrl-C / SIGTERM before the cluster served: the shell's convention
        cluster.stop()
        _fail("interrupted during start-up; stopped what had started", 130)
    except (RuntimeError, TimeoutError, ValueError) as exc:
        cluster.stop()
        _fail(str(exc), 1)
    typer.echo(banner(cluster))
    typer.echo(f"REDIS_URL={cluster.url}")
    sys.stdout.flush()
    raise typer.Exit(cluster.wait())


@app.command()
def status(namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT,
           json: bool = typer.Option(False, "--json", help="One JSON object instead of tables.")) -> None:
    """Per-rank load, scheduler state and queue depths, read from Redis."""
    from services.admin.status import collect, render
    from shared.bus import RedisUnreachable, check_reachable

    try:
        url = local_state.resolve_redis_url(redis_url, namespace)
        asyncio.run(check_reachable(url))
    except (local_state.NoCluster, RedisUnreachable) as exc:
        _fail(str(exc), 2)
    data = asyncio.run(collect(url, namespace))
    if not data["cluster"] and not data["ranks"]:
        from services.admin.cmd_common import no_cluster_message
        _fail(no_cluster_message(namespace, data["redis_url"]), 2)
    if json:
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    out_console().print(render(data))


# ---------------------------------------------------------------------- services
def _settings(cls, sets: list[str]):  # type: ignore[no-untyped-def]
    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            _fail(f"--set takes KEY=VALUE, got {item!r}", 2)
        overrides[key.strip().replace("-", "_")] = value
    env = dict(os.environ)
    env.update({"LOCKSTEP_" + k.upper(): v for k, v in overrides.items()})
    from shared.settings import names_of

    known = {n.upper() for f in cls.model_fields for n in names_of(cls, f)}   # old names of renamed settings too
    unknown = [k for k in overrides if k.upper() not in known]
    if unknown:
        _fail(f"unknown setting(s) {unknown}; see `lockstep config` or docs/configuration.md", 2)
    try:
        settings = cls.from_env(env)
    except ValueError as exc:
        _fail(str(exc), 2)
    if not settings.redis_url:
        _fail("no Redis URL: set LOCKSTEP_REDIS_URL or --set redis_url=redis://HOST:PORT", 2)
    return settings


SET_OPT = typer.Option([], "--set", help="Override a setting: KEY=VALUE (also LOCKSTEP_KEY env vars).")


@app.command("api-server")
def api_server(sets: list[str] = SET_OPT) -> None:
    """Run one api-server replica (settings from LOCKSTEP_* env vars and --set)."""
    from services.api_server.main import main
    from shared.settings import ApiServerSettings
    raise typer.Exit(main(_settings(ApiServerSettings, sets)))


@app.command("scheduler")
def scheduler(sets: list[str] = SET_OPT) -> None:
    """Run the scheduler (leader or standby)."""
    from services.scheduler.service import main
    from shared.settings import SchedulerSettings
    raise typer.Exit(main(_settings(SchedulerSettings, sets)))


@app.command("engine-worker")
def engine_worker(sets: list[str] = SET_OPT) -> None:
    """Run one DP engine rank (claims a rank slot in Redis unless rank is set)."""
    from services.engine_worker.worker import main
    from shared.settings import EngineSettings
    raise typer.Exit(main(_settings(EngineSettings, sets)))


def _register_optional() -> None:
    """Commands that live in their own modules register themselves here."""
    import importlib
    for mod in ("services.admin.simulate_cmd", "services.admin.bench_cmd", "services.admin.init_cmd",
                "services.admin.steps_cmd", "services.admin.request_cmd", "services.admin.drain_cmd",
                "services.admin.config_cmd", "services.admin.watch", "services.admin.chaos",
                "services.admin.engine_cmd"):
        try:
            module = importlib.import_module(mod)
        except ImportError:
            continue
        module.register(app)


_register_optional()

# Group `lockstep --help` by what people come for.
_PANELS = {
    "Run and watch": ("up", "engine", "status", "watch"),
    "Inspect and steer": ("steps", "request", "drain", "resume", "config", "init"),
    "Measure": ("bench", "simulate", "chaos"),
    "Services (what `up` and compose start)": ("api-server", "scheduler", "engine-worker"),
}
_ORDER = [n for names in _PANELS.values() for n in names]


def _cmd_name(cmd) -> str:  # type: ignore[no-untyped-def]
    return cmd.name or (cmd.callback.__name__.replace("_", "-") if cmd.callback else "")


def reflow_help(doc: str) -> str:
    """A docstring's paragraphs as single lines: typer's rich help keeps a source line
    break inside a paragraph, so a wrapped docstring printed with a ragged edge."""
    import inspect
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if p.lstrip().startswith(("-", "\b")) else " ".join(p.split("\n")) for p in paragraphs)


for _cmd in app.registered_commands:
    _doc = _cmd.help or (_cmd.callback.__doc__ if _cmd.callback else None)
    if _doc:
        _cmd.help = reflow_help(_doc)
    for _panel, _names in _PANELS.items():
        if _cmd_name(_cmd) in _names:
            _cmd.rich_help_panel = _panel
app.registered_commands.sort(key=lambda c: _ORDER.index(_cmd_name(c)) if _cmd_name(c) in _ORDER else len(_ORDER))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
