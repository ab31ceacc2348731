"""``scripts/bench-live``: the default against another configuration on real clusters.

For each configuration it starts a fresh ``lockstep up`` (same ranks, api-servers and
backend; all at once, in their own namespaces and ports), warms it, and drives it with
``lockstep bench --load F --capacity C`` several times, the runs of the configurations
interleaved. The capacity ``C`` is measured once, on the first configuration's cluster (the
same requests all at once: ``lockstep bench --load``), and every configuration then gets
the same trace at the same rate, so the runs differ only in the system. Prints a
markdown table (median and every run) and writes the JSON of every run.

    scripts/bench-live --ranks 8 --api-servers 2 --backend sim --load 1.2 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "default": [],                                               # what `lockstep up` runs
    "least_score": ["--policy", "least_score", "--no-align-tokens"],   # the earlier default
}
MEASURES = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "balance_ratio", "idle_forward_fraction", "completed", "failed",
            "rejected", "errors")   # of the failed: refused with a 429 (admission control), and why the rest failed


def _cli(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.admin.cli", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


class Cluster:
    """One ``lockstep up`` in its own namespace, state dir and port."""

    def __init__(self, name: str, args: list[str], up_args: list[str], workdir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.port, self.redis_url = name, free_port(), ""
        self.ns = f"bl{name.replace('_', '')}{os.getpid() % 10000}"
        self.env = {**os.environ, **(env or {}), "LOCKSTEP_STATE_DIR": str(workdir / f"state-{name}"),
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("LOCKSTEP_REDIS_URL", None)
        self.log = open(workdir / f"up-{name}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "up", "--port", str(self.port),
                                      "--namespace", self.ns, *up_args, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until `up` printed its Redis URL and the api-servers answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lockstep up ({self.name}) exited {self.proc.returncode}; see {self.log.name}")
            for line in Path(self.log.name).read_text().splitlines():
                if line.startswith("REDIS_URL="):
                    self.redis_url = line.split("=", 1)[1].strip()
            try:
                if self.redis_url and \
                        httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"lockstep up ({self.name}) not serving within {timeout:.0f} s; see {self.log.name}")

    def bench(self, *args: str, timeout: float = 1800.0) -> dict[str, Any]:
        p = _cli("bench", "-n", self.ns, "--url", f"http://127.0.0.1:{self.port}/v1", "--redis-url", self.redis_url,
                 "--json", *args, env=self.env, timeout=timeout)
        doc = None
        if p.returncode in (0, 1) and p.stdout.strip():
            # 1 with a document: the run ended, some requests failed; its "failed" is reported
            doc = json.loads(p.stdout.strip().splitlines()[-1])
        if doc is None or (p.returncode == 1 and (not doc.get("completed") or doc.get("error"))):
            raise RuntimeError(f"lockstep bench ({self.name}) exited {p.returncode}: {p.stderr[-2000:]}")
        return doc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def run(a: argparse.Namespace) -> dict[str, Any]:
    up_args = ["--ranks", str(a.ranks), "--api-servers", str(a.api_servers), "--backend", a.backend]
    if a.time_scale is not None:
        up_args += ["--time-scale", str(a.time_scale)]
    work = ["--workload", a.workload, "--requests", str(a.requests), "--seed", str(a.seed)]
    # the engines' and api-servers' limit: the trace is clipped to it, as the simulator's is
    # to its profile's (the default profile's 20,480 keeps its 16k-token prompts)
    env = {"LOCKSTEP_MAX_MODEL_LEN": str(a.max_model_len)} if a.max_model_len else {}
    doc: dict[str, Any] = {"ranks": a.ranks, "api_servers": a.api_servers, "backend": a.backend,
                           "time_scale": a.time_scale, "max_model_len": a.max_model_len,
                           "workload": a.workload, "requests": a.requests, "seed": a.seed, "load": a.load,
                           "configs": {k: CONFIGS[k] for k in a.configs}, "capacity_rps": a.capacity,
                           "runs": {}}
    with tempfile.TemporaryDirectory(prefix="lockstep-bench-live-") as tmp:
        # every cluster up at once and the runs interleaved (run i of each config back to
        # back): the machine's background load then hits every config alike; an idle
        # cluster pauses its group and costs almost nothing while another one runs
        clusters = [Cluster(name, CONFIGS[name], up_args, Path(tmp), env) for name in a.configs]
        try:
            for c in clusters:
                c.wait_ready()
                # warm: every rank's first steps (and the group's formation) outside the runs
                c.bench("--workload", "poisson", "--requests", str(4 * a.ranks), "--rate", "20", "--seed", "99")
                doc["runs"][c.name] = []
            if doc["capacity_rps"] is None:
                probe = clusters[0].bench(*work, "--load", str(a.load))
                doc["capacity_rps"] = probe["capacity_rps"]
                doc["capacity_from"] = clusters[0].name
                doc["capacity_probe"] = probe["capacity_probe"]
                print(f"capacity {probe['capacity_rps']:.2f} requests/s (measured on {clusters[0].name})",
                      file=sys.stderr, flush=True)
            for i in range(a.runs):
                for c in clusters:
                    r = c.bench(*work, "--load", str(a.load), "--capacity", str(doc["capacity_rps"]))
                    doc["runs"][c.name].append({k: r.get(k) for k in MEASURES})
                    print(f"{c.name} run {i + 1}: " + ", ".join(f"{k} {r.get(k)}" for k in MEASURES[:3]),
                          file=sys.stderr, flush=True)
        finally:
            for c in clusters:
                c.stop()
    return doc


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(doc: dict[str, Any]) -> str:
    lines = ["| config | throughput tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | balance | "
             "idle-forward fraction | runs (tok/s, TTFT p99 ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, runs in doc["runs"].items():
        def med(k: str) -> float | None:
            vals = [r[k] for r in runs if r.get(k) is not None]
            return statistics.median(vals) if vals else None
        each = " / ".join(f"{_fmt(r['throughput_tok_s'], '.0f')}, {_fmt(r['ttft_p99_ms'], '.0f')}" for r in runs)
        lines.append(f"| {name} | {_fmt(med('throughput_tok_s'), '.0f')} | {_fmt(med('ttft_p50_ms'), '.0f')} | "
                     f"{_fmt(med('ttft_p99_ms'), '.0f')} | {_fmt(med('itl_p50_ms'), '.1f')} | "
                     f"{_fmt(med('itl_p99_ms'), '.0f')} | {_fmt(med('balance_ratio'), '.3f')} | "
                     f"{_fmt(med('idle_forward_fraction'), '.3f')} | {each} |")
    return "\n".join(lines)


def verdict(doc: dict[str, Any], a: str = "default", b: str = "least_score") -> list[str]:
    """Run-by-run: does ``a`` beat ``b`` on throughput and on TTFT p99 (run i against run i)?"""
    out = []
    ra, rb = doc["runs"].get(a, []), doc["runs"].get(b, [])
    for i, (x, y) in enumerate(zip(ra, rb), 1):
        tp = x["throughput_tok_s"] is not None and y["throughput_tok_s"] is not None and \
            x["throughput_tok_s"] > y["throughput_tok_s"]
        tt = x["ttft_p99_ms"] is not None and y["ttft_p99_ms"] is not None and x["ttft_p99_ms"] < y["ttft_p99_ms"]
        out.append(f"run {i}: throughput {'beats' if tp else 'does NOT beat'} {b}, "
                   f"TTFT p99 {'beats' if tt else 'does NOT beat'} {b}")
    return out


def failures(doc: dict[str, Any]) -> list[str]:
    """Every run in which a request did not complete: how many, how many of those the
    api-servers refused with a 429 (admission control: the client may retry), and why
    the others failed. A run with failures is not the same trace served."""
    out = []
    for name, runs in doc["runs"].items():
        for i, r in enumerate(runs, 1):
            if r.get("failed"):
                n = (r.get("completed") or 0) + r["failed"]
                why = "; ".join(r.get("errors") or []) or "not recorded"
                out.append(f"{name} run {i}: {r['failed']} of {n} requests failed "
                           f"({r.get('rejected') or 0} refused with a 429; errors: {why})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench-live", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--api-servers", type=int, default=2)
    ap.add_argument("--backend", default="sim", choices=("sim", "torch"))
    ap.add_argument("--time-scale", type=float, default=None,
                    help="sim backend: multiply the modeled device time (lockstep up --time-scale), so a "
                         "small machine's CPU overhead does not dominate the step time")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the cluster's max_model_len (LOCKSTEP_MAX_MODEL_LEN); the trace is clipped to it. "
                         "Default: the sim backend's simulator profile's (20480: the simulator's trace), "
                         "else the settings' own")
    ap.add_argument("--workload", default="bursty")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=1.2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--capacity", type=float, default=None, help="requests/s; measured on the first config if absent")
    ap.add_argument("--configs", default="default,least_score", help=f"from: {', '.join(CONFIGS)}")
    ap.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    a = ap.parse_args(argv)
    a.configs = [x.strip() for x in a.configs.split(",") if x.strip()]
    if a.max_model_len is None and a.backend == "sim":
        from services.simulator.profile import load as load_profile
        a.max_model_len = load_profile(None).engine.max_model_len
    bad = [x for x in a.configs if x not in CONFIGS]
    if bad:
        ap.error(f"unknown configs {bad}; choose from {', '.join(CONFIGS)}")
    doc = run(a)
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    scale = f" (time scale {a.time_scale:g})" if a.time_scale is not None else ""
    scale += f", max_model_len {a.max_model_len}" if a.max_model_len else ""
    print(f"{a.ranks} ranks x {a.api_servers} api-servers, backend {a.backend}{scale}, {a.workload}, "
          f"{a.requests} requests at {a.load:g} x {doc['capacity_rps']:.2f} requests/s "
          f"(capacity measured on {doc.get('capacity_from', 'given')})\n")
    print(table(doc))
    print()
    for line in verdict(doc):
        print("- " + line)
    for line in failures(doc):
        print("- NOT every request completed: " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
