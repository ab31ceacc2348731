"""Stop strings: engine-side byte detection and api-side text holdback/trim."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.stop import StopChecker, TextStopper
from shared.tokenizer import EOS, StreamDecoder, encode


def _first_stop_token(stop: list[str], tokens: list[int]) -> int | None:
    return StopChecker(stop).feed_many(tokens)


def _reference_cut(text: str, stop: list[str]) -> str:
    """Text before the first stop string to complete (longest on a tie), else all."""
    for k in range(1, len(text) + 1):
        done = [s for s in stop if s and text[:k].endswith(s)]
        if done:
            return text[: k - max(len(s) for s in done)]
    return text


# -- engine side -------------------------------------------------------------------------

def test_checker_ascii_and_position():
    toks = encode("hello world")
    assert _first_stop_token(["wor"], toks) == toks.index(ord("r"))
    assert _first_stop_token(["xyz"], toks) is None
    assert _first_stop_token([], toks) is None
    assert not StopChecker([]) and not StopChecker([""])


def test_checker_multibyte_completes_on_last_byte():
    toks = encode("caf") + encode("é") + encode("!")
    i = _first_stop_token(["é"], toks)
    assert i == 4                       # the second byte of é completes it, not the first
    assert _first_stop_token(["fé!"], toks) == len(toks) - 1


def test_checker_several_stops_first_completed_wins():
    toks = encode("abcdef")
    assert _first_stop_token(["def", "bc"], toks) == 2
    assert _first_stop_token(["abcd", "cd"], toks) == 3


def test_checker_ignores_special_tokens_and_primes():
    toks = encode("ab") + [EOS] + encode("c")
    assert _first_stop_token(["abc"], toks) == 3
    c = StopChecker(["xyz"])
    c.prime(encode("aaxy"))             # a resumed request: the stop spans the resume point
    assert c.feed(ord("z"))


def test_checker_tail_bounded():
    c = StopChecker(["abc"])
    for t in encode("x" * 10_000):
        assert not c.feed(t)
    assert len(c._tail) <= c.max_len


# -- api side ----------------------------------------------------------------------------

def test_stopper_holds_back_possible_prefix_then_releases():
    s = TextStopper(["STOP"])
    assert s.feed("hello ST") == "hello "
    assert s.feed("A") == "STA"          # "STA" can no longer become "STOP"
    assert s.feed("rt S") == "rt "
    assert s.finish() == "S"
    assert not s.stopped


def test_stopper_stop_spanning_pieces_trims():
    s = TextStopper(["</end>"])
    out = s.feed("answer</e") + s.feed("n") + s.feed("d>junk")
    assert out == "answer" and s.stopped and s.matched == "</end>"
    assert s.feed("more") == "" and s.finish() == ""


def test_stopper_several_stops_first_completed_wins():
    s = TextStopper(["cd", "bcde"])
    assert s.feed("abcdef") == "ab"          # "cd" completes before "bcde"
    s = TextStopper(["xyz", "y"])
    assert s.feed("axy") == "ax" and s.stopped and s.matched == "y"
    s = TextStopper(["b", "ab"])
    assert s.feed("xab") == "x" and s.matched == "ab"   # same end: the longest
    # chunking never changes the answer
    s = TextStopper(["b", "aba"])
    assert s.feed("a") + s.feed("ba") == "a"
    s = TextStopper(["b", "aba"])
    assert s.feed("aba") == "a"


def test_stopper_multibyte_through_stream_decoder():
    dec, s = StreamDecoder(), TextStopper(["né"])
    sent = ""
    for t in encode("bonné jour"):   # one byte at a time: é arrives split
        sent += s.feed(dec.feed([t]))
        assert "né" not in sent
    assert sent == "bon" and s.stopped


def test_stopper_no_stops_is_passthrough():
    s = TextStopper([])
    assert s.feed("abc") == "abc" and s.finish() == ""


ALPHA = "ab€é\n"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHA, max_size=40),
       stop=st.lists(st.text(alphabet=ALPHA, min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_stopper_property(text, stop, cuts):
    ref = _reference_cut(text, stop)
    s = TextStopper(stop)
    sent = ""
    bounds = sorted(set(c for c in cuts if c <= len(text)))
    prev = 0
    for b in bounds + [len(text)]:
        sent += s.feed(text[prev:b])
        prev = b
        assert ref.startswith(sent)      # never past a stop string, never wrong text
    sent += s.finish()
    assert sent == ref


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHA, max_size=40),
       stop=st.lists(st.text(alphabet=ALPHA, min_size=1, max_size=4), max_size=3))
def test_engine_and_api_agree(text, stop):
    """Engine cuts the token stream at the stop-completing token; the api-server decodes
    and trims: the client sees exactly the text before the first stop string."""
    toks = encode(text)
    i = StopChecker(stop).feed_many(toks)
    emitted = toks if i is None else toks[: i + 1]
    dec, s = StreamDecoder(), TextStopper(stop)
    sent = "".join(s.feed(dec.feed([t])) for t in emitted)
    sent += s.feed(dec.flush()) + s.finish()
    assert sent == _reference_cut(text, stop)
    assert (i is not None) == s.stopped
