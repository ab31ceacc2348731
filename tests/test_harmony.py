"""gpt-oss's harmony output: thinking, answer and tool calls told apart (shared/harmony.py),
whole and streamed, through the chat choice with a tokenizer whose frame tokens are
special, as gpt-oss's are."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.api_server.choice import StreamChoice, final
from services.api_server.errors import ApiError
from services.api_server.gateway import RequestChannel
from services.api_server.protocol import parse
from shared.harmony import HarmonyStart
from shared.reasoning import HARMONY, default_parser, split_calls

PROMPT = "<|start|>user<|message|>weather?<|end|><|start|>assistant"
THINK_THEN_ANSWER = ("<|channel|>analysis<|message|>The user asks. 1<2 and <b> stay text.<|end|>"
                     "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>')
OUTPUTS = [THINK_THEN_ANSWER, CALL,
           # the recipient before the channel, as gpt-oss's template writes earlier calls
           '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>',
           # a preamble the user may see, then a call; no <|end|> before the next header
           "<|channel|>commentary<|message|>Checking.<|start|>assistant<|channel|>commentary to=functions.f"
           "<|message|>{}<|call|>",
           "<|channel|>analysis<|message|>cut short in the thinki",             # max_tokens
           "<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>fin",   # cut in a header
           "no harmony at all, as a fine-tune might write",
           "<|channel|>final<|message|>a final without thinking<|return|>",
           '<|channel|>analysis<|message|>search<|end|><|start|>assistant to=browser.search<|channel|>analysis'
           '<|message|>{"q": "x"}<|call|>']


def whole(text: str, prompt: str = PROMPT):
    return split_calls(HarmonyStart.for_prompt(prompt), text)


def test_thinking_answer_and_calls_are_told_apart():
    assert whole(THINK_THEN_ANSWER) == ("The user asks. 1<2 and <b> stay text.", "It is sunny.", [])
    assert whole(CALL) == ("Need the tool.", None, [("get_weather", '{"city": "Paris"}')])
    assert whole(OUTPUTS[2]) == (None, None, [("f", '{"a": 1}')])
    assert whole(OUTPUTS[3]) == (None, "Checking.", [("f", "{}")])
    assert whole(OUTPUTS[4]) == ("cut short in the thinki", None, [])
    assert whole(OUTPUTS[5]) == ("done", None, [])                   # a header cut short is no one's
    assert whole(OUTPUTS[6]) == (None, OUTPUTS[6], [])                # not harmony: all answer
    assert whole(OUTPUTS[8]) == ("search", None, [])                  # a built-in tool: not served
    long_plain = "words " * 200
    assert whole(long_plain) == (None, long_plain, [])


def test_a_model_that_is_not_gpt_oss_streams_its_answer_at_once():
    # (served with --reasoning-parser openai_gptoss, its whole short answer came in one
    # piece at the end: held as a possible header until 512 characters or the end)
    s = HarmonyStart.for_prompt("a prompt without harmony").splitter()
    assert s.feed("Hel") == ("", "Hel") and s.feed("lo") == ("", "lo")
    t = HarmonyStart.for_prompt("no harmony here").splitter()
    assert t.feed("<") == ("", "") and t.feed("|channel|>final<|message|>Hi") == ("", "Hi")   # harmony after all


def test_where_the_output_starts_is_read_from_the_prompt():
    # a prompt that opened the final channel itself: the output is its body
    assert whole("Sunny.<|return|>", PROMPT + "<|channel|>final<|message|>") == (None, "Sunny.", [])
    assert whole("thinking<|end|>", PROMPT + "<|channel|>analysis<|message|>") == ("thinking", None, [])
    # the prompt's "assistant" is the first header's start, never answer text
    assert whole("plain") == (None, "plain", [])


@settings(max_examples=200, deadline=None)
@given(text=st.sampled_from(OUTPUTS), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_streamed_pieces_join_to_the_whole_split(text, cuts):
    s = HarmonyStart.for_prompt(PROMPT).splitter()
    think, answer, last = "", "", 0
    for cut in sorted(c for c in cuts if c <= len(text)) + [len(text)]:
        a, b = s.feed(text[last:cut])
        assert "<|" not in a + b or text == OUTPUTS[6], "a frame marker leaked into the text"
        think, answer, last = think + a, answer + b, cut
    a, b = s.finish()
    assert (think + a or None, answer + b or None, s.calls) == whole(text)


def test_gpt_oss_checkpoints_get_the_harmony_parser_by_default():
    assert default_parser("gpt_oss") == HARMONY and default_parser("qwen3_moe") == ""


# --- through the chat choice, with gpt-oss's frame tokens special ---------------------------

HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}"
    "<|channel|>commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.f to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
FRAME = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from shared.hf_tokenizer import HFTokenizer
    from tests.hf_checkpoints import make_tokenizer

    d = tmp_path_factory.mktemp("harmony-tok")
    fast = make_tokenizer(d, chat_template=HARMONY_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": FRAME})
    fast.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [fast.convert_tokens_to_ids("<|return|>"),
                                                                           fast.convert_tokens_to_ids("<|call|>")]}))
    t = HFTokenizer(d)
    assert all(t.is_special(t.token_id(m)) for m in FRAME)
    return t


def _chat(tok, **body):
    return parse({"model": "m", "messages": [{"role": "user", "content": "weather?"}], **body}, "chat",
                 served_model="m", max_model_len=4096, num_ranks=1, tok=tok, reasoning_parser=HARMONY)


def _channel(tok, text: str, finish: str = "stop") -> RequestChannel:
    ch = RequestChannel("r")
    ch.tokens, ch.finish = tok.encode(text, add_special_tokens=False), finish
    return ch


def test_a_whole_answer_has_thinking_answer_and_calls(tok):
    p = _chat(tok)
    assert p.prompt_text.endswith("<|start|>assistant")
    msg = final(p, _channel(tok, THINK_THEN_ANSWER), 0, p.prompt, p.prompt_text)["message"]
    assert (msg["reasoning"], msg["content"]) == ("The user asks. 1<2 and <b> stay text.", "It is sunny.")
    # without the parser the frame tokens are skipped and the channels run together
    plain = parse({"model": "m", "messages": [{"role": "user", "content": "weather?"}]}, "chat",
                  served_model="m", max_model_len=4096, num_ranks=1, tok=tok)
    mashed = final(plain, _channel(tok, THINK_THEN_ANSWER), 0, plain.prompt, plain.prompt_text)["message"]["content"]
    assert mashed.startswith("analysisThe user asks.")
    p = _chat(tok, tools=[WEATHER])
    c = final(p, _channel(tok, CALL), 0, p.prompt, p.prompt_text)
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    assert c["message"]["reasoning"] == "Need the tool."
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c["message"]["tool_calls"]] == \
        [("get_weather", {"city": "Paris"})]
    # tool_choice none: the model's calls are not returned
    p = _chat(tok, tools=[WEATHER], tool_choice="none")
    c = final(p, _channel(tok, CALL), 0, p.prompt, p.prompt_text)
    assert c["finish_reason"] == "stop" and "tool_calls" not in c["message"]


def test_a_stream_sends_thinking_answer_and_calls_token_by_token(tok):
    for text, tools in ((THINK_THEN_ANSWER, None), (CALL, [WEATHER])):
        p = _chat(tok, stream=True, **({"tools": tools} if tools else {}))
        ids = tok.encode(text, add_special_tokens=False)
        ch, out = RequestChannel("r"), []
        sc = StreamChoice(p, ch, 0, p.prompt, p.prompt_text)
        for i, t in enumerate(ids):
            ch.tokens.append(t)
            ch.finish = "stop" if i == len(ids) - 1 else None
            out += sc.poll()
        deltas = [e["delta"] for e in out]
        thought = "".join(d.get("reasoning") or "" for d in deltas)
        answer = "".join(d.get("content") or "" for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls") or ()]
        whole_c = final(p, _channel(tok, text), 0, p.prompt, p.prompt_text)
        assert thought == whole_c["message"]["reasoning"]
        assert (answer or None) == whole_c["message"]["content"]
        assert [c["function"] for c in calls] == [c["function"] for c in whole_c["message"].get("tool_calls") or ()]
        assert out[-1]["finish_reason"] == whole_c["finish_reason"]
        assert not any("<|" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas)


def test_an_earlier_call_reaches_the_template_as_gpt_oss_reads_it(tok):
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    p = parse({"model": "m", "messages": history, "tools": [WEATHER]}, "chat", served_model="m",
              max_model_len=4096, num_ranks=1, tok=tok, reasoning_parser=HARMONY)
    # the thinking as "thinking", the arguments as an object (once JSON, not a JSON string of it)
    assert "<|channel|>analysis<|message|>Need the tool.<|end|>" in p.prompt_text
    assert '<|message|>{"city": "Paris"}<|call|>' in p.prompt_text
    assert "<|channel|>final<|message|><|end|>" not in p.prompt_text     # no empty answer turn


def test_reasoning_effort_reaches_a_template_that_reads_it(tok):
    assert "Reasoning: high" in _chat(tok, reasoning_effort="high").prompt_text
    assert "Reasoning: medium" in _chat(tok).prompt_text
    with pytest.raises(ApiError) as e:
        _chat(tok, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
    assert e.value.param == "reasoning_effort"
    # a template that reads no effort (the byte model's) drops it and the api-server logs it,
    # as vLLM's template ignores it: clients send an effort to every model (it was a 400)
    plain = parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low",
                   "chat_template_kwargs": {"enable_thinking": False}}, "chat",
                  served_model="m", max_model_len=4096, num_ranks=1)
    assert set(plain.ignored) == {"reasoning_effort", "chat_template_kwargs.enable_thinking"}
    assert plain.prompt_text == parse({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "chat",
                                      served_model="m", max_model_len=4096, num_ranks=1).prompt_text
    with pytest.raises(ApiError) as e:      # one the request sets itself is still a 400
        parse({"model": "m", "messages": [{"role": "user", "content": "x"}],
               "chat_template_kwargs": {"messages": []}}, "chat", served_model="m", max_model_len=4096, num_ranks=1)
    assert e.value.param == "chat_template_kwargs"
    # a checkpoint's template: what it reads takes effect, the rest is dropped and logged
    read = _chat(tok, reasoning_effort="high", chat_template_kwargs={"enable_thinking": True})
    assert "Reasoning: high" in read.prompt_text and read.ignored == ("chat_template_kwargs.enable_thinking",)
