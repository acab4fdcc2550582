"""Abort semantics of the routed experts, with a real Scheduler stepped in the test process.

An aborted request returns its tokens so far and the rows of every token whose routing was
computed for it (docs/routed_experts.md), never stale ones. The races are made deterministic by
stepping the scheduler (``run_step``) ourselves: with overlap scheduling one step is in flight
after each call (``scheduler.pending``), and the abort arrives over the scheduler's real ZMQ
socket exactly while a chosen step is in flight. Rows are compared with the independent float64
reference forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.managers.io_struct import AbortReq, BatchTokenIDOut, TokenizedGenerateReqInput
from sgl_jax.srt.managers.request_options import RequestOptions
from sgl_jax.srt.managers.scheduler import Scheduler
from sgl_jax.srt.managers.transport import recv_obj
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.testing import TEST_MODEL_PATH, engine_args
from tests.engine_utils import expected_rows, prompt_ids, reference

CHUNK = 16
CFG = ModelConfig.from_hf(TEST_MODEL_PATH)


class SteppedScheduler:
    """A Scheduler in this process, fed and read through its own ZMQ sockets."""

    def __init__(self, **overrides) -> None:
        args = ServerArgs(**engine_args(**{
            "enable_return_routed_experts": True, "chunked_prefill_size": CHUNK,
            "precompile_token_paddings": [CHUNK], "precompile_bs_paddings": [1, 2],
            **overrides,
        }))
        self.port_args = PortArgs.new()
        self.ctx = zmq.Context()
        self.outputs = self.ctx.socket(zmq.PULL)  # where the detokenizer would listen
        self.outputs.bind(self.port_args.detokenizer_ipc)
        self.scheduler = Scheduler(args, self.port_args)
        self.inputs = self.ctx.socket(zmq.PUSH)
        self.inputs.connect(self.port_args.scheduler_ipc)
        self.seen: dict[str, dict] = {}  # rid -> outputs so far

    def send(self, msg) -> None:
        self.inputs.send_pyobj(msg)
        # Taken off the scheduler's own socket and processed now, exactly as the next step's
        # recv would: the race is ours to choose, whatever the ipc delivery timing.
        assert self.scheduler.recv_socket.poll(5000)
        self.scheduler.process_input(self.scheduler.recv_socket.recv_pyobj())

    def submit(self, rid: str, ids: list[int], max_new_tokens: int, asks: bool = True,
               **options) -> None:
        params = SamplingParams.from_dict(
            {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True})
        params.normalize()
        opts = RequestOptions(return_routed_experts=asks, **options).validate(len(ids), True)
        self.send(TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=params,
                                            options=opts))

    def step(self) -> None:
        self.scheduler.run_step()

    def in_flight(self, rid: str) -> tuple[bool, bool] | None:
        """(in the step in flight, and that step samples its next token), or None."""
        pending = self.scheduler.pending
        if pending is None:
            return None
        batch = pending[0]
        for req, samples in zip(batch.reqs, batch.samples_output, strict=True):
            if req.rid == rid:
                return True, samples
        return None

    def finished(self, rid: str, timeout_ms: int = 5000) -> dict:
        """The request's outputs, accumulated until its final message (other requests'
        messages read meanwhile are kept for them)."""
        while not self._final(rid):
            assert self.outputs.poll(timeout_ms), f"no final output for {rid}"
            msg = recv_obj(self.outputs)
            assert isinstance(msg, BatchTokenIDOut)
            for rec in msg.outputs:
                out = self.seen.setdefault(rec.rid, {"output_ids": [], "routed_experts": None,
                                                     "finished_reason": None})
                out["output_ids"] += rec.new_ids
                out["finished_reason"] = rec.finish_reason
                out["routed_experts"] = None if rec.routed is None else rec.routed.ids
        return self.seen.pop(rid)

    def _final(self, rid: str) -> bool:
        return rid in self.seen and self.seen[rid]["finished_reason"] is not None

    def assert_idle_and_leak_free(self) -> None:
        s = self.scheduler
        s.drain()
        assert not s.policy.has_work()
        states = s.memory.states  # per-request state slots go back with the request
        assert states.available() == states.num_slots
        stats = s.memory.stats()
        assert stats["locked_kv_slots"] == 0
        assert stats["available_kv_slots"] + stats["evictable_kv_slots"] == stats["total_kv_slots"]
        assert stats["free_req_slots"] == stats["total_req_slots"]

    def close(self) -> None:
        # The scheduler's own sockets and context too: left to the garbage collector, a
        # context whose socket is still open blocks in term() (the scheduler and its rooms
        # form a reference cycle, so the order they are collected in is not refcount's).
        for sock in (self.inputs, self.outputs):
            sock.close(linger=0)
        self.ctx.term()
        self.scheduler.close()
        self.port_args.remove()


@pytest.fixture(scope="module")
def sched():
    s = SteppedScheduler()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def leak_free(sched):
    yield
    sched.assert_idle_and_leak_free()


def reference_prompt_rows(ids: list[int]) -> np.ndarray:
    return reference().forward(ids).topk_ids


def test_abort_while_the_last_prefill_chunk_is_in_flight(sched):
    ids = prompt_ids(11, 2 * CHUNK + 8)  # chunks of 16, 16, 8
    sched.submit("last-chunk", ids, max_new_tokens=8)
    for _ in range(3):
        sched.step()
    assert sched.in_flight("last-chunk") == (True, True)  # the last chunk, not processed yet
    sched.send(AbortReq(rid="last-chunk"))
    sched.step()
    out = sched.finished("last-chunk")
    assert out["finished_reason"]["type"] == "abort"
    # The in-flight step was completed first: its routing was computed, its token sampled.
    assert out["output_ids"] == reference().greedy_generate(ids, 1)
    np.testing.assert_array_equal(out["routed_experts"], reference_prompt_rows(ids))


@pytest.mark.parametrize("start", [0, 5])
def test_abort_mid_chunk_returns_the_computed_rows(sched, start):
    ids = prompt_ids(12 + start, 3 * CHUNK + 4)
    rid = f"mid-chunk-{start}"
    sched.submit(rid, ids, max_new_tokens=8, routed_experts_start_len=start)
    sched.step()
    sched.step()
    assert sched.in_flight(rid) == (True, False)  # its second chunk, a chunk boundary
    sched.send(AbortReq(rid=rid))
    sched.step()
    out = sched.finished(rid)
    assert out["finished_reason"]["type"] == "abort" and out["output_ids"] == []
    # Two chunks' routing was computed: rows [start, 32).
    np.testing.assert_array_equal(out["routed_experts"],
                                  reference_prompt_rows(ids)[start : 2 * CHUNK])


def test_abort_while_decoding(sched):
    ids = prompt_ids(13, 10)
    sched.submit("decoding", ids, max_new_tokens=50)
    for _ in range(6):
        sched.step()
    assert sched.in_flight("decoding") == (True, True)
    sched.send(AbortReq(rid="decoding"))
    sched.step()
    out = sched.finished("decoding")
    assert out["finished_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 50
    assert out["output_ids"] == reference().greedy_generate(ids, len(out["output_ids"]))
    rows = out["routed_experts"]
    assert len(rows) == len(ids) + len(out["output_ids"]) - 1
    np.testing.assert_array_equal(rows, expected_rows(ids, out["output_ids"]))


def test_abort_before_it_starts_returns_no_rows(sched):
    ids = prompt_ids(14, 8)
    sched.submit("never-ran", ids, max_new_tokens=4)
    sched.send(AbortReq(rid="never-ran"))
    sched.step()
    out = sched.finished("never-ran")
    assert out["finished_reason"]["type"] == "abort" and out["output_ids"] == []
    assert out["routed_experts"].shape == (0, CFG.num_hidden_layers, CFG.num_experts_per_tok)


def test_abort_of_a_retracted_request_returns_the_rows_it_had():
    # Room for the two prompts but not for both to decode far: the newer one is retracted.
    s = SteppedScheduler(max_total_tokens=48, schedule_conservativeness=0.0)
    try:
        a, b = prompt_ids(15, 12), prompt_ids(16, 12)
        s.submit("older", a, max_new_tokens=30)
        s.submit("newer", b, max_new_tokens=30)
        for _ in range(40):
            s.step()
            if s.scheduler.policy.num_retractions:
                break
        assert s.scheduler.policy.num_retractions == 1
        retracted = s.scheduler.policy.waiting[0]
        assert retracted.rid == "newer" and retracted.req_pool_idx is None
        so_far = list(retracted.output_ids)
        s.send(AbortReq(rid="newer"))
        s.step()
        out = s.finished("newer")
        assert out["finished_reason"]["type"] == "abort" and out["output_ids"] == so_far
        np.testing.assert_array_equal(out["routed_experts"], expected_rows(b, so_far))
        while s.scheduler.policy.running or s.scheduler.policy.waiting or s.scheduler.pending:
            s.step()
        done = s.finished("older")
        assert done["finished_reason"]["type"] == "length"
        np.testing.assert_array_equal(done["routed_experts"], expected_rows(a, done["output_ids"]))
        s.assert_idle_and_leak_free()
    finally:
        s.close()
