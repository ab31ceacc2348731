"""What every rank of one engine group must share beyond the step protocol: the backend,
the device kind (gloo or NCCL collectives), and for the torch backend the model and its
dtype. Rank 0 publishes its signature at the rendezvous and a rank with another refuses
to join (membership.py), with the difference named.

Without it a host started with another ``LOCKSTEP_MODEL`` (or ``--device``, or
``--dtype``) joined the group: the experts' all-to-all exchanged tensors of other shapes
or dtypes, every collective failed, and the group re-formed every few seconds for ever;
a model of the same shape served requests resumed across ranks with another model's
weights."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from services.engine_worker.model.factory import is_checkpoint

_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}


def model_identity(model: str, seed: int) -> str:
    """The model a torch rank serves, alike on every host that has the same checkpoint,
    wherever it keeps it: a digest of its config.json and its weight files' names and
    sizes (reading the weights themselves would take minutes)."""
    if not is_checkpoint(model):
        return f"random(seed={seed})" if model == "random" else "lockstep-moe"
    h = hashlib.sha256()
    root = Path(model)
    try:
        h.update((root / "config.json").read_bytes())
        for f in sorted(root.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size};".encode())
    except OSError as exc:
        return f"checkpoint unreadable ({exc.__class__.__name__})"
    return f"checkpoint {h.hexdigest()[:16]}"


def signature(s: Any) -> dict[str, str]:
    """This rank's signature, from its EngineSettings."""
    sig = {"backend": s.backend, "device": s.device}
    if s.backend == "torch":
        sig["model"] = model_identity(s.model, s.seed)
        if is_checkpoint(s.model):
            dtype = _DTYPE_NAMES.get(s.dtype, s.dtype)
            sig["dtype"] = dtype if dtype != "auto" else ("bfloat16" if s.device == "cuda" else "float32")
    return sig


def encode(sig: dict[str, str]) -> str:
    return "; ".join(f"{k}={v}" for k, v in sorted(sig.items()))


def decode(text: str) -> dict[str, str]:
    out = {}
    for part in text.split("; "):
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


def differences(mine: dict[str, str], rank0: dict[str, str]) -> list[str]:
    """'model X here, Y on rank 0' for each key the two disagree on."""
    return [f"{k} {mine.get(k, 'none')} here, {rank0.get(k, 'none')} on rank 0"
            for k in sorted(set(mine) | set(rank0)) if mine.get(k) != rank0.get(k)]
