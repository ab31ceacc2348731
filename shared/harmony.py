"""gpt-oss's harmony output, told apart: its thinking, its answer and its tool calls. Pure.

gpt-oss writes every turn as messages framed by special tokens (the text here is decoded
with them kept)::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

or, to call a tool, ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{...}<|call|>`` (the recipient may also stand before the channel). The ``analysis``
channel is thinking; ``final``, and ``commentary`` with no recipient (a preamble the user
may see), are answer; a message to ``functions.NAME`` is a call of NAME with the message
as its arguments; one to another recipient (the built-in ``browser``, ``python``) is no
one's, as those tools are not served. A message ends at ``<|end|>``, ``<|call|>``,
``<|return|>``, or where the next header begins. Text outside messages (headers, an
``<|endoftext|>``) is no one's.

An output that never writes a header is not harmony (a fine-tune, random weights): it is
all answer. A header is short, so text that has gone ``MAX_HEADER`` characters without
``<|message|>`` is taken as such an answer, and streams from then on; where the prompt
holds no harmony header at all, an output whose first characters are not ``<|`` is taken
as one at once (else a model that is not gpt-oss, served with this parser, streamed its
whole short answer in one piece at the end).

As reasoning.Splitter: ``feed`` takes text as it comes, holds back only what may be the
start of a marker, and streamed and whole outputs split the same."""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
MAX_HEADER = 512
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass(frozen=True, slots=True)
class Header:
    channel: str = ""
    recipient: str = ""

    @staticmethod
    def parse(text: str) -> "Header":
        ch, to = _CHANNEL.search(text), _RECIPIENT.search(text)
        return Header(ch.group(1) if ch else "", to.group(1) if to else "")

    @property
    def call(self) -> str | None:
        """The function this message calls (None: not a call)."""
        return self.recipient[len("functions."):] if self.recipient.startswith("functions.") else None

    @property
    def thinking(self) -> bool:
        return self.channel == "analysis"


def _held(text: str) -> int:
    """How many of ``text``'s last characters may begin a marker."""
    for k in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in MARKERS):
            return k
    return 0


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first of ``markers`` in ``text``: (its index, itself), or (-1, "")."""
    best, which = -1, ""
    for m in markers:
        i = text.find(m)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which


@dataclass(frozen=True, slots=True)
class HarmonyStart:
    """Where a request's output begins: in a header (``head``, what the prompt already
    wrote of it, e.g. ``assistant``) or, where the prompt opened a message, in its body."""
    head: str = ""
    body: Header | None = None

    keep_special = True      # the frame is special tokens: the decoder must keep them

    @staticmethod
    def for_prompt(prompt_text: str) -> "HarmonyStart":
        tail = prompt_text[prompt_text.rfind(START) + len(START):] if START in prompt_text else ""
        if any(e in tail for e in ENDS):
            return HarmonyStart()
        if MESSAGE in tail:
            return HarmonyStart(body=Header.parse(tail[:tail.index(MESSAGE)]))
        return HarmonyStart(head=tail)

    def splitter(self) -> "HarmonySplitter":
        return HarmonySplitter(self)


class HarmonySplitter:
    """Text in, (thinking, answer) pieces out, in order; the calls gathered in ``calls``
    as (name, arguments) in the order written."""

    def __init__(self, start: HarmonyStart) -> None:
        self.header: Header | None = start.body   # None: in a header
        self.head = start.head                     # the prompt's part of the first header
        self.buf = ""
        self.harmony = start.body is not None      # a message was framed: the text is harmony
        self.plain = False                         # no header came: all of it is answer
        self.args: list[str] = []                  # the call being written
        self.calls: list[tuple[str, str]] = []

    def _body(self, text: str, think: list[str], answer: list[str]) -> None:
        h = self.header
        if h is None or not text:
            return
        if h.call is not None:
            self.args.append(text)
        elif h.recipient:          # to harmony's built-in tools (browser, python): not served, no one's
            return
        elif h.thinking:
            think.append(text)
        else:
            answer.append(text)

    def _end_message(self) -> None:
        if self.header is not None and self.header.call is not None:
            self.calls.append((self.header.call, "".join(self.args).strip()))
        self.header, self.args = None, []

    def feed(self, text: str) -> tuple[str, str]:
        think: list[str] = []
        answer: list[str] = []
        if self.plain:
            return "", text
        self.buf += text
        while True:
            if self.header is None:                    # a header: wait for its <|message|>
                at = self.buf.find(MESSAGE)
                if at < 0:
                    if not self.harmony and not self.head and self.buf and not (
                            self.buf.startswith("<|") or "<|".startswith(self.buf)):
                        # the prompt is not harmony and the output does not open a header
                        # with a special token (a model that is not gpt-oss): answer, streamed
                        self.plain, rest, self.buf = True, self.buf, ""
                        return "", rest
                    if not self.harmony and len(self.buf) > MAX_HEADER and not any(m in self.buf for m in MARKERS):
                        self.plain, rest, self.buf = True, self.buf, ""
                        return "", rest
                    break
                self.header = Header.parse(self.head + self.buf[:at])
                self.head, self.buf, self.harmony = "", self.buf[at + len(MESSAGE):], True
                continue
            at, marker = _first(self.buf, (*ENDS, START, CHANNEL))
            if at < 0:
                keep = _held(self.buf)
                self._body(self.buf[:len(self.buf) - keep], think, answer)
                self.buf = self.buf[len(self.buf) - keep:]
                break
            self._body(self.buf[:at], think, answer)
            self._end_message()
            # an end marker is dropped; a header that begins without one starts the next message
            self.buf = self.buf[at + len(marker):] if marker in ENDS else self.buf[at:]
        return "".join(think), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is held at the end: a message cut short (max_tokens) keeps what it wrote; a
        header cut short is dropped, or is the answer where nothing was harmony."""
        rest, self.buf = self.buf, ""
        if self.plain or (not self.harmony and self.header is None):
            return "", rest
        think: list[str] = []
        answer: list[str] = []
        self._body(rest if self.header is not None else "", think, answer)
        if self.header is not None and self.header.call is not None:
            self._end_message()
        return "".join(think), "".join(answer)
