"""The options of a generate request besides its prompt and sampling parameters: declared once.

``RequestOptions`` is the one declaration of these fields and ``validate`` the one check. Every
surface derives from it: the native ``/generate`` body and the OpenAI bodies declare a field
per option (``option_fields``), ``GenerateReqInput`` carries them by name (a value, or a list
of one value per prompt for a batch), ``Engine.generate`` accepts them as keywords, and the
message to the scheduler and the scheduler's ``Req`` hold the validated ``RequestOptions``.
Adding an option is adding a field here (and its check to ``validate``).

Bad values raise ``InvalidRequestError`` (a ValueError naming the field and what to change):
the Engine raises it to the caller, HTTP answers 400 with an OpenAI-style error body.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sgl_jax.srt.routed_experts_codec import (
    ROUTED_EXPERT_WEIGHTS_DTYPES,
    ROUTED_EXPERTS_DTYPES,
    max_num_experts,
)
from sgl_jax.srt.sampling.sampling_params import MAX_TOKEN_IDS_LOGPROB, MAX_TOP_LOGPROBS

# Bad values are echoed in errors through a bounded repr: a value of a 32 MiB body is neither
# rendered whole nor sent back whole.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 6
_REPR.maxlevel = 2
_shown = _REPR.repr

# How a response hands over the routed-experts arrays (``routed_experts_format``).
ROUTED_EXPERTS_FORMATS = ("base64", "numpy")


class InvalidRequestError(ValueError):
    """Bad input, with the request field it is about (the ``param`` of an OpenAI error)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestOptions:
    # Return the routed experts (the router's top-k expert ids, per token and layer); needs
    # the server started with --enable-return-routed-experts.
    return_routed_experts: bool = False
    # Return only rows [s, seq_len - 1): 0 <= s <= prompt tokens; needs return_routed_experts.
    routed_experts_start_len: int | None = None
    # Wire dtype of the ids: int32, int16, uint16 or uint8 (unsigned ones mark a layer without
    # a router with their maximum); None: the server's --routed-experts-dtype. It must hold
    # every expert id plus the no-router marker.
    routed_experts_dtype: str | None = None
    # Also return the router's top-k weights of every row (same shape and order as the ids);
    # needs return_routed_experts.
    return_routed_expert_weights: bool = False
    # Their wire dtype: float32 (default) or float16; needs return_routed_expert_weights.
    routed_expert_weights_dtype: str | None = None
    # Return the prompt's rows apart, as ``prompt_routed_experts``, once per distinct prompt of
    # the request (in the first choice that has it), and per choice only the generated rows;
    # needs return_routed_experts.
    routed_experts_split: bool = False
    # How the arrays (ids and weights) are handed back: "base64" (the default, SGLang's) or
    # "numpy" (Engine: numpy arrays; HTTP: raw bytes in a MessagePack body, asked for by
    # 'Accept: application/msgpack', which sets it). Applies to the routed-experts keys only.
    routed_experts_format: str | None = None
    # Return the log-probabilities of the generated tokens (meta_info output_token_logprobs),
    # SGLang's spelling; the distribution is log_softmax(logits / temperature).
    return_logprob: bool = False
    # First prompt position with an input logprob (input_token_logprobs): 0 <= s < prompt
    # tokens; None or -1: none. Needs return_logprob.
    logprob_start_len: int | None = None
    # How many most likely tokens (with their logprobs) per position, 0..20. Needs
    # return_logprob.
    top_logprobs_num: int = 0
    # Ids whose logprobs are returned at every position (at most 64). Needs return_logprob.
    token_ids_logprob: list[int] | None = None
    # Add each logprob entry's token text (else None). Needs return_logprob.
    return_text_in_logprobs: bool = False

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def pick(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        """The option entries of ``values`` (e.g. a request body or keyword arguments)."""
        return {k: v for k, v in values.items() if k in cls.defaults()}

    @property
    def start_len(self) -> int:
        """First row returned (``routed_experts_start_len``, 0 when not given)."""
        return self.routed_experts_start_len or 0

    @property
    def dtype(self) -> str:
        """The wire dtype of the rows (resolved by ``validate``; int32 before)."""
        return self.routed_experts_dtype or "int32"

    @property
    def raw_routed_experts(self) -> bool:
        """The routed-experts arrays go out as numpy arrays, not base64."""
        return self.routed_experts_format == "numpy"

    @property
    def input_logprob_start(self) -> int | None:
        """First prompt position with an input logprob, or None (validated options)."""
        s = self.logprob_start_len
        return None if not self.return_logprob or s is None or s < 0 else s

    def validate(
        self, prompt_len: int, routed_experts_enabled: bool, num_experts: int | None = None,
        default_dtype: str = "int32", weights_enabled: bool = True,
        vocab_size: int | None = None,
    ) -> RequestOptions:
        """Checks the options of one prompt of ``prompt_len`` tokens for a model of
        ``num_experts`` experts; returns them with the dtype resolved (``default_dtype``, the
        server's, when not given)."""
        want = _boolean(self, "return_routed_experts")
        if want and not routed_experts_enabled:
            raise InvalidRequestError(
                "return_routed_experts needs the server started with "
                "--enable-return-routed-experts (Engine(enable_return_routed_experts=True))",
                "return_routed_experts",
            )
        start = self.routed_experts_start_len
        if start is not None:
            if isinstance(start, bool) or not isinstance(start, int):
                raise InvalidRequestError(
                    f"'routed_experts_start_len' must be an integer, not {_shown(start)}",
                    "routed_experts_start_len",
                )
            if not want:
                raise InvalidRequestError(
                    "'routed_experts_start_len' needs return_routed_experts=true",
                    "routed_experts_start_len",
                )
            if not 0 <= start <= prompt_len:
                raise InvalidRequestError(
                    f"routed_experts_start_len={start} is outside [0, {prompt_len}] "
                    f"(0 to the prompt's token count)",
                    "routed_experts_start_len",
                )
        given = self.routed_experts_dtype
        dtype = default_dtype if given is None else given
        what = "routed_experts_dtype" if given is not None else "the server's --routed-experts-dtype"
        if not isinstance(dtype, str) or dtype not in ROUTED_EXPERTS_DTYPES:
            raise InvalidRequestError(
                f"{what}={_shown(dtype)} is not a routed-experts dtype; use one of "
                f"{', '.join(ROUTED_EXPERTS_DTYPES)}",
                "routed_experts_dtype",
            )
        if given is not None and not want:
            raise InvalidRequestError(
                "'routed_experts_dtype' needs return_routed_experts=true", "routed_experts_dtype"
            )
        if want and num_experts is not None and num_experts > max_num_experts(dtype):
            raise InvalidRequestError(
                f"{what}={dtype} holds at most {max_num_experts(dtype)} expert ids (with the "
                f"no-router marker); this model has {num_experts} experts: use "
                f"{_narrowest_for(num_experts)} or wider",
                "routed_experts_dtype",
            )
        weights = _boolean(self, "return_routed_expert_weights")
        if weights and not want:
            raise InvalidRequestError(
                "'return_routed_expert_weights' needs return_routed_experts=true",
                "return_routed_expert_weights",
            )
        if weights and not weights_enabled:
            raise InvalidRequestError(
                "return_routed_expert_weights needs the server started with "
                "--enable-return-routed-expert-weights "
                "(Engine(enable_return_routed_expert_weights=True))",
                "return_routed_expert_weights",
            )
        wdtype = self.routed_expert_weights_dtype
        if wdtype is not None:
            if not isinstance(wdtype, str) or wdtype not in ROUTED_EXPERT_WEIGHTS_DTYPES:
                raise InvalidRequestError(
                    f"routed_expert_weights_dtype={_shown(wdtype)}; use one of "
                    f"{', '.join(ROUTED_EXPERT_WEIGHTS_DTYPES)}",
                    "routed_expert_weights_dtype",
                )
            if not weights:
                raise InvalidRequestError(
                    "'routed_expert_weights_dtype' needs return_routed_expert_weights=true",
                    "routed_expert_weights_dtype",
                )
        if _boolean(self, "routed_experts_split") and not want:
            raise InvalidRequestError(
                "'routed_experts_split' needs return_routed_experts=true", "routed_experts_split"
            )
        fmt = self.routed_experts_format
        if fmt is not None and fmt not in ROUTED_EXPERTS_FORMATS:
            raise InvalidRequestError(
                f"routed_experts_format={_shown(fmt)}; use one of {', '.join(ROUTED_EXPERTS_FORMATS)}",
                "routed_experts_format")
        self._validate_logprobs(prompt_len, vocab_size)
        return dataclasses.replace(
            self, routed_experts_dtype=dtype,
            token_ids_logprob=None if self.token_ids_logprob is None
            else list(self.token_ids_logprob),
        )

    def _validate_logprobs(self, prompt_len: int, vocab_size: int | None) -> None:
        asked = _boolean(self, "return_logprob")
        _boolean(self, "return_text_in_logprobs")
        given = {
            "logprob_start_len": self.logprob_start_len is not None,
            "top_logprobs_num": self.top_logprobs_num != 0,
            "token_ids_logprob": self.token_ids_logprob is not None,
            "return_text_in_logprobs": self.return_text_in_logprobs,
        }
        for name, set_ in given.items():
            if set_ and not asked:
                raise InvalidRequestError(f"'{name}' needs return_logprob=true", name)
        start = self.logprob_start_len
        if start is not None and (
            not _is_int(start) or not (start == -1 or 0 <= start < prompt_len)
        ):
            raise InvalidRequestError(
                f"logprob_start_len={_shown(start)} must be -1 (no input logprobs) or in "
                f"[0, {prompt_len}) (a position of the prompt)", "logprob_start_len")
        top = self.top_logprobs_num
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs_num={_shown(top)} must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                "top_logprobs_num")
        ids = self.token_ids_logprob
        if ids is not None:
            if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                raise InvalidRequestError("'token_ids_logprob' must be a list of token ids",
                                          "token_ids_logprob")
            if len(ids) > MAX_TOKEN_IDS_LOGPROB:
                raise InvalidRequestError(
                    f"'token_ids_logprob' has {len(ids)} ids; at most "
                    f"{MAX_TOKEN_IDS_LOGPROB} are allowed", "token_ids_logprob")
            bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"'token_ids_logprob' holds {bad[0]}, outside the vocabulary "
                    f"[0, {vocab_size})", "token_ids_logprob")

    @property
    def weights_dtype(self) -> str:
        return self.routed_expert_weights_dtype or "float32"


def _narrowest_for(num_experts: int) -> str:
    fits = [d for d in ROUTED_EXPERTS_DTYPES if max_num_experts(d) >= num_experts]
    return min(fits, key=lambda d: (max_num_experts(d), d.startswith("u")))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _boolean(options: RequestOptions, name: str) -> bool:
    """The option ``name``, which must be a JSON boolean (no 0/1 or "true" coercion)."""
    value = getattr(options, name)
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be true or false, not {_shown(value)}", name)
    return value


def option_fields() -> dict[str, tuple[Any, Any]]:
    """The options as pydantic field definitions (name -> (type, default)) for an HTTP body.

    Typed ``Any`` on purpose: values are checked by ``RequestOptions.validate`` (the one check,
    shared with the Engine), and the native batch body may give a list of one value per prompt.
    """
    return {name: (Any, default) for name, default in RequestOptions.defaults().items()}
