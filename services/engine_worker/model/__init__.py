"""The real torch backend: a small MoE transformer with experts sharded across DP ranks.

One concept per file: ``config`` (shape), ``kv_cache`` (paged cache + batch layout),
``layers`` (attention, router, expert FFN), ``moe`` (expert-parallel dispatch/combine),
``model`` (the transformer), ``sampler`` (seeded sampling), ``runner`` (TorchModelRunner),
``bench`` (decode-step benchmark). Real checkpoints (Hugging Face layout): ``hf_config``
(config.json), ``loader`` (safetensors, a rank's own experts only), ``hf_layers`` and ``rope``
(shared blocks), one file per architecture (``qwen3_moe``, ``mixtral``, ``olmoe``,
``deepseek_v2``: V2 and V3), ``factory`` (the engine's backend for its settings), ``bundled/`` (the
default model's trained weights)."""

from services.engine_worker.model.config import MoEConfig
from services.engine_worker.model.runner import TorchModelRunner

__all__ = ["MoEConfig", "TorchModelRunner"]
