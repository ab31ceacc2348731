"""The request bodies of the OpenAI-compatible routes as msgspec Structs: one definition
that is the type, the validation (types and ranges, done while decoding) and the OpenAPI
schema. Rules that span fields or depend on the served model (best_of >= n, the context
length, token ids within the vocabulary) are checked in protocol.py after decoding.

Every field is optional with ``None`` as "absent": OpenAI clients send ``null`` for a
default, so ``null`` is always accepted and means the default (docs/api.md).
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

MAX_STOP_STRINGS = 64       # vLLM has no limit; a bound still (each costs an endswith per token)
MAX_STOP_LEN = 1024
MAX_LOGPROBS = 20           # as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 128           # engine requests one HTTP request may make: prompts x max(n, best_of)
MAX_TOOLS = 128

# Parameters this server knows and does not implement yet: accepted only at their neutral
# value (checked in protocol.py, which needs the value, hence ``Any`` here); anything else
# is a 400 naming the field. name -> (the neutral values, their JSON schema).
NEUTRAL: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "bad_words": (([],), {"type": "array", "maxItems": 0}),
    "include_stop_str_in_output": ((False,), {"type": "boolean", "enum": [False]}),
    "skip_special_tokens": ((True,), {"type": "boolean", "enum": [True]}),
    "suffix": (("",), {"type": "string", "maxLength": 0}),
    "functions": (([],), {"type": "array", "maxItems": 0}),
    "function_call": (("none",), {"type": "string", "enum": ["none"]}),
    "modalities": ((["text"],), {"type": "array", "items": {"type": "string", "enum": ["text"]}, "maxItems": 1}),
    "audio": ((), {"type": "null"}),
    "prediction": ((), {"type": "null"}),
    "web_search_options": ((), {"type": "null"}),
    "store": ((False,), {"type": "boolean", "enum": [False]}),
    # vLLM's own parameters that this server does not implement yet: a vLLM client that
    # sends one must hear so, not get a 200 with the parameter doing nothing
    "allowed_token_ids": ((), {"type": "null"}),
    "truncate_prompt_tokens": ((), {"type": "null"}),
    "use_beam_search": ((False,), {"type": "boolean", "enum": [False]}),
    "length_penalty": ((1.0,), {"type": "number", "enum": [1.0]}),
    "return_tokens_as_token_ids": ((False,), {"type": "boolean", "enum": [False]}),
    "priority": ((0,), {"type": "integer", "enum": [0]}),
    "logits_processors": ((), {"type": "null"}),
    "guided_whitespace_pattern": ((), {"type": "null"}),
    "chat_template": ((), {"type": "null"}),
    "documents": ((), {"type": "null"}),
}
# Neutral-only in chat, where it does not take effect (in completions it does).
CHAT_NEUTRAL: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "echo": ((False,), {"type": "boolean", "enum": [False]}),
}
UNSUPPORTED_NOTE = "not supported yet: only the neutral value shown is accepted; any other value is a 400"


def _neutral(name: str) -> Any:
    return Annotated[Any, Meta(description=UNSUPPORTED_NOTE, extra_json_schema=NEUTRAL[name][1])]


def _int(lo: int | None = None, hi: int | None = None, doc: str | None = None) -> Any:
    return Annotated[int, Meta(ge=lo, le=hi, description=doc)] | None


def _num(lo: float | None = None, hi: float | None = None, gt: float | None = None, doc: str | None = None) -> Any:
    return Annotated[float, Meta(ge=lo, le=hi, gt=gt, description=doc)] | None


NonEmpty = Annotated[str, Meta(min_length=1)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LEN)]   # bytes: checked in protocol.py
JsonSchema = dict[str, Any] | str      # an object, or one as a string (vLLM's guided_json)


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: Annotated[bool, Meta(description="vLLM's: usage in every chunk")] | None = None


class JsonSchemaFormat(Struct, kw_only=True):
    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's: exactly one of the fields (checked in structured.py)."""
    json: JsonSchema | None = None
    regex: NonEmpty | None = None
    choice: Annotated[list[NonEmpty], Meta(min_length=1)] | None = None
    grammar: NonEmpty | None = None
    json_object: bool | None = None


class Function(Struct, kw_only=True):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"]
    function: Function


class FunctionName(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class ContentPart(Struct, kw_only=True):
    type: str                      # only "text" (and an assistant's "refusal") is served: checked in protocol.py
    text: str | None = None
    refusal: str | None = None     # an assistant turn's refusal part, sent back in the history


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None     # an assistant turn's earlier calls (shown in the prompt)
    tool_call_id: str | None = None
    # an assistant turn's thinking sent back (vLLM's name, and DeepSeek's older one): the
    # checkpoint's template gets it as reasoning_content, and shows it where it does
    reasoning: str | None = None
    reasoning_content: str | None = None


Messages = Annotated[list[ChatMessage], Meta(min_length=1)]
TopK = _int(-1, doc="-1 or 0: no cut")
MinTokens = _int(0, doc="at most max_tokens")
PromptLogprobs = _int(0, MAX_LOGPROBS, "vLLM's: each prompt token's logprob and the top k (not with stream)")
BestOf = _int(1, MAX_CHOICES, "candidates per prompt (>= n), the n with the highest cumulative logprob are returned")
EchoMaxTokens = _int(0, doc="0 only with echo: the prompt (and its logprobs) alone")
Tools = Annotated[list[Tool], Meta(max_length=MAX_TOOLS)]
TokenIds = list[Annotated[int, Meta(ge=0)]]


class GenerationBody(Struct, kw_only=True):
    """The fields both generation routes take."""
    model: str | None = None   # none, null or "": the served model (as vLLM reads it; curl scripts leave it out)
    temperature: _num(0.0, 2.0) = None
    top_p: _num(0.0, 1.0) = None          # 0: the most likely token only (OpenAI accepts 0)
    seed: _int(-2**63, 2**63 - 1) = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    top_k: TopK = None
    min_p: _num(0.0, 1.0) = None
    presence_penalty: _num(-2.0, 2.0) = None
    frequency_penalty: _num(-2.0, 2.0) = None
    repetition_penalty: _num(hi=2.0, gt=0.0) = None
    data_parallel_rank: _int(0) = None
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100, le=100)]],
                          Meta(max_length=MAX_LOGIT_BIAS,
                               description="token id (as a string) -> bias added to its logit")] | None = None
    min_tokens: MinTokens = None
    response_format: ResponseFormat | None = None
    guided_json: Annotated[JsonSchema, Meta(description="a JSON schema")] | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Meta(min_length=1)] | None = None
    guided_grammar: Annotated[str, Meta(min_length=1, description="a Lark or GBNF grammar")] | None = None
    structured_outputs: Annotated[StructuredOutputs, Meta(
        description="exactly one of json, regex, choice, grammar, json_object")] | None = None
    prompt_logprobs: PromptLogprobs = None
    n: _int(1, MAX_CHOICES) = None
    best_of: BestOf = None
    stop_token_ids: Annotated[TokenIds, Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    return_token_ids: Annotated[bool, Meta(
        description="vLLM's: the prompt's and the output's token ids in the response (prompt_token_ids, "
                    "each choice's token_ids; streamed, each chunk's new ones)")] | None = None
    # informational: accepted, never change the output (docs/api.md)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # not supported yet: neutral values only
    bad_words: _neutral("bad_words") = None
    include_stop_str_in_output: _neutral("include_stop_str_in_output") = None
    skip_special_tokens: _neutral("skip_special_tokens") = None
    allowed_token_ids: _neutral("allowed_token_ids") = None
    truncate_prompt_tokens: _neutral("truncate_prompt_tokens") = None
    use_beam_search: _neutral("use_beam_search") = None
    length_penalty: _neutral("length_penalty") = None
    return_tokens_as_token_ids: _neutral("return_tokens_as_token_ids") = None
    priority: _neutral("priority") = None
    logits_processors: _neutral("logits_processors") = None
    guided_whitespace_pattern: _neutral("guided_whitespace_pattern") = None


# A prompt: a string, token ids, or a batch of up to MAX_CHOICES of either (protocol.py
# tells them apart and counts the batch: msgspec allows one list type in a union).
Prompt = Annotated[str | list[str | int | TokenIds], Meta(
    description="a string, a list of token ids, or a list of up to 128 of either (a batch)")]


class CompletionBody(GenerationBody, kw_only=True, forbid_unknown_fields=True):
    prompt: Prompt
    max_tokens: EchoMaxTokens = None
    echo: bool | None = None
    logprobs: _int(0, MAX_LOGPROBS) = None
    suffix: _neutral("suffix") = None


class ChatBody(GenerationBody, kw_only=True, forbid_unknown_fields=True):
    messages: Messages
    max_tokens: _int(1) = None
    max_completion_tokens: _int(1) = None
    tools: Tools | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice, Meta(
        description="\"auto\" needs a tool parser: a 400 here, as vLLM without one")] | None = None
    parallel_tool_calls: Annotated[bool, Meta(
        description="false: tool_choice \"required\" makes one call")] | None = None
    logprobs: bool | None = None
    top_logprobs: _int(0, MAX_LOGPROBS) = None
    functions: _neutral("functions") = None
    function_call: _neutral("function_call") = None
    modalities: _neutral("modalities") = None
    audio: _neutral("audio") = None
    prediction: _neutral("prediction") = None
    reasoning_effort: Annotated[Literal["low", "medium", "high"] | None, Meta(
        description="how long a reasoning model thinks, for a checkpoint whose chat template reads it (gpt-oss); "
                    "elsewhere a 400")] = None
    web_search_options: _neutral("web_search_options") = None
    store: _neutral("store") = None
    echo: Annotated[Any, Meta(description=UNSUPPORTED_NOTE, extra_json_schema=CHAT_NEUTRAL["echo"][1])] = None
    add_generation_prompt: Annotated[bool, Meta(
        description="false: no assistant turn opened after the messages (default true; false with continue_final_message)")] | None = None
    continue_final_message: Annotated[bool, Meta(
        description="true: the model continues the final message (an assistant reply the client began) instead of starting a turn")] | None = None
    chat_template: _neutral("chat_template") = None
    chat_template_kwargs: Annotated[dict[str, Any], Meta(
        description="variables for a served checkpoint's chat template (enable_thinking...), each one the template "
                    "reads; the byte model's template reads none")] | None = None
    documents: _neutral("documents") = None
    include_reasoning: Annotated[bool, Meta(
        description="with a reasoning parser (LOCKSTEP_REASONING_PARSER): false leaves the thinking out of the "
                    "answer (default true)")] | None = None


class TokenizeBody(Struct, kw_only=True):
    """vLLM's /tokenize: either 'prompt' (completion-style) or 'messages' (chat-style,
    through the chat template)."""
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None
    tools: Annotated[Tools, Meta(description="as in chat completions: counted as the prompt shows them")] | None = None


class DetokenizeBody(Struct, kw_only=True):
    tokens: TokenIds        # below the served model's vocabulary size: protocol.py
    model: str | None = None


_UNKNOWN_NOTE = "Unknown fields are ignored (logged once per field name at warning level); see docs/api.md."


def _components() -> dict[str, Any]:
    from services.api_server.responses_api import ResponsesBody   # (it imports nothing from here)
    _, comps = msgspec.json.schema_components([CompletionBody, ChatBody, TokenizeBody, DetokenizeBody,
                                               ResponsesBody], ref_template="#/components/schemas/{name}")
    for name in ("CompletionBody", "ChatBody", "ResponsesBody"):
        # Decoding forbids unknown fields only to find their names (decode.py); the route
        # serves the request without them, as vLLM does.
        comps[name]["additionalProperties"] = True
        comps[name]["description"] = _UNKNOWN_NOTE
    return comps


COMPONENTS: dict[str, Any] = _components()
COMPLETION_SCHEMA = COMPONENTS["CompletionBody"]
CHAT_SCHEMA = COMPONENTS["ChatBody"]


def openapi_body(name: str) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is the Struct ``name``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def add_components(spec: dict[str, Any]) -> dict[str, Any]:
    """The Structs' schemas into an OpenAPI document (the routes refer to them)."""
    spec.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENTS)
    return spec
