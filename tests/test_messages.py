"""The bus messages (shared/messages.py, shared/stats.py): every kind round-trips, the
wire keeps its short keys and leaves defaults out, what the previous (hand-written) codec
wrote still decodes and what it required is still written (a rolling restart mixes
releases), unknown keys are ignored, and malformed input is refused with a clear error."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.bus import decode_entries
from shared.messages import (FIELD, Abort, Delta, MessageError, Outputs, Request, Resume, Retire, SamplingParams,
                             WaveNotice,
                             decode, dumps, encode, encode_deltas, loads, output_entry, request_owner)
from shared.stats import RankStats, Snapshot


def _wire(msg) -> dict:
    return orjson.loads(encode(msg))


def _full_request() -> Request:
    sp = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, seed=3, stop=["\n"], ignore_eos=True, top_k=4,
                        min_p=0.1, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2,
                        logit_bias={7: -2.5, 300: 1.0}, min_tokens=2, stop_token_ids=[9], logprobs=2,
                        prompt_logprobs=1, guide=["regex", "a+"])
    return Request(id="r1", api="api0", prompt=[104, 105], params=sp, arrival=1.25, rank=1, batch="b-1",
                   batch_counts=[1, 0], generated=[1, 2], dispatcher="scheduler.3", dispatch_seq=7, epoch=2)


# ------------------------------------------------------------------ round trips

def test_every_kind_round_trips_through_its_wire_form():
    snap = Snapshot(wave=1, step=9, t=2.5, seq=4, carried=(1,), ranks={
        0: RankStats(0, 1, 9, waiting=2, idle=True, dur_ms=1.5, recv={"scheduler.1": 3}, extra={"gen": 1}),
        1: RankStats(1, 1, 8)})
    messages = [
        Request(id="r0", api="a", prompt=[1, 2, 255], params=SamplingParams(), arrival=1.0),
        Request(id="r0", api="a", prompt=[1, 50000], params=SamplingParams(), arrival=1.0),   # not byte-sized
        _full_request(),
        Abort("r1"), Abort("r1", 2, "timeout"),
        Delta("r1", 3, [1, 2]), Delta("r1", 3, [], "stop", 12, 1, None, 2, [[-0.5, [[1, -0.5]]]], [[-1.0, []]], 2),
        Outputs([Delta("a", 0, [1]), Delta("b", 4, [2], "length", 3, 0)]),
        Resume(["r1", "r2"]), Retire("r1", 3, 0),
        WaveNotice(3, 1), WaveNotice(-1, 2, 5),
        RankStats(3, 2, 1, waiting=1, recv={"api-x": 2}, extra={"comm_s": 0.5}),
        snap,
    ]
    for msg in messages:
        raw = encode(msg)
        assert decode(raw, type(msg)) == msg
        assert type(msg).from_dict(orjson.loads(raw)) == msg if hasattr(msg, "from_dict") else True
        if hasattr(msg, "to_dict"):   # the dict form is the same document
            assert orjson.loads(dumps(msg.to_dict())) == orjson.loads(raw)


@given(st.lists(st.integers(0, 2**20), max_size=40), st.lists(st.integers(0, 255), max_size=8),
       st.integers(1, 4096), st.one_of(st.none(), st.integers(0, 2**31)),
       st.dictionaries(st.integers(0, 2**17), st.floats(-100, 100), max_size=4))
def test_requests_round_trip(prompt, generated, max_tokens, seed, bias):
    req = Request(id="x", api="a", prompt=prompt, params=SamplingParams(max_tokens=max_tokens, seed=seed,
                                                                      logit_bias=bias),
                  arrival=3.5, generated=generated)
    back = Request.from_dict(loads(encode(req)))
    assert back == req and back.prompt == prompt and back.params.logit_bias == bias
    assert encode(back) == encode(req)   # written on unchanged (scheduler -> inbox)


def test_output_entries_decode_by_kind():
    assert output_entry(loads(encode_deltas([Delta("a", 0, [5])]))) == Outputs([Delta("a", 0, [5])])
    assert output_entry(loads(encode(Resume(["a"])))) == Resume(["a"])


# ------------------------------------------------------------------ the wire

def test_short_keys_and_defaults_left_out():
    assert _wire(Request(id="r", api="a", prompt=[104, 105], params=SamplingParams(), arrival=1.5)) == {
        "k": "req", "id": "r", "api": "a", "p": "6869", "at": 1.5,
        # the six keys the first codec always wrote (its readers require them) stay written
        "sp": {"mt": 16, "te": 1.0, "tp": 1.0, "sd": None, "st": [], "ie": False}}
    assert _wire(_full_request()) == {
        "k": "req", "id": "r1", "api": "api0", "p": "6869", "at": 1.25, "r": 1, "b": "b-1", "bc": [1, 0],
        "g": [1, 2], "dp": "scheduler.3", "ds": 7, "ep": 2,
        "sp": {"mt": 5, "te": 0.5, "tp": 0.9, "sd": 3, "st": ["\n"], "ie": True, "tk": 4, "mp": 0.1, "pp": 0.5,
               "fp": 0.25, "rp": 1.2, "lb": [[7, -2.5], [300, 1.0]], "mn": 2, "si": [9], "lp": 2, "pl": 1,
               "gd": ["regex", "a+"]}}
    # a prompt with an id above 255 goes as a list
    assert _wire(Request(id="r", api="a", prompt=[1, 256], params=SamplingParams(), arrival=0.0))["p"] == [1, 256]
    assert _wire(SamplingParams(logit_bias={3: 1.0}))["lb"] == [[3, 1.0]]   # pairs on their own too
    assert _wire(Abort("r")) == {"k": "abort", "id": "r", "r": None, "why": "client_disconnected"}
    assert orjson.loads(encode_deltas([Delta("r", 4, [7], rank=0), Delta("s", 1, [], "stop", 9, 0, epoch=1)])) == {
        "k": "out", "ds": [{"id": "r", "o": 4, "t": [7], "r": 0},
                           {"id": "s", "o": 1, "t": [], "f": "stop", "pt": 9, "r": 0, "ep": 1}]}
    assert _wire(Resume(["a"])) == {"k": "resume", "ids": ["a"]}
    assert _wire(WaveNotice(4, 0)) == {"w": 4, "r": 0}
    assert _wire(WaveNotice(-1, 2, 0)) == {"w": -1, "r": 2, "reform": 0}
    # the shape shared/wake.py's script writes
    assert WaveNotice.from_dict(loads(b'{"w":' + b"7" + b',"r":-1}')) == WaveNotice(7, -1)


def test_stats_rows_keep_full_names_and_every_field():
    row = _wire(RankStats(2, 0, 5))
    assert row["rank"] == 2 and row["idle"] is False and row["recv"] == {} and row["prefill_pending"] == 0
    assert set(row) == set(RankStats.__struct_fields__)
    snap = _wire(Snapshot(0, 5, 1.0, {2: RankStats(2, 0, 5)}))
    assert set(snap) == {"wave", "step", "t", "ranks", "carried", "seq"} and list(snap["ranks"]) == ["2"]


def test_the_previous_codecs_documents_still_decode():
    """Literal documents as the hand-written codec wrote them (a rank of the previous
    release in a rolling restart)."""
    req = Request.from_dict({"k": "req", "id": "r", "api": "a", "p": "6869",
                             "sp": {"mt": 4, "te": 1.0, "tp": 1.0, "sd": None, "st": [], "ie": False,
                                    "lb": [[7, 1.5]]},
                             "at": 1.0, "b": "b1", "bc": None, "dp": "scheduler.1", "ds": 0})
    assert req.prompt == [104, 105] and req.params.max_tokens == 4 and req.batch == "b1"
    assert req.params.logit_bias == {7: 1.5} and req.dispatcher == "scheduler.1"
    assert Request.from_dict({"k": "req", "id": "r", "api": "a", "p": [300], "sp": {"mt": 1, "te": 1, "tp": 1,
                              "sd": 5, "st": ["x"], "ie": True}, "at": 2}).prompt == [300]
    assert Abort.from_dict({"k": "abort", "id": "r", "r": None, "why": ""}) == Abort("r", None, "")
    d = Delta.from_dict({"id": "r", "o": 2, "t": [1], "r": 3, "plo": 1})
    assert d == Delta("r", 2, [1], rank=3)
    row = {"rank": 1, "wave": 0, "step": 3, "waiting": 2, "recv": {}, "extra": {}, "idle": False, "t": 5.0}
    assert RankStats.from_dict(row) == RankStats(1, 0, 3, waiting=2, t=5.0)
    assert Snapshot.from_dict({"wave": 0, "step": 3, "t": 1.0, "seq": 2, "carried": [1],
                               "ranks": {"1": row}}).ranks[1].waiting == 2


def test_unknown_keys_are_ignored():
    """A newer release may add keys; this one reads past them (the old codec did too)."""
    doc = _wire(_full_request())
    doc["zz"] = 1
    doc["sp"]["zz"] = [1]
    assert Request.from_dict(doc) == _full_request()
    assert Delta.from_dict({"id": "r", "o": 0, "t": [], "new": {"x": 1}}) == Delta("r", 0, [])
    assert RankStats.from_dict({"rank": 0, "wave": 0, "step": 0, "gpu_temp": 71}) == RankStats(0, 0, 0)


# ------------------------------------------------------------------ bad input

BAD = [
    (Request, {"k": "req", "api": "a", "p": "00", "sp": {}, "at": 1.0}, "missing required field `id`"),
    (Request, {"k": "req", "id": "r", "api": "a", "p": "zz", "sp": {}, "at": 1.0}, "non-hexadecimal"),
    (Request, {"k": "req", "id": "r", "api": "a", "p": [1, "x"], "sp": {}, "at": 1.0}, "`$.p"),
    (Request, {"k": "req", "id": "r", "api": "a", "p": [], "sp": {"mt": "many"}, "at": 1.0}, "`$.sp.mt`"),
    (Request, {"k": "abort", "id": "r"}, "`$.k`"),
    (Request, [1, 2], "Expected `object`, got `array`"),
    (Abort, {"k": "abort", "id": 5}, "`$.id`"),
    (Delta, {"id": "r", "o": 0}, "missing required field `t`"),
    (Delta, {"id": "r", "o": "0", "t": []}, "`$.o`"),
    (RankStats, {"rank": 0, "wave": 0, "step": "x"}, "`$.step`"),
    (Snapshot, {"wave": 0, "step": 0, "t": 0.0, "ranks": {"0": {"rank": "zero"}}}, "$.ranks"),
    (WaveNotice, {"w": 1, "r": 0, "reform": "x"}, "`$.reform`"),
]


@pytest.mark.parametrize("cls,doc,says", BAD, ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(BAD)])
def test_malformed_documents_are_refused_clearly(cls, doc, says):
    with pytest.raises(MessageError) as err:
        cls.from_dict(doc)
    assert says in str(err.value) and cls.__name__ in str(err.value)
    with pytest.raises(MessageError):
        decode(orjson.dumps(doc), cls)


def test_bad_output_entries_and_json():
    with pytest.raises(MessageError, match="Outputs | Resume"):
        output_entry({"k": "corrupt"})
    with pytest.raises(MessageError, match=r"\$\.ds\[0\]"):
        output_entry({"k": "out", "ds": [{"id": 1}]})
    with pytest.raises(MessageError, match="malformed Request"):
        decode(b"{not json", Request)
    with pytest.raises(MessageError, match="JSON object, not list"):
        loads(b"[1]")


def test_decode_entries_marks_anything_but_an_object_corrupt():
    """A reader's ``doc.get`` never meets a list, a number or broken JSON."""
    entries = [(b"1-0", {FIELD: b"[1, 2]"}), (b"2-0", {FIELD: b"7"}), (b"3-0", {FIELD: b"{oops"}),
               (b"4-0", {FIELD: encode(Abort("r"))})]
    docs = [doc for _, _, doc in decode_entries([(b"s", entries)])]
    assert docs[:3] == [{"k": "corrupt"}] * 3 and docs[3]["k"] == "abort"


def test_request_owner_names_only_whole_requests():
    assert request_owner(_wire(_full_request())) == ("api0", "r1")
    assert request_owner({"k": "req", "id": ["x"], "api": "a"}) is None
    assert request_owner({"k": "req", "id": "x"}) is None
    assert request_owner(_wire(Abort("r"))) is None
    assert request_owner({"k": "corrupt"}) is None


def test_message_shapes_doc_names_every_wire_key():
    """docs/redis-keys.md's *Message shapes* table stays true to the Structs."""
    import msgspec

    from tests.conftest import ROOT

    rows = {}   # Struct name -> (kind cell, keys cell)
    for line in (ROOT / "docs" / "redis-keys.md").read_text().splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) == 4:
            rows[cells[1].strip("` ").split("`")[0]] = (cells[0][2:], cells[3])
    for cls in (Request, SamplingParams, Abort, Outputs, Delta, Resume, WaveNotice, RankStats, Snapshot):
        assert cls.__name__ in rows, f"no row for {cls.__name__}"
        kind, keys = rows[cls.__name__]
        info = msgspec.inspect.type_info(cls)
        missing = [f.encode_name for f in info.fields if f"`{f.encode_name}`" not in keys]
        assert not missing, (cls.__name__, missing)
        assert kind == (f"`{info.tag}`" if info.tag is not None else "—"), (cls.__name__, kind)
