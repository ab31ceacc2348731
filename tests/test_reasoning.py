"""A reasoning model's thinking told from its answer (LOCKSTEP_REASONING_PARSER): the
splitter (shared/reasoning.py), the chat choice that uses it, streamed and whole, and a
live cluster with the official client."""

from __future__ import annotations

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.api_server.choice import with_reasoning, StreamChoice, final
from services.api_server.errors import ApiError
from services.api_server.gateway import RequestChannel
from services.api_server.protocol import parse
from shared.reasoning import ANSWER_ONLY, PARSERS, Reasoning, Splitter, check_parser, split
from tests.conftest import start_cluster

THINKING, ANSWER = Reasoning(True), Reasoning(False)


@pytest.mark.parametrize("reasoning, text, want", [
    (ANSWER, "<think>weigh it</think>42", ("weigh it", "42")),      # the model opens it (Qwen3 before 2507)
    (ANSWER, " \n<think>a</think>\n\nb", ("a", "\n\nb")),           # whitespace before the tag: dropped
    (THINKING, "weigh it</think>42", ("weigh it", "42")),           # the template opened it
    (THINKING, "<think>weigh it</think>42", ("weigh it", "42")),    # ... and the model wrote it again
    (THINKING, "weigh it", ("weigh it", None)),                     # cut by max_tokens while thinking
    (THINKING, "a</think>", ("a", None)),                           # no answer after it
    (ANSWER, "just an answer", (None, "just an answer")),
    (ANSWER, "an answer that says <think>", (None, "an answer that says <think>")),   # not at the start: text
    (THINKING, "a</think>b</think>c", ("a", "b</think>c")),         # only the first closes it
    (THINKING, "a</thi", ("a</thi", None)),                         # a tag never completed is text
    (ANSWER, "<thi", (None, "<thi")),
    (ANSWER, "", (None, None)),
])
def test_split(reasoning, text, want):
    assert split(reasoning, text) == want


@pytest.mark.parametrize("parser, prompt, thinking", [
    ("qwen3", "<|im_start|>assistant\n", False),                        # no tag: the answer, unless it opens one
    ("deepseek_r1", "<｜Assistant｜>", True),                            # R1 often skips writing <think>
    ("qwen3", "<|im_start|>assistant\n<think>\n", True),                # Qwen3-Thinking-2507's template
    ("deepseek_r1", "<｜Assistant｜><think>\n\n</think>\n\n", False),     # thinking switched off by the template
    ("qwen3", "<think>old</think>earlier turn<|im_start|>assistant\n<think>\n", True),   # the last tag counts
    ("glm45", "<think>old</think>earlier turn<|assistant|>", False),
])
def test_where_the_output_starts_is_read_from_the_prompt(parser, prompt, thinking):
    assert Reasoning.for_prompt(parser, prompt).thinking is thinking


def test_unknown_parser_names_the_known_ones():
    check_parser("")
    for name in PARSERS:
        check_parser(name)
    with pytest.raises(ValueError, match="deepseek_r1, deepseek_v3, glm45, openai_gptoss, qwen3"):
        check_parser("r1")


OUTPUTS = ["<think>weigh </think> it</think>42", "a</think>b", " <think>x", "plain answer", "<thi", "</think>",
           "thinking about </think and more</think>done"]


@given(text=st.sampled_from(OUTPUTS), thinking=st.booleans(), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_streamed_pieces_join_to_the_whole_split(text, thinking, cuts):
    s = Splitter(thinking)
    think, answer, last = "", "", 0
    for cut in sorted(c for c in cuts if c <= len(text)) + [len(text)]:
        a, b = s.feed(text[last:cut])
        assert not (a and answer), "thinking after the answer began"
        think, answer, last = think + a, answer + b, cut
    a, b = s.finish()
    assert (think + a or None, answer + b or None) == split(Reasoning(thinking), text)


# --- the chat choice (byte model: one token per byte) -------------------------------------

def _chat(parser: str = "deepseek_r1", **body):
    return parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, "chat",
                 served_model="m", max_model_len=4096, num_ranks=1, reasoning_parser=parser)


def _channel(text: str, finish: str = "stop") -> RequestChannel:
    ch = RequestChannel("r")
    ch.tokens, ch.finish = list(text.encode()), finish
    return ch


def test_a_whole_answer_has_its_thinking_apart():
    p = _chat()
    ch = _channel("let me see</think>Paris")
    msg = final(p, ch, 0, p.prompt, p.prompt_text)["message"]
    assert (msg["content"], msg["reasoning"], msg["reasoning_content"]) == ("Paris", "let me see", "let me see")
    # usage's reasoning_tokens: the thinking's ("let me see": 10 byte tokens); it was never counted
    assert ch.reasoning_tokens == 10
    assert with_reasoning(p, {}, ch.reasoning_tokens) == {"completion_tokens_details": {"reasoning_tokens": 10}}
    assert with_reasoning(_chat(""), {}, 0) == {}        # no parser: no thinking to count
    msg = final(p, _channel("still thinking", "length"), 0, p.prompt, p.prompt_text)["message"]
    assert (msg["content"], msg["reasoning"]) == (None, "still thinking")
    hidden = _chat(include_reasoning=False)
    msg = final(hidden, _channel("let me see</think>Paris"), 0, hidden.prompt, hidden.prompt_text)["message"]
    assert msg == {"role": "assistant", "content": "Paris"}
    plain = _chat("")
    msg = final(plain, _channel("let me see</think>Paris"), 0, plain.prompt, plain.prompt_text)["message"]
    assert msg == {"role": "assistant", "content": "let me see</think>Paris"}


def test_a_stream_sends_thinking_then_answer_a_byte_at_a_time():
    p = _chat(stream=True)
    text = "let me see</think>Paris"
    ch, out = RequestChannel("r"), []
    sc = StreamChoice(p, ch, 0, p.prompt, p.prompt_text)
    for i, b in enumerate(text.encode()):
        ch.tokens.append(b)
        ch.finish = "stop" if i == len(text) - 1 else None
        out += sc.poll()
    deltas = [e["delta"] for e in out]
    thought = "".join(d.get("reasoning") or "" for d in deltas)
    answer = "".join(d.get("content") or "" for d in deltas)
    assert (thought, answer) == ("let me see", "Paris")
    assert all(d["reasoning_content"] == d["reasoning"] for d in deltas if "reasoning" in d)
    assert not any("</" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas)
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any("reasoning" in d for d in deltas[first_answer:])
    assert out[-1]["finish_reason"] == "stop"
    assert ch.reasoning_tokens == 10


def test_include_reasoning_false_needs_a_parser():
    with pytest.raises(ApiError, match="needs a reasoning parser") as e:
        _chat("", include_reasoning=False)
    assert e.value.param == "include_reasoning"
    assert _chat("", include_reasoning=True).reasoning is None        # true is what it does anyway


# --- live: `lockstep up --reasoning-parser` with the official client ---------------------

@pytest.fixture(scope="module")
def r1_cluster(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("r1"), "--ranks", "2", "--api-servers", "1", "--backend", "sim",
                            "--reasoning-parser", "deepseek_r1")
    yield cluster
    cluster.stop()


@pytest.mark.slow
def test_a_cluster_with_a_reasoning_parser_answers_with_the_thinking_apart(r1_cluster):
    # The sim's text has no </think>: under deepseek_r1 all of it is thinking (R1 starts inside
    # it), exactly what a completion of the same prompt tokens writes.
    c = openai.OpenAI(base_url=r1_cluster.api_url, api_key="unused", max_retries=0, timeout=60)
    try:
        import httpx
        msgs = [{"role": "user", "content": "why is the sky blue?"}]
        base = r1_cluster.api_url.rsplit("/v1", 1)[0]
        ids = httpx.post(f"{base}/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"]
        same = dict(max_tokens=24, seed=5, extra_body={"ignore_eos": True})
        text = c.completions.create(model="lockstep-moe", prompt=ids, **same).choices[0].text
        assert text and "</think>" not in text
        whole = c.chat.completions.create(model="lockstep-moe", messages=msgs, **same)
        msg = whole.choices[0].message
        assert msg.content is None and msg.model_extra["reasoning"] == text == msg.model_extra["reasoning_content"]
        # all of it thinking: every output token is a reasoning token (it said 0)
        assert whole.usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens == 24
        chunks = list(c.chat.completions.create(model="lockstep-moe", messages=msgs, stream=True,
                                                stream_options={"include_usage": True}, **same))
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 24
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == text
        assert not "".join(d.content or "" for d in deltas)
        # a template-closed thinking (here: the client's prefilled turn ends it) leaves the answer alone
        closed = msgs + [{"role": "assistant", "content": "<think>sure</think>"}]
        msg = c.chat.completions.create(model="lockstep-moe", messages=closed, max_tokens=24, seed=5,
                                        extra_body={"ignore_eos": True, "continue_final_message": True,
                                                    "add_generation_prompt": False}).choices[0].message
        assert msg.content and msg.model_extra.get("reasoning") is None
        # Responses: the thinking is a reasoning item before the (empty) message
        r = c.responses.create(model="lockstep-moe", input="why is the sky blue?", max_output_tokens=24)
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output[0].content[0].text
        assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
        events = list(c.responses.create(model="lockstep-moe", input="why is the sky blue?", max_output_tokens=24,
                                         stream=True))
        done = events[-1].response
        assert [o.type for o in done.output] == ["reasoning", "message"]
        assert 0 < done.usage.output_tokens_details.reasoning_tokens <= done.usage.output_tokens
        assert done.output[0].content[0].text == "".join(e.delta for e in events
                                                         if e.type == "response.reasoning_text.delta")
    finally:
        c.close()


def test_a_turns_reasoning_reaches_a_checkpoints_template_as_reasoning_content(tmp_path):
    # Qwen3's and DeepSeek's templates read message.reasoning_content; clients send it back
    # under vLLM's name (reasoning) or DeepSeek's (reasoning_content)
    pytest.importorskip("transformers")
    from shared.hf_tokenizer import HFTokenizer
    from tests.hf_checkpoints import make_tokenizer

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n")
    make_tokenizer(tmp_path, chat_template=template)
    tok = HFTokenizer(tmp_path)
    for field in ("reasoning", "reasoning_content"):
        p = parse({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello", field: "greet back"},
                                {"role": "user", "content": "bye"}]},
                  "chat", served_model="m", max_model_len=4096, num_ranks=1, tok=tok, reasoning_parser="qwen3")
        assert "<think>greet back</think>hello" in p.prompt_text
        assert p.reasoning.thinking        # the template opened the thinking: the output starts in it


def test_a_constrained_output_is_all_answer_whatever_the_prompt_opened():
    # deepseek_r1 starts inside the thinking (as a template that opens <think> does): the
    # grammar-forced JSON went to "reasoning" (lost with include_reasoning false) and a
    # forced tool call came back as no tool_calls
    p = _chat(response_format={"type": "json_object"})
    assert p.reasoning == ANSWER_ONLY
    msg = final(p, _channel('{"a": 1}'), 0, p.prompt, p.prompt_text)["message"]
    assert (msg["content"], msg["reasoning"]) == ('{"a": 1}', None)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    p = _chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    msg = final(p, _channel('{"c": "x"}'), 0, p.prompt, p.prompt_text)["message"]
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"c": "x"}' and msg["reasoning"] is None
    # a model that writes freely ("auto") still thinks first; no answer is a null content
    p = _chat(tools=[tool], tool_choice="auto")
    msg = final(p, _channel("weighing it"), 0, p.prompt, p.prompt_text)["message"]
    assert (msg["content"], msg["reasoning"]) == (None, "weighing it")
