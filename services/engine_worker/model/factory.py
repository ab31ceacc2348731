"""The engine's torch backend for its settings: the bundled model, or the checkpoint
directory ``settings.model`` names (its weights on this rank, its vocabulary for stop
strings and structured output, its EOS tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BUNDLED = ("", "lockstep-moe", "random")   # the bundled model's names (not checkpoint directories)
# The bundled model: trained by scripts/train-bundled-model on Python's own docstrings, byte
# tokens. "random" is the seeded random-weight model of the same shape (config.py).
BUNDLED_DIR = Path(__file__).with_name("bundled")


def is_checkpoint(model: str) -> bool:
    return model not in BUNDLED


DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32")   # what make_runner takes for a checkpoint


def check_dtype(model: str, dtype: str) -> None:
    """Refuse, before any process starts, a ``--dtype`` the ranks would fail on or ignore:
    only a checkpoint directory is loaded in it (the bundled model runs in float32)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be auto, bfloat16 or float32, not {dtype!r}")
    if dtype != "auto" and not is_checkpoint(model):
        raise ValueError(f"--dtype {dtype} applies to a checkpoint (--model DIR); the bundled model "
                         f"({model or 'lockstep-moe'}) always runs in float32: drop --dtype")


def check_backend(model: str, backend: str) -> None:
    """Refuse a ``--model`` the sim backend would ignore (it runs no model: it makes up byte
    tokens at the cost model's pace): a checkpoint, or the random-weight bundled model."""
    if backend != "torch" and model not in ("", "lockstep-moe"):
        raise ValueError(f"--model {model} needs --backend torch: the sim backend runs no model (it makes up "
                         "byte tokens); use --backend torch, or drop --model")


def check_bundled(ranks: int, max_model_len: int | None = None) -> None:
    """Refuse, before any process starts, a rank count over which the bundled model's
    experts (the trained one's and ``random``'s alike) do not split evenly, and a
    ``max_model_len`` past its positions (a request reaching them failed the forward, which
    took down every rank that ran it, spares too)."""
    from services.engine_worker.model.config import MoEConfig

    positions = MoEConfig().max_position
    if max_model_len is not None and max_model_len > positions:
        raise ValueError(f"max_model_len {max_model_len} exceeds the bundled model's {positions} positions; "
                         f"set LOCKSTEP_MAX_MODEL_LEN={positions} or less (or serve a checkpoint, --model DIR)")
    n = MoEConfig().n_experts
    if n % ranks:
        fits = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise ValueError(f"the bundled model's {n} experts do not split over {ranks} ranks: use --ranks "
                         f"{fits} with --backend torch (or --backend sim, or a checkpoint whose expert count "
                         f"{ranks} divides, --model DIR)")


def check_checkpoint(model: str, ranks: int, max_model_len: int) -> Any:
    """Refuse, with what to do instead, a directory that cannot be served by ``ranks`` ranks
    (before any process starts). Returns its HFConfig."""
    from services.engine_worker.model.loader import read_config, tensor_files

    if not Path(model).is_dir():
        raise ValueError(f"--model {model!r} is not a directory; give a local Hugging Face checkpoint "
                         "(`huggingface-cli download ORG/NAME --local-dir DIR`, see README)")
    cfg = read_config(model)
    tensor_files(model)                 # the weights are there
    if not (Path(model) / "tokenizer.json").is_file():
        raise ValueError(f"{model} has no tokenizer.json")
    cfg.experts_of_rank(0, ranks)       # the experts split evenly
    if max_model_len > cfg.max_position:
        raise ValueError(f"max_model_len {max_model_len} exceeds the checkpoint's {cfg.max_position} positions; "
                         f"set LOCKSTEP_MAX_MODEL_LEN={cfg.max_position} or less")
    return cfg


def make_runner(settings: Any, rank: int) -> Any:
    import torch

    from services.engine_worker.model.config import MoEConfig
    from services.engine_worker.model.runner import TorchModelRunner

    from services.engine_worker.lockstep import rank_device

    s = settings
    device = rank_device(s.device, rank)   # cuda: this rank's own GPU
    if not is_checkpoint(s.model):
        check_bundled(s.ranks, s.max_model_len)
        if s.model != "random" and (BUNDLED_DIR / "model.safetensors").is_file():
            # byte tokens: stop strings and EOS stay the byte tokenizer's (no use_vocabulary)
            return TorchModelRunner.from_pretrained(str(BUNDLED_DIR), rank, s.ranks, s.num_kv_blocks, s.block_size,
                                                    device=device, dtype=torch.float32)
        return TorchModelRunner(MoEConfig(seed=s.seed), rank, s.ranks, s.num_kv_blocks, s.block_size, device=device)
    from shared import grammar
    from shared.hf_tokenizer import HFTokenizer, token_bytes_table
    from shared.stop import use_vocabulary

    check_checkpoint(s.model, s.ranks, s.max_model_len)
    dtypes = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
              "fp32": torch.float32}
    if s.dtype not in dtypes:
        raise ValueError(f"dtype must be auto, bfloat16 or float32, not {s.dtype!r}")
    runner = TorchModelRunner.from_pretrained(s.model, rank, s.ranks, s.num_kv_blocks, s.block_size,
                                              device=device, dtype=dtypes[s.dtype])
    tok = HFTokenizer(s.model)
    use_vocabulary(token_bytes_table(tok))
    # structured output's masks over the checkpoint's tokens (built now: about a second for a
    # large vocabulary, which the first guided request would otherwise stall a step for)
    if tok.eos_token_ids:   # (with none, the api-servers refuse structured output)
        runner.grammar_vocab = grammar.checkpoint_vocab(str(s.model), tok.eos_token_ids, runner.config.vocab_size)
    return runner
