"""Per-request sampling parameters (host side), with SGLang's field names.

Life cycle: ``SamplingParams.from_dict`` (type checks, unknown keys) -> ``verify`` (value ranges,
needs the vocab size and context length) -> ``normalize`` (canonical forms the scheduler and the
device sampler rely on). Every error is a ``ValueError`` whose message names the offending field
and what is allowed, so the HTTP layer can hand it to the user as a 400 unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

from sgl_jax.srt import sglang_fields

# A temperature below this is greedy decoding; the device sampler uses the same threshold, so a
# request is greedy on the host exactly when it is greedy on the device.
SAMPLING_EPS = 1e-6
# Most top logprobs a request may ask for per position (OpenAI's limit is 20), and most ids of
# ``token_ids_logprob``: static widths in the step, so one compiled variant serves every request.
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS_LOGPROB = 64

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # each stop string is searched for in every new piece of text
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63  # exclusive; seeds fit a signed 64-bit integer (what most clients can send)

# SGLang's names of our parameters (sglang-router forwards "sampling_seed" and drops "seed").
_ALIASES = {"sampling_seed": "seed"}
# SGLang's parameters we do not implement: accepted when they ask for nothing, else refused.
_SGLANG_ONLY = sglang_fields.fields_of(sglang_fields.SAMPLING)

# The penalties are accepted only at their neutral values: the engine does not implement them,
# and silently ignoring a non-neutral penalty would return different text than the user asked for.
_UNSUPPORTED_NEUTRAL: dict[str, float] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Constrained decoding (at most one; constrained/grammar.py): a JSON schema (text), a
    # regular expression, or an EBNF (GBNF / Lark) grammar the output must match.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON-like dict, checking keys and types (not value ranges: see verify).

        A value of ``None`` means "not given" and leaves the field at its default, because
        OpenAI-style clients routinely send explicit nulls for parameters they do not set.
        Integer fields take integers only (``128.0`` is refused), as on the OpenAI routes:
        one rule for every surface (docs/reliability.md); float fields take integers too.
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(
                f"sampling_params must be an object/dict, got {type(d).__name__}"
            )
        accepted = [f.name for f in dataclasses.fields(cls)]
        kwargs: dict[str, Any] = {}
        for key, value in _resolve_aliases(d).items():
            if key in _SGLANG_ONLY:
                refusal = _SGLANG_ONLY[key].refusal(value)
                if refusal is not None:
                    raise ValueError(f"sampling_params.{key}: {refusal} (got {_describe(value)})")
                continue
            if key not in _FIELD_CHECKERS:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; accepted parameters: "
                    + ", ".join(accepted)
                )
            if value is None and key not in _OPTIONAL_FIELDS:
                continue
            kwargs[key] = _FIELD_CHECKERS[key](key, value)
        return cls(**kwargs)

    # ------------------------------------------------------------------ checks

    def verify(self, vocab_size: int, context_len: int | None = None) -> None:
        """Check value ranges; raises ValueError naming the field and the allowed values."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if context_len is not None and self.max_new_tokens > context_len:
            raise ValueError(
                f"max_new_tokens must be <= the context length {context_len}, "
                f"got {self.max_new_tokens}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(
                f"top_k must be -1 (whole vocabulary) or >= 1, got {self.top_k}"
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.stop_token_ids is not None:
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids, "
                                 f"got {len(self.stop_token_ids)}")
            for tid in self.stop_token_ids:
                if not (0 <= tid < vocab_size):
                    raise ValueError(
                        f"stop_token_ids must be token ids in [0, {vocab_size}), got {tid}"
                    )
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(stops)}"
            )
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty, got an empty string")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, "
                             f"got {max(len(s) for s in stops)}")
        if self.seed is not None and not (0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        given = [k for k in _CONSTRAINT_FIELDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(_CONSTRAINT_FIELDS)}; got "
                             f"{' and '.join(given)}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name, neutral in _UNSUPPORTED_NEUTRAL.items():
            value = getattr(self, name)
            if value != neutral:
                raise ValueError(
                    f"{name} is not supported by this engine; only {neutral} is accepted, "
                    f"got {value}"
                )

    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, if any (after ``verify``)."""
        return next(((k, getattr(self, k)) for k in _CONSTRAINT_FIELDS
                     if getattr(self, k) is not None), None)

    def normalize(self) -> SamplingParams:
        """Canonicalise in place (idempotent) and return self.

        - ``stop`` becomes a list of strings (``None`` -> ``[]``, ``"x"`` -> ``["x"]``).
        - A temperature below ``SAMPLING_EPS`` means greedy decoding: ``top_k`` is set to 1 so
          every consumer sees one unambiguous greedy form. The temperature itself is kept (the
          device sampler also treats it as greedy), which keeps ``to_dict`` truthful.
        - ``top_k == -1`` stays -1 here; the sampler maps it (and any ``top_k >= vocab``) to the
          vocabulary size, which only it knows for certain (padded vocabularies).
        """
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.is_greedy:
            self.top_k = 1
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _resolve_aliases(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with SGLang's spellings renamed to ours; both given, they must agree."""
    out = dict(d)
    for alias, name in _ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if out.get(name) is not None and value is not None and out[name] != value:
            raise ValueError(f"{name} ({out[name]!r}) and its alias {alias} ({value!r}) "
                             f"disagree; give one of them")
        if out.get(name) is None:
            out[name] = value
    return out


# ---------------------------------------------------------------------- type checkers
# Each takes (field name, value) and returns the value in its canonical Python type, or raises a
# ValueError naming the field and the expected type. bool is rejected wherever a number is
# expected: it is an int subclass in Python, but ``"max_new_tokens": true`` is a client bug.


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise ValueError(f"{name} must be an integer, got {_describe(value)}")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_describe(value)}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    # numpy.bool_ is not a bool subclass; accept it by duck-typing on its type name.
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{name} must be a boolean (true/false), got {_describe(value)}")


def _check_optional_int(name: str, value: Any) -> int | None:
    return None if value is None else _check_int(name, value)


def _check_stop(name: str, value: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return list(value)
    raise ValueError(f"{name} must be a string or a list of strings, got {_describe(value)}")


def _check_token_ids(name: str, value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of integers, got {_describe(value)}")
    try:
        return [_check_int(name, v) for v in value]
    except ValueError:
        raise ValueError(f"{name} must be a list of integers, got {_describe(value)}") from None


def _check_grammar_text(name: str, value: Any) -> str | None:
    """A constraint's text; a JSON schema may also come as an object (kept as its JSON)."""
    if value is None or isinstance(value, str):
        return value
    if name == "json_schema" and isinstance(value, dict):
        return json.dumps(value)
    raise ValueError(f"{name} must be a string, got {_describe(value)}")


_CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")
_FIELD_CHECKERS = {
    "max_new_tokens": _check_int,
    "temperature": _check_float,
    "top_p": _check_float,
    "top_k": _check_int,
    "min_p": _check_float,
    "stop": _check_stop,
    "stop_token_ids": _check_token_ids,
    "ignore_eos": _check_bool,
    "skip_special_tokens": _check_bool,
    "seed": _check_optional_int,
    "n": _check_int,
    "frequency_penalty": _check_float,
    "presence_penalty": _check_float,
    "repetition_penalty": _check_float,
    **dict.fromkeys(_CONSTRAINT_FIELDS, _check_grammar_text),
}
# Fields whose None is a real value rather than "use the default" (here both mean the same, but
# passing None through keeps from_dict's output equal to the input).
_OPTIONAL_FIELDS = frozenset({"stop", "stop_token_ids", "seed", *_CONSTRAINT_FIELDS})

assert set(_FIELD_CHECKERS) == {f.name for f in dataclasses.fields(SamplingParams)}
