"""The shared-memory arena of the finish path (``shm_arena.py``): large routed-experts arrays
go from the scheduler to the tokenizer manager through memory both map, the message through the
(real) detokenizer carries a reference; what arrives is the host table's rows bit for bit; a
range is lent to the reader's views until the last one is gone and then reused; an arena with
no room sends through the socket instead; a reference to anything but the arena is refused;
and the writer can be another process (the scheduler's, as in a server)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import zmq

from sgl_jax.srt.managers.io_struct import ReqOutput
from sgl_jax.srt.managers.output_sender import OutputSender
from sgl_jax.srt.managers.shm_arena import ArenaReader, ArenaRef, ArenaWriter, is_borrowed
from sgl_jax.srt.managers.transport import SideArray, SideSender, recv_obj, send_obj
from sgl_jax.srt.routed_experts_codec import to_wire_dtype
from tests.test_side_channel import _finished, _table_with_rows, _through, hops  # noqa: F401

MiB = 1 << 20


@pytest.fixture()
def arena_hops(hops):  # noqa: F811 (the fixture imported above)
    """``hops`` whose side sender has an arena of 4 MiB."""
    to_detok, detok, manager, side_out, side_in, port_args = hops
    arena = ArenaWriter.create(4)
    assert arena is not None  # Linux: a memfd
    side = SideSender(zmq.Context.instance(), port_args.tokenizer_ipc, min_bytes=0, arena=arena)
    yield to_detok, detok, manager, side, side_in, port_args
    side.close()


@pytest.mark.parametrize("dtype", ["int32", "int16", "uint8", "uint16"])
def test_rows_go_through_the_arena_exact(arena_hops, dtype: str) -> None:
    to_detok, _, _, side, side_in, _ = arena_hops
    table, slots, rows = _table_with_rows(60)
    sender = OutputSender(to_detok, stream_interval=1, side=side)
    got, out = _through(arena_hops, sender, [_finished("a", table, slots, dtype, weights=True)])
    packed = got._wire_columns()[ReqOutput._fields.index("routed")]
    assert type(packed[1][0]) is ArenaRef and type(packed[3][0]) is ArenaRef  # ids, weights
    # Narrow rows to a signed wire dtype are cast by the copy into the arena; the reference
    # names the wire dtype.
    assert np.dtype(packed[1][0].dtype) == np.dtype(dtype)
    routed = out.outputs[0].routed
    assert routed.ids.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(routed.ids, to_wire_dtype(rows, dtype))
    np.testing.assert_array_equal(routed.weights, table.gather_weights(slots))
    assert is_borrowed(routed.ids) and not routed.ids.flags.writeable
    assert side.arena.in_use() == 2
    del got, out, routed
    gc.collect()
    assert side.arena.in_use() == 0  # the views are gone: the ranges are free
    assert side_in.pending() == 0  # nothing went through the socket


def test_a_range_lives_as_long_as_any_view_of_it() -> None:
    writer, reader = ArenaWriter.create(1), ArenaReader()
    try:
        ref = writer.put(np.arange(1000, dtype=np.int32))
        array = reader.array(ref.name, ref.pid, ref.fd, ref.slot, ref.offset, ref.dtype,
                             ref.shape)
        view = array[10:20][::2]
        del array
        gc.collect()
        assert writer.in_use() == 1 and is_borrowed(view)
        np.testing.assert_array_equal(view, np.arange(10, 20, 2))
        # The range is taken: a new array goes elsewhere and does not overwrite it.
        other = writer.put(np.full(1000, -1, np.int32))
        assert other.offset >= ref.offset + 4000
        np.testing.assert_array_equal(view, np.arange(10, 20, 2))
        del view
        gc.collect()
        assert writer.in_use() == 1  # only ``other``, never read, is still taken
        assert not is_borrowed(np.arange(3))
    finally:
        writer.close()


def test_a_full_arena_sends_through_the_socket(arena_hops) -> None:
    to_detok, detok, manager, side, side_in, _ = arena_hops
    first = np.arange(3 * MiB // 4, dtype=np.int32)  # 3 MiB of the 4
    second = np.arange(2 * MiB // 4, dtype=np.int32) * 7  # no room left: the socket
    refs = [side.put(first), side.put(second)]
    assert type(refs[0]) is ArenaRef and type(refs[1]) is SideArray
    side.flush()
    for i, ref in enumerate(refs):
        send_obj(to_detok, ref)
        send_obj(detok.send_socket, recv_obj(detok.recv_socket))
        np.testing.assert_array_equal(recv_obj(manager, side=side_in), (first, second)[i])
    gc.collect()
    third = side.put(second)  # the first range was released when its array was dropped
    assert type(third) is ArenaRef


def test_a_cast_on_the_way_equals_astype_through_either_path(arena_hops) -> None:
    to_detok, detok, manager, side, side_in, _ = arena_hops
    rows = np.random.default_rng(3).integers(-1, 127, (MiB // 4,), dtype=np.int8)
    # Into the arena (1 MiB of int32, cast by the copy), then with the arena full, the socket.
    hog = side.put(np.zeros(3 * MiB // 4, np.int32))
    refs = [side.put(rows, np.dtype(np.int32)), side.put(rows, np.dtype(np.int32))]
    assert type(hog) is ArenaRef
    assert type(refs[0]) is ArenaRef and type(refs[1]) is SideArray
    side.flush()
    for ref in refs:
        send_obj(to_detok, ref)
        send_obj(detok.send_socket, recv_obj(detok.recv_socket))
        got = recv_obj(manager, side=side_in)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, rows.astype(np.int32))


def test_a_reference_to_anything_else_is_refused() -> None:
    writer, reader = ArenaWriter.create(1), ArenaReader()
    try:
        ref = writer.put(np.zeros(100, np.int32))
        with tempfile.TemporaryFile() as other:  # an open file, not the arena
            with pytest.raises(ValueError, match="not the arena"):
                reader.array(ref.name, os.getpid(), other.fileno(), 0, ref.offset, "<i4", (100,))
        with pytest.raises(ValueError, match="out of range"):
            reader.array(ref.name, ref.pid, ref.fd, 0, writer.size - 8, "<i4", (100,))
        with pytest.raises(ValueError, match="out of range"):  # a negative size
            reader.array(ref.name, ref.pid, ref.fd, 0, ref.offset, "<i4", (-1, 100))
        with pytest.raises(ValueError, match="not the arena"):
            reader.array("../../etc/passwd", ref.pid, ref.fd, 0, ref.offset, "<i4", (100,))
    finally:
        writer.close()


def test_another_process_writes_and_sees_its_ranges_released(tmp_path) -> None:
    """The writer in its own process (as the scheduler): the rows it put arrive exact, and
    once this process drops them the writer sees its ranges free."""
    address = f"ipc://{tmp_path}/arena"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(address)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import numpy as np, zmq
        from sgl_jax.srt.managers.shm_arena import ArenaWriter
        from sgl_jax.srt.managers.transport import send_obj, recv_obj
        sock = zmq.Context.instance().socket(zmq.PAIR)
        sock.connect({address!r})
        arena = ArenaWriter.create(16)  # room for both (6 MiB each)
        rows = np.random.default_rng(0).integers(0, 128, (4096, 48, 8)).astype(np.int32)
        send_obj(sock, [arena.put(rows), arena.put(rows[::-1].copy())])
        assert recv_obj(sock) == "dropped"
        send_obj(sock, arena.in_use())
    """)], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert sock.poll(60_000)
        reader_side = type("Side", (), {"arena": ArenaReader()})()
        got = recv_obj(sock, side=reader_side)
        rows = np.random.default_rng(0).integers(0, 128, (4096, 48, 8)).astype(np.int32)
        np.testing.assert_array_equal(got[0], rows)
        np.testing.assert_array_equal(got[1], rows[::-1])
        del got
        gc.collect()
        send_obj(sock, "dropped")
        assert sock.poll(60_000)
        assert recv_obj(sock) == 0
        assert child.wait(60) == 0
    finally:
        child.kill()
        sock.close(linger=0)


# -- through a real server and Engine ------------------------------------------------------------
PROMPT_TOKENS = 800  # x 48 layers x top-8 x 4 bytes = 1.2 MiB of rows: above SIDE_MIN_BYTES


@pytest.fixture(scope="module")
def routing_model(tmp_path_factory) -> str:
    """A random checkpoint with Qwen3-30B-A3B's routing shape (48 layers, 128 experts, top-8)."""
    from sgl_jax.tools.make_random_model import write_random_model

    path = str(tmp_path_factory.mktemp("routing"))
    write_random_model(path, "qwen3-30b-a3b-routing", {"max_position_embeddings": 2048},
                       seed=0, check_routing=False)
    return path


PROMPT = np.random.default_rng(1).integers(10, 500, PROMPT_TOKENS).tolist()
SETTINGS = dict(enable_return_routed_experts=True, context_length=2048, max_total_tokens=4096,
                precompile_bs_paddings=[1], chunked_prefill_size=256)
GREEDY = {"max_new_tokens": 2, "temperature": 0.0}


def test_server_answers_large_rows_from_the_arena_exact(request, routing_model) -> None:
    """Int32 rows (1.2 MiB: through the arena; MessagePack sends them from it) equal the same
    request's uint8 rows (0.3 MiB: inside the message, no arena) on both routes; and many more
    than the arena holds, one after another, all arrive (ranges are released once sent, or
    the socket takes over)."""
    import httpx
    import msgpack

    from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
    from sgl_jax.testing import server_flags
    from tests.server_utils import server_fixture

    # An arena of 2 MiB: one request's rows at a time.
    flags = server_flags(model_path=routing_model, routed_experts_shm_mb=2, **SETTINGS)
    server_gen = server_fixture(request, flags)
    server = next(server_gen)
    try:
        def body(dtype: str) -> dict:
            return {"input_ids": PROMPT, "return_routed_experts": True,
                    "routed_experts_dtype": dtype, "sampling_params": GREEDY}

        with httpx.Client(timeout=300) as client:
            small = client.post(server.url + "/generate", json=body("uint8")).json()
            want = extract_routed_experts_from_meta_info(small).astype(np.int32)
            assert want.shape == (PROMPT_TOKENS + 1, 48, 8) and want.max() < 128
            big = client.post(server.url + "/generate", json=body("int32")).json()
            np.testing.assert_array_equal(extract_routed_experts_from_meta_info(big), want)
            for _ in range(4):  # 4 x 1.2 MiB through a 2 MiB arena
                r = client.post(server.url + "/generate", json=body("int32"),
                                headers={"Accept": "application/msgpack"})
                assert r.status_code == 200
                meta = msgpack.unpackb(r.content)["meta_info"]
                assert meta["routed_experts_shape"] == list(want.shape)
                np.testing.assert_array_equal(
                    np.frombuffer(meta["routed_experts"], "<i4").reshape(want.shape), want)
    finally:
        next(server_gen, None)


def test_engine_numpy_results_are_copies_not_views(routing_model) -> None:
    """An in-process caller keeps its arrays (an RL loop holds rollouts for a training step):
    they are its own, writable memory, not views that would pin the arena; and they equal the
    rows that came inside the message."""
    from sgl_jax.srt.entrypoints.engine import Engine
    from sgl_jax.testing import engine_args

    def rows(engine: Engine, dtype: str) -> np.ndarray:
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY,
                              return_routed_experts=True, routed_experts_dtype=dtype,
                              routed_experts_format="numpy")
        return out["meta_info"]["routed_experts"]

    with Engine(**engine_args(model_path=routing_model, **SETTINGS)) as engine:
        small, big = rows(engine, "uint8"), rows(engine, "int32")
    assert big.nbytes > MiB and big.dtype == np.int32
    assert not is_borrowed(big) and big.flags.writeable
    np.testing.assert_array_equal(big, small.astype(np.int32))
