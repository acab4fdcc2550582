"""SGLang's request fields that sgl_jax does not implement: the one table, and its check.

SGLang clients, and gateways that re-serialise requests in SGLang's schema (sglang-router
0.3.2 sends ``"model": null``, ``"log_metrics": true``, ``"return_hidden_states": false``, ...
on every ``/generate``; docs/scaling.md), send fields this engine has no use for. Each is
accepted when it asks for nothing (null, or one of its ``neutral`` values) and then ignored;
any other value asks for a feature we do not have, and the request is refused with a message
that names the field. A field that only labels a request (logs, metrics) is ignored whatever
its value, as long as it has the right JSON type.

The table covers the fields of SGLang's request bodies as sglang-router 0.3.2 forwards them
(``GenerateRequest``, ``ChatCompletionRequest``, ``CompletionRequest`` and the
``sampling_params`` object), plus a few of SGLang's that the router drops (``routed_dp_rank``,
``stop_regex``, ``structural_tag``, ``custom_params``, the stream options), minus the ones
sgl_jax implements (those are real fields of our bodies, ``RequestOptions`` or
``SamplingParams``). Truly unknown fields keep their old fate: a 400 on ``/generate``, in
``sampling_params`` and in ``stream_options``, ignored on the OpenAI routes.

This module imports nothing of ours, so that both the HTTP bodies and ``SamplingParams`` can
use it; callers turn a refusal message into their own error type.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Where a field appears: the native /generate body, the OpenAI chat and completions bodies,
# their stream_options object, and the sampling_params object of /generate.
GENERATE, CHAT, COMPLETION, STREAM_OPTIONS, SAMPLING = (
    "generate", "chat", "completion", "stream_options", "sampling")
SURFACES = (GENERATE, CHAT, COMPLETION, STREAM_OPTIONS, SAMPLING)
_OPENAI = frozenset({CHAT, COMPLETION})
_ALL_BODIES = frozenset({GENERATE, CHAT, COMPLETION})


@dataclass(frozen=True)
class SGLangField:
    name: str
    surfaces: frozenset[str]
    # What a value other than null and the neutral ones asks for, as the subject of "is not
    # supported by this server".
    asks_for: str = ""
    # Values that ask for nothing (besides null); compared with their JSON type, so 0 is not
    # false.
    neutral: tuple[Any, ...] = ()
    # Set for a field that only labels the request: every value of this JSON type is ignored.
    label_type: type | tuple[type, ...] | None = None

    def refusal(self, value: Any) -> str | None:
        """None if ``value`` is accepted (and ignored), else why the request is refused (a
        message to prefix with the field's name)."""
        if value is None or any(_same(value, n) for n in self.neutral):
            return None
        if self.label_type is not None:
            if isinstance(value, self.label_type) and not _is_bool_as_number(value,
                                                                            self.label_type):
                return None
            return f"must be {_type_name(self.label_type)}, or null"
        allowed = ", ".join(["null", *(_json(n) for n in self.neutral)])
        return (f"{self.asks_for} not supported by this server; leave the field out or send "
                f"{allowed}")


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral


def _is_bool_as_number(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, bool) and bool not in kinds


def _json(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        inner = ", ".join(f'"{k}": {_json(v)}' for k, v in value.items())
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_json(v) for v in value) + "]"
    return str(value)


def _type_name(kind: type | tuple[type, ...]) -> str:
    names = {bool: "true or false", str: "a string", dict: "an object", int: "an integer"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _f(name: str, surfaces: frozenset[str] | str, asks_for: str = "", *neutral: Any,
       label: type | tuple[type, ...] | None = None) -> SGLangField:
    where = frozenset({surfaces}) if isinstance(surfaces, str) else surfaces
    return SGLangField(name, where, asks_for, tuple(neutral), label)


_MULTIMODAL = "multimodal input is"
_PD = "prefill-decode disaggregation is"
_LORA = "LoRA adapters are"
_CONSTRAINED = "constrained decoding is"
_DP_RANK = "a data-parallel rank other than 0 is"
_FUNCTIONS = "function calls are"
_MIN_LENGTH = "a minimum output length is"

FIELDS: tuple[SGLangField, ...] = (
    # -- /generate (SGLang's GenerateReqInput) ----------------------------------------------
    _f("input_embeds", GENERATE, "prompt embeddings are"),
    _f("image_data", GENERATE, _MULTIMODAL),
    _f("video_data", GENERATE, _MULTIMODAL),
    _f("audio_data", GENERATE, _MULTIMODAL),
    _f("modalities", GENERATE, _MULTIMODAL, []),
    _f("log_metrics", GENERATE, label=bool),  # no per-request metrics here
    _f("return_hidden_states", _ALL_BODIES, "hidden states are", False),
    _f("session_params", _ALL_BODIES, "sessions (continued prompts) are"),
    _f("lora_path", _ALL_BODIES, _LORA),
    _f("lora_id", GENERATE, _LORA),
    _f("custom_logit_processor", GENERATE, "custom logit processors are"),
    _f("bootstrap_host", GENERATE, _PD),
    _f("bootstrap_port", GENERATE, _PD),
    _f("bootstrap_room", GENERATE, _PD),
    _f("bootstrap_pair_key", GENERATE, _PD),
    # One engine is data-parallel rank 0; for more, run replicas behind a router.
    _f("data_parallel_rank", GENERATE, _DP_RANK, 0),
    _f("routed_dp_rank", GENERATE, _DP_RANK, 0),
    _f("background", GENERATE, "background responses are", False),
    _f("conversation_id", GENERATE, label=str),  # tracking only
    _f("priority", GENERATE, "priority scheduling is"),
    _f("extra_key", GENERATE, "a prefix-cache namespace is"),
    _f("no_logs", GENERATE, label=bool),  # request contents are never logged here
    _f("custom_labels", GENERATE, label=dict),  # metric labels; no per-request metrics here
    _f("return_bytes", GENERATE, "output as bytes is", False),
    _f("return_entropy", GENERATE, "token entropy is", False),
    # -- OpenAI chat and completions, SGLang's extensions -------------------------------------
    _f("logit_bias", _OPENAI | {SAMPLING}, "logit bias is", {}),
    _f("min_tokens", _OPENAI, _MIN_LENGTH, 0),
    _f("no_stop_trim", _OPENAI | {SAMPLING}, "keeping stop strings in the output is", False),
    # -- chat only ----------------------------------------------------------------------------
    _f("function_call", CHAT, _FUNCTIONS, "none"),
    _f("functions", CHAT, _FUNCTIONS, []),
    _f("metadata", CHAT, label=dict),  # OpenAI's stored-completion tags
    _f("safety_identifier", CHAT, label=str),
    _f("service_tier", CHAT, label=str),  # a billing tier, nothing to serve differently
    _f("modalities", CHAT, "output other than text is", ["text"]),
    _f("reasoning_effort", CHAT, "reasoning effort is"),
    _f("verbosity", CHAT, "verbosity is"),
    _f("continue_final_message", CHAT, "continuing the final assistant message is", False),
    _f("chat_template_kwargs", CHAT, "chat template arguments are", {}),
    # -- stream_options -----------------------------------------------------------------------
    _f("continuous_usage_stats", STREAM_OPTIONS, "usage in every chunk is", False),
    _f("include_obfuscation", STREAM_OPTIONS, label=bool),  # padding against size leaks
    # -- sampling_params (SGLang's SamplingParams) --------------------------------------------
    _f("min_new_tokens", SAMPLING, _MIN_LENGTH, 0),
    _f("stop_regex", SAMPLING, "regular-expression stops are"),
    _f("structural_tag", SAMPLING, _CONSTRAINED),
    _f("custom_params", SAMPLING, "custom logit processor parameters are", {}),
)


def fields_of(surface: str) -> dict[str, SGLangField]:
    """The table's fields of one surface, by name."""
    if surface not in SURFACES:
        raise ValueError(f"unknown surface {surface!r}; one of {SURFACES}")
    return {f.name: f for f in FIELDS if surface in f.surfaces}


def refusals(surface: str, values: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(field, message) for every table field of ``surface`` in ``values`` that is refused."""
    table = fields_of(surface)
    for name, value in values.items():
        field = table.get(name)
        message = field.refusal(value) if field is not None else None
        if message is not None:
            yield name, message


def _check_table() -> None:
    seen: set[tuple[str, str]] = set()
    for f in FIELDS:
        for s in f.surfaces:
            if s not in SURFACES or (f.name, s) in seen:
                raise AssertionError(f"sglang_fields: {f.name!r} on {s!r} is bad or repeated")
            seen.add((f.name, s))
        if (f.label_type is None) == (not f.asks_for):
            raise AssertionError(f"sglang_fields: {f.name!r} needs asks_for xor label_type")


_check_table()
