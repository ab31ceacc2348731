"""Redis replies as text. Clients run with ``decode_responses=False`` (payloads stay bytes
for orjson), so names, ids and hash fields are decoded where they are read, here."""

from __future__ import annotations

from typing import Any


def as_str(v: Any) -> str:
    """A reply value (bytes, or str from a decoding client) as str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def str_keys(d: dict[Any, Any]) -> dict[str, Any]:
    """A hash or XINFO reply with str field names; values as they came."""
    return {as_str(k): v for k, v in d.items()}
