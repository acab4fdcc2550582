"""The scheduler's side of a verify step: which tokens each request feeds and which KV slots
it writes (``plan``), and what it keeps once the target has verified them (``settle``).

NGRAM proposes drafts on the host and the step feeds them. EAGLE / NEXTN draft inside the
step that computes a request's last token, so their verify step reads its inputs on the
device (speculative/device_inputs.py) and may be launched while its predecessor is still in
flight (overlap scheduling): it then gets the slots of every position it may touch. The draft
tokens the device proposed are kept on the host in the request's state slot
(mem_cache/request_state.py), to know what the next verify step fed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sgl_jax.srt.mem_cache.request_state import SPEC_DRAFTS, spec_drafts_kind
from sgl_jax.srt.speculative.decoding import SpeculativeDecoding
from sgl_jax.srt.speculative.requests import SpecMemory, SpecRequest, StepInFlight
from sgl_jax.srt.speculative.verify import accepted_tokens


@dataclass
class VerifyPlan:
    """A verify step's layout: per request its tokens (``lens``: the last token then its
    drafts) and the KV slots they write; ``out_cache_loc`` is None when the device resolves
    the slots (``verify_first`` / ``verify_slots``, device inputs)."""

    lens: list[int]
    out_cache_loc: np.ndarray | None
    drafts: list[list[int]] | None = None  # NGRAM: the draft tokens fed
    draft_scratch: np.ndarray | None = None
    verify_first: np.ndarray | None = None
    verify_slots: np.ndarray | None = None


class VerifySchedule:
    def __init__(self, speculation: SpeculativeDecoding, memory: SpecMemory, context_len: int,
                 verify_slot_width: int) -> None:
        self.spec = speculation
        self.memory = memory
        self.context_len = context_len
        self.verify_slot_width = verify_slot_width
        self.drafts_table = None
        if speculation.drafts_in_step:
            assert memory.states is not None, "EAGLE / NEXTN keep drafts in state slots"
            memory.states.register(spec_drafts_kind(speculation.num_steps))
            self.drafts_table = memory.states.rows(SPEC_DRAFTS)

    # -- planning -------------------------------------------------------------------------------
    def plan(self, reqs: list[SpecRequest], in_flight: StepInFlight | None,
             settle: Callable[[], None], make_room: Callable[[], None]) -> VerifyPlan | None:
        """The layout of the verify step of ``reqs``, each of which has a decode slot's worth of
        KV available. None when it processed the step in flight (``settle``) or freed memory
        (``make_room``: retract or end a request) instead: the caller schedules again."""
        if self.spec.drafts_in_step:
            return self._plan_device_inputs(reqs, in_flight, settle, make_room)
        return self._plan_host_drafts(reqs)

    def _plan_host_drafts(self, reqs: list[SpecRequest]) -> VerifyPlan:
        """NGRAM: each request's last token and its drafts; when the drafts' KV does not fit,
        no request drafts this step (one slot each fits: the caller made sure)."""
        memory = self.memory
        drafts = [self.spec.drafts(r, self.context_len) for r in reqs]
        need = sum(memory.kv_needed(r.kv_len, 1 + len(d))
                   for r, d in zip(reqs, drafts, strict=True))
        if need > memory.available_kv():
            drafts = [[] for _ in reqs]
        slots = []
        for req, d in zip(reqs, drafts, strict=True):
            got = memory.alloc_kv(req, 1 + len(d))
            assert got is not None, "the verify step's slots were counted"
            memory.assign_kv(req, got)
            slots.append(got)
        return VerifyPlan([1 + len(d) for d in drafts], np.concatenate(slots), drafts=drafts)

    def _plan_device_inputs(self, reqs: list[SpecRequest], in_flight: StepInFlight | None,
                            settle: Callable[[], None],
                            make_room: Callable[[], None]) -> VerifyPlan | None:
        """EAGLE / NEXTN. With a verify step in flight a request's first position is known
        only within the drafts that step may reject: the step gets the slots of every
        position it may touch, allocated past what the request holds. A request whose next
        step would feed fewer drafts once the step in flight is processed (near its token or
        context limit), a step in flight that is not a verify step, or KV that does not fit,
        settles the step in flight first."""
        memory, spec, scratch = self.memory, self.spec, self.spec.scratch
        prev: dict[int, int] = {}  # id(req) -> tokens it brought to the step in flight
        if in_flight is not None:
            if in_flight.forward_mode.is_verify:
                prev = {id(r): n for r, n in zip(in_flight.reqs, in_flight.extend_lens,
                                                  strict=True)}
            if not prev or any(spec.room(r, self.context_len, prev[id(r)]) < spec.num_steps
                               for r in reqs if id(r) in prev):
                settle()
                return None
        # Per request: tokens, the lower bound of its first position, and what it holds now.
        layout = []
        for r in reqs:
            n_prev = prev.get(id(r))
            if n_prev is None:
                layout.append((r, 1 + spec.room(r, self.context_len), r.kv_len, r.kv_len))
            else:  # the step in flight keeps 1 to n_prev of its tokens; it holds its scratch
                layout.append((r, 1 + spec.num_steps, r.kv_len - n_prev + 1, r.kv_len + scratch))
        need = sum(memory.kv_needed(held, r.kv_len + n + scratch - held)
                   for r, n, _, held in layout)
        if need > memory.available_kv():
            if prev:
                settle()
                return None
            layout = [(r, 1, r.kv_len, r.kv_len) for r in reqs]  # no drafts this step
            if sum(memory.kv_needed(r.kv_len, 1 + scratch) for r in reqs) > memory.available_kv():
                make_room()  # EAGLE's scratch does not fit either
                return None
        spec.overlapped_steps += bool(prev)
        table = memory.req_to_token_pool.req_to_token
        slots = np.zeros((len(reqs), self.verify_slot_width), np.int32)
        for i, (r, n, first, held) in enumerate(layout):
            end = r.kv_len + n + scratch
            got = memory.extend_held_kv(r, held, end - held)
            assert got is not None, "the verify step's slots were counted"
            slots[i, : end - first] = table[r.req_pool_idx, first:end]
        return VerifyPlan(
            [n for _, n, _, _ in layout], None,
            draft_scratch=np.zeros((len(reqs), scratch), np.int32),
            verify_first=np.array([first for _, _, first, _ in layout], np.int32),
            verify_slots=slots)

    def verified_slots(self, reqs: list[SpecRequest], lens: list[int]) -> np.ndarray:
        """The KV slots a device-input verify step wrote, once every step before it is
        processed: a request's tokens start at its last token's position. A request that
        ended meanwhile (its slots released) points at the padding slot, which no request
        holds."""
        table = self.memory.req_to_token_pool.req_to_token
        locs = []
        for req, n in zip(reqs, lens, strict=True):
            if req.req_pool_idx is None or req.finished:
                locs.append(np.zeros(n, np.int32))
            else:
                first = req.seq_len - 1
                locs.append(table[req.req_pool_idx, first : first + n].astype(np.int32))
        return np.concatenate(locs)

    # -- drafts the device proposed -------------------------------------------------------------
    def keep_drafts(self, req: SpecRequest, drafts: np.ndarray) -> None:
        """The draft tokens the step that computed ``req``'s last token proposed."""
        self.drafts_table[req.state_slot, : len(drafts)] = drafts

    def kept_drafts(self, req: SpecRequest, n: int) -> list[int]:
        return self.drafts_table[req.state_slot, :n].tolist()

    # -- results --------------------------------------------------------------------------------
    def settle(self, reqs: list[SpecRequest], lens: list[int],
               fed_drafts: list[list[int]] | None, all_ids: np.ndarray,
               drafts: np.ndarray | None, logprobs: dict[str, np.ndarray] | None,
               check_finish: Callable[[SpecRequest], None]) -> tuple[list[SpecRequest], int]:
        """Each request keeps the drafts the target confirmed and the target's next token,
        stopping at a token that ends it; the KV of every later position (rejected drafts)
        goes back, so their routed rows are never read and never enter the prefix cache.
        Returns the requests that changed (the caller ends the finished ones) and the
        tokens gained."""
        gained: list[int] = []
        changed: list[SpecRequest] = []
        scratch = self.spec.scratch
        start = 0
        fed_drafts = fed_drafts or [None] * len(reqs)
        for i, (req, fed, n) in enumerate(zip(reqs, fed_drafts, lens, strict=True)):
            first, start = start, start + n
            if req.finished:  # aborted while the step ran
                continue
            req.inflight -= 1
            req.spec_verify_ct += 1
            if fed is None:  # device inputs: the drafts the step before this one proposed
                fed = self.kept_drafts(req, n - 1)
            tokens = accepted_tokens(fed, all_ids[first : first + n].tolist())
            for j, token in enumerate(tokens):
                if logprobs is not None and req.logprobs is not None:
                    t = first + j
                    req.logprobs.add("output", logprobs["target"][t], token,
                                     logprobs["top_values"][t], logprobs["top_ids"][t],
                                     logprobs["token_ids"][t])
                req.output_ids.append(token)
                check_finish(req)
                if req.finished:
                    break
            gained.append(j + 1)
            # Every position but the last token's holds KV (the invariant of a decode step);
            # a successor in flight (overlap) holds its own positions past that, and its
            # scratch: ``kv_len`` counted this step's n positions, of which j + 1 are kept.
            successor = req.inflight > 0 and not req.finished
            kept = req.kv_len - (n - j - 1) if successor else req.seq_len - 1
            self.memory.shrink_kv(req, kept, held=req.kv_len + scratch,
                                  reserve=scratch if successor else 0)
            if drafts is not None:
                self.keep_drafts(req, drafts[i])
            changed.append(req)
        self.spec.record(gained)
        return changed, sum(gained)
