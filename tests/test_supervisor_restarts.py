"""How the supervisor of `lockstep up` / `lockstep engine` counts deaths (pure rules,
driven with real short-lived processes; Redis unreachable, so no slot is released):
per rank whichever process held it, per role for the others, and the waiting spares
together. A rank whose every process dies stops the supervisor; spares that keep dying
are not started for a minute but do not stop a cluster that serves without them (they
did, while a crash-looping rank replaced by fresh spares never counted at all)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.admin.supervisor import MAX_RESTARTS_PER_MIN, Supervisor


class Dying(Supervisor):
    """Every child it starts exits at once with code 1."""

    url = "redis://127.0.0.1:1/0"
    namespace = "sup"
    world = 2

    def __init__(self, log_dir: Path, spares: int) -> None:
        self.said: list[str] = []
        super().__init__(log_dir, out=self.said.append)
        self.spares = spares

    @staticmethod
    def _popen(args, env, log) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    def run_rounds(self, n: int) -> bool:
        for _ in range(n):
            for c in self.children:
                c.proc.wait(30)
            if not self.supervise():
                return False
        return True


@pytest.mark.timeout(120)
def test_a_rank_whose_every_process_dies_stops_the_supervisor(tmp_path):
    sup = Dying(tmp_path, spares=0)
    sup._spawn("engine-1", ["engine-worker"], {})
    assert not sup.run_rounds(MAX_RESTARTS_PER_MIN + 1)
    assert any("engine-1 keeps exiting (more than" in m for m in sup.said), sup.said


@pytest.mark.timeout(120)
def test_spares_that_keep_dying_are_held_back_without_stopping_the_cluster(tmp_path):
    sup = Dying(tmp_path, spares=1)
    sup._next_top_up = float("inf")    # no Redis here: only the restart path starts spares
    sup._spawn_spare()
    assert sup.run_rounds(MAX_RESTARTS_PER_MIN + 1)
    assert any("hot spares keep exiting" in m for m in sup.said), sup.said
    assert sup.children == []          # none started again for a minute
    assert sup.run_rounds(1)
