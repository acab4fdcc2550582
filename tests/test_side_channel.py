"""The side channel of the finish path (M21 item 3): a request's large routed-experts arrays go
from the scheduler's OutputSender straight to the tokenizer manager's receiver, and the message
through the (real) detokenizer carries only references; what arrives is bit-identical to what
the host table held, in every wire dtype, with routing weights, across several senders and when
the side data is still in flight."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from sgl_jax.srt.managers import transport
from sgl_jax.srt.managers.detokenizer_manager import DetokenizerManager
from sgl_jax.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut, ReqOutput
from sgl_jax.srt.managers.output_sender import OutputSender
from sgl_jax.srt.managers.request_options import RequestOptions
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.managers.transport import (
    SideArray,
    SideReceiver,
    SideSender,
    recv_obj,
    send_obj,
)
from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache
from sgl_jax.srt.routed_experts_codec import (
    extract_routed_expert_weights_from_meta_info,
    extract_routed_experts_from_meta_info,
    to_wire_dtype,
)
from sgl_jax.srt.routed_experts_output import RoutedExpertsOut
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import PortArgs, ServerArgs

LAYERS, TOP_K, EXPERTS = 4, 3, 16
PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture()
def hops():
    """Scheduler socket -> real detokenizer -> manager socket, and the side channel between
    the scheduler and the manager."""
    port_args = PortArgs.new()
    detok = DetokenizerManager(ServerArgs(), port_args)
    ctx = zmq.Context()
    to_detok = ctx.socket(zmq.PUSH)
    to_detok.connect(port_args.detokenizer_ipc)
    manager = ctx.socket(zmq.PULL)
    manager.bind(port_args.tokenizer_ipc)
    side_in = SideReceiver(ctx, port_args.tokenizer_ipc)
    side_out = SideSender(ctx, port_args.tokenizer_ipc, min_bytes=0)
    yield to_detok, detok, manager, side_out, side_in, port_args
    side_in.close()
    side_out.close()
    for sock in (to_detok, manager, detok.recv_socket, detok.send_socket):
        sock.close(linger=0)
    ctx.term()
    port_args.remove()


def _table_with_rows(n: int) -> tuple[RoutedExpertsHostCache, np.ndarray, np.ndarray]:
    """A host table holding ``n`` rows (layer 1 without a router), their slots and the int32
    rows written."""
    table = RoutedExpertsHostCache(4 * n, LAYERS, TOP_K, EXPERTS, weights=True)
    rng = np.random.default_rng(n)
    slots = rng.permutation(4 * n)[:n]
    rows = rng.integers(0, EXPERTS, (n, LAYERS, TOP_K)).astype(np.int32)
    rows[:, 1] = -1
    table.write(slots, rows)
    table.write_weights(slots, rng.random((n, LAYERS, TOP_K), dtype=np.float32))
    table.set_valid(slots, True)
    return table, slots, rows


def _finished(rid: str, table: RoutedExpertsHostCache, slots: np.ndarray, dtype: str,
              weights: bool) -> Req:
    req = Req(rid=rid, origin_input_ids=PROMPT, seed=0, stream=False,
              sampling_params=SamplingParams(max_new_tokens=1),
              options=RequestOptions(return_routed_experts=True, routed_experts_dtype=dtype,
                                     return_routed_expert_weights=weights))
    req.output_ids = [7]
    req.finished_reason = {"type": "length", "length": 1}
    req.routed_experts = table.gather(slots, raw=True)  # as the scheduler gathers them
    req.routed_expert_weights = table.gather_weights(slots) if weights else None
    return req


def _through(hops, sender: OutputSender, reqs: list[Req]) -> tuple[BatchTokenIDOut,
                                                                    BatchStrOut]:
    """One message through the detokenizer, and the manager's receive with the side channel."""
    _, detok, manager, _, side_in, _ = hops
    sender.send(reqs)
    got = recv_obj(detok.recv_socket)
    send_obj(detok.send_socket, detok.handle_batch_token_id_out(got))
    return got, recv_obj(manager, side=side_in)


@pytest.mark.parametrize("dtype", ["int32", "int16", "uint16", "uint8"])
def test_rows_skip_the_detokenizer_and_arrive_exact(hops, dtype: str) -> None:
    to_detok, _, _, side_out, side_in, _ = hops
    table, slots, rows = _table_with_rows(50)
    sender = OutputSender(to_detok, stream_interval=1, side=side_out)
    reqs = [_finished("a", table, slots, dtype, weights=True),
            _finished("b", table, slots[:20], dtype, weights=False)]
    got, out = _through(hops, sender, reqs)

    # The detokenizer held references only (the arrays never crossed it).
    packed = got._wire_columns()[ReqOutput._fields.index("routed")]
    assert all(type(a) is SideArray for a in packed[1])
    assert type(packed[3][0]) is SideArray and packed[3][1] is None
    # The manager got the arrays, equal to the host table's rows in the wire dtype.
    first, second = out.outputs[0].routed, out.outputs[1].routed
    assert type(first) is RoutedExpertsOut and first.ids.dtype == np.dtype(dtype).newbyteorder("<")
    np.testing.assert_array_equal(first.ids, to_wire_dtype(rows, dtype))
    np.testing.assert_array_equal(second.ids, to_wire_dtype(rows[:20], dtype))
    np.testing.assert_array_equal(first.weights, table.gather_weights(slots))
    assert second.weights is None
    assert not first.ids.flags.writeable  # a view of the received frame
    # The meta_info the manager builds decodes to the host table's int32 rows.
    meta = {"meta_info": first.meta_info()}
    np.testing.assert_array_equal(
        extract_routed_experts_from_meta_info(meta).reshape(rows.shape).astype(np.int32)
        if dtype.startswith("int") else extract_routed_experts_from_meta_info(meta),
        to_wire_dtype(rows, dtype) if not dtype.startswith("int") else rows)
    np.testing.assert_array_equal(extract_routed_expert_weights_from_meta_info(meta),
                                  table.gather_weights(slots))
    assert side_in.pending() == 0  # nothing left behind


def test_small_arrays_stay_in_the_message(hops) -> None:
    to_detok, _, _, _, side_in, port_args = hops
    ctx = zmq.Context.instance()
    side_out = SideSender(ctx, port_args.tokenizer_ipc)  # the default threshold (1 MiB)
    try:
        table, slots, rows = _table_with_rows(30)
        sender = OutputSender(to_detok, stream_interval=1, side=side_out)
        got, out = _through(hops, sender, [_finished("s", table, slots, "int32", True)])
        packed = got._wire_columns()[ReqOutput._fields.index("routed")]
        assert type(packed[1][0]) is np.ndarray  # 30 rows: far below 1 MiB
        np.testing.assert_array_equal(out.outputs[0].routed.ids, rows)
        big = np.zeros((1 << 20) // 4, np.int32)
        assert type(side_out.put(big)) is SideArray
        assert side_out.put(big[::2]) is not None and type(side_out.put(big[::2])) is np.ndarray
    finally:
        side_out.close()


def test_side_data_of_several_senders_and_still_in_flight(hops) -> None:
    """Two schedulers' side data interleaved with their messages in another order, and a
    message whose side data is sent after it: every array reaches its own message."""
    to_detok, detok, manager, side_a, side_in, port_args = hops
    ctx = zmq.Context.instance()
    side_b = SideSender(ctx, port_args.tokenizer_ipc, min_bytes=0)
    try:
        arrays = {name: np.full((3, 2), i, np.int32) for i, name in enumerate("abc")}

        def message(name: str, side: SideSender) -> BatchTokenIDOut:
            rec = ReqOutput(rid=name, new_ids=[1], finish_reason=None, prompt_tokens=1,
                            completion_tokens=1, cached_tokens=0, stop=(),
                            skip_special_tokens=True,
                            routed=RoutedExpertsOut(side.put(arrays[name]), start=0))
            return BatchTokenIDOut(outputs=[rec])

        msg_a, msg_b = message("a", side_a), message("b", side_b)
        side_a.flush()
        side_b.flush()
        msg_c = message("c", side_a)  # its side data goes out only after the message
        for msg in (msg_b, msg_a, msg_c):
            send_obj(to_detok, msg)
            send_obj(detok.send_socket, detok.handle_batch_token_id_out(
                recv_obj(detok.recv_socket)))
        late = threading.Timer(0.3, side_a.flush)
        late.start()
        got = [recv_obj(manager, side=side_in) for _ in range(3)]
        late.join()
        for out, name in zip(got, "bac", strict=True):
            rec = out.outputs[0]
            assert rec.rid == name
            np.testing.assert_array_equal(rec.routed.ids, arrays[name])
        assert side_in.pending() == 0
    finally:
        side_b.close()


def test_missing_side_data_fails_instead_of_hanging(hops, monkeypatch) -> None:
    to_detok, detok, manager, side_out, side_in, _ = hops
    monkeypatch.setattr(transport, "SIDE_WAIT_S", 0.3)
    rec = ReqOutput(rid="lost", new_ids=[1], finish_reason=None, prompt_tokens=1,
                    completion_tokens=1, cached_tokens=0, stop=(), skip_special_tokens=True,
                    routed=RoutedExpertsOut(side_out.put(np.ones((2, 2), np.int32)), start=0))
    send_obj(to_detok, BatchTokenIDOut(outputs=[rec]))  # its side data is never flushed
    send_obj(detok.send_socket, detok.handle_batch_token_id_out(recv_obj(detok.recv_socket)))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        recv_obj(manager, side=side_in)
    assert time.monotonic() - t0 < 5
