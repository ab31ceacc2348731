"""A reasoning model's thinking, told from its answer (vLLM's ``--reasoning-parser``). Pure.

Models of the DeepSeek-R1 / Qwen3 / GLM-4.5 / DeepSeek-V3.1 families think between
``<think>`` and ``</think>`` and answer after. Where the output starts is read from the
rendered prompt: a chat template that opens the thinking itself (Qwen3-Thinking-2507, R1's
newer template, V3.1 with ``thinking``) leaves ``<think>`` as the prompt's last tag, so the
output starts inside it; one that closes it (``enable_thinking: false`` renders an empty
``<think></think>``) leaves ``</think>``, so all of it is answer. With no tag in the
prompt, ``deepseek_r1`` starts inside the thinking (R1 often skips writing ``<think>``),
the others in the answer, where a ``<think>`` the model writes first opens the thinking.
Within the output, only the first ``</think>`` closes it; any later tag is text.
gpt-oss's harmony channels (``openai_gptoss``) are told apart in shared/harmony.py.

One rule for streamed and whole responses: ``Splitter.feed`` takes text as it comes and
holds back only what may be the start of the tag it waits for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.harmony import HarmonyStart

START, END = "<think>", "</think>"
HARMONY = "openai_gptoss"

# parser name -> whether the output starts inside the thinking when the prompt has no tag
PARSERS = {"deepseek_r1": True, "qwen3": False, "glm45": False, "deepseek_v3": False, HARMONY: False}


def default_parser(model_type: str) -> str:
    """The parser a checkpoint gets when none is named: gpt-oss's harmony is its only way
    to write, so it is always read (as vLLM reads it); other models' thinking stays text."""
    return HARMONY if model_type == "gpt_oss" else ""


def check_parser(name: str) -> None:
    if name and name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {', '.join(sorted(PARSERS))} "
                         "(or none)")


@dataclass(frozen=True, slots=True)
class Reasoning:
    """How one request's output begins: inside the thinking or not (``may_open``: a
    ``<think>`` the model writes first opens it)."""
    thinking: bool
    may_open: bool = True

    @staticmethod
    def for_prompt(parser: str, prompt_text: str) -> "Reasoning":
        opened, closed = prompt_text.rfind(START), prompt_text.rfind(END)
        if opened < 0 and closed < 0:
            return Reasoning(PARSERS[parser])
        return Reasoning(opened > closed)

    def splitter(self) -> "Splitter":
        return Splitter(self.thinking, self.may_open)

    keep_special = False     # the <think> tags are text, whatever the decoder does with special tokens


def for_prompt(parser: str, prompt_text: str) -> Any:
    """How one request's output begins (a Reasoning, or for harmony a HarmonyStart); both
    make its ``splitter()`` and say whether it reads special tokens (``keep_special``)."""
    if parser == HARMONY:
        return HarmonyStart.for_prompt(prompt_text)
    return Reasoning.for_prompt(parser, prompt_text)


# Structured output (or a forced tool call) constrains the whole output from its first
# token: the model cannot think there, and the text is the answer whatever the prompt opened
ANSWER_ONLY = Reasoning(False, may_open=False)


def _held(text: str, tag: str) -> int:
    """How many of ``text``'s last characters may begin ``tag`` (to hold until more comes)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class Splitter:
    """Text in, (thinking, answer) pieces out, in order."""

    def __init__(self, thinking: bool, may_open: bool = True) -> None:
        self.thinking = thinking
        self.at_start = may_open  # only whitespace so far: a <think> here opens the thinking (or repeats it)
        self.closed = False      # its </think> came: the rest is answer
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        think, answer = "", ""
        if self.at_start:
            body = self.buf.lstrip()
            if body.startswith(START):
                self.buf, self.thinking, self.at_start = body[len(START):], True, False
            elif not body or START.startswith(body):
                return think, answer              # wait: whitespace, or a tag begun
            else:
                self.at_start = False
        if self.thinking and not self.closed:
            at = self.buf.find(END)
            if at < 0:
                keep = _held(self.buf, END)
                think, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return think, answer
            think, self.buf, self.closed = self.buf[:at], self.buf[at + len(END):], True
        answer, self.buf = self.buf, ""
        return think, answer

    def finish(self) -> tuple[str, str]:
        """What is held at the end: a tag that never completed is text of where it stood."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.thinking and not self.closed else ("", rest)


def split(reasoning: Any, text: str) -> tuple[str | None, str | None]:
    """A whole output's (thinking, answer); None for an empty one (as vLLM gives them)."""
    return split_calls(reasoning, text)[:2]


def split_calls(reasoning: Any, text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """A whole output's (thinking, answer, the (name, arguments) of its harmony calls)."""
    s = reasoning.splitter()
    a, b = s.feed(text)
    c, d = s.finish()
    return (a + c) or None, (b + d) or None, getattr(s, "calls", [])
