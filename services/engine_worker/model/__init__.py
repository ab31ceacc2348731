"""The real torch backend: a small MoE transformer with experts sharded across DP ranks.

One concept per file: ``config`` (shape), ``kv_cache`` (paged cache + batch layout),
``layers`` (attention, router, expert FFN), ``moe`` (expert-parallel dispatch/combine),
``model`` (the transformer), ``sampler`` (seeded sampling), ``runner`` (TorchModelRunner),
``bench`` (decode-step benchmark)."""

from services.engine_worker.model.config import MoEConfig
from services.engine_worker.model.runner import TorchModelRunner

__all__ = ["MoEConfig", "TorchModelRunner"]
