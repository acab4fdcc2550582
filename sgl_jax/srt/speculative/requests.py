"""What speculative decoding's scheduling reads and calls: a request and its memory, as
protocols. The scheduler's ``Req`` and ``ReqMemory`` satisfy them; speculative code never
imports the scheduler's types (imports point down: managers -> speculative)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.request_state import RequestStateTable
from sgl_jax.srt.sampling.sampling_params import SamplingParams


class SpecRequest(Protocol):
    """A request as speculative decoding sees it."""

    rid: str
    sampling_params: SamplingParams
    output_ids: list[int]
    req_pool_idx: int | None
    state_slot: int | None
    kv_len: int
    inflight: int
    spec_verify_ct: int
    logprobs: Any  # a LogprobRecord when the request asked for logprobs, else None

    @property
    def fill_ids(self) -> list[int]: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def finished(self) -> bool: ...


class SpecMemory(Protocol):
    """The KV memory of the requests a verify step holds (one rank: speculation runs without
    DP attention)."""

    req_to_token_pool: ReqToTokenPool
    states: RequestStateTable | None

    def kv_needed(self, kv_len: int, n: int) -> int: ...
    def available_kv(self) -> int: ...
    def alloc_kv(self, req: Any, n: int) -> np.ndarray | None: ...
    def assign_kv(self, req: Any, slots: np.ndarray) -> None: ...
    def extend_held_kv(self, req: Any, held: int, n: int) -> np.ndarray | None: ...
    def shrink_kv(self, req: Any, kv_len: int, held: int | None = None,
                  reserve: int = 0) -> None: ...


class StepInFlight(Protocol):
    """The launched step the host has not processed yet."""

    forward_mode: ForwardMode
    reqs: list[Any]
    extend_lens: list[int]
