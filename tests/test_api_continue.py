"""Assistant prefill: ``continue_final_message`` (the model continues a reply the client
began: "Sure,", "{") and ``add_generation_prompt: false``, as vLLM takes them, in the byte
model's chat format; a checkpoint's template is checked against transformers in
test_checkpoints_tokenizer.py. Pure parts first, then the official client against a live
``--backend sim`` cluster."""

from __future__ import annotations

import httpx
import pytest

from services.api_server.errors import ApiError
from services.api_server.protocol import chat_template, parse
from shared.hf_tokenizer import continue_final
from shared.tokenizer import encode

MODEL = "lockstep-moe"
BEGUN = [{"role": "user", "content": "Give me JSON"}, {"role": "assistant", "content": "Sure, {"}]


def _chat(**body):
    return parse({"model": "m", "messages": BEGUN, **body}, "chat", served_model="m", max_model_len=4096,
                 num_ranks=1)


def test_the_final_message_is_continued_not_closed():
    p = _chat(continue_final_message=True)
    assert p.prompt_text == "<|user|>\nGive me JSON\n<|assistant|>\nSure, {"
    assert p.prompt == encode(p.prompt_text)
    # the same with the generation prompt turned off explicitly, as vLLM clients send it
    assert _chat(continue_final_message=True, add_generation_prompt=False).prompt_text == p.prompt_text


def test_without_a_generation_prompt_no_turn_is_opened():
    assert _chat(add_generation_prompt=False).prompt_text == chat_template(BEGUN, add_generation_prompt=False)
    assert _chat().prompt_text == chat_template(BEGUN) and _chat().prompt_text.endswith("<|assistant|>\n")


def test_both_at_once_is_refused_naming_the_field():
    with pytest.raises(ApiError) as e:
        _chat(continue_final_message=True, add_generation_prompt=True)
    assert e.value.status == 400 and e.value.param == "continue_final_message"


@pytest.mark.parametrize("final, rendered, want", [
    ("Sure, {", "<a>Sure, {\n</a>", "<a>Sure, {"),
    ("Sure ", "<a>Sure </a>", "<a>Sure "),         # the template kept the trailing space
    ("Sure ", "<a>Sure</a>", "<a>Sure"),           # it trimmed it: cut after the text
    ("x", "<a>x</a><b>x</b>", "<a>x</a><b>x"),     # the last occurrence
])
def test_continue_final_cuts_as_transformers_does(final, rendered, want):
    assert continue_final(rendered, [{"role": "assistant", "content": final}]) == want


def test_continue_final_refuses_a_message_the_template_did_not_render():
    with pytest.raises(ValueError, match="does not render"):
        continue_final("<a>changed</a>", [{"role": "assistant", "content": "Sure"}])
    with pytest.raises(ValueError, match="text to continue"):
        continue_final("<a></a>", [{"role": "assistant", "content": None}])


def test_continue_live_sim(sim_cluster):
    import openai

    c = openai.OpenAI(base_url=sim_cluster.api_url, api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=MODEL, messages=BEGUN, max_tokens=6, temperature=0,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    want = encode("<|user|>\nGive me JSON\n<|assistant|>\nSure, {")
    assert r.usage.prompt_tokens == len(want) and r.usage.completion_tokens >= 1
    n = httpx.post(sim_cluster.api_url.removesuffix("/v1") + "/tokenize", timeout=10,
                   json={"model": MODEL, "messages": BEGUN, "continue_final_message": True}).json()
    assert n["tokens"] == want
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        c.chat.completions.create(model=MODEL, messages=BEGUN, max_tokens=2,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": True})
