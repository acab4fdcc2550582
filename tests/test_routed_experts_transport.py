"""The cost side of routed experts (M9 items 2-3): the narrow, lazily written host table, the
finish-time gather of rows [start_len, n) only, and the transport between processes (rows out
of band, bounded messages), over real ZMQ sockets."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zmq

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.managers.io_struct import BatchTokenIDOut, ReqOutput
from sgl_jax.srt.managers.output_sender import OutputSender
from sgl_jax.srt.managers.req_memory import ReqMemory
from sgl_jax.srt.managers.request_options import RequestOptions
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.managers.transport import recv_obj, send_obj
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache
from sgl_jax.srt.routed_experts_output import RoutedExpertsOut
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.testing import TEST_MODEL_PATH

LAYERS, TOP_K = 48, 8


# -- the host table -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [(16, np.uint8), (128, np.uint8), (255, np.uint8), (256, np.uint16), (300, np.uint16),
     (65535, np.uint16)],
)
def test_host_table_dtype_is_the_narrowest_holding_ids_and_marker(num_experts, dtype) -> None:
    table = RoutedExpertsHostCache(64, 3, 4, num_experts)
    assert table.dtype == dtype
    rng = np.random.default_rng(num_experts)
    rows = rng.integers(0, num_experts, (10, 3, 4)).astype(np.int32)
    rows[:, 1] = -1  # a layer without a router
    rows[0, 0, 0] = num_experts - 1  # the largest id is not the marker
    slots = rng.permutation(64)[:10]
    table.write(slots, rows)
    out = table.gather(slots)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, rows)


def test_host_table_rejects_more_experts_than_uint16_holds() -> None:
    with pytest.raises(ValueError, match="65535"):
        RoutedExpertsHostCache(8, 2, 2, 65536)


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_host_table_is_written_lazily() -> None:
    slots = 200_000  # 73 MiB of uint8: far above malloc's mmap threshold
    before = _rss()
    table = RoutedExpertsHostCache(slots, LAYERS, TOP_K, 128)
    size = table.rows.nbytes
    assert size == slots * LAYERS * TOP_K  # one byte per id
    assert _rss() - before < size // 8, "the table was filled at construction"
    # Pages are committed as slots are written.
    table.write(np.arange(slots // 2), np.zeros((slots // 2, LAYERS, TOP_K), np.int32))
    assert _rss() - before > size // 3


# -- the finish-time gather ---------------------------------------------------------------------


def test_routed_rows_of_gathers_only_rows_from_start_len() -> None:
    alloc = TokenToKVPoolAllocator(256, page_size=1)
    table = RoutedExpertsHostCache(alloc.num_slots, LAYERS, TOP_K, 128)
    mem = ReqMemory(ReqToTokenPool(4, 128), alloc, RadixCache(alloc), table)
    prompt = list(range(40))
    req = Req(rid="r", origin_input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=8),
              seed=0, options=RequestOptions(return_routed_experts=True,
                                             routed_experts_start_len=30))
    assert mem.admit(req)
    slots = mem.alloc_kv(req, len(prompt))
    mem.assign_kv(req, slots)
    req.kv_len = len(prompt)
    req.output_ids = [7]  # seq_len 41: rows [30, 40)
    rows = np.random.default_rng(0).integers(0, 128, (len(prompt), LAYERS, TOP_K)).astype(np.int32)
    table.write(slots, rows)
    got = mem.routed_rows_of(req)
    assert got.shape == (10, LAYERS, TOP_K)
    np.testing.assert_array_equal(got, rows[30:40])
    np.testing.assert_array_equal(mem.routed_rows_of(req, start=35), rows[35:40])


# -- the transport ------------------------------------------------------------------------------


@pytest.fixture()
def pipe(tmp_path):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"ipc://{tmp_path}/pipe"
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def test_arrays_travel_out_of_band(pipe) -> None:
    push, pull = pipe
    rows = np.arange(4096 * LAYERS * TOP_K, dtype=np.int32).reshape(4096, LAYERS, TOP_K)
    msg = BatchTokenIDOut(outputs=[
        ReqOutput(rid=rid, new_ids=[i], finish_reason=None, prompt_tokens=1,
                  completion_tokens=1, cached_tokens=0, stop=[], skip_special_tokens=True,
                  routed=RoutedExpertsOut(ids, start=0))
        for i, (rid, ids) in enumerate([("a", rows), ("b", rows[:10].astype(np.uint8))])
    ])
    send_obj(push, msg)
    frames = pull.recv_multipart()
    assert len(frames) == 3  # the pickle, then each array's raw bytes
    assert len(frames[0]) < 2048  # the 6 MiB of rows are not in the pickle
    assert bytes(frames[1]) == rows.tobytes()
    send_obj(push, msg)
    got = recv_obj(pull)
    np.testing.assert_array_equal(got.outputs[0].routed.ids, rows)
    assert got.outputs[1].routed.ids.dtype == np.uint8
    send_obj(push, {"control": True})  # a message without arrays is one frame
    assert recv_obj(pull) == {"control": True}


def _finished(rid: str, n_rows: int, dtype: str = "int32") -> Req:
    req = Req(rid=rid, origin_input_ids=[1] * (n_rows + 1),
              sampling_params=SamplingParams(max_new_tokens=1), seed=0,
              options=RequestOptions(return_routed_experts=True, routed_experts_dtype=dtype))
    req.output_ids = [5]
    req.finished_reason = {"type": "length", "length": 1}
    rng = np.random.default_rng(abs(hash(rid)) % 1000)
    req.routed_experts = rng.integers(0, 128, (n_rows, LAYERS, TOP_K)).astype(np.int32)
    return req


def test_a_burst_of_finishing_requests_goes_out_in_bounded_messages(pipe) -> None:
    push, pull = pipe
    per_req = 512 * LAYERS * TOP_K * 4  # 768 KiB of int32 rows each
    limit = 2 * per_req + 1000
    sender = OutputSender(push, stream_interval=1, max_message_bytes=limit)
    big = _finished("big", 2048)  # 3 MiB: larger than the bound, goes alone
    reqs = [_finished(f"r{i}", 512) for i in range(7)]
    reqs.insert(3, big)
    expected = {r.rid: r.routed_experts.copy() for r in reqs}
    sender.send(reqs)

    got: dict[str, np.ndarray] = {}
    sizes = []
    while pull.poll(1000):
        msg = recv_obj(pull)
        assert isinstance(msg, BatchTokenIDOut)
        rids = [o.rid for o in msg.outputs]
        size = sum(o.routed.ids.nbytes for o in msg.outputs)
        sizes.append((rids, size))
        assert size <= limit or rids == ["big"], sizes
        for o in msg.outputs:
            got[o.rid] = o.routed.ids
    assert len(sizes) == 5, sizes  # [r0 r1] [r2] [big] [r3 r4] [r5 r6]
    assert [rids for rids, _ in sizes] == [["r0", "r1"], ["r2"], ["big"], ["r3", "r4"],
                                           ["r5", "r6"]]
    assert got.keys() == expected.keys()
    for rid, rows in expected.items():
        np.testing.assert_array_equal(got[rid], rows)


def test_bounded_messages_carry_the_wire_dtype(pipe) -> None:
    push, pull = pipe
    sender = OutputSender(push, stream_interval=1, max_message_bytes=1)
    reqs = [_finished("u8", 16, "uint8"), _finished("i32", 16)]
    reqs[0].routed_experts[:, 0] = -1
    sender.send(reqs)
    first, second = recv_obj(pull), recv_obj(pull)
    assert [o.rid for o in first.outputs] == ["u8"]
    assert [o.rid for o in second.outputs] == ["i32"]
    u8 = first.outputs[0].routed.ids
    assert u8.dtype == np.uint8 and (u8[:, 0] == 255).all()
    np.testing.assert_array_equal(u8[:, 1:], reqs[0].routed_experts[:, 1:])
    assert second.outputs[0].routed.ids.dtype == np.int32


def test_model_config_of_the_bundled_model_fits_uint8() -> None:
    cfg = ModelConfig.from_hf(TEST_MODEL_PATH)
    assert RoutedExpertsHostCache(4, cfg.num_hidden_layers, cfg.num_experts_per_tok,
                                  cfg.num_experts).dtype == np.uint8
