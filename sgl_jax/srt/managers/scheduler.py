"""The scheduler process: owns JAX, the model and all KV memory; runs continuous batching.

Loop: recv -> schedule (``prefill() or decode()``) -> run -> process results -> send outputs.
The scheduler conducts; what it schedules and how is in rooms of their own: admission, chunked
prefill and retraction in ``batch_policy`` (which also holds the request queues), the DP
attention rank of each new request in ``dp_balancer``, speculative verify steps in
``speculative/verify_schedule``, weight updates in ``weight_update_flow``, per-request
auxiliary state in ``mem_cache/request_state`` (through ``req_memory``) and outputs in
``output_sender``. With data-parallel attention one step holds every rank's rows in one mode.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import zmq
from jax.sharding import Mesh

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.constrained.matchers import GrammarMatchers
from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.layers.moe.routed_experts_capturer import set_global_experts_capturer
from sgl_jax.srt.managers.batch_policy import BatchPolicy
from sgl_jax.srt.managers.control import (
    ControlOp,
    ControlReply,
    ExpertRecorder,
    UpdateWeights,
    UpdateWeightsReqOutput,
    memory_released_message,
)
from sgl_jax.srt.managers.dp_balancer import DPBalancer, rank_info
from sgl_jax.srt.managers.finish_checker import FinishChecker
from sgl_jax.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from sgl_jax.srt.managers.multi_node import LeaderRunner, open_leader_channel
from sgl_jax.srt.managers.output_sender import OutputSender
from sgl_jax.srt.managers.req_memory import RankedMemory, ReqMemory
from sgl_jax.srt.managers.schedule_batch import Req, ScheduleBatch, finish_abort, finish_length
from sgl_jax.srt.managers.shm_arena import ArenaWriter
from sgl_jax.srt.managers.step_stats import StepStats
from sgl_jax.srt.managers.transport import SideSender
from sgl_jax.srt.managers.weight_update_flow import WeightUpdateFlow
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.request_state import RequestStateTable
from sgl_jax.srt.model_executor.model_runner import ModelRunner, StepOutput
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.speculative.decoding import SpeculativeDecoding
from sgl_jax.srt.speculative.verify_schedule import VerifySchedule
from sgl_jax.srt.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Future tokens of running requests are reserved up to this many each when admitting new
# requests; beyond it, retraction handles the rare request that really grows that long.
RESERVE_CLIP = 256


class Scheduler:
    """The conductor: recv -> schedule -> run -> emit. Each concern owns its state in its own
    room: admission and retraction (``policy``), DP rank assignment (``balancer``), the
    verify steps of speculative decoding (``verify``), weight updates (``weights``) and
    outputs (``outputs``); the scheduler holds them, not their fields."""

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
        self.memory = self._build_memory()
        self.dp_size = len(self.memory)
        self.balancer = DPBalancer(server_args.load_balance_method, self.dp_size)
        self.context_len = self.model_config.context_len
        speculation = SpeculativeDecoding.create(server_args)
        self.policy = BatchPolicy(
            self.memory, self, chunk_budget=server_args.chunked_prefill_size,
            max_running=self.runner.max_running_requests, context_len=self.context_len,
            conservativeness=server_args.schedule_conservativeness,
            draft_scratch=0 if speculation is None else speculation.scratch)
        self.verify = None if speculation is None else VerifySchedule(
            speculation, self.memory[0], self.context_len, self.runner.verify_slot_width)
        self.weights = WeightUpdateFlow(self.model_config, self.policy, self.node.control)
        eos_ids = set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.grammar = GrammarMatchers.for_server(  # constrained decoding
            server_args.grammar_backend, self.tokenizer, self.model_config.vocab_size,
            sorted(eos_ids), self.memory.states)
        self.finish_checker = FinishChecker(eos_ids, self.context_len, self.tokenizer,
                                            self.grammar)
        self.seed_rng = np.random.default_rng(server_args.random_seed)
        self.num_generated_tokens = 0
        self.step_stats = StepStats()
        self.overlap = not server_args.disable_overlap_schedule
        self.pending: tuple[ScheduleBatch, StepOutput] | None = None  # launched, unprocessed
        self.paused = False  # /pause_generation: no step is launched; every request waits

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
                                    speculative=speculation is not None, side=self.side)
        self._step_started = time.perf_counter()

    def _build_memory(self) -> RankedMemory:
        """One ReqMemory per DP attention rank (one without DP attention), over the rank's KV
        allocator with a radix tree of its own; the request slots, the routed-experts host
        table and the per-request state slots are shared by the ranks."""
        pools = self.runner.memory_pools()
        args = self.server_args
        states = RequestStateTable(pools.req_to_token.size)
        return RankedMemory([
            ReqMemory(pools.req_to_token, allocator,
                      RadixCache(allocator, disable=args.disable_radix_cache,
                                 page_size=args.page_size),
                      pools.routed_rows, states)
            for allocator in pools.kv_allocators
        ])

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
        if self.grammar is not None:
            self.grammar.close()
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
        if self.weights.ready():
            self.drain()
            msg, reply = self.weights.apply()
            self.outputs.weight_version = self.weights.version
            self.answer(msg, reply)
        if self.paused:
            self.drain()
            return None
        if self.verify is not None and self.policy.chunked:
            # A prompt's next chunk lays out its KV and draft scratch past those of its
            # previous chunk, which must be settled (its scratch freed) first.
            self.drain()
        if self.pending is not None and GrammarMatchers.any_constrained(self.pending[0].reqs):
            self.drain()  # a grammar's next mask needs the token in flight
        batch = self.policy.prefill(admit_new=self.weights.waiting is None) or self.decode()
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

    def decode(self) -> ScheduleBatch | None:
        """A decode step of the running requests (a verify step under speculation)."""
        while True:
            reqs = self.policy.decode_reqs()
            if not reqs:
                return None
            if self.verify is None:
                return self.policy.decode_batch(reqs)
            in_flight = None if self.pending is None else self.pending[0]
            plan = self.verify.plan(reqs, in_flight, self.drain, self.policy.make_room)
            if plan is not None:
                return ScheduleBatch.for_verify(reqs, plan)
            # The step in flight was processed or memory was freed: schedule again.

    def has_step_in_flight(self) -> bool:
        return self.pending is not None

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
        idle = self.paused or not (self.policy.has_work() or self.pending)
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
            seed=seed, stream=msg.stream, options=msg.options, grammar=msg.grammar,
        )
        if self.grammar is not None:
            self.grammar.prepare(req)
        # The prompt plus the first generated token, in whole pages.
        need = self.memory[0].kv_needed(0, len(req.origin_input_ids) + 1)  # ranks alike
        released = self.runner.released_memory()  # the tokenizer manager refuses these first
        if released or need > self.memory.total_kv():
            self._end(req, memory_released_message(sorted(released)) if released else
                      f"the prompt needs {need} KV slots but the KV cache holds "
                      f"{self.memory.total_kv()}{self._per_rank}; raise --max-total-tokens")
            return
        if self.dp_size > 1:
            req.dp_rank = self.balancer.assign(req, self.memory, self.policy.rank_counts)
        self.policy.waiting.append(req)

    @property
    def _per_rank(self) -> str:
        return " per DP attention rank" if self.dp_size > 1 else ""

    # -- ending requests (policy.RequestEnder) --------------------------------------------------
    def _end(self, req: Req, message: str) -> None:
        """Ends ``req`` now with ``message`` (not waiting: removed by the caller)."""
        req.finished_reason = finish_abort(message)
        self.finish(req)
        self.outputs.send([req])

    def end_out_of_memory(self, req: Req) -> None:
        """A request that cannot grow even with its rank's whole KV cache to itself."""
        self.settle(req)  # a chunked prompt's previous chunk may still be in flight
        if req.finished:
            return
        total = self.runner.max_total_tokens if self.dp_size == 1 else self.memory.total_kv()
        self._end(req, f"out of KV cache: the request reached {req.seq_len} tokens and the "
                       f"KV cache holds {total}{self._per_rank}; raise --max-total-tokens")

    def finish(self, req: Req) -> None:
        """Takes an ended request out of the schedule and releases its memory (its routed
        experts gathered first).

        Every step that computed part of it must have been processed (``settle``), except one
        launched after the step that ended it: that one only computes the position of its
        last token, which has no row.
        """
        self.policy.remove(req)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        """Ends a request now. It returns its tokens so far and, if it asked, the rows of every
        token whose routing was computed (docs/routed_experts.md: abort)."""
        req = self.policy.find(rid)
        if req is None:
            return  # unknown, or ended already
        if req in self.policy.waiting:
            self.policy.waiting.remove(req)
        else:
            self.settle(req)
            if req.finished:
                return  # ended by the step just processed; its output went out there
        self._end(req, reason)

    # -- running and results --------------------------------------------------------------------
    def launch_batch(self, batch: ScheduleBatch) -> StepOutput:
        """Dispatches a step; the requests' accounting moves on as if it had run."""
        mwb = batch.to_model_worker_batch(None if self.grammar is None else self.grammar.mask(
            batch.reqs, batch.samples_output))
        out = self.node.run_batch(mwb, rids=[r.rid for r in batch.reqs])
        for req, n, samples in zip(batch.reqs, batch.extend_lens, batch.samples_output,
                                   strict=True):
            req.kv_len += n
            if samples:
                req.inflight += 1
                if batch.forward_mode == ForwardMode.EXTEND:
                    self.policy.running.append(req)
        batch.capture_routed = mwb.return_routed_experts
        return out

    def process_batch_result(self, batch: ScheduleBatch, out: StepOutput) -> None:
        if batch.out_cache_loc is None:  # a verify step with device inputs
            batch.out_cache_loc = self.verify.verified_slots(batch.reqs, batch.extend_lens)
        # Rows first: a request finishing below gathers rows that include this step's.
        self.runner.collect_routing(out, batch.out_cache_loc, copy=batch.capture_routed)
        all_ids = np.asarray(out.next_token_ids)
        drafts = None if out.drafts is None else np.asarray(out.drafts)
        if batch.forward_mode.is_verify:
            lp = None if out.logprobs is None else {k: np.asarray(v)
                                                    for k, v in vars(out.logprobs).items()}
            changed, gained = self.verify.settle(batch.reqs, batch.extend_lens, batch.drafts,
                                                 all_ids, drafts, lp, self.finish_checker.check)
            self.num_generated_tokens += gained
            self._finish_and_send(changed)
            return
        if batch.draft_scratch is not None:  # EAGLE's chain slots go back first
            for req in batch.reqs:
                if req.req_pool_idx is not None:
                    self.memory.of(req).shrink_kv(req, req.kv_len,
                                                  held=req.kv_len + self.policy.draft_scratch)
        if batch.logprob_rows:
            batch.record_logprobs(out.logprobs, all_ids)
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
                    self.verify.keep_drafts(req, drafts[i])
                if req.first_token_time is None:
                    req.first_token_time = now
                self.num_generated_tokens += 1
                self.finish_checker.check(req)
            changed.append(req)
        self._finish_and_send(changed)

    def _finish_and_send(self, changed: list[Req]) -> None:
        for req in changed:
            if req.finished:
                self.finish(req)
        self.outputs.send(changed)

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
        if self.policy.has_work():
            raise ValueError("requests are still running")
        self.memory.flush()

    def released_memory(self) -> frozenset[str]:
        return self.runner.released_memory()

    def quiesce(self) -> None:
        started = self.policy.num_requests()
        if started or self.weights.waiting is not None:
            raise ValueError(
                f"the engine is not idle ({started} request(s) running or waiting"
                f"{', a weight update waiting for them' if self.weights.waiting else ''}); "
                "let them finish or abort them first (paused requests hold their KV cache too)")
        self.drain()

    def request_weight_update(self, msg: UpdateWeights,
                              checkpoint: str | None = None) -> UpdateWeightsReqOutput | None:
        return self.weights.request(msg, checkpoint, paused=self.paused, abort=self.abort)

    def server_info(self) -> dict[str, Any]:
        policy = self.policy
        info = {
            "weight_version": self.weights.version,
            "paused": self.paused,
            "released_memory": sorted(self.runner.released_memory()),
            **self.memory.stats(),  # summed over the DP attention ranks
            "num_running_reqs": len(policy.running) + len(policy.chunked),
            "num_waiting_reqs": len(policy.waiting),
            "num_retractions": policy.num_retractions,
            "num_generated_tokens": self.num_generated_tokens,
            "num_compiles": self.runner.num_compiles,
            "step_stats": self.step_stats.data,
            "max_total_tokens": self.runner.max_total_tokens,
            "max_running_requests": policy.max_running,
            "context_length": self.context_len,
            "memory_bytes": self.runner.memory_report(),
        }
        if self.dp_size > 1:
            info["dp_size"] = self.dp_size
            info["dp_ranks"] = rank_info(policy.rank_counts(), self.memory)
        if self.verify is not None:  # SGLang's name
            info["avg_spec_accept_length"] = self.verify.spec.accept_length
            info["spec_overlapped_steps"] = self.verify.spec.overlapped_steps
        return info
