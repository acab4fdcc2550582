"""Req: a request's state inside the scheduler; ScheduleBatch: the requests of one step.

``ScheduleBatch -> ModelWorkerBatch -> ForwardBatch`` is the only shape change of a batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_jax.srt.forward_batch_info import ForwardMode, LogprobRequest, ModelWorkerBatch
from sgl_jax.srt.managers.logprob_record import LogprobRecord
from sgl_jax.srt.managers.request_options import RequestOptions
from sgl_jax.srt.mem_cache.radix_cache import TreeNode
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.speculative.verify_schedule import VerifyPlan


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_matched_token(token_id: int) -> dict[str, Any]:
    return {"type": "stop", "matched": token_id}


def finish_matched_str(stop: str) -> dict[str, Any]:
    return {"type": "stop", "matched": stop}


def finish_abort(message: str = "aborted") -> dict[str, Any]:
    return {"type": "abort", "message": message}


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    stream: bool = False
    options: RequestOptions = field(default_factory=RequestOptions)  # validated

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    # Memory held: a request slot, and KV slots req_to_token[req_pool_idx, :kv_len].
    req_pool_idx: int | None = None
    kv_len: int = 0  # positions whose K/V are in the cache
    prefix_len: int = 0  # of those, how many belong to the radix tree (locked via last_node)
    last_node: TreeNode | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    inflight: int = 0  # launched steps whose sampled token the host has not processed yet
    admitted: bool = False
    # Its data-parallel attention rank (0 without DP attention), chosen when it arrives and
    # kept for its life: every KV slot it holds is of that rank's allocator.
    dp_rank: int = 0
    # Its rows [start_len, n) once it ends (n: tokens whose routing was computed); set
    # earlier when it is retracted, in case it is aborted while it waits to resume.
    routed_experts: np.ndarray | None = None
    routed_expert_weights: np.ndarray | None = None  # the same rows' weights, when asked
    routed_sent: int = 0  # of its rows from start_len on, how many have been streamed out
    sent_len: int = 0  # output ids already handed to the detokenizer
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None  # time.monotonic() when its first output was taken
    spec_verify_ct: int = 0  # speculative decoding: the verify steps it took part in
    # Its slot of per-request auxiliary state (mem_cache/request_state.py) while it holds
    # memory: EAGLE / NEXTN's next draft tokens live there.
    state_slot: int | None = None
    logprobs: LogprobRecord | None = None  # when it asked (return_logprob)
    # Constrained decoding: its grammar, and its matcher's build until the matcher moves into
    # its state slot (constrained/matchers.py).
    grammar: str | None = None
    grammar_build: Any = None

    def __post_init__(self) -> None:
        self.logprobs = LogprobRecord.for_request(self.options, self.origin_input_ids)

    @property
    def fill_ids(self) -> list[int]:
        """Every token of the sequence so far: prompt, then outputs."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids) - self.inflight, 0)

    def can_grow(self, context_len: int) -> bool:
        """Another token may be sampled, counting the ones still in flight."""
        return (
            self.remaining_new_tokens() > 0 and self.seq_len + self.inflight < context_len
        )


@dataclass
class ScheduleBatch:
    """The requests of one step and, for an extend step, how many new tokens each brings."""

    forward_mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    out_cache_loc: np.ndarray | None  # None: a device-input verify step's, known later
    # Extend steps: whether each request's sampled token is a real output (its prompt is
    # complete after this step) or a chunk boundary to be discarded.
    samples_output: list[bool] = field(default_factory=list)
    capture_routed: bool = False  # whether the step's routed-experts rows go to the host
    # Logits rows whose logprobs to record: (request, row, prompt token), in order; the
    # sampled rows have no prompt token (None: an output), the input-logprob rows a negative
    # row -1 - j, j-th after the padded sampled rows. Set by to_model_worker_batch.
    logprob_rows: list[tuple[Req, int, int | None]] = field(default_factory=list)
    # DP attention: the rank of each request (row), int32 [B]; None without DP attention.
    dp_ranks: np.ndarray | None = None
    # A verify step (speculative decoding): each request's draft tokens, fed after its last
    # token (``extend_lens[i] == 1 + len(drafts[i])``).
    drafts: list[list[int]] | None = None
    # EAGLE: each row's slots for the draft chain's positions after its tokens ([B, steps - 1];
    # held only during the step).
    draft_scratch: np.ndarray | None = None
    # EAGLE / NEXTN verify steps (speculative/device_inputs.py): inputs read on the device,
    # each row's lower bound of its first position and the slots from there ([B, width]).
    # ``out_cache_loc`` is known once the step before it is processed.
    verify_first: np.ndarray | None = None
    verify_slots: np.ndarray | None = None

    @classmethod
    def for_verify(cls, reqs: list[Req], plan: VerifyPlan) -> ScheduleBatch:
        """The verify step of speculative decoding laid out by ``plan``."""
        return cls(ForwardMode.TARGET_VERIFY, reqs, plan.lens, plan.out_cache_loc,
                   [True] * len(reqs), drafts=plan.drafts, draft_scratch=plan.draft_scratch,
                   verify_first=plan.verify_first, verify_slots=plan.verify_slots)

    def to_model_worker_batch(self, vocab_mask: np.ndarray | None = None) -> ModelWorkerBatch:
        """``vocab_mask``: the rows' packed allowed ids (constrained decoding), or None."""
        reqs = self.reqs
        prefix_lens = np.array([r.kv_len for r in reqs], np.int32)
        out_cache_loc = self.out_cache_loc
        if self.forward_mode.is_decode:
            # Each request feeds the token it sampled last, read on the device: it may still
            # be in flight (overlap scheduling).
            input_ids = np.full(len(reqs), -1, np.int32)
        elif self.verify_slots is not None:  # inputs and slots resolved on the device
            prefix_lens = self.verify_first
            input_ids = np.full(sum(self.extend_lens), -1, np.int32)
            out_cache_loc = np.zeros(len(input_ids), np.int32)
        elif self.forward_mode.is_verify:  # the last token (on the host: no overlap), drafts
            input_ids = np.concatenate([
                np.asarray(r.fill_ids[r.kv_len :] + d, np.int32)
                for r, d in zip(reqs, self.drafts, strict=True)
            ])
        else:
            input_ids = np.concatenate([
                np.asarray(r.fill_ids[r.kv_len : r.kv_len + n], np.int32)
                for r, n in zip(reqs, self.extend_lens, strict=True)
            ])
        asks = np.array([r.options.return_routed_experts for r in reqs], bool)
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            req_pool_indices=np.array([r.req_pool_idx for r in reqs], np.int32),
            prefix_lens=prefix_lens,
            extend_lens=np.array(self.extend_lens, np.int32),
            input_ids=input_ids,
            out_cache_loc=out_cache_loc,
            sampling_params=[r.sampling_params for r in reqs],
            seeds=[r.seed for r in reqs],
            steps=[len(r.output_ids) + r.inflight for r in reqs],
            return_routed_experts=bool(asks.any()),
            routed_reqs=None if asks.all() else asks,  # only some ask: copy only theirs
            logprobs=self._plan_logprobs(),
            dp_ranks=self.dp_ranks,
            draft_next_ids=None if self.draft_scratch is None else self._draft_next_ids(),
            draft_scratch=self.draft_scratch,
            verify_slots=self.verify_slots,
            vocab_mask=vocab_mask,
        )

    def _draft_next_ids(self) -> np.ndarray:
        """EAGLE: per row the token after its last one when it is a prompt token (a chunk's
        end), else -1 (the step's sampled token)."""
        out = np.full(len(self.reqs), -1, np.int32)
        if not self.forward_mode.is_verify:
            for i, (r, n) in enumerate(zip(self.reqs, self.extend_lens, strict=True)):
                if r.kv_len + n < r.seq_len:
                    out[i] = r.fill_ids[r.kv_len + n]
        return out

    def record_logprobs(self, logprobs: Any, next_ids: np.ndarray) -> None:
        """Adds the step's logprobs (the step output's ``logprobs``) to its requests' records
        (before their tokens: a request that finishes on this token sends them with it)."""
        lp = {k: np.asarray(v) for k, v in vars(logprobs).items()}
        padded_rows = len(next_ids)
        for req, row, prompt_token in self.logprob_rows:
            if req.finished:  # ended (aborted) while the step ran; nothing more is recorded
                continue
            if row < 0:
                row = padded_rows - 1 - row
            side, token = ("output", next_ids[row]) if prompt_token is None else \
                ("input", prompt_token)
            req.logprobs.add(side, lp["target"][row], token, lp["top_values"][row],
                             lp["top_ids"][row], lp["token_ids"][row])

    def _plan_logprobs(self) -> LogprobRequest | None:
        """The logprob work of this step, and ``logprob_rows`` to record it by."""
        reqs = self.reqs
        if not any(r.logprobs for r in reqs):
            return None
        plan = LogprobRequest(token_ids=[
            r.logprobs.token_ids if r.logprobs else None for r in reqs])
        if self.forward_mode.is_verify:  # the accepted tokens' rows are known after the step
            return plan
        self.logprob_rows = []
        start = 0
        for i, (r, n) in enumerate(zip(reqs, self.extend_lens, strict=True)):
            if r.logprobs is not None:
                if self.samples_output[i] and r.sampling_params.max_new_tokens > 0:
                    self.logprob_rows.append((r, i, None))
                if not self.forward_mode.is_decode:
                    prompt_len = len(r.origin_input_ids)
                    for p in r.logprobs.plan_input(r.kv_len, n, prompt_len):
                        self.logprob_rows.append((r, -1 - len(plan.extra_tokens),
                                                  r.origin_input_ids[p]))
                        plan.extra_tokens.append(start + (p - 1 - r.kv_len))
                        plan.extra_targets.append(r.origin_input_ids[p])
                        plan.extra_temperatures.append(r.sampling_params.temperature)
                        plan.extra_token_ids.append(r.logprobs.token_ids)
            start += n
        return plan
