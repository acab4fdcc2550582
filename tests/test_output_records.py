"""The output records between processes (M17): what the scheduler's OutputSender gives for a
request arrives as the same ReqOutput, field by field, through both hops (real ZMQ sockets, a
real DetokenizerManager with the bundled tokenizer), the detokenizer changing only the text."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from sgl_jax.srt.managers.detokenizer_manager import DetokenizerManager
from sgl_jax.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut, ReqOutput
from sgl_jax.srt.managers.output_sender import OutputSender
from sgl_jax.srt.managers.request_options import RequestOptions
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.managers.transport import recv_obj, send_obj
from sgl_jax.srt.routed_experts_output import RoutedExpertsOut
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import PortArgs, ServerArgs

LAYERS, TOP_K = 3, 2
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def hops():
    """The scheduler's socket to a real detokenizer, and the socket it sends on to."""
    port_args = PortArgs.new()
    detok = DetokenizerManager(ServerArgs(), port_args)
    ctx = zmq.Context()
    to_detok = ctx.socket(zmq.PUSH)
    to_detok.connect(port_args.detokenizer_ipc)
    manager = ctx.socket(zmq.PULL)
    manager.bind(port_args.tokenizer_ipc)
    yield to_detok, detok, manager
    for sock in (to_detok, manager, detok.recv_socket, detok.send_socket):
        sock.close(linger=0)
    ctx.term()
    port_args.remove()


def _through(hops, sender: OutputSender, reqs: list[Req]) -> tuple[BatchTokenIDOut, BatchStrOut]:
    """One message through both hops: as the detokenizer got it, and as the manager got it."""
    _, detok, manager = hops
    sender.send(reqs)
    got = recv_obj(detok.recv_socket)
    send_obj(detok.send_socket, detok.handle_batch_token_id_out(got))
    return got, recv_obj(manager)


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, (n, LAYERS, TOP_K)).astype(np.int32)


def test_every_field_arrives_as_the_sender_gave_it(hops) -> None:
    streamed = _rows(2, 0)
    sender = OutputSender(hops[0], stream_interval=1,
                          routed_rows_of=lambda req, start, weights=False, raw=False:
                          streamed.astype(np.float32) / 8 if weights else streamed)
    plain = Req(rid="plain", origin_input_ids=PROMPT, seed=0, stream=True,
                sampling_params=SamplingParams(max_new_tokens=8, stop=["xyz", "\n\n"],
                                               skip_special_tokens=False))
    plain.output_ids, plain.cached_tokens, plain.first_token_time = [21, 22], 3, 12.5
    stream = Req(rid="stream", origin_input_ids=PROMPT, seed=0, stream=True,
                 sampling_params=SamplingParams(max_new_tokens=8),
                 options=RequestOptions(return_routed_experts=True, routed_experts_start_len=1,
                                        return_routed_expert_weights=True,
                                        routed_expert_weights_dtype="float16",
                                        return_logprob=True, top_logprobs_num=2))
    stream.output_ids = [31]
    stream.logprobs.add("output", -0.25, 31, np.array([-0.25, -2.0]), np.array([31, 7]),
                        np.zeros(0))
    done = Req(rid="done", origin_input_ids=PROMPT, seed=0,
               sampling_params=SamplingParams(max_new_tokens=1),
               options=RequestOptions(return_routed_experts=True, routed_experts_dtype="uint8"))
    done.output_ids, done.finished_reason = [41], {"type": "length", "length": 1}
    done.routed_experts = _rows(5, 1)
    done.routed_experts[0, 0] = -1  # a layer without a router

    got, out = _through(hops, sender, [plain, stream, done])

    assert isinstance(out, BatchStrOut) and len(out) == 3
    recs = out.outputs
    assert all(type(r) is ReqOutput for r in recs)
    assert recs[0]._replace(text="") == ReqOutput(
        rid="plain", new_ids=[21, 22], finish_reason=None, prompt_tokens=5,
        completion_tokens=2, cached_tokens=3, stop=("xyz", "\n\n"), skip_special_tokens=False,
        first_token_time=12.5)
    assert recs[1].logprobs == {"output_token_logprobs": [(-0.25, 31)],
                                "output_top_logprobs": [[(-0.25, 31), (-2.0, 7)]]}
    assert (recs[1].rid, recs[1].new_ids, recs[1].stop, recs[1].first_token_time) == \
        ("stream", [31], (), None)
    assert recs[2].finish_reason == {"type": "length", "length": 1}
    assert recs[0].routed is None and recs[0].logprobs is None and recs[2].logprobs is None

    routed = recs[1].routed
    assert type(routed) is RoutedExpertsOut and routed.start == 1
    np.testing.assert_array_equal(routed.ids, streamed)
    assert routed.weights.dtype == np.float16
    np.testing.assert_array_equal(routed.weights, (streamed / 8).astype(np.float16))
    final = recs[2].routed
    assert final.ids.dtype == np.uint8 and final.start == 0 and final.weights is None
    assert final.ids[0, 0, 0] == 255  # the uint8 no-router marker
    np.testing.assert_array_equal(final.ids[1:], done.routed_experts[1:])

    # The detokenizer changed the text alone: the records it got are the manager's but that.
    assert [r._replace(text="", routed=None) for r in got.outputs] == \
        [r._replace(text="", routed=None) for r in recs]
    assert [r.text for r in got.outputs] == ["", "", ""]
    assert recs[2].text  # a finished request's text is all flushed
    assert sender.pack([plain]) is None  # sent: nothing is due until it grows


def test_records_built_by_hand_travel_the_same(hops) -> None:
    to_detok, detok, manager = hops
    recs = [ReqOutput(rid=f"h{i}", new_ids=[50 + i], finish_reason={"type": "abort"},
                      prompt_tokens=1, completion_tokens=1, cached_tokens=0, stop=(),
                      skip_special_tokens=True,
                      routed=RoutedExpertsOut(_rows(1, i), start=4) if i % 2 else None)
            for i in range(5)]
    send_obj(to_detok, BatchTokenIDOut(outputs=recs, weight_version="7"))
    send_obj(detok.send_socket, detok.handle_batch_token_id_out(recv_obj(detok.recv_socket)))
    out = recv_obj(manager)
    assert out.weight_version == "7"
    assert [r.rid for r in out.outputs] == [r.rid for r in recs]
    for sent, arrived in zip(recs, out.outputs, strict=True):
        assert (arrived.routed is None) == (sent.routed is None)
        if sent.routed is not None:
            assert arrived.routed.start == 4
            np.testing.assert_array_equal(arrived.routed.ids, sent.routed.ids)


def test_an_empty_batch_pickles() -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        send_obj(push, BatchStrOut(outputs=[]))
        got = recv_obj(pull)
        assert len(got) == 0 and got.outputs == [] and got.weight_version == "0"
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_a_record_needs_all_its_values() -> None:
    with pytest.raises(ValueError, match="12 values for 13 fields"):
        BatchTokenIDOut.of_values([("r", [1], None, 1, 1, 0, (), True, "", None, None, None)])
