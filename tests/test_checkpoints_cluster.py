"""A real checkpoint through the whole cluster: `lockstep up --model DIR` (api-server ->
scheduler -> 2 EP ranks over gloo), queried with the official openai client, answers
token for token what transformers' greedy ``generate`` makes of the same prompt, with the
checkpoint's chat template, streaming detokenization, stop strings and usage; and its
structured output and forced tool calls follow the grammar over the checkpoint's tokens."""

from __future__ import annotations
import json
import re

import pytest
import torch

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from tests.conftest import start_cluster  # noqa: E402
from tests.hf_checkpoints import TOOLS_CHAT_TEMPLATE, make_checkpoint  # noqa: E402
from tests.test_checkpoint_structured import PERSON, WEATHER  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Every rank holds its own experts;", "Straße, café, 東京"]
CHATS = [[{"role": "user", "content": "Hello, how are you today?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt-cluster")
    ckpt = tmp / "tiny-qwen3-moe"
    ref = make_checkpoint(ckpt, "qwen3_moe", max_position_embeddings=4096, chat_template=TOOLS_CHAT_TEMPLATE)
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(ckpt)
    cluster = start_cluster(tmp, "--ranks", "2", "--api-servers", "1", "--spares", "0", "--model", str(ckpt))
    try:
        client = openai.OpenAI(base_url=cluster.api_url, api_key="x", timeout=60, max_retries=0)
        banner = (tmp / "up.out").read_text()
        assert f"model '{ckpt.name}'" in banner, banner          # up says the name clients must send
        yield client, ckpt.name, ref, hf_tok
    finally:
        cluster.stop()


def greedy(ref, hf_tok, ids: list[int]) -> list[int]:
    eos = ref.generation_config.eos_token_id
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=hf_tok.pad_token_id)
    return out[0, len(ids):].tolist()


def test_completions_equal_transformers_generate_on_both_ranks(served):
    client, name, ref, hf_tok = served
    assert [m.id for m in client.models.list().data] == [name]
    for i, prompt in enumerate(PROMPTS):
        ids = hf_tok(prompt)["input_ids"]
        want = greedy(ref, hf_tok, ids)
        for rank in (0, 1):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"data_parallel_rank": rank})
            # (a character cut in two by max_tokens is dropped, as vLLM drops it: no U+FFFD at the end)
            assert r.choices[0].text == hf_tok.decode(want, skip_special_tokens=True).rstrip("\ufffd"), (prompt, rank)
            assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
            assert r.choices[0].finish_reason == ("length" if len(want) == MAX_NEW else "stop")


def test_chat_uses_the_checkpoints_template_and_streams_the_same_text(served):
    client, name, ref, hf_tok = served
    for msgs in CHATS:
        ids = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        want = hf_tok.decode(greedy(ref, hf_tok, ids), skip_special_tokens=True).rstrip("\ufffd")
        r = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(ids)
        stream = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX_NEW, temperature=0,
                                                stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == want and len(pieces) > 2    # streamed in pieces, joined to the same text


def test_a_stop_string_ends_the_text_where_it_starts(served):
    client, name, ref, hf_tok = served
    ids = hf_tok(PROMPTS[0])["input_ids"]
    full = hf_tok.decode(greedy(ref, hf_tok, ids), skip_special_tokens=True)
    stop = full[3:6]
    assert len(stop) == 3, full
    r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.usage.completion_tokens < MAX_NEW        # the engine stopped there, it did not run on


def test_tokenize_detokenize_and_tokenizer_info_use_the_checkpoints_tokenizer(served):
    import httpx

    client, name, ref, hf_tok = served
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    text = "Straße, café 東京 😀"
    r = httpx.post(f"{base}/tokenize", json={"model": name, "prompt": text, "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf_tok(text)["input_ids"]
    assert body["token_strs"] == hf_tok.convert_ids_to_tokens(body["tokens"])
    msgs = CHATS[1]
    r = httpx.post(f"{base}/tokenize", json={"model": name, "messages": msgs}, timeout=30).json()
    want = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert r["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    big = hf_tok.convert_tokens_to_ids("<|im_end|>") + 300      # past the byte model's 260 ids
    r = httpx.post(f"{base}/detokenize", json={"model": name, "tokens": body["tokens"] + [big % len(hf_tok)]},
                   timeout=30)
    assert r.status_code == 200 and r.json()["prompt"].startswith(text)
    info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
    assert info["vocab_size"] == len(hf_tok) and info["eos_token"] == "<|im_end|>"
    assert info["chat_template"] == hf_tok.chat_template


def _person(text: str) -> None:
    out = json.loads(text)
    assert set(out) == {"name", "age"} and len(out["name"]) <= 8 and 0 <= out["age"] <= 120, text


def test_structured_output_and_forced_calls_follow_the_checkpoints_tokens(served):
    # (a 400 before: the grammar was built for the byte model's tokens only); random weights,
    # so only the grammar makes these parse
    client, name, ref, hf_tok = served
    msgs = [{"role": "user", "content": "a person, as JSON"}]
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in (1, 2):
        r = client.chat.completions.create(model=name, messages=msgs, max_tokens=300, seed=seed, temperature=1.0,
                                           response_format=schema)
        assert r.choices[0].finish_reason == "stop"          # the checkpoint's EOS ended the finished grammar
        _person(r.choices[0].message.content)
        r = client.completions.create(model=name, prompt="id:", max_tokens=40, seed=seed,
                                      extra_body={"guided_regex": r"[A-Z]{3}-\d{2,4}"})
        assert re.fullmatch(r"[A-Z]{3}-\d{2,4}", r.choices[0].text), r.choices[0].text
    stream = client.chat.completions.create(model=name, messages=msgs, max_tokens=300, seed=3, stream=True,
                                            response_format=schema)
    _person("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=300, seed=4, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=300, seed=5, tools=[WEATHER],
                                       tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    assert all(c.function.name == "get_weather" for c in r.choices[0].message.tool_calls)
