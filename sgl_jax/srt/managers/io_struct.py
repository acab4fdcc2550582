"""Every message that crosses a process boundary (pickled over ZMQ), built with keywords; the
control operations and their replies are in ``control.py``."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from sgl_jax.srt.managers.logprob_record import LogprobsOut
from sgl_jax.srt.managers.request_options import InvalidRequestError, RequestOptions
from sgl_jax.srt.routed_experts_output import RoutedExpertsOut
from sgl_jax.srt.sampling.sampling_params import SamplingParams

MAX_RID_CHARS = 256


@dataclass
class GenerateReqInput:
    """A generate request as the user gives it: one prompt or a batch of them.

    ``options`` holds the ``RequestOptions`` fields the caller set, by name: a value, or for a
    batch a list of one value per prompt. They are checked per prompt by
    ``RequestOptions.validate`` when the tokenizer manager takes the request.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("give exactly one of 'text' (a prompt) and 'input_ids'")
        if self.text is not None and not (
            isinstance(self.text, str)
            or (isinstance(self.text, list) and all(isinstance(t, str) for t in self.text))
        ):
            raise InvalidRequestError(
                "'text' (the prompt) must be a string or a list of strings", "text"
            )
        if self.input_ids is not None and not isinstance(self.input_ids, list):
            raise InvalidRequestError(
                "'input_ids' must be a list of token ids or a list of such lists", "input_ids"
            )
        if not self.is_single and self.batch_size == 0:
            raise InvalidRequestError(
                "the batch is empty", "text" if self.text is not None else "input_ids"
            )
        unknown = set(self.options) - set(RequestOptions.names())
        if unknown:
            raise InvalidRequestError(
                f"unknown request option(s) {sorted(unknown)}; the options are "
                f"{list(RequestOptions.names())}"
            )

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return len(self.input_ids) == 0 or not isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        return 1 if self.is_single else len(self.text if self.text is not None else self.input_ids)

    def ensure_rids(self) -> list[str]:
        """Request ids in prompt order, made up (uuid4) where the caller gave none.

        Fixed before the request is sent, so that whoever sent it can abort it by id.
        """
        n = self.batch_size
        if self.rid is None:
            self.rid = uuid.uuid4().hex if self.is_single else [uuid.uuid4().hex for _ in range(n)]
        if self.is_single:
            if not isinstance(self.rid, str):
                raise InvalidRequestError("'rid' must be a string for one prompt", "rid")
            rids = [self.rid]
        elif not (isinstance(self.rid, list) and all(isinstance(r, str) for r in self.rid)):
            raise InvalidRequestError(
                "'rid' must be a list of strings (one per prompt) for a batch", "rid"
            )
        elif len(self.rid) != n:
            raise InvalidRequestError(f"'rid' has {len(self.rid)} entries for {n} prompts", "rid")
        else:
            rids = list(self.rid)
        # A rid is echoed in every output of its request (meta_info "id") and in logs.
        if any(not 0 < len(r) <= MAX_RID_CHARS or not r.isprintable() for r in rids):
            raise InvalidRequestError(
                f"'rid' must be 1 to {MAX_RID_CHARS} printable characters", "rid")
        return rids

    def split(self) -> list[GenerateReqInput]:
        """One single-prompt request per prompt; per-prompt fields may be lists or scalars."""
        rids = self.ensure_rids()
        if self.is_single:
            return [self]
        n = self.batch_size

        def pick(value: Any, i: int, name: str) -> Any:
            if isinstance(value, list):
                if len(value) != n:
                    raise InvalidRequestError(
                        f"'{name}' has {len(value)} entries for {n} prompts", name
                    )
                return value[i]
            return value

        return [
            GenerateReqInput(
                text=self.text[i] if self.text is not None else None,
                input_ids=self.input_ids[i] if self.input_ids is not None else None,
                sampling_params=pick(self.sampling_params, i, "sampling_params"),
                rid=rids[i],
                stream=self.stream,
                options={k: pick(v, i, k) for k, v in self.options.items()},
            )
            for i in range(n)
        ]

    def shape_results(self, results: list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]]:
        """The final results as the caller gets them: the dict of a single prompt, or a list
        in prompt order (results of a batch carry their prompt's ``index``)."""
        if self.is_single:
            return results[0]
        return order_results(results)


def order_results(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Results of a batch, which finish in any order, in prompt order (by ``index``)."""
    return sorted(results, key=lambda r: r.get("index", 0))


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    options: RequestOptions = field(default_factory=RequestOptions)  # validated
    # Constrained decoding: the validated llguidance grammar (constrained/grammar.py).
    grammar: str | None = None


@dataclass
class AbortReq:
    rid: str


class ReqOutput(NamedTuple):
    """One request's new output since its previous message.

    The scheduler (``OutputSender``) gives each as its values (``BatchTokenIDOut.of_values``);
    the detokenizer reads the ids, ``stop`` and ``skip_special_tokens`` and fills ``text``
    (``BatchTokenIDOut.with_text``), passing everything else through; the tokenizer manager
    reads the records (``outputs``). Each optional feature is ONE payload, None when the
    request did not ask, and formats itself for the response where the tokenizer manager
    builds ``meta_info`` (so a new feature is a field here and its payload type, not a
    column on every hop).

    A named tuple, immutable: a batch turns records into columns and back with ``zip`` (no
    per-field attribute lookups), on every hop of every streamed step.
    """

    rid: str  # the per-submission key the scheduler and detokenizer know
    new_ids: list[int]  # output ids since the request's previous message
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int  # so far
    cached_tokens: int
    stop: tuple[str, ...]  # stop strings, trimmed from the text by the detokenizer
    skip_special_tokens: bool
    text: str = ""  # the text that became final with these ids (the detokenizer's)
    # Routed-experts rows (and routing weights) completed since the previous message;
    # arrays travel out of band (transport.py).
    routed: RoutedExpertsOut | None = None
    logprobs: LogprobsOut | None = None  # entries recorded since the previous message
    # When the scheduler took its first output token (time.monotonic(), a system-wide clock
    # on one host): the metrics' time to first token.
    first_token_time: float | None = None
    # Speculative decoding: the verify steps the request has taken part in (None without).
    spec_verify_ct: int | None = None


_FIELD_INDEX = {name: i for i, name in enumerate(ReqOutput._fields)}
_TEXT, _ROUTED = _FIELD_INDEX["text"], _FIELD_INDEX["routed"]
# A record from the tuple of its values with no Python-level call (the generated
# ``ReqOutput(...)`` parses 12 arguments in Python: twice the cost, per request per hop).
_make_record = functools.partial(tuple.__new__, ReqOutput)


class _OutputBatch:
    """The records of some requests, held as records (``outputs``) or as columns: one per
    ``ReqOutput`` field, the routed-experts one packed (``RoutedExpertsOut.pack_column``).

    A batch pickles as its columns (field names and classes once per message, not per
    request) and is received as columns; it builds its records only when they are read. The
    scheduler gives its records as values (``of_values``) and the detokenizer fills the text
    column (``with_text``): neither builds a record, and every payload passes the detokenizer
    as it came.
    """

    __slots__ = ("_outputs", "_columns", "weight_version")

    def __init__(self, outputs: list[ReqOutput], weight_version: str = "0") -> None:
        self._outputs: list[ReqOutput] | None = outputs
        self._columns: list[Sequence[Any]] | None = None
        self.weight_version = weight_version  # of the weights that computed these outputs

    @classmethod
    def of_values(cls: type[_Batch], values: Iterable[tuple[Any, ...]],
                  weight_version: str = "0") -> _Batch:
        """The batch of the records whose values ``values`` holds: per request, a tuple of
        its ``ReqOutput`` fields in order, a payload as the tuple of its own fields. How the
        scheduler gives them, for every streamed request on every step: building the record
        and payload objects there (~0.15 us each) would be a third of its work per request,
        for objects that process never reads."""
        return _batch_of_columns(cls, _columns_of(values), weight_version)

    @property
    def outputs(self) -> list[ReqOutput]:
        """One record per request (built from the columns when first read)."""
        if self._outputs is None:
            columns = list(self._columns)
            columns[_ROUTED] = RoutedExpertsOut.unpack_column(columns[_ROUTED],
                                                              len(columns[0]))
            self._outputs = list(map(_make_record, zip(*columns, strict=True)))
        return self._outputs

    def columns(self, *names: str) -> list[Sequence[Any]]:
        """The columns of the fields ``names`` (not "routed", which travels packed), one
        value per request in order."""
        columns = self._wire_columns()
        return [columns[_FIELD_INDEX[name]] for name in names]

    def _wire_columns(self) -> list[Sequence[Any]]:
        if self._columns is not None:
            return self._columns
        return _columns_of(self._outputs)  # not kept: ``outputs`` is the caller's list

    def __len__(self) -> int:
        return len(self._outputs if self._outputs is not None else self._columns[0])

    def __reduce__(self) -> tuple:
        return _batch_of_columns, (type(self), self._wire_columns(), self.weight_version)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(outputs={self.outputs!r}, " \
               f"weight_version={self.weight_version!r})"


_Batch = TypeVar("_Batch", bound=_OutputBatch)


def _columns_of(values: Iterable[tuple[Any, ...]]) -> list[Sequence[Any]]:
    """Records (or their values) -> one column per ``ReqOutput`` field, the routed one
    packed."""
    columns = list(zip(*values, strict=True)) or [()] * len(ReqOutput._fields)
    if len(columns) != len(ReqOutput._fields):
        raise ValueError(f"a record has {len(columns)} values for {len(ReqOutput._fields)} "
                         "fields")
    columns[_ROUTED] = RoutedExpertsOut.pack_column(columns[_ROUTED])
    return columns


def _batch_of_columns(cls: type[_Batch], columns: list[Sequence[Any]],
                      weight_version: str) -> _Batch:
    """A batch holding ``columns`` (``_columns_of``'s); also how a batch unpickles (a
    module-level function pickles as its name, a bound classmethod as an object)."""
    batch = cls.__new__(cls)
    batch._outputs, batch._columns, batch.weight_version = None, columns, weight_version
    return batch


class BatchTokenIDOut(_OutputBatch):
    """Scheduler -> detokenizer: the new output of some requests (text not yet filled)."""

    __slots__ = ()

    def with_text(self, texts: Sequence[str]) -> BatchStrOut:
        """The same records, their ``text`` filled (one per request, in order)."""
        columns = list(self._wire_columns())
        columns[_TEXT] = texts
        return _batch_of_columns(BatchStrOut, columns, self.weight_version)


class BatchStrOut(_OutputBatch):
    """Detokenizer -> tokenizer manager: the same records, their ``text`` filled."""

    __slots__ = ()
