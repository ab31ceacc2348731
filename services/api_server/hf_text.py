"""Prompts and stops of a served checkpoint (``--model DIR``): its own tokenizer and chat
template instead of bytes, and its EOS tokens (generation_config.json) as stop tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.api_server.errors import ApiError
from shared.hf_tokenizer import continue_final
from shared.messages import SamplingParams


def checkpoint_dir(model: str) -> str | None:
    """``model`` when it names a checkpoint directory (config.json + tokenizer.json), else None."""
    p = Path(model)
    return str(p) if p.is_dir() and (p / "config.json").is_file() else None


def model_type(model_dir: str) -> str:
    """A checkpoint's ``model_type`` (config.json), "" where it has none."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return cfg.get("model_type", "") if isinstance(cfg, dict) else ""


def chat_prompt(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    import jinja2

    from shared.hf_tokenizer import ToolsUnread

    if template_kwargs:
        try:
            tok.check_template_kwargs(template_kwargs)
        except ValueError as exc:
            raise ApiError(400, f"'chat_template_kwargs': {exc}", param="chat_template_kwargs") from None
    try:
        text = tok.render_chat(messages, add_generation_prompt, template_kwargs, tools)
    except ToolsUnread as exc:
        raise ApiError(400, f"'tools': {exc}", param="tools", code="unsupported_parameter") from None
    except (jinja2.TemplateError, ValueError) as exc:   # the template's raise_exception, or none at all
        raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
    if continue_final_message:
        try:
            text = continue_final(text, messages)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="continue_final_message") from None
    return text, tok.encode(text, add_special_tokens=False)   # the template wrote the special tokens


def completion_prompt(tok: Any, prompt: Any) -> tuple[list[int], str]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]        # ["text"] or [[ids]]; [65] is one token, not the int 65
    if isinstance(prompt, str):
        return tok.encode(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < tok.vocab_size for t in prompt):
            raise ApiError(400, f"token ids must be within 0..{tok.vocab_size - 1}", param="prompt")
        return list(prompt), tok.decode(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "batched prompts are not supported yet; send one prompt per request", param="prompt")
    if prompt == [] or prompt == [[]]:
        raise ApiError(400, "the prompt is empty", param="prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")


def checkpoint_stops(params: SamplingParams, tok: Any) -> None:
    """The checkpoint's EOS tokens end a request as stop tokens (unless ignore_eos). The
    engine's own EOS check is the byte model's id, an ordinary token here: ignore_eos
    turns it off."""
    if not params.ignore_eos:
        params.stop_token_ids = sorted(set(params.stop_token_ids) | set(tok.eos_token_ids))
    params.ignore_eos = True


def tokenizer_info(tok: Any, max_model_len: int) -> dict[str, Any]:
    """vLLM's /tokenizer_info for a checkpoint's tokenizer."""
    sp = tok.special_tokens
    ids = {k: (tok.token_id(v) if v else None) for k, v in sp.items()}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "vocab_size": tok.vocab_size,
            "model_max_length": max_model_len, "eos_token": sp["eos_token"],
            "eos_token_id": tok.eos_token_ids[0] if tok.eos_token_ids else ids["eos_token"],
            "bos_token": sp["bos_token"], "bos_token_id": ids["bos_token"], "pad_token": sp["pad_token"],
            "unk_token": sp["unk_token"], "chat_template": tok.chat_template}
