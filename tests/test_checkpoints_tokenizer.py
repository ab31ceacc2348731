"""A checkpoint's tokenizer and chat template: lockstep's HFTokenizer (tokenizers + jinja2,
no transformers at run time) against transformers' own tokenizer on locally trained BPEs
of both families (byte-level like Qwen/OLMoE, metaspace + byte fallback like Mixtral)."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from shared.hf_tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer, load_tokenizer, token_bytes_table  # noqa: E402
from tests.hf_checkpoints import make_tokenizer  # noqa: E402

KINDS = ["bytelevel", "metaspace"]
TEXTS = ["Hello, world!", "Straße, café 東京 😀 — naïve\n\tdef f(x):\n        return x", "🦓🦓 ✓ ", "  leading spaces",
         "", "a" * 50, "<|im_end|> is special"]

# A template that leans on what transformers provides: namespace, loop controls, tojson,
# raise_exception, bos/eos tokens and trim_blocks/lstrip_blocks whitespace rules.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for m in messages %}
  {% if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif %}
  {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role: ' + m.role) }}{% endif %}
  {% if loop.first and ns.system %}[SYS]{{ ns.system }}[/SYS]
{% endif %}
<{{ m.role }}>{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}
  {% if m.meta is defined %}{{ m.meta | tojson }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Straße?  "},
     {"role": "assistant", "content": "Ja."}, {"role": "user", "content": "東京 😀"}],
    [{"role": "user", "content": "x", "meta": {"k": "café", "n": [1, 2]}}],
]


@pytest.fixture(scope="module", params=KINDS)
def tok_dir(request, tmp_path_factory) -> tuple[Path, object]:
    d = tmp_path_factory.mktemp(request.param)
    return d, make_tokenizer(d, request.param)


def test_encode_decode_match_transformers(tok_dir):
    d, ref = tok_dir
    tok = HFTokenizer(d)
    assert tok.vocab_size == len(ref)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"]
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_renders_as_transformers(tok_dir, conv, gen):
    d, ref = tok_dir
    tok = HFTokenizer(d)
    assert tok.render_chat(conv, gen) == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    ids = ref.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.chat_prompt(conv, gen) == list(ids)


@pytest.mark.parametrize("final", ["Sure, {", "Ja. ", "  東京"])
def test_continue_final_message_renders_as_transformers(tok_dir, final):
    """Assistant prefill through the checkpoint's template (services/api_server/hf_text.py),
    the rich template too (it closes an assistant turn with EOS: the cut must drop it)."""
    from services.api_server.hf_text import chat_prompt

    d, ref = tok_dir
    conv = [*CONVERSATIONS[1][:2], {"role": "assistant", "content": final}]
    for template in (None, RICH_TEMPLATE):
        tok, r = HFTokenizer(d), type(ref).from_pretrained(d)
        if template:
            tok.chat_template = r.chat_template = template
        want = r.apply_chat_template(conv, tokenize=False, add_generation_prompt=False, continue_final_message=True)
        text, ids = chat_prompt(tok, conv, False, True)
        assert text == want and ids == tok.encode(want, add_special_tokens=False)


THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
                     "not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tok_dir):
    """Qwen3's enable_thinking: a variable the template reads takes effect; one it does not
    read, or one the request sets itself, is a 400 naming chat_template_kwargs."""
    from services.api_server.errors import ApiError
    from services.api_server.hf_text import chat_prompt

    d, ref = tok_dir
    tok, r = HFTokenizer(d), type(ref).from_pretrained(d)
    tok.chat_template = r.chat_template = THINKING_TEMPLATE
    conv = CONVERSATIONS[0]
    for kw in ({"enable_thinking": False}, {"enable_thinking": True}, {}):
        want = r.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **kw)
        assert chat_prompt(tok, conv, True, False, kw)[0] == want
    assert chat_prompt(tok, conv, True, False, {"enable_thinking": False})[0].endswith("<think></think>")
    for bad in ({"thinking_budget": 5}, {"messages": []}, {"add_generation_prompt": False}):
        with pytest.raises(ApiError) as e:
            chat_prompt(tok, conv, True, False, bad)
        assert e.value.param == "chat_template_kwargs" and next(iter(bad)) in e.value.message


@pytest.mark.parametrize("conv", CONVERSATIONS + [[{"role": "tool", "content": "x"}]])
def test_a_richer_template_renders_as_transformers(tok_dir, conv):
    d, ref = tok_dir
    tok = HFTokenizer(d)
    ref = type(ref).from_pretrained(d)          # a copy: the fixture's keeps its own template
    tok.chat_template = ref.chat_template = RICH_TEMPLATE
    if conv[0]["role"] == "tool":       # raise_exception: both refuse, with the template's message
        with pytest.raises(jinja2.TemplateError, match="bad role: tool"):
            tok.render_chat(conv)
        with pytest.raises(Exception, match="bad role: tool"):
            ref.apply_chat_template(conv, tokenize=False)
        return
    assert tok.render_chat(conv) == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40),
       cut=st.lists(st.integers(1, 4), min_size=1, max_size=20))
def test_streamed_pieces_join_to_the_full_decode(text, cut):
    """Fed in arbitrary groups of tokens, the pieces never hold a broken character before
    the end and join to decode(all tokens) (merged tokens, byte fallback, multi-byte)."""
    for tok in _TOKS.values():
        ids = tok.encode(text) + [tok.eos_token_ids[0]]
        dec, pieces, i, k = tok.stream_decoder(), [], 0, 0
        while i < len(ids):
            n = cut[k % len(cut)]
            pieces.append(dec.feed(ids[i:i + n]))
            i, k = i + n, k + 1
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text
        assert "".join(pieces) + dec.flush() == tok.decode(ids)


def test_a_character_cut_by_the_length_cap_is_dropped_not_ended_in_a_replacement_char():
    """max_tokens can end the output between the bytes of one character: the text stops
    before it (as vLLM's), where decode(all tokens) ends in U+FFFD; a broken byte inside
    the text still shows as U+FFFD."""
    byte = load_tokenizer(None, lambda *a: "")
    for tok in (byte, *_TOKS.values()):
        ids = tok.encode("ab日本")
        for cut in range(1, len(ids)):
            if not tok.decode(ids[:cut]).endswith("\ufffd"):
                continue
            dec = tok.stream_decoder()
            text = dec.feed(ids[:cut]) + dec.flush()
            assert text == tok.decode(ids[:cut]).rstrip("\ufffd") and "\ufffd" not in text
    dec = byte.stream_decoder()
    assert dec.feed([0xE6, ord("a")]) + dec.flush() == "\ufffda"


_TOKS: dict[str, HFTokenizer] = {}


@pytest.fixture(scope="module", autouse=True)
def _both_tokenizers(tmp_path_factory):
    for k in KINDS:
        d = tmp_path_factory.mktemp(f"both-{k}")
        make_tokenizer(d, k)
        _TOKS[k] = HFTokenizer(d)


def test_token_bytes_spell_the_text(tok_dir):
    """The engine's byte view (for stop strings) is the decoded text's bytes (a metaspace
    tokenizer's leading space, stripped by its decoder, aside)."""
    d, _ = tok_dir
    tok = HFTokenizer(d)
    table = token_bytes_table(tok)
    for text in TEXTS:
        ids = tok.encode(text)
        spelled = b"".join(table[i] for i in ids).decode("utf-8")
        assert spelled in (tok.decode(ids), " " + tok.decode(ids))
    assert table[tok.eos_token_ids[0]] == b""


def test_factory_and_the_byte_tokenizer_satisfy_one_interface(tok_dir):
    d, _ = tok_dir
    byte = load_tokenizer(None, lambda msgs, gen=True: "".join(m["content"] for m in msgs))
    hf = load_tokenizer(str(d), lambda *a: "")
    assert isinstance(byte, ByteTokenizer) and isinstance(hf, HFTokenizer)
    for t in (byte, hf):
        tt: TextTokenizer = t
        ids = tt.encode("héllo")
        dec = tt.stream_decoder()
        assert dec.feed(ids) + dec.flush() == tt.decode(ids) == "héllo"
        assert tt.eos_token_ids
    assert byte.render_chat([{"role": "user", "content": "a"}]) == "a"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(d / "nowhere")


def test_engine_stop_strings_see_the_checkpoints_text(tok_dir):
    """With the checkpoint's vocabulary the engine's StopChecker stops at the token that
    completes a stop string (which may end inside a merged token); the byte view would
    read token ids as bytes and stop at the wrong place or never."""
    from shared.stop import StopChecker, use_vocabulary

    d, _ = tok_dir
    tok = HFTokenizer(d)
    ids = tok.encode("Hello, world! How are you today?")
    want = next(i for i in range(len(ids)) if "world" in tok.decode(ids[:i + 1]))
    use_vocabulary(token_bytes_table(tok))
    try:
        checker = StopChecker(["world"])
        assert checker.feed_many(ids) == want
        resumed = StopChecker(["world"])
        resumed.prime(ids[:want])          # a resumed request: its streamed tokens, then the next
        assert resumed.feed(ids[want])
    finally:
        use_vocabulary(None)
    assert StopChecker(["world"]).feed_many(ids) != want   # the byte view misreads these ids


def test_api_parse_uses_the_checkpoints_tokenizer_template_and_eos(tok_dir):
    from services.api_server.errors import ApiError
    from services.api_server.protocol import parse

    d, ref = tok_dir
    tok = HFTokenizer(d)
    conv = CONVERSATIONS[1]
    p = parse({"model": "m", "messages": conv, "max_tokens": 5}, "chat", served_model="m", max_model_len=512,
              num_ranks=1, tok=tok)
    want = ref.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    assert p.prompt == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert p.params.stop_token_ids == sorted(tok.eos_token_ids) and p.params.ignore_eos   # the byte EOS is off
    p = parse({"model": "m", "prompt": "Hello, world!", "ignore_eos": True, "stop_token_ids": [5]}, "completion",
              served_model="m", max_model_len=512, num_ranks=1, tok=tok)
    assert p.prompt == ref("Hello, world!")["input_ids"] and p.params.stop_token_ids == [5]
    p = parse({"model": "m", "prompt": "x", "logit_bias": {"300": 5}, "stop_token_ids": [301]}, "completion",
              served_model="m", max_model_len=512, num_ranks=1, tok=tok)      # ids past the byte model's 260
    assert p.params.logit_bias == {300: 5.0} and 301 in p.params.stop_token_ids
    with pytest.raises(ApiError, match="outside"):
        parse({"model": "m", "prompt": "x", "logit_bias": {str(tok.vocab_size): 5}}, "completion", served_model="m",
              max_model_len=512, num_ranks=1, tok=tok)
    with pytest.raises(ApiError, match="token ids must be within"):
        parse({"model": "m", "prompt": [1, tok.vocab_size]}, "completion", served_model="m", max_model_len=512,
              num_ranks=1, tok=tok)
    # one token id is a prompt of one token (it was taken for the int 65 and refused)
    for prompt in ([65], [[65]]):
        assert parse({"model": "m", "prompt": prompt}, "completion", served_model="m", max_model_len=512,
                     num_ranks=1, tok=tok).prompt == [65]
    with pytest.raises(ApiError, match="token ids must be within"):
        parse({"model": "m", "prompt": [tok.vocab_size]}, "completion", served_model="m", max_model_len=512,
              num_ranks=1, tok=tok)
    # logprobs name tokens by the checkpoint's tokenizer (services/api_server/logprobs.py CheckpointNames)
    assert parse({"model": "m", "prompt": "x", "logprobs": 1}, "completion", served_model="m", max_model_len=512,
                 num_ranks=1, tok=tok).params.logprobs == 1
    tok.chat_template = RICH_TEMPLATE     # a template's raise_exception is the client's 400, not a 500
    with pytest.raises(ApiError, match="refused") as e:
        parse({"model": "m", "messages": [{"role": "developer", "content": "x"}]}, "chat", served_model="m",
              max_model_len=512, num_ranks=1, tok=tok)
    assert e.value.status == 400


# A Qwen2.5-shaped template: the tools as JSON lines in a system turn, calls as <tool_call> blocks.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Wetter — météo",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_reach_a_checkpoints_template_as_transformers_passes_them(tok_dir):
    # (they were never shown: the template got tools=None whatever the request sent)
    from services.api_server.errors import ApiError
    from services.api_server.protocol import parse

    d, ref = tok_dir
    tok = HFTokenizer(d)
    ref = type(ref).from_pretrained(d)
    tok.chat_template = ref.chat_template = TOOLS_TEMPLATE
    conv = CONVERSATIONS[0]
    want = ref.apply_chat_template(conv, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in want
    p = parse({"model": "m", "messages": conv, "tools": [WEATHER_TOOL], "max_tokens": 4}, "chat", served_model="m",
              max_model_len=4096, num_ranks=1, tok=tok)
    assert p.prompt_text == want and p.tool_call.mode == "auto" and p.tool_call.fmt == "hermes"
    # a template that reads no tools would hide them from the model: refused, not ignored
    loop = "{%- for m in messages %}"
    tok.chat_template = loop + TOOLS_TEMPLATE.split(loop)[1]      # the same turns, no tools
    with pytest.raises(ApiError) as err:
        parse({"model": "m", "messages": conv, "tools": [WEATHER_TOOL]}, "chat", served_model="m",
              max_model_len=4096, num_ranks=1, tok=tok)
    assert err.value.param == "tools" and "does not show tools" in err.value.message
