"""The scheduler process: owns JAX, the model and all KV memory; runs continuous batching.

Loop: recv -> schedule (``prefill() or decode()``) -> run -> process results -> send outputs.
Prefill batches come first: waiting requests are admitted FIFO within a token budget
(``chunked_prefill_size``), a prompt longer than the budget is prefilled in chunks, and a
request reuses the longest cached prefix of its tokens. When a decode step cannot get KV
slots, the newest requests are retracted (their memory freed, their progress kept) and
later resumed by a prefill of everything they have so far.

Data-parallel attention (``--enable-dp-attention --dp-size D``): this one scheduler gives each
new request a rank (``DPBalancer``) that it keeps for its life, and everything above holds
per rank: each rank has its own KV allocator and radix tree (``RankedMemory``), its own token
budget, KV reservation, part-way prefilled prompt and retractions. One step holds every rank's
rows in one mode: an extend step when some rank has prefill work (ranks without are idle in
it), else a decode step of every rank's running requests. With D == 1 this is the scheduler it
always was.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

import numpy as np
import zmq
from jax.sharding import Mesh

from sgl_jax.srt.bounded_text import bound_message
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.layers.moe.routed_experts_capturer import set_global_experts_capturer
from sgl_jax.srt.managers.control import (
    ControlOp,
    ControlReply,
    ExpertRecorder,
    UpdateWeights,
    UpdateWeightsReqOutput,
    memory_released_message,
)
from sgl_jax.srt.managers.dp_balancer import DPBalancer, RankCounts
from sgl_jax.srt.managers.finish_checker import FinishChecker
from sgl_jax.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sgl_jax.srt.managers.multi_node import LeaderRunner, exit_on_fatal, open_leader_channel
from sgl_jax.srt.managers.output_sender import OutputSender
from sgl_jax.srt.managers.req_memory import RankedMemory, ReqMemory
from sgl_jax.srt.managers.schedule_batch import Req, ScheduleBatch, finish_abort, finish_length
from sgl_jax.srt.managers.shm_arena import ArenaWriter
from sgl_jax.srt.managers.transport import SideSender
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.model_executor.model_runner import ModelRunner, StepOutput
from sgl_jax.srt.model_executor.weight_updater import check_compatible
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.speculative.decoding import SpeculativeDecoding
from sgl_jax.srt.speculative.verify import accepted_tokens
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.srt.utils import (
    configure_logging,
    enable_compilation_cache,
    report_startup,
    watch_parent,
)

logger = logging.getLogger(__name__)

# Future tokens of running requests are reserved up to this many each when admitting new
# requests; beyond it, retraction handles the rare request that really grows that long.
RESERVE_CLIP = 256


class StepStats:
    """Wall time of whole scheduler steps (schedule + run + process), per forward mode."""

    def __init__(self) -> None:
        self.data = {mode.name.lower(): {"steps": 0, "seconds": 0.0, "tokens": 0}
                     for mode in ForwardMode}

    def record(self, batch: ScheduleBatch, seconds: float) -> None:
        entry = self.data[batch.forward_mode.name.lower()]
        entry["steps"] += 1
        entry["seconds"] += seconds
        entry["tokens"] += sum(batch.extend_lens)


class Scheduler:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs,
                 mesh: Mesh | None = None) -> None:
        self.server_args = server_args
        self.model_config = ModelConfig.from_hf(server_args.model_path, server_args.context_length)
        self.tokenizer = Tokenizer.from_pretrained(
            server_args.tokenizer_path or self.model_config.model_path
        )
        # Multi-node: the followers' hello comes first (before any JAX work), then every
        # node builds the same runner and precompiles the same shapes in the same order.
        channel = None
        if server_args.nnodes > 1:
            channel = open_leader_channel(server_args, self.model_config)
        self.runner = ModelRunner(server_args, self.model_config, mesh=mesh)
        if not server_args.disable_precompile:
            self.runner.precompile()
        # What changes the runner's device state goes through here (to every node).
        self.node = LeaderRunner(self.runner, channel)
        # get_global_experts_capturer() in this scheduler's thread.
        set_global_experts_capturer(self.runner.capturer)
        pools = self.runner.memory_pools()
        # One ReqMemory per DP attention rank (one without DP attention), over the rank's KV
        # allocator with a radix tree of its own.
        self.memory = RankedMemory([
            ReqMemory(pools.req_to_token, allocator,
                      RadixCache(allocator, disable=server_args.disable_radix_cache,
                                 page_size=server_args.page_size),
                      pools.routed_rows)
            for allocator in pools.kv_allocators
        ])
        self.dp_size = len(self.memory)
        self.balancer = DPBalancer(server_args.load_balance_method, self.dp_size)
        self.chunk_budget = server_args.chunked_prefill_size  # tokens per rank per step
        self.max_running = self.runner.max_running_requests  # request slots of all ranks
        self.rank_max_running = -(-self.max_running // self.dp_size)
        self.context_len = self.model_config.context_len
        self.finish_checker = FinishChecker(
            set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids),
            self.context_len, self.tokenizer,
        )
        self.seed_rng = np.random.default_rng(server_args.random_seed)

        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Rank -> the request of that rank whose prompt is part-way prefilled (one at most:
        # a prompt is cut where its rank's token budget ends).
        self.chunked: dict[int, Req] = {}
        self.num_retractions = 0
        self.num_generated_tokens = 0
        self.step_stats = StepStats()
        self.overlap = not server_args.disable_overlap_schedule
        self.pending: tuple[ScheduleBatch, StepOutput] | None = None  # launched, unprocessed
        self.paused = False  # /pause_generation: no step is launched; every request waits
        self.weight_updates = 0
        self.weight_version = "0"
        # A weight update waiting for the requests that started on the old weights to finish.
        self.update: UpdateWeights | None = None
        self.speculation = SpeculativeDecoding.create(server_args)

        self.ctx = ctx = zmq.Context(2)
        self.recv_socket = ctx.socket(zmq.PULL)
        self.recv_socket.bind(port_args.scheduler_ipc)
        self.send_socket = ctx.socket(zmq.PUSH)
        self.send_socket.connect(port_args.detokenizer_ipc)
        # Large routed-experts arrays go straight to the tokenizer manager (transport.py).
        self.side = (SideSender(ctx, port_args.tokenizer_ipc,
                                arena=ArenaWriter.create(server_args.routed_experts_shm_mb))
                     if server_args.enable_return_routed_experts else None)
        self.outputs = OutputSender(self.send_socket, server_args.stream_interval,
                                    routed_rows_of=self.memory.routed_rows_of,
                                    speculative=self.speculation is not None, side=self.side)
        self._step_started = time.perf_counter()

    # -- loop -----------------------------------------------------------------------------------
    def event_loop(self, stop: threading.Event | None = None) -> None:
        """Steps until ``stop`` is set (a thread of the caller's process) or forever."""
        while stop is None or not stop.is_set():
            self.run_step()

    def close(self) -> None:
        """Releases the sockets (and the followers of a multi-node job); from the loop's
        thread, once it has stopped."""
        self.node.close()
        self.recv_socket.close(linger=0)
        self.send_socket.close(linger=0)
        if self.side is not None:
            self.side.close()
        self.ctx.term()

    def run_step(self) -> ScheduleBatch | None:
        """recv -> schedule -> launch -> process; returns the batch launched, if any.

        With overlap (the default) a step's results are processed after the next step has been
        launched, so the host's bookkeeping runs while the device computes: a decode step
        reads its input tokens from the device (the next-inputs buffer), not from the host;
        so does an EAGLE / NEXTN verify step (speculative/device_inputs.py).
        So at most one step is in flight (``pending``) between two calls.
        """
        for msg in self.recv_requests():
            self.process_input(msg)
        if self.update is not None and not self._started_requests():
            self.drain()
            self.apply_weight_update()
        if self.paused:
            self.drain()
            return None
        if self.speculation is not None and self.chunked:
            # A prompt's next chunk lays out its KV and draft scratch past those of its
            # previous chunk, which must be settled (its scratch freed) first.
            self.drain()
        batch = self.prefill() or self.decode()
        launched = (batch, self.launch_batch(batch)) if batch is not None else None
        if self.pending is not None:
            self.process_batch_result(*self.pending)
        self.pending = launched
        if not self.overlap:
            self.drain()
        now = time.perf_counter()
        if batch is not None:
            self.step_stats.record(batch, now - self._step_started)
        self._step_started = now
        return batch

    def drain(self) -> None:
        """Processes the launched step, if any (before retraction, and without overlap)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.process_batch_result(*pending)

    def settle(self, req: Req) -> None:
        """Processes the step in flight if it computes part of ``req``, so that ``req``'s
        rows and tokens on the host are complete before it is ended out of turn (abort)."""
        if self.pending is not None and any(r is req for r in self.pending[0].reqs):
            self.drain()

    def recv_requests(self) -> list[Any]:
        idle = self.paused or not (self.waiting or self.running or self.chunked or self.pending)
        msgs = []
        if idle and not self.recv_socket.poll(timeout=1000):
            return msgs
        while True:
            try:
                msgs.append(self.recv_socket.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                return msgs

    def process_input(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, ControlOp):
            self.answer(msg, msg.apply(self))  # None: answered later (a weight update)
        else:
            logger.error("scheduler got an unknown message %r", type(msg))

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        params = msg.sampling_params
        seed = params.seed if params.seed is not None else int(self.seed_rng.integers(2**63))
        req = Req(
            rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=params,
            seed=seed, stream=msg.stream, options=msg.options,
        )
        # The prompt plus the first generated token, in whole pages.
        need = self.memory[0].kv_needed(0, len(req.origin_input_ids) + 1)  # ranks alike
        released = self.runner.released_memory()  # the tokenizer manager refuses these first
        if released or need > self.memory.total_kv():
            req.finished_reason = finish_abort(
                memory_released_message(sorted(released)) if released else
                f"the prompt needs {need} KV slots but the KV cache holds "
                f"{self.memory.total_kv()}{self._per_rank}; raise --max-total-tokens"
            )
            self.finish(req)
            self.outputs.send([req])
            return
        if self.dp_size > 1:
            req.dp_rank = self._choose_rank(req)
        self.waiting.append(req)

    @property
    def _per_rank(self) -> str:
        return " per DP attention rank" if self.dp_size > 1 else ""

    def _choose_rank(self, req: Req) -> int:
        """The DP attention rank of a new request: where its prompt's prefix is cached, else
        by ``--load-balance-method`` (dp_balancer)."""
        usable = req.origin_input_ids[:-1]  # admission computes the last token at least
        cached = [m.tree.cached_prefix_len(usable) for m in self.memory.ranks]
        loads = None
        if self.balancer.needs_loads:
            loads = self._rank_counts().loads([m.held_kv() for m in self.memory.ranks])
        return self.balancer.choose(cached, loads)

    def _rank_counts(self) -> RankCounts:
        return RankCounts.of(self.dp_size, [*self.running, *self.chunked.values()], self.waiting)

    # -- scheduling -----------------------------------------------------------------------------
    def _future_kv(self, req: Req, kv_len: int) -> int:
        """KV (whole pages, in tokens) for ``req``'s future tokens once it holds ``kv_len``."""
        future = min(req.remaining_new_tokens(), RESERVE_CLIP)
        return self.memory.of(req).kv_needed(kv_len, future)

    def prefill(self) -> ScheduleBatch | None:
        """An extend step: admits waiting requests FIFO within each rank (a rank that cannot
        take its next one takes no later one this step; other ranks go on)."""
        if not self.waiting and not self.chunked:
            return None
        dp = self.dp_size
        budget = [self.chunk_budget] * dp  # tokens per rank
        on_rank = [0] * dp  # running requests + those of this batch, per rank
        # Reserved for the future tokens of the running requests and of those whose whole
        # prompt this batch computes, per rank.
        future = [0] * dp
        for r in self.running:
            on_rank[r.dp_rank] += 1
            future[r.dp_rank] += self._future_kv(r, r.kv_len)
        blocked: set[int] = set()
        reqs: list[Req] = []
        lens: list[int] = []
        locs: list[np.ndarray] = []
        scratch = self._draft_scratch()
        scratches: list[np.ndarray] = []
        candidates = [self.chunked[r] for r in sorted(self.chunked)] + list(self.waiting)
        if self.update is not None:  # new requests wait for the new weights
            candidates = [r for r in candidates if r.admitted]
        for req in candidates:
            rank = req.dp_rank
            if len(blocked) == dp or len(self.running) + len(reqs) >= self.max_running:
                break
            if rank in blocked:
                continue
            if budget[rank] == 0 or on_rank[rank] >= self.rank_max_running:
                blocked.add(rank)
                continue
            memory = self.memory[rank]
            alone = on_rank[rank] == 0  # nothing else of its rank holds or reserves KV
            fresh = req.req_pool_idx is None
            if fresh and not memory.admit(req):
                break  # no request slot left (shared by all ranks)
            todo = req.seq_len - req.kv_len
            n = min(todo, budget[rank])
            mine = self._future_kv(req, req.seq_len) if n == todo else 0
            reserve = int((future[rank] + mine) * self.server_args.schedule_conservativeness)
            slots = None
            need = memory.kv_needed(req.kv_len, n + scratch)
            if memory.available_kv() - reserve >= need or alone:
                slots = memory.alloc_kv(req, n + scratch)
            if slots is None:
                if fresh:
                    memory.release(req, cache=False)
                if alone:
                    # Alone, with every evictable slot evicted, it still does not fit.
                    self._abort_unfittable(req)
                    continue
                blocked.add(rank)
                continue
            memory.assign_kv(req, slots)
            if fresh:
                self.waiting.remove(req)
            future[rank] += mine
            on_rank[rank] += 1
            reqs.append(req)
            lens.append(n)
            locs.append(slots[:n])
            scratches.append(slots[n:])
            budget[rank] -= n
        if not reqs:
            return None
        samples = [r.kv_len + n == r.seq_len for r, n in zip(reqs, lens, strict=True)]
        for req, done in zip(reqs, samples, strict=True):
            # A rank's part-way prompt comes first among its candidates: if it is not in this
            # batch, no other request of its rank is, and it stays.
            if not done:
                self.chunked[req.dp_rank] = req
            elif self.chunked.get(req.dp_rank) is req:
                del self.chunked[req.dp_rank]
        return ScheduleBatch(ForwardMode.EXTEND, reqs, lens, np.concatenate(locs), samples,
                             dp_ranks=self._dp_ranks(reqs),
                             draft_scratch=np.stack(scratches) if scratch else None)

    def _draft_scratch(self) -> int:
        """Slots a request holds past its step's tokens during the step (EAGLE's chain)."""
        return 0 if self.speculation is None else self.speculation.scratch

    def _dp_ranks(self, reqs: list[Req]) -> np.ndarray | None:
        if self.dp_size == 1:
            return None
        return np.fromiter((r.dp_rank for r in reqs), dtype=np.int32, count=len(reqs))

    def _growing(self) -> list[Req]:
        """The running requests that decode next, grouped by rank (in running order within).

        A request whose in-flight tokens already reach its limit waits for them instead.
        """
        reqs = [r for r in self.running if r.can_grow(self.context_len)]
        return sorted(reqs, key=lambda r: r.dp_rank) if self.dp_size > 1 else reqs

    def _short_rank(self, reqs: list[Req]) -> int | None:
        """The first rank whose requests of ``reqs`` cannot all get a decode slot, if any."""
        for rank in sorted({r.dp_rank for r in reqs}):
            if not self.memory[rank].decode_fits([r for r in reqs if r.dp_rank == rank]):
                return rank
        return None

    def decode(self) -> ScheduleBatch | None:
        reqs = self._growing()
        if not reqs:
            return None
        # Every rank must fit before any allocates (a decode slot is recorded when taken).
        short = self._short_rank(reqs)
        if short is not None and self.pending is not None:
            self.drain()  # finishes may free memory; retraction needs settled requests
            return self.decode()
        while short is not None:
            holders = self._holders(short)
            if len(holders) == 1:
                self._abort_unfittable(holders[0])
            else:
                self.retract_one(short)
            reqs = self._growing()
            if not reqs:
                return None
            short = self._short_rank(reqs)
        if self.speculation is not None:
            return self._verify_batch(reqs)
        slots = []
        for rank in sorted({r.dp_rank for r in reqs}):
            got = self.memory[rank].alloc_decode_kv([r for r in reqs if r.dp_rank == rank])
            assert got is not None, "decode_fits promised these slots"
            slots.append(got)
        return ScheduleBatch(ForwardMode.DECODE, reqs, [1] * len(reqs), np.concatenate(slots),
                             [True] * len(reqs), dp_ranks=self._dp_ranks(reqs))

    def _verify_batch(self, reqs: list[Req]) -> ScheduleBatch:
        """The decode step of speculative decoding: each request's last token and its drafts.
        When the drafts' KV does not fit, no request drafts this step (one slot each fits:
        ``decode`` made sure, retracting if it had to)."""
        if self.speculation.drafts_in_step:
            return self._device_verify_batch(reqs)
        memory = self.memory[0]  # speculation runs without DP attention
        drafts = [self.speculation.drafts(r, self.context_len) for r in reqs]
        need = sum(memory.kv_needed(r.kv_len, 1 + len(d)) for r, d in zip(reqs, drafts, strict=True))
        if need > memory.available_kv():
            drafts = [[] for _ in reqs]
        slots = []
        for req, d in zip(reqs, drafts, strict=True):
            got = memory.alloc_kv(req, 1 + len(d))
            assert got is not None, "the verify step's slots were counted"
            memory.assign_kv(req, got)
            slots.append(got)
        return ScheduleBatch(ForwardMode.TARGET_VERIFY, reqs, [1 + len(d) for d in drafts],
                             np.concatenate(slots), [True] * len(reqs), drafts=drafts)

    def _device_verify_batch(self, reqs: list[Req]) -> ScheduleBatch:
        """EAGLE / NEXTN: a verify step whose inputs the device holds (speculative/
        device_inputs.py). With a verify step in flight (overlap scheduling) a request's first
        position is known only within the drafts that step may reject: the step gets the slots
        of every position it may touch, allocated past what the request holds. A request whose
        next step would feed fewer drafts once the step in flight is processed (near its
        token or context limit), a step in flight that is not a verify step, or KV that does
        not fit, settles the step in flight first."""
        memory = self.memory[0]  # speculation runs without DP attention
        spec = self.speculation
        scratch = spec.scratch
        in_flight: dict[int, int] = {}  # id(req) -> tokens it brought to the step in flight
        if self.pending is not None:
            pending = self.pending[0]
            if pending.forward_mode.is_verify:
                in_flight = {id(r): n for r, n in zip(pending.reqs, pending.extend_lens,
                                                       strict=True)}
            if not in_flight or any(
                    spec.room(r, self.context_len, in_flight[id(r)]) < spec.num_steps
                    for r in reqs if id(r) in in_flight):
                self.drain()
                return self.decode()
        # Per request: tokens, the lower bound of its first position, and what it holds now.
        plan = []
        for r in reqs:
            n_prev = in_flight.get(id(r))
            if n_prev is None:
                plan.append((r, 1 + spec.room(r, self.context_len), r.kv_len, r.kv_len))
            else:  # the step in flight keeps 1 to n_prev of its tokens; it holds its scratch
                plan.append((r, 1 + spec.num_steps, r.kv_len - n_prev + 1, r.kv_len + scratch))
        need = sum(memory.kv_needed(held, r.kv_len + n + scratch - held)
                   for r, n, _, held in plan)
        if need > memory.available_kv():
            if in_flight:
                self.drain()
                return self.decode()
            plan = [(r, 1, r.kv_len, r.kv_len) for r in reqs]  # no drafts this step
            if sum(memory.kv_needed(r.kv_len, 1 + scratch) for r in reqs) > memory.available_kv():
                holders = self._holders(0)  # EAGLE's scratch does not fit either
                if len(holders) == 1:
                    self._abort_unfittable(holders[0])
                else:
                    self.retract_one()
                return self.decode()
        spec.overlapped_steps += bool(in_flight)
        table = memory.req_to_token_pool.req_to_token
        slots = np.zeros((len(reqs), self.runner.verify_slot_width), np.int32)
        for i, (r, n, first, held) in enumerate(plan):
            end = r.kv_len + n + scratch
            got = memory.extend_held_kv(r, held, end - held)
            assert got is not None, "the verify step's slots were counted"
            slots[i, : end - first] = table[r.req_pool_idx, first:end]
        return ScheduleBatch(
            ForwardMode.TARGET_VERIFY, reqs, [n for _, n, _, _ in plan], None,
            [True] * len(reqs), draft_scratch=np.zeros((len(reqs), scratch), np.int32),
            verify_first=np.array([first for _, _, first, _ in plan], np.int32),
            verify_slots=slots)

    def _abort_unfittable(self, req: Req) -> None:
        """A request that cannot grow even with its rank's whole KV cache to itself ends here."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.settle(req)  # a chunked prompt's previous chunk may still be in flight
        if req.finished:
            return
        total = self.runner.max_total_tokens if self.dp_size == 1 else self.memory.total_kv()
        req.finished_reason = finish_abort(
            f"out of KV cache: the request reached {req.seq_len} tokens and the KV cache holds "
            f"{total}{self._per_rank}; raise --max-total-tokens"
        )
        self.finish(req)
        self.outputs.send([req])

    def _holders(self, rank: int) -> list[Req]:
        """The requests holding KV of ``rank``: its running ones and its part-way prompt."""
        chunked = self.chunked.get(rank)
        return [r for r in self.running if r.dp_rank == rank] + ([chunked] if chunked else [])

    def retract_one(self, rank: int = 0) -> None:
        """Frees the memory of the newest request holding KV of ``rank`` (a running one, or
        its part-way prefilled prompt) and queues it to resume from the front (on the same
        rank). Every step that computed part of it has been processed."""
        req = max(self._holders(rank), key=lambda r: r.arrival_time)
        if self.chunked.get(rank) is req:
            del self.chunked[rank]
        else:
            self.running.remove(req)
        if req.options.return_routed_experts:
            # Kept in case it is aborted before it resumes; replaced when it ends.
            self._gather_routed(req)
        self.memory.release(req, cache=True)
        self.waiting.appendleft(req)
        self.num_retractions += 1
        logger.info("KV cache full: retracted %s (%d tokens so far)", req.rid, req.seq_len)

    # -- running and results --------------------------------------------------------------------
    def launch_batch(self, batch: ScheduleBatch) -> StepOutput:
        """Dispatches a step; the requests' accounting moves on as if it had run."""
        mwb = batch.to_model_worker_batch()
        out = self.node.run_batch(mwb, rids=[r.rid for r in batch.reqs])
        for req, n, samples in zip(batch.reqs, batch.extend_lens, batch.samples_output,
                                   strict=True):
            req.kv_len += n
            if samples:
                req.inflight += 1
                if batch.forward_mode == ForwardMode.EXTEND:
                    self.running.append(req)
        batch.capture_routed = mwb.return_routed_experts
        return out

    def process_batch_result(self, batch: ScheduleBatch, out: StepOutput) -> None:
        if batch.out_cache_loc is None:  # a verify step with device inputs
            batch.out_cache_loc = self._verified_slots(batch)
        # Rows first: a request finishing below gathers rows that include this step's.
        self.runner.collect_routing(out, batch.out_cache_loc, copy=batch.capture_routed)
        all_ids = np.asarray(out.next_token_ids)
        drafts = None if out.drafts is None else np.asarray(out.drafts)
        if batch.forward_mode.is_verify:
            self._process_verify_result(batch, out, all_ids, drafts)
            return
        if batch.draft_scratch is not None:  # EAGLE's chain slots go back first
            for req in batch.reqs:
                if req.req_pool_idx is not None:
                    self.memory.of(req).shrink_kv(req, req.kv_len,
                                                  held=req.kv_len + self._draft_scratch())
        if batch.logprob_rows:
            self._record_logprobs(batch, out, all_ids)
        next_ids = all_ids[: len(batch.reqs)].tolist()
        now = time.monotonic()  # the metrics' first-token time (one clock read per step)
        changed: list[Req] = []
        for i, (req, samples, token) in enumerate(zip(batch.reqs, batch.samples_output,
                                                      next_ids, strict=True)):
            if not samples or req.finished:  # a chunk boundary, or ended while this step ran
                continue
            req.inflight -= 1
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = finish_length(0)
            else:
                req.output_ids.append(token)
                if drafts is not None:
                    req.spec_drafts = drafts[i].tolist()
                if req.first_token_time is None:
                    req.first_token_time = now
                self.num_generated_tokens += 1
                self.finish_checker.check(req)
            if req.finished:
                self.finish(req)
            changed.append(req)
        self.outputs.send(changed)

    def _verified_slots(self, batch: ScheduleBatch) -> np.ndarray:
        """The KV slots a device-input verify step wrote, now that every step before it is
        processed: a request's tokens start at its last token's position. A request that
        ended meanwhile (its slots released) points at the padding slot, which no request
        holds."""
        locs = []
        for req, n in zip(batch.reqs, batch.extend_lens, strict=True):
            if req.req_pool_idx is None or req.finished:
                locs.append(np.zeros(n, np.int32))
            else:
                first = req.seq_len - 1
                table = self.memory.of(req).req_to_token_pool.req_to_token
                locs.append(table[req.req_pool_idx, first : first + n].astype(np.int32))
        return np.concatenate(locs)

    def _process_verify_result(self, batch: ScheduleBatch, out: StepOutput,
                               all_ids: np.ndarray, drafts: np.ndarray | None) -> None:
        """Each request keeps the drafts the target confirmed and the target's next token,
        stopping at a token that ends it; the KV of every later position (rejected drafts)
        goes back, so their routed rows are never read and never enter the prefix cache."""
        lp = None if out.logprobs is None else {k: np.asarray(v)
                                                for k, v in vars(out.logprobs).items()}
        gained: list[int] = []
        changed: list[Req] = []
        scratch = self._draft_scratch()
        start = 0
        fed_drafts = batch.drafts or [None] * len(batch.reqs)
        for i, (req, fed, n) in enumerate(zip(batch.reqs, fed_drafts, batch.extend_lens,
                                              strict=True)):
            first, start = start, start + n
            if req.finished:  # aborted while the step ran
                continue
            req.inflight -= 1
            req.spec_verify_ct += 1
            if fed is None:  # device inputs: the drafts the step before this one proposed
                fed = req.spec_drafts[: n - 1]
            tokens = accepted_tokens(fed, all_ids[first : first + n].tolist())
            for j, token in enumerate(tokens):
                if lp is not None and req.logprobs is not None:
                    t = first + j
                    req.logprobs.add("output", lp["target"][t], token, lp["top_values"][t],
                                     lp["top_ids"][t], lp["token_ids"][t])
                req.output_ids.append(token)
                self.finish_checker.check(req)
                if req.finished:
                    break
            gained.append(j + 1)
            self.num_generated_tokens += j + 1
            # Every position but the last token's holds KV (the invariant of a decode step);
            # a successor in flight (overlap) holds its own positions past that, and its
            # scratch: ``kv_len`` counted this step's n positions, of which j + 1 are kept.
            successor = req.inflight > 0 and not req.finished
            kept = req.kv_len - (n - j - 1) if successor else req.seq_len - 1
            self.memory.of(req).shrink_kv(req, kept, held=req.kv_len + scratch,
                                          reserve=scratch if successor else 0)
            if drafts is not None:
                req.spec_drafts = drafts[i].tolist()
            if req.finished:
                self.finish(req)
            changed.append(req)
        self.speculation.record(gained)
        self.outputs.send(changed)

    @staticmethod
    def _record_logprobs(batch: ScheduleBatch, out: StepOutput, next_ids: np.ndarray) -> None:
        """Adds the step's logprobs to its requests' records (before their tokens: a request
        that finishes on this token sends them with it)."""
        lp = {k: np.asarray(v) for k, v in vars(out.logprobs).items()}
        padded_rows = len(next_ids)
        for req, row, prompt_token in batch.logprob_rows:
            if req.finished:  # ended (aborted) while the step ran; nothing more is recorded
                continue
            if row < 0:
                row = padded_rows - 1 - row
            side, token = ("output", next_ids[row]) if prompt_token is None else \
                ("input", prompt_token)
            req.logprobs.add(side, lp["target"][row], token, lp["top_values"][row],
                             lp["top_ids"][row], lp["token_ids"][row])

    def finish(self, req: Req) -> None:
        """Takes an ended request out of the schedule and releases its memory, its routed
        experts gathered first (they are read through its KV slots).

        Every step that computed part of it must have been processed (``settle``), except one
        launched after the step that ended it: that one only computes the position of its
        last token, which has no row.
        """
        if req in self.running:
            self.running.remove(req)
        if self.chunked.get(req.dp_rank) is req:
            del self.chunked[req.dp_rank]
        # A request that holds no memory has none to gather: a retracted one keeps the rows
        # taken at retraction, one that never started has none (an empty array).
        holds = req.req_pool_idx is not None
        if req.options.return_routed_experts and (holds or req.routed_experts is None):
            self._gather_routed(req)
        self.memory.release(req, cache=True)

    def _gather_routed(self, req: Req) -> None:
        """``req``'s rows [start_len, n) (and their routing weights, if asked), from the host."""
        # In the table's narrow dtype: converted once, to the wire dtype, when sent.
        req.routed_experts = self.memory.routed_rows_of(req, raw=True)
        if req.options.return_routed_expert_weights:
            req.routed_expert_weights = self.memory.routed_rows_of(req, weights=True)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        """Ends a request now. It returns its tokens so far and, if it asked, the rows of every
        token whose routing was computed (docs/routed_experts.md: abort)."""
        req = next((r for r in self.waiting if r.rid == rid), None)
        if req is not None:
            self.waiting.remove(req)
        else:
            started = [*self.running, *self.chunked.values()]
            req = next((r for r in started if r.rid == rid), None)
            if req is None:
                return  # unknown, or ended already
            self.settle(req)
            if req.finished:
                return  # ended by the step just processed; its output went out there
        req.finished_reason = finish_abort(reason)
        self.finish(req)
        self.outputs.send([req])

    # -- control (control.ControlTarget: what control operations use) ------------------------
    def answer(self, op: ControlOp, reply: Any) -> None:
        if reply is not None:
            self.outputs.send_control(ControlReply(call_id=op.call_id, reply=reply))

    def on_every_node(self, op: ControlOp) -> Any:
        return self.node.control(op)

    def expert_recorder(self) -> ExpertRecorder | None:
        return self.runner.recorder()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        logger.info("generation %s", "paused" if paused else "continued")

    def flush_cache(self) -> None:
        """Drops every rank's prefix cache."""
        if self.waiting or self.running or self.chunked:
            raise ValueError("requests are still running")
        self.memory.flush()

    def released_memory(self) -> frozenset[str]:
        return self.runner.released_memory()

    def quiesce(self) -> None:
        started = len(self.waiting) + len(self.running) + len(self.chunked)
        if started or self.update is not None:
            raise ValueError(
                f"the engine is not idle ({started} request(s) running or waiting"
                f"{', a weight update waiting for them' if self.update else ''}); let them "
                "finish or abort them first (paused requests hold their KV cache too)")
        self.drain()

    # -- weight updates -------------------------------------------------------------------------
    def _started_requests(self) -> list[Req]:
        """Requests computed in part on the current weights (running, chunked, retracted)."""
        return [r for r in [*self.running, *self.chunked.values(), *self.waiting] if r.admitted]

    def request_weight_update(self, msg: UpdateWeights,
                              checkpoint: str | None = None) -> UpdateWeightsReqOutput | None:
        """Takes an update: at once if nothing started on the old weights (after aborting
        everything with ``abort_all_requests``), else once the started requests have finished
        (new ones wait meanwhile); answered then. While paused, started requests cannot
        finish: that is an error unless they are aborted. Returns a refusal, or None."""
        def refuse(message: str) -> UpdateWeightsReqOutput:
            logger.warning("weight update refused: %s", message)
            return UpdateWeightsReqOutput(
                success=False, message=message, weight_version=self.weight_version)

        if self.update is not None:
            return refuse("another weight update is in progress")
        try:
            if checkpoint is not None:
                check_compatible(self.model_config, checkpoint)
        except Exception as e:  # noqa: BLE001 - a bad update never stops the scheduler
            if not isinstance(e, ValueError):
                logger.exception("checking the weight update from %r failed", checkpoint)
            return refuse(bound_message(str(e) or type(e).__name__))
        if msg.abort_all_requests:
            for req in [*self.waiting, *self.running, *self.chunked.values()]:
                if not req.finished:
                    self.abort(req.rid, "aborted for a weight update")
        elif self.paused and self._started_requests():
            return refuse(
                f"{len(self._started_requests())} request(s) are paused part-way; continue "
                "generation first, or pass abort_all_requests=true"
            )
        self.update = msg
        logger.info("weight update requested; waiting for %d started request(s)",
                    len(self._started_requests()))
        return None

    def apply_weight_update(self) -> None:
        msg, self.update = self.update, None
        try:
            result = self.node.control(msg)  # WeightUpdater.report
        except Exception as e:  # noqa: BLE001 - the old weights serve on (see weight_updater)
            # WeightUpdateError (a ValueError, its traceback logged where it was raised if the
            # error was unexpected) is what the updater raises; anything else is a bug.
            if isinstance(e, ValueError):
                logger.warning("weight update failed: %s", bound_message(str(e)))
            else:
                logger.exception("weight update failed")
            return self.answer(msg, UpdateWeightsReqOutput(
                success=False, message=bound_message(str(e) or type(e).__name__),
                weight_version=self.weight_version))
        # Cached KV and routed-experts rows were computed with the old weights.
        self.memory.flush()
        self.weight_updates += 1
        self.weight_version = msg.weight_version or str(self.weight_updates)
        self.outputs.weight_version = self.weight_version
        logger.info("weights updated (%d parameters in %.2fs); weight_version %s",
                    result["num_parameters"], result["seconds"], self.weight_version)
        self.answer(msg, UpdateWeightsReqOutput(
            success=True, message="weights updated", weight_version=self.weight_version,
            **result))

    def server_info(self) -> dict[str, Any]:
        info = {
            "weight_version": self.weight_version,
            "paused": self.paused,
            "released_memory": sorted(self.runner.released_memory()),
            **self.memory.stats(),  # summed over the DP attention ranks
            "num_running_reqs": len(self.running) + len(self.chunked),
            "num_waiting_reqs": len(self.waiting),
            "num_retractions": self.num_retractions,
            "num_generated_tokens": self.num_generated_tokens,
            "num_compiles": self.runner.num_compiles,
            "step_stats": self.step_stats.data,
            "max_total_tokens": self.runner.max_total_tokens,
            "max_running_requests": self.max_running,
            "context_length": self.context_len,
            "memory_bytes": self.runner.memory_report(),
        }
        if self.dp_size > 1:
            info["dp_size"] = self.dp_size
            info["dp_ranks"] = self.rank_info()
        if self.speculation is not None:  # SGLang's name
            info["avg_spec_accept_length"] = self.speculation.accept_length
            info["spec_overlapped_steps"] = self.speculation.overlapped_steps
        return info

    def rank_info(self) -> list[dict[str, int]]:
        """Per DP attention rank: its requests and its KV slots (``server_info``)."""
        counts = self._rank_counts()
        return [{"dp_rank": r, "num_running_reqs": counts.running[r],
                 "num_waiting_reqs": counts.waiting[r], **self.memory.rank_stats(r)}
                for r in range(self.dp_size)]


def start_scheduler(server_args: ServerArgs, port_args: PortArgs, pipe: Any,
                    mesh: Mesh | None = None) -> Scheduler:
    """Builds the scheduler (loads and compiles) and reports ready with its numbers, or the
    error, over ``pipe``: the child process's and the single-process mode's start-up."""
    t0 = time.perf_counter()

    def ready_info(scheduler: Scheduler) -> dict[str, Any]:
        runner = scheduler.runner
        return {
            "pid": os.getpid(),
            "startup_seconds": time.perf_counter() - t0,
            "load_seconds": runner.load_seconds,
            "max_total_tokens": runner.max_total_tokens,
            "max_running_requests": runner.max_running_requests,
            "context_length": runner.context_len,
            "memory_bytes": runner.memory_report(),
            "num_compiles": runner.num_compiles,
        }

    return report_startup(pipe, lambda: Scheduler(server_args, port_args, mesh=mesh), ready_info)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe: Any) -> None:
    configure_logging(server_args.log_level, prefix="scheduler")
    watch_parent()
    enable_compilation_cache(server_args)
    scheduler = start_scheduler(server_args, port_args, pipe)
    threading.current_thread().name = "scheduler"
    if server_args.nnodes > 1:
        # SIGTERM (Engine.shutdown) ends the loop, so the followers are told to stop.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        scheduler.event_loop()
    except SystemExit:
        logger.info("scheduler stopped")
    except BaseException:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        if server_args.nnodes > 1:
            # A step fails when a node is lost, and the step channel's watcher then names it
            # (exit_on_fatal) within a heartbeat or two: give it that long. Never fall through
            # to a normal exit: JAX's atexit hook shuts the distributed runtime down, which
            # waits for every node, and a lost node never answers.
            time.sleep(min(server_args.dist_timeout, 5.0))
            exit_on_fatal("the scheduler crashed (see above)")
        raise
    finally:
        scheduler.close()
