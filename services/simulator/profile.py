"""Deployment profiles for the simulator: the engine limits of every rank and the device
cost model of one lockstep step, with where the numbers come from.

A profile is JSON: ``{"name", "source", "engine": {EngineConfig fields}, "cost":
{CostModel fields}}`` (plus free-form ``"fit"`` notes). Bundled ones live in
``services/simulator/profiles/NAME.json``; ``--profile`` takes a bundled name or a path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.cost_model import CostModel
from services.simulator.engine_group import EngineConfig

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "default"


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    engine: EngineConfig
    cost: CostModel
    extra: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        return {"name": self.name, "source": self.source, "engine": asdict(self.engine),
                "cost": self.cost.to_dict(), **self.extra}


def bundled() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load(name_or_path: str | Path | None = None) -> Profile:
    """A bundled profile by name, or a JSON file."""
    key = str(name_or_path) if name_or_path else DEFAULT_PROFILE
    path = Path(key)
    if not (key.endswith(".json") or path.is_file()):
        path = PROFILE_DIR / f"{key}.json"
        if not path.is_file():
            raise ValueError(f"unknown profile {key!r}; bundled: {', '.join(bundled())}, or a JSON file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read profile ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a profile is a JSON object with 'engine' and 'cost'")
    eng, cost = doc.get("engine", {}), doc.get("cost", {})
    fields = EngineConfig.__dataclass_fields__
    if not isinstance(eng, dict) or set(eng) - set(fields):
        raise ValueError(f"{path}: unknown engine fields {sorted(set(eng) - set(fields)) if isinstance(eng, dict) else eng!r}; "
                         f"known: {sorted(fields)}")
    bad = [k for k, v in eng.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ValueError(f"{path}: engine {', '.join(f'{k}={eng[k]!r}' for k in bad)}: engine limits are integers >= 1")
    engine = EngineConfig(**eng)
    kv_tokens = engine.num_kv_blocks * engine.block_size
    if kv_tokens < engine.max_model_len:
        # as the live settings: a rank must hold one request of the longest length, else
        # requests that fit the model fail on every rank
        raise ValueError(f"{path}: engine num_kv_blocks x block_size = {kv_tokens} tokens of KV per rank, "
                         f"less than max_model_len ({engine.max_model_len}); raise num_kv_blocks to at "
                         f"least {-(-engine.max_model_len // engine.block_size)} or lower max_model_len")
    extra = {k: v for k, v in doc.items() if k not in ("name", "source", "engine", "cost")}
    return Profile(doc.get("name", path.stem), doc.get("source", ""), engine,
                   CostModel.checked(cost, str(path), what="cost"), extra)
