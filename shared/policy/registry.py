"""Policy names -> classes. Every component (scheduler, api-server in client mode,
simulator, CLI) builds policies here, so a name means the same object everywhere."""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, class). Imported lazily so a policy's module loads only when used.
POLICIES: dict[str, tuple[str, str]] = {
    "waterfill": ("shared.policy.waterfill", "WaterFill"),
    "round_robin": ("shared.policy.dispatch", "RoundRobin"),
    "least_score": ("shared.policy.dispatch", "LeastScore"),
    "least_tokens": ("shared.policy.dispatch", "LeastTokens"),
    "staggered": ("shared.policy.staggered", "StaggeredBatcher"),
}

DEFAULT_POLICY = "waterfill"


# What each is for (``lockstep up --help``).
PURPOSE: dict[str, str] = {
    "waterfill": "the default: binds each request to the rank with the least prefill pending, "
                 "holding it centrally while every rank has two steps queued (right at every load)",
    "least_score": "vLLM's waiting x 4 + running score, placed at once",
    "least_tokens": "SGLang-style outstanding tokens, placed at once",
    "round_robin": "rotate, ignoring load (a baseline)",
    "staggered": "FastDeploy-style batches every rank starts in the same step",
}


def policy_names() -> list[str]:
    return list(POLICIES)


def policy_class(name: str) -> type:
    """The class a policy name stands for (ValueError naming the known ones)."""
    try:
        module_name, class_name = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    return getattr(importlib.import_module(module_name), class_name)


def make_policy(name: str, **params: Any) -> Any:
    """Build a policy by name. ``params`` go to its constructor (e.g. num_api_servers)."""
    return policy_class(name)(**params)
