"""The scheduler process: owns JAX, the model and all KV memory; runs continuous batching.

Loop: recv -> schedule (``prefill() or decode()``) -> run -> process results -> send outputs.
Prefill batches come first: waiting requests are admitted FIFO within a token budget
(``chunked_prefill_size``), a prompt longer than the budget is prefilled in chunks, and a
request reuses the longest cached prefix of its tokens. When a decode step cannot get KV
slots, the newest requests are retracted (their memory freed, their progress kept) and
later resumed by a prefill of everything they have so far.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import deque
from typing import Any

import numpy as np
import zmq

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    TokenizedGenerateReqInput,
)
from sgl_jax.srt.managers.req_memory import ReqMemory
from sgl_jax.srt.managers.schedule_batch import (
    Req,
    ScheduleBatch,
    finish_abort,
    finish_length,
    finish_matched_str,
    finish_matched_token,
)
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.model_executor.model_runner import ModelRunner, StepOutput
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.srt.utils import configure_logging, enable_compilation_cache, watch_parent

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
    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        self.server_args = server_args
        self.model_config = ModelConfig.from_hf(server_args.model_path, server_args.context_length)
        self.tokenizer = Tokenizer.from_pretrained(
            server_args.tokenizer_path or self.model_config.model_path
        )
        self.eos_ids = set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.runner = ModelRunner(server_args, self.model_config)
        if not server_args.disable_precompile:
            self.runner.precompile()
        tree = RadixCache(
            self.runner.token_to_kv_pool_allocator, disable=server_args.disable_radix_cache,
            page_size=server_args.page_size,
        )
        self.memory = ReqMemory(
            self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator, tree,
            self.runner.capturer,
        )
        self.chunk_budget = server_args.chunked_prefill_size
        self.max_running = self.runner.max_running_requests
        self.context_len = self.model_config.context_len
        self.seed_rng = np.random.default_rng(server_args.random_seed)

        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the one request whose prompt is part-way prefilled
        self.num_retractions = 0
        self.num_generated_tokens = 0
        self.step_stats = StepStats()
        self.overlap = not server_args.disable_overlap_schedule
        self.pending: tuple[ScheduleBatch, StepOutput] | None = None  # launched, unprocessed

        ctx = zmq.Context(2)
        self.recv_socket = ctx.socket(zmq.PULL)
        self.recv_socket.bind(port_args.scheduler_ipc)
        self.send_socket = ctx.socket(zmq.PUSH)
        self.send_socket.connect(port_args.detokenizer_ipc)

    # -- loop -----------------------------------------------------------------------------------
    def event_loop(self) -> None:
        """recv -> schedule -> launch -> process.

        With overlap (the default) a step's results are processed after the next step has been
        launched, so the host's bookkeeping runs while the device computes: a decode step
        reads its input tokens from the device (the last-token buffer), not from the host.
        """
        last = time.perf_counter()
        while True:
            for msg in self.recv_requests():
                self.process_input(msg)
            batch = self.prefill() or self.decode()
            launched = (batch, self.launch_batch(batch)) if batch is not None else None
            if self.pending is not None:
                self.process_batch_result(*self.pending)
            self.pending = launched
            if not self.overlap:
                self.drain()
            if batch is not None:
                now = time.perf_counter()
                self.step_stats.record(batch, now - last)
                last = now
            else:
                last = time.perf_counter()

    def drain(self) -> None:
        """Processes the launched step, if any (before retraction, and without overlap)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.process_batch_result(*pending)

    def recv_requests(self) -> list[Any]:
        idle = not (self.waiting or self.running or self.chunked or self.pending)
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
        elif isinstance(msg, FlushCacheReq):
            self.send_socket.send_pyobj(self.flush_cache())
        elif isinstance(msg, GetServerInfoReq):
            self.send_socket.send_pyobj(GetServerInfoReqOutput(info=self.server_info()))
        else:
            logger.error("scheduler got an unknown message %r", type(msg))

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        params = msg.sampling_params
        seed = params.seed if params.seed is not None else int(self.seed_rng.integers(2**63))
        req = Req(
            rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=params,
            seed=seed, stream=msg.stream, return_routed_experts=msg.return_routed_experts,
            routed_experts_start_len=msg.routed_experts_start_len,
        )
        # The prompt plus the first generated token, in whole pages.
        need = self.memory.kv_needed(0, len(req.origin_input_ids) + 1)
        if need > self.runner.token_to_kv_pool_allocator.size:
            req.finished_reason = finish_abort(
                f"the prompt needs {need} KV slots but the KV cache holds "
                f"{self.runner.token_to_kv_pool_allocator.size}; raise --max-total-tokens"
            )
            self.send_outputs([req])
            return
        self.waiting.append(req)

    # -- scheduling -----------------------------------------------------------------------------
    def _future_kv(self, req: Req, kv_len: int) -> int:
        """KV (whole pages, in tokens) for ``req``'s future tokens once it holds ``kv_len``."""
        return self.memory.kv_needed(kv_len, min(req.remaining_new_tokens(), RESERVE_CLIP))

    def prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        budget = self.chunk_budget
        reqs: list[Req] = []
        lens: list[int] = []
        locs: list[np.ndarray] = []
        candidates = ([self.chunked] if self.chunked else []) + list(self.waiting)
        # Reserved for the future tokens of the running requests and of those whose whole
        # prompt this batch computes.
        future = sum(self._future_kv(r, r.kv_len) for r in self.running)
        for req in candidates:
            if budget == 0 or len(self.running) + len(reqs) >= self.max_running:
                break
            fresh = req.req_pool_idx is None
            if fresh and not self.memory.admit(req):
                break
            todo = req.seq_len - req.kv_len
            n = min(todo, budget)
            mine = self._future_kv(req, req.seq_len) if n == todo else 0
            reserve = int((future + mine) * self.server_args.schedule_conservativeness)
            slots = None
            need = self.memory.kv_needed(req.kv_len, n)
            if self.memory.available_kv() - reserve >= need or not (self.running or reqs):
                slots = self.memory.alloc_kv(req, n)
            if slots is None:
                if fresh:
                    self.memory.release(req, cache=False)
                if not (self.running or reqs):
                    # Alone, with every evictable slot evicted, it still does not fit.
                    self._abort_unfittable(req)
                    continue
                break
            self.memory.assign_kv(req, slots)
            if fresh:
                self.waiting.remove(req)
            future += mine
            reqs.append(req)
            lens.append(n)
            locs.append(slots)
            budget -= n
        if not reqs:
            return None
        samples = [r.kv_len + n == r.seq_len for r, n in zip(reqs, lens, strict=True)]
        self.chunked = next((r for r, done in zip(reqs, samples, strict=True) if not done), None)
        return ScheduleBatch(ForwardMode.EXTEND, reqs, lens, np.concatenate(locs), samples)

    def decode(self) -> ScheduleBatch | None:
        # A request whose in-flight tokens already reach its limit waits for them instead.
        reqs = [r for r in self.running if r.can_grow(self.context_len)]
        if not reqs:
            return None
        slots = self.memory.alloc_decode_kv(reqs)  # recorded in req_to_token too
        if slots is None and self.pending is not None:
            self.drain()  # finishes may free memory; retraction needs settled requests
            return self.decode()
        while slots is None:
            if len(self.running) == 1:
                self._abort_unfittable(self.running[0])
                return None
            self.retract_one()
            reqs = [r for r in self.running if r.can_grow(self.context_len)]
            if not reqs:
                return None
            slots = self.memory.alloc_decode_kv(reqs)
        return ScheduleBatch(ForwardMode.DECODE, reqs, [1] * len(reqs), slots, [True] * len(reqs))

    def _abort_unfittable(self, req: Req) -> None:
        """A request that cannot grow even with the whole KV cache to itself ends here."""
        if req in self.waiting:
            self.waiting.remove(req)
        req.finished_reason = finish_abort(
            f"out of KV cache: the request reached {req.seq_len} tokens and the KV cache holds "
            f"{self.runner.max_total_tokens}; raise --max-total-tokens"
        )
        self.finish(req)
        self.send_outputs([req])

    def retract_one(self) -> None:
        """Frees the newest running request's memory and queues it to resume from the front."""
        req = max(self.running, key=lambda r: r.arrival_time)
        self.running.remove(req)
        self.memory.release(req, cache=True)
        self.waiting.appendleft(req)
        self.num_retractions += 1
        logger.info("KV cache full: retracted %s (%d tokens so far)", req.rid, req.seq_len)

    # -- running and results --------------------------------------------------------------------
    def launch_batch(self, batch: ScheduleBatch) -> StepOutput:
        """Dispatches a step; the requests' accounting moves on as if it had run."""
        mwb = batch.to_model_worker_batch()
        self.runner.capturer.on_forward_launch(mwb.out_cache_loc, mwb.return_routed_experts)
        _, out = self.runner.run_worker_batch(mwb)
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
        # Rows first: a request finishing below gathers rows that include this step's.
        self.runner.capturer.on_forward_end(
            out.routed_rows, batch.out_cache_loc, len(batch.out_cache_loc),
            copy=batch.capture_routed,
        )
        next_ids = np.asarray(out.next_token_ids)[: len(batch.reqs)].tolist()
        changed: list[Req] = []
        for req, samples, token in zip(batch.reqs, batch.samples_output, next_ids, strict=True):
            if not samples or req.finished:  # a chunk boundary, or ended while this step ran
                continue
            req.inflight -= 1
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = finish_length(0)
            else:
                req.output_ids.append(token)
                self.num_generated_tokens += 1
                self.check_finished(req)
            if req.finished:
                self.finish(req)
            changed.append(req)
        self.send_outputs(changed)

    def check_finished(self, req: Req) -> None:
        params = req.sampling_params
        token = req.output_ids[-1]
        if not params.ignore_eos and token in self.eos_ids:
            req.finished_reason = finish_matched_token(token)
        elif params.stop_token_ids and token in params.stop_token_ids:
            req.finished_reason = finish_matched_token(token)
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finished_reason = finish_length(params.max_new_tokens)
        elif req.seq_len >= self.context_len:
            req.finished_reason = finish_length(len(req.output_ids))
        elif params.stop:
            longest = max(len(s) for s in params.stop)
            tail = self.tokenizer.decode(
                req.output_ids[-(longest + 8) :], skip_special_tokens=params.skip_special_tokens
            )
            matched = next((s for s in params.stop if s in tail), None)
            if matched is not None:
                req.finished_reason = finish_matched_str(matched)

    def finish(self, req: Req) -> None:
        """Collects the routed experts (before the KV goes) and releases the request."""
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req.return_routed_experts and req.req_pool_idx is not None:
            if req.kv_len >= req.seq_len - 1:
                rows = self.runner.capturer.get_routed_experts(
                    req.req_pool_idx, req.seq_len, self.runner.req_to_token_pool
                )
                req.routed_experts = rows[req.routed_experts_start_len :]
        self.memory.release(req, cache=True)

    def abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self.memory.release(req, cache=False)
                req.finished_reason = finish_abort()
                self.send_outputs([req])
                return
        for req in self.running + ([self.chunked] if self.chunked else []):
            if req.rid == rid:
                req.finished_reason = finish_abort()
                self.finish(req)
                self.send_outputs([req])
                return

    def send_outputs(self, reqs: list[Req]) -> None:
        interval = self.server_args.stream_interval
        out = [
            r for r in reqs
            if r.finished or (r.stream and len(r.output_ids) - r.sent_len >= interval)
        ]
        if not out:
            return
        msg = BatchTokenIDOut(
            rids=[r.rid for r in out],
            new_output_ids=[r.output_ids[r.sent_len :] for r in out],
            finished_reasons=[r.finished_reason for r in out],
            prompt_tokens=[len(r.origin_input_ids) for r in out],
            completion_tokens=[len(r.output_ids) for r in out],
            cached_tokens=[r.cached_tokens for r in out],
            stop_strs=[list(r.sampling_params.stop or []) for r in out],
            skip_special_tokens=[r.sampling_params.skip_special_tokens for r in out],
            output_routed_experts=[r.routed_experts for r in out],
        )
        for r in out:
            r.sent_len = len(r.output_ids)
        self.send_socket.send_pyobj(msg)

    # -- control --------------------------------------------------------------------------------
    def flush_cache(self) -> FlushCacheReqOutput:
        if self.waiting or self.running or self.chunked:
            return FlushCacheReqOutput(success=False, message="requests are still running")
        self.memory.flush()
        return FlushCacheReqOutput(success=True)

    def server_info(self) -> dict[str, Any]:
        return {
            **self.memory.stats(),
            "num_running_reqs": len(self.running) + (1 if self.chunked else 0),
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


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe: Any) -> None:
    configure_logging(server_args.log_level, prefix="scheduler")
    watch_parent()
    enable_compilation_cache(server_args)
    try:
        t0 = time.perf_counter()
        scheduler = Scheduler(server_args, port_args)
        runner = scheduler.runner
        pipe.send({
            "status": "ready",
            "pid": os.getpid(),
            "startup_seconds": time.perf_counter() - t0,
            "load_seconds": runner.load_seconds,
            "max_total_tokens": runner.max_total_tokens,
            "max_running_requests": runner.max_running_requests,
            "context_length": runner.context_len,
            "memory_bytes": runner.memory_report(),
            "num_compiles": runner.num_compiles,
        })
    except BaseException:
        pipe.send({"status": "error", "error": traceback.format_exc()})
        raise
    threading.current_thread().name = "scheduler"
    try:
        scheduler.event_loop()
    except BaseException:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        raise
