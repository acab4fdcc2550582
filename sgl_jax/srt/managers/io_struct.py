"""Every message that crosses a process boundary (pickled over ZMQ), built with keywords; the
control operations and their replies are in ``control.py``."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_jax.srt.managers.request_options import InvalidRequestError, RequestOptions
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


@dataclass
class AbortReq:
    rid: str


@dataclass
class BatchTokenIDOut:
    """Scheduler -> detokenizer: new output ids (and final state) of some requests."""

    rids: list[str]
    new_output_ids: list[list[int]]
    finished_reasons: list[dict | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    stop_strs: list[list[str]]
    skip_special_tokens: list[bool]
    output_routed_experts: list[np.ndarray | None] = field(default_factory=list)
    # The same rows' routing weights (float32 or float16), for requests that asked.
    output_routed_expert_weights: list[np.ndarray | None] = field(default_factory=list)
    weight_version: str = "0"  # of the weights that computed these outputs
    # Per request: its logprob entries since its previous message (LogprobRecord.take_new),
    # or None when it did not ask.
    output_logprobs: list[dict[str, list] | None] = field(default_factory=list)
    # Per request: when the scheduler took its first output token (time.monotonic(), a
    # system-wide clock on one host), or None: the metrics' time to first token.
    first_token_times: list[float | None] = field(default_factory=list)


@dataclass
class BatchStrOut:
    """Detokenizer -> tokenizer manager: new text of some requests."""

    rids: list[str]
    output_strs: list[str]
    new_output_ids: list[list[int]]
    finished_reasons: list[dict | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # Rows as the scheduler sent them (out of band; base64 only in the response).
    output_routed_experts: list[np.ndarray | None] = field(default_factory=list)
    output_routed_expert_weights: list[np.ndarray | None] = field(default_factory=list)
    weight_version: str = "0"
    output_logprobs: list[dict[str, list] | None] = field(default_factory=list)
    first_token_times: list[float | None] = field(default_factory=list)  # as above
