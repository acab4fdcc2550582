"""Request and response bodies of the HTTP API (pydantic v2).

Requests are validated from the raw JSON text in strict mode, so a wrong type (``"n": "2"``,
``"stream": 1``) is a 400 rather than a silent coercion; integers are still accepted where a
float is expected. Every body also declares the fields of SGLang's request schema that we do
not implement (``sglang_fields``): accepted and ignored when they ask for nothing, a 400 naming
the field otherwise. Beyond those, OpenAI request bodies ignore unknown fields (clients send
many optional ones we do not implement and that do not change the output); the native
``/generate`` body forbids them, because there an unknown key is almost always a misspelt
parameter.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sgl_jax.srt import sglang_fields
from sgl_jax.srt.managers.io_struct import MAX_RID_CHARS, GenerateReqInput
from sgl_jax.srt.managers.request_options import (
    InvalidRequestError,
    RequestOptions,
    option_fields,
)

# n copies of every prompt are scheduled as independent requests; bound it so one request
# cannot queue an unbounded amount of work.
MAX_N = 128


class OpenAIError(Exception):
    """An error with its HTTP status and OpenAI error fields, raised by the serving layer."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code,
        )


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type, param=param, code=code)
    ).model_dump()


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending top-level parameter for a ValidationError."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['msg']}", None
    if not first["loc"]:
        return f"the request body: {first['msg']} (got {short_repr(first.get('input'))})", None
    param = _clip(str(first["loc"][0]))
    # A value that fits no branch of a union yields one error per branch (loc names the
    # branch type, e.g. ("prompt", "list[int]", 1)); list the accepted forms once instead.
    branches = list(dict.fromkeys(
        str(e["loc"][1]) for e in errors
        if len(e["loc"]) > 1 and e["loc"][0] == first["loc"][0] and _is_type_name(e["loc"][1])
    ))
    if len(branches) > 1:
        return f"{param}: expected one of {', '.join(branches)}", param
    loc = _clip(".".join(str(p) for p in first["loc"] if not _is_type_name(p)))
    message = f"{loc}: {first['msg']}"
    if first["type"] != "missing":
        message += f" (got {short_repr(first.get('input'))})"
    return message, param


def _clip(name: str, limit: int = 100) -> str:
    """A field name or path from the body, bounded: an unknown key may be megabytes long."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _is_type_name(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"})


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- requests ---------------------------------------------------------------------------------
def sglang_fields_model(surface: str) -> type[BaseModel]:
    """A base holding the ``sglang_fields`` table's fields of ``surface``, to list beside a
    body's own base: each optional and untyped here, checked by the table (a refused value is
    a validation error at that field, so the 400 names it). Its config is empty: the body's
    own base decides strictness and unknown keys."""
    table = sglang_fields.fields_of(surface)

    def check(cls: type, value: Any, info: Any) -> Any:
        message = table[info.field_name].refusal(value)
        if message is not None:
            raise PydanticCustomError("unsupported_sglang_field", message)
        return value

    return create_model(
        f"SGLang{surface.title().replace('_', '')}Fields",
        __validators__={"_check_sglang_fields": field_validator(*table)(check)},
        **{name: (Any, None) for name in table},
    )


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(sglang_fields_model(sglang_fields.STREAM_OPTIONS)):
    # Closed: an option we do not know could change what the stream carries.
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


def _set_options(body: BaseModel) -> dict[str, Any]:
    """The request options a body sets (checked later by ``RequestOptions.validate``)."""
    return {name: getattr(body, name) for name in RequestOptions.names()
            if name in body.model_fields_set}


# The request options (sgl_jax extensions; the `openai` client sends them through extra_body),
# declared by RequestOptions.
_OpenAIOptions = create_model("OpenAIOptions", __base__=_Request, **option_fields())


class OpenAISamplingRequest(_OpenAIOptions):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    # SGLang's name for the seed: the same as seed (both given, they must agree).
    sampling_seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang's sglext: cached_tokens_details ({"device", "host"}) in the response's sglext.
    return_cached_tokens_details: bool = False
    # Constrained decoding (SGLang's extensions; at most one): the output matches a JSON
    # schema (text or object), a regular expression or an EBNF grammar.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """SGLang sampling parameters; None values mean "engine default"."""
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "json_schema": self.json_schema,
            "regex": self.regex,
            "ebnf": self.ebnf,
        }
        return {k: v for k, v in params.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def request_seed(self) -> int | None:
        """``seed``, or SGLang's ``sampling_seed``; both given, they must agree."""
        if None not in (self.seed, self.sampling_seed) and self.seed != self.sampling_seed:
            raise InvalidRequestError(
                f"'seed' ({self.seed}) and 'sampling_seed' ({self.sampling_seed}) disagree; "
                f"give one of them", "sampling_seed")
        return self.seed if self.seed is not None else self.sampling_seed

    def options(self) -> dict[str, Any]:
        return _set_options(self)


class CompletionRequest(OpenAISamplingRequest, sglang_fields_model(sglang_fields.COMPLETION)):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None
    # SGLang's: prompt_token_ids and token_ids on each choice (streamed: the new ids of each
    # chunk, the prompt's on a choice's first chunk).
    return_token_ids: bool = False



class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, ...) are kept: the chat template may use them.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    # A string or OpenAI content parts (the tokenizer checks the parts: text only). Only an
    # assistant message that makes tool calls may go without, as with OpenAI.
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None:
            extra = self.model_extra or {}
            calls = extra.get("tool_calls") or extra.get("function_call")
            if not (self.role == "assistant" and calls):
                raise ValueError(
                    f"a '{self.role}' message needs 'content' (only an assistant message with "
                    f"'tool_calls' may omit it)"
                )
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDef


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"] = "function"
    function: _FunctionName


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or JSON that
    matches ``json_schema.schema``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    # {"name", "schema", "strict", "description"}: only "schema" is read.
    json_schema: dict[str, Any] | None = None

    def schema_text(self) -> str | None:
        """The JSON schema the output must match (None for text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        schema = (self.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format type 'json_schema' needs "
                                      "json_schema.schema (an object)", "response_format")
        return json.dumps(schema)


class ChatCompletionRequest(OpenAISamplingRequest, sglang_fields_model(sglang_fields.CHAT)):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Token in: the prompt exactly, the chat template skipped (messages are still required,
    # as with SGLang, and only their size is checked).
    input_ids: list[int] | None = None
    # Each choice's meta_info whole, output_token_logprobs included; sglext then omits the
    # routed experts (they are in meta_info), as SGLang does.
    return_meta_info: bool = False
    return_input_ids_in_sglext: bool = False
    return_output_ids_in_sglext: bool = False
    # Tools rendered by the chat template; calls parsed from the text (--tool-call-parser).
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool = True
    # With --reasoning-parser: <think>...</think> goes to reasoning_content (separate_reasoning),
    # streamed as it comes or, stream_reasoning false, in one piece when it ends.
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class _GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # SGLang's multi-model field; None: the served model
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False

    def to_input(self) -> GenerateReqInput:
        return GenerateReqInput(
            text=self.text, input_ids=self.input_ids, sampling_params=self.sampling_params,
            rid=self.rid, stream=self.stream, options=_set_options(self),
        )


# The native /generate body: GenerateReqInput's fields, the request options flat beside them
# (each a value, or a list of one value per prompt of a batch), and SGLang's fields we do not
# implement.
GenerateRequest = create_model(
    "GenerateRequest", __base__=(_GenerateBody, sglang_fields_model(sglang_fields.GENERATE)),
    **option_fields())


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str = Field(max_length=MAX_RID_CHARS)


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's body: a checkpoint directory of the served architecture and shapes."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str = Field(max_length=4096)  # PATH_MAX
    load_format: Literal["auto", "safetensors"] | None = None  # safetensors is all we read
    weight_version: str | None = None
    abort_all_requests: bool = False


class MemoryOccupationRequest(BaseModel):
    """SGLang's body of /release_memory_occupation and /resume_memory_occupation (optional:
    no body = every tag); the tags are checked by the operation (``control.py``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tags: list[str] | None = Field(None, max_length=8)


# -- responses --------------------------------------------------------------------------------
def _omit_none(value: Any) -> bool:
    return value is None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = Field(None, exclude_if=_omit_none)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = Field(None, exclude_if=_omit_none)
    meta_info: dict[str, Any] | None = Field(None, exclude_if=_omit_none)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_omit_none)
    token_ids: list[int] | None = Field(None, exclude_if=_omit_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(None, exclude_if=_omit_none)


class CompletionStreamResponse(CompletionResponse):
    pass


class FunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=_omit_none)
    arguments: str | None = Field(None, exclude_if=_omit_none)


class ToolCall(BaseModel):
    index: int | None = Field(None, exclude_if=_omit_none)  # in stream deltas
    id: str | None = Field(None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(None, exclude_if=_omit_none)
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_omit_none)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = None
    matched_stop: int | str | None = Field(None, exclude_if=_omit_none)
    meta_info: dict[str, Any] | None = Field(None, exclude_if=_omit_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_omit_none)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = None
    matched_stop: int | str | None = Field(None, exclude_if=_omit_none)
    meta_info: dict[str, Any] | None = Field(None, exclude_if=_omit_none)


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = Field(None, exclude_if=_omit_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sgl_jax"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
