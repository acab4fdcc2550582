"""Every message that crosses a process boundary (pickled over ZMQ), built with keywords."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sgl_jax.srt.sampling.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    """A generate request as the user gives it: one prompt or a batch of them."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_routed_experts: bool | list[bool] = False
    routed_experts_start_len: int | list[int | None] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' (a prompt) and 'input_ids'")
        if self.text is not None and not (
            isinstance(self.text, str)
            or (isinstance(self.text, list) and all(isinstance(t, str) for t in self.text))
        ):
            raise ValueError("'text' (the prompt) must be a string or a list of strings")
        if self.input_ids is not None and not isinstance(self.input_ids, list):
            raise ValueError("'input_ids' must be a list of token ids or a list of such lists")

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return len(self.input_ids) == 0 or not isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        return 1 if self.is_single else len(self.text if self.text is not None else self.input_ids)

    def split(self) -> list[GenerateReqInput]:
        """One single-prompt request per prompt; per-request fields may be lists or scalars."""
        if self.is_single:
            return [replace(self, rid=self.rid or uuid.uuid4().hex)]
        n = self.batch_size

        def pick(value: Any, i: int, name: str, list_type: type = list) -> Any:
            if isinstance(value, list_type):
                if len(value) != n:
                    raise ValueError(f"'{name}' has {len(value)} entries for {n} prompts")
                return value[i]
            return value

        return [
            GenerateReqInput(
                text=self.text[i] if self.text is not None else None,
                input_ids=self.input_ids[i] if self.input_ids is not None else None,
                sampling_params=pick(self.sampling_params, i, "sampling_params"),
                rid=pick(self.rid, i, "rid") if self.rid is not None else uuid.uuid4().hex,
                stream=self.stream,
                return_routed_experts=pick(self.return_routed_experts, i, "return_routed_experts"),
                routed_experts_start_len=pick(
                    self.routed_experts_start_len, i, "routed_experts_start_len"
                ),
            )
            for i in range(n)
        ]


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetServerInfoReq:
    pass


@dataclass
class GetServerInfoReqOutput:
    info: dict[str, Any]


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
    output_routed_experts: list[str | None] = field(default_factory=list)
