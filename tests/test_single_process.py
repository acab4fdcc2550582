"""Single-process mode (M18): ``Engine(enable_single_process=True)`` runs the scheduler and the
detokenizer as threads of this process, on its JAX runtime.

Outputs are checked against the independent float64 reference (tokens and routed-experts rows)
and against the multi-process engine (the same bytes); the threads, the event loops, the
caller's mesh, shutdown and a real failure of the scheduler's step are driven for real.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest
from jax.sharding import Mesh
from tqdm._monitor import TMonitor

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.entrypoints.engine import EngineStartupError
from sgl_jax.srt.managers.tokenizer_manager import EngineDeadError
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.testing import (
    TEST_MODEL_PATH,
    engine_args,
    fake_devices_flags,
    server_flags,
    wait_until,
)
from tests.engine_utils import (
    assert_no_leak,
    decoded_rows,
    expected_rows,
    prompt_ids,
    reference_greedy,
)
from tests.server_utils import start_server

CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
GREEDY = {"temperature": 0.0, "ignore_eos": True}
ARGS = engine_args(enable_return_routed_experts=True)
REPO = Path(__file__).absolute().parents[1]


@pytest.fixture(scope="module")
def single():
    eng = Engine(**ARGS, enable_single_process=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def multi():
    eng = Engine(**ARGS)
    yield eng
    eng.shutdown()


def check_against_reference(ids: list[int], out: dict) -> None:
    n = out["meta_info"]["completion_tokens"]
    assert out["output_ids"] == reference_greedy(ids, n)
    np.testing.assert_array_equal(decoded_rows(out, L, K), expected_rows(ids, out["output_ids"]))


def engine_threads() -> set[threading.Thread]:
    """Live threads but tqdm's monitor: a process-wide daemon that tqdm starts with the first
    progress bar of the process (the loading bar here, or a trainer's own) and keeps."""
    return {t for t in threading.enumerate() if not isinstance(t, TMonitor)}


def test_same_tokens_and_routed_experts_as_multi_process_and_reference(single, multi):
    assert not ServerArgs().enable_single_process  # the default stays multi-process
    assert set(multi.child_pids()) == {"scheduler", "detokenizer"}
    assert single.child_pids() == {}
    info = single.get_server_info()
    assert info["pid"] == os.getpid() and info["server_args"]["enable_single_process"]
    prompts = [prompt_ids(40 + i, 3 + 29 * i) for i in range(5)]
    params = [{**GREEDY, "max_new_tokens": 4 + 3 * i} for i in range(5)]
    outs = {}
    for name, eng in (("single", single), ("multi", multi)):
        outs[name] = eng.generate(input_ids=prompts, sampling_params=params,
                                  return_routed_experts=True)
        assert_no_leak(eng)
    for ids, a, b in zip(prompts, outs["single"], outs["multi"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        # Bit-exact: the same bytes on the wire.
        assert a["meta_info"]["routed_experts"] == b["meta_info"]["routed_experts"]
        check_against_reference(ids, a)


def test_generate_from_several_threads(single):
    """Sync generate from 6 threads and async_generate from 2 threads' own loops, at once."""
    prompts = [prompt_ids(100 + i, 5 + 11 * i) for i in range(8)]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def call(i: int) -> None:
        try:
            start.wait()
            kwargs = {"input_ids": prompts[i], "max_new_tokens": 6 + i,
                      "return_routed_experts": True, **GREEDY}
            if i % 4 == 3:
                results[i] = asyncio.run(single.async_generate(**kwargs))
            else:
                results[i] = single.generate(**kwargs)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i, ids in enumerate(prompts):
        check_against_reference(ids, results[i])
    assert_no_leak(single)


def test_inside_a_running_event_loop(single):
    """As in a notebook or an asyncio trainer: sync generate works (it blocks the caller's
    loop for its duration), and so do async_generate, concurrent and streaming."""
    prompts = [prompt_ids(200 + i, 7 + 5 * i) for i in range(4)]

    async def main() -> tuple:
        sync = single.generate(input_ids=prompts[0], max_new_tokens=5,
                               return_routed_experts=True, **GREEDY)
        gathered = await asyncio.gather(*(
            single.async_generate(input_ids=p, max_new_tokens=5, return_routed_experts=True,
                                  **GREEDY) for p in prompts[1:]))
        stream = await single.async_generate(input_ids=prompts[0], max_new_tokens=5,
                                             stream=True, **GREEDY)
        chunks = [c async for c in stream]
        return sync, gathered, chunks

    sync, gathered, chunks = asyncio.run(main())
    check_against_reference(prompts[0], sync)
    for ids, out in zip(prompts[1:], gathered, strict=True):
        check_against_reference(ids, out)
    assert sum((c["output_ids"] for c in chunks), []) == sync["output_ids"]
    assert_no_leak(single)


def test_bad_mesh_or_devices_are_clear_errors():
    one = np.array(jax.devices()[:1])
    good = Mesh(one.reshape(1, 1), ("expert", "tensor"))
    cases = [
        ({"mesh": Mesh(one.reshape(1, 1), ("data", "model"))}, "needs exactly"),
        ({"mesh": good, "tp_size": 2}, r"'tensor' 1 x 'expert' 1 but tp_size=2"),
        ({"mesh": one}, "must be a jax.sharding.Mesh"),
        ({"mesh": good, "enable_single_process": False}, "needs enable_single_process=True"),
        ({"mesh": good, "device_indexes": [0]}, "either mesh or device_indexes"),
        ({"device_indexes": [0, 0]}, "distinct device positions"),
        ({"enable_single_process": True, "nnodes": 2, "dist_init_addr": "127.0.0.1:1"},
         "runs on one node"),
    ]
    for kwargs, message in cases:
        kwargs = {"enable_single_process": True, **kwargs}
        with pytest.raises(ValueError, match=message):
            Engine(**engine_args(**kwargs))
    before = engine_threads()
    # Only the scheduler knows the devices: a start-up error naming the bad index.
    with pytest.raises(EngineStartupError, match=r"device_indexes=\[5\]: \[5\] not in"):
        Engine(**engine_args(enable_single_process=True, device_indexes=[5]))
    assert engine_threads() == before


def test_multi_device_mesh_and_device_indexes():
    """A 2 x 2 mesh the caller built (devices in an order of its own) and device_indexes, on
    4 fake CPU devices in a process of their own (tests/single_process_mesh_worker.py)."""
    prompts = [prompt_ids(300 + i, 6 + 17 * i) for i in range(3)]
    env = {**os.environ, "XLA_FLAGS": fake_devices_flags(4),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.single_process_mesh_worker", json.dumps([prompts, 6])],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    mesh, picked = report["mesh"], report["device_indexes"]
    assert mesh["devices"] == [0, 1, 2, 3] and mesh["max_devices_per_array"] == 4
    assert picked["devices"] == [2, 3] and picked["max_devices_per_array"] == 2
    for run in (mesh, picked):
        assert run["child_pids"] == {}
        for ids, out_ids, rows in zip(prompts, run["output_ids"], run["routed_experts"],
                                      strict=True):
            out = {"output_ids": out_ids,
                   "meta_info": {"routed_experts": rows, "completion_tokens": len(out_ids)}}
            check_against_reference(ids, out)


def test_given_mesh_context_manager_and_shutdown_leave_no_thread():
    before = engine_threads()
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("expert", "tensor"))
    ids = prompt_ids(400, 9)
    with Engine(**ARGS, enable_single_process=True, mesh=mesh) as eng:
        assert eng.server_args.tp_size == eng.server_args.ep_size == 1
        check_against_reference(ids, eng.generate(input_ids=ids, max_new_tokens=5,
                                                  return_routed_experts=True, **GREEDY))
        # A call still waiting (generation paused) when another thread shuts the engine
        # down fails, clearly.
        eng.pause_generation()
        waiting: list[BaseException] = []

        def long_call() -> None:
            try:
                eng.generate(input_ids=ids, max_new_tokens=5, **GREEDY)
            except BaseException as e:  # reported below
                waiting.append(e)

        caller = threading.Thread(target=long_call)
        caller.start()
        assert wait_until(lambda: eng.get_server_info()["num_waiting_reqs"] == 1)
    caller.join(10)
    assert not caller.is_alive()
    assert len(waiting) == 1 and isinstance(waiting[0], EngineDeadError), waiting
    assert "shut down" in str(waiting[0])
    assert engine_threads() == before
    eng.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(input_ids=ids, max_new_tokens=2)


def test_failure_in_the_scheduler_thread_raises_in_the_caller():
    """A real failure of the step: the caller frees device arrays the engine holds (as a
    trainer freeing "its" memory might). Waiting and later calls raise, as after a child
    process's death, and shutdown still leaves no thread."""
    before_threads = engine_threads()
    keep = jax.live_arrays()  # held, so that no id below is reused by a new array
    before = {id(a) for a in keep}
    eng = Engine(**engine_args(enable_single_process=True))
    ids = prompt_ids(500, 6)
    assert eng.generate(input_ids=ids, max_new_tokens=3, **GREEDY)["output_ids"] == \
        reference_greedy(ids, 3)
    for array in jax.live_arrays():
        if id(array) not in before:
            array.delete()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"the scheduler thread failed \(\w+"):
        eng.generate(input_ids=ids, max_new_tokens=3)
    assert time.monotonic() - t0 < 10
    with pytest.raises(EngineDeadError, match="scheduler thread failed"):
        eng.generate(input_ids=ids, max_new_tokens=3)
    eng.shutdown()
    assert engine_threads() == before_threads


def test_http_server_with_enable_single_process():
    """The flag works for the server too (its default stays multi-process): one process,
    the same answers, SIGTERM exits 0."""
    server = start_server(server_flags(enable_return_routed_experts=True,
                                       enable_single_process=True))
    try:
        info = server.get("/get_server_info").json()
        assert info["pid"] == server.proc.pid and info["pids"] == {}
        assert psutil.Process(server.proc.pid).children() == []
        ids = prompt_ids(600, 11)
        out = server.post("/generate", json={
            "input_ids": ids, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 6, **GREEDY}}).json()
        check_against_reference(ids, out)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
