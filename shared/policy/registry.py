"""Policy names -> classes. Every component (scheduler, api-server in client mode,
simulator, CLI) builds policies here, so a name means the same object everywhere."""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, class). Imported lazily so a policy's module loads only when used.
POLICIES: dict[str, tuple[str, str]] = {
    "round_robin": ("shared.policy.dispatch", "RoundRobin"),
    "least_score": ("shared.policy.dispatch", "LeastScore"),
    "least_tokens": ("shared.policy.dispatch", "LeastTokens"),
    "staggered": ("shared.policy.staggered", "StaggeredBatcher"),
    "waterfill": ("shared.policy.waterfill", "WaterFill"),
}

DEFAULT_POLICY = "least_score"


def policy_names() -> list[str]:
    return list(POLICIES)


def make_policy(name: str, **params: Any) -> Any:
    """Build a policy by name. ``params`` go to its constructor (e.g. num_api_servers)."""
    try:
        module_name, class_name = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**params)
