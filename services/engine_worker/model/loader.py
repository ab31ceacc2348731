"""Load a Hugging Face-format checkpoint directory onto one EP rank.

The directory holds config.json, the weights (model.safetensors, or shards named by
model.safetensors.index.json) and optionally generation_config.json. Tensors are read
one at a time with safetensors' safe_open (memory-mapped), and only the ones this rank
holds: the shared weights and its own experts; another rank's experts are never read.
Nothing is downloaded: a missing file is an error that says what is missing."""

from __future__ import annotations

import importlib
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.moe import AllToAll

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_config(model_dir: str | Path) -> HFConfig:
    d = Path(model_dir)
    path = d / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model needs a local Hugging Face checkpoint directory "
                                "(config.json, *.safetensors, tokenizer.json); see README 'Real checkpoints'")
    raw = json.loads(path.read_text())
    gen = d / "generation_config.json"
    if gen.is_file():     # the generation config's EOS list wins (chat models stop on more than one)
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            raw["eos_token_id"] = eos
    return HFConfig.from_dict(raw)


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it}."""
    d = Path(model_dir)
    if (d / INDEX).is_file():
        weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        return {name: d / f for name, f in weight_map.items()}
    if (d / SINGLE).is_file():
        from safetensors import safe_open
        with safe_open(str(d / SINGLE), framework="pt") as f:
            return {name: d / SINGLE for name in f.keys()}
    raise FileNotFoundError(f"{d} has neither {INDEX} nor {SINGLE}")


@dataclass(frozen=True, slots=True)
class Rows:
    """A target that is rows ``start:stop`` of the checkpoint tensor's first axis: one rank's
    experts of a fused expert tensor (gpt-oss), read without reading the other rows."""
    dest: torch.Tensor
    start: int
    stop: int


# The 16 values of an FP4 (e2m1) code: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 expert tensor as float32: ``blocks`` [E, rows, G, 16] bytes, two FP4
    codes each (low nibble first), ``scales`` [E, rows, G] biased exponents (127 = x1), one
    per 32 values. The checkpoint stores each expert's matrix as [out, in]; the model's
    fused layout is [in, out], hence the transpose."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)   # [E, rows, G, 32]
    vals = torch.ldexp(vals, scales.to(torch.int32)[..., None] - 127)
    return vals.flatten(-2).transpose(1, 2)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-quantized FP8 weight (DeepSeek-V3's checkpoints: e4m3 values, one float scale
    per ``block`` tile, the last tiles partial) as float32: value x its tile's scale."""
    rows, cols = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w.float() * s


def load_weights(targets: dict[str, torch.Tensor | Rows], model_dir: str | Path,
                 fp8_block: tuple[int, int] | None = None, mxfp4: bool = False) -> int:
    """Copy each named tensor of the checkpoint into its target (casting to the target's
    dtype and device; an FP8 weight with its ``<name>_scale_inv`` is dequantized first, when
    the config says ``fp8_block``; with ``mxfp4``, a tensor stored as ``<name>_blocks`` and
    ``<name>_scales`` is dequantized). A ``Rows`` target reads only its rows. Returns the
    bytes read. Every target must be found, with its shape."""
    from safetensors import safe_open

    where = tensor_files(model_dir)

    def packed(name: str) -> bool:
        return mxfp4 and name not in where and f"{name}_blocks" in where and f"{name}_scales" in where

    missing = sorted(n for n in targets if n not in where and not packed(n))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {model_dir} lacks tensors {', '.join(missing[:5])}{more}")
    by_file: dict[Path, list[str]] = defaultdict(list)
    read = 0
    for name in targets:
        if packed(name):
            t, n = _read_mxfp4(name, targets[name], where)
            read += n
            _copy(targets[name], t, name, where[f"{name}_blocks"])
        else:
            by_file[where[name]].append(name)
    for path, names in sorted(by_file.items()):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                target = targets[name]
                t = f.get_slice(name)[target.start:target.stop] if isinstance(target, Rows) else f.get_tensor(name)
                read += t.numel() * t.element_size()
                scale_name = name + "_scale_inv"
                if fp8_block is not None and t.dtype == torch.float8_e4m3fn and scale_name in where:
                    with safe_open(str(where[scale_name]), framework="pt", device="cpu") as sf:
                        scale = sf.get_tensor(scale_name)
                    read += scale.numel() * scale.element_size()
                    t = dequantize_fp8(t, scale, fp8_block)
                elif t.dtype == torch.float8_e4m3fn:
                    raise ValueError(f"tensor {name} is FP8 without a block scale ({scale_name}) or a config "
                                     "quantization_config that names its weight_block_size; use a bf16 checkpoint")
                _copy(target, t, name, path)
    return read


def _read_mxfp4(name: str, target: torch.Tensor | Rows, where: dict[str, Path]) -> tuple[torch.Tensor, int]:
    """The dequantized tensor (its target's rows only) and the bytes read for it."""
    from safetensors import safe_open

    parts = []
    for suffix in ("_blocks", "_scales"):
        with safe_open(str(where[name + suffix]), framework="pt", device="cpu") as f:
            sl = f.get_slice(name + suffix)
            parts.append(sl[target.start:target.stop] if isinstance(target, Rows) else sl[:])
    return dequantize_mxfp4(*parts), sum(p.numel() * p.element_size() for p in parts)


def _copy(target: torch.Tensor | Rows, t: torch.Tensor, name: str, path: Path) -> None:
    dest = target.dest if isinstance(target, Rows) else target
    if t.shape != dest.shape:
        raise ValueError(f"tensor {name} in {path.name} has shape {tuple(t.shape)}, "
                         f"the config implies {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(t)


def build_model(cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None, dtype: torch.dtype,
                device: str | torch.device) -> nn.Module:
    """The architecture's model file (qwen3_moe.py, mixtral.py, gpt_oss.py, ...), parameters empty."""
    module = importlib.import_module(f"services.engine_worker.model.{cfg.architecture}")
    return module.build(cfg, rank, world_size, comm, dtype, device)


def load_model(model_dir: str | Path, cfg: HFConfig, rank: int, world_size: int, comm: AllToAll | None,
               dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    model = build_model(cfg, rank, world_size, comm, dtype, device)
    model.bytes_read = load_weights(model.weight_names(), model_dir, cfg.fp8_block, cfg.mxfp4)
    return model.eval()
