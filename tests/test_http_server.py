"""The HTTP server, end to end: native routes, errors, auth, health, abort, disconnects, exit.

One server (with an API key and routed experts on) serves most tests; the tests that stop or
break a server start their own.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
import requests

from sgl_jax.srt.routed_experts_codec import (
    extract_routed_expert_weights_from_meta_info,
    extract_routed_experts_from_meta_info,
)
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.srt.utils import free_port
from sgl_jax.testing import ServerProcess, server_flags, wait_until
from sgl_jax.tools.make_random_model import write_random_model
from sgl_jax.tools.reference_forward import ReferenceModel, routed_experts_rows
from tests.server_utils import server_fixture, sse_events, start_server

ARGS = server_flags(enable_return_routed_experts=True, enable_return_routed_expert_weights=True)

API_KEY = "test-key"
LONG = {"max_new_tokens": 3000, "ignore_eos": True}  # ~10 s of decoding: must be aborted


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, ARGS,
                              api_key=API_KEY)


@pytest.fixture(scope="module")
def model_info(server):
    return server.get("/get_model_info").json()


@pytest.fixture(scope="module")
def reference(model_info):
    return ReferenceModel(model_info["model_path"])


def rows_of(result: dict, info: dict) -> np.ndarray:
    flat = extract_routed_experts_from_meta_info(result)
    assert flat is not None
    return flat.reshape(-1, info["num_hidden_layers"], info["num_experts_per_tok"])


def idle(server: ServerProcess) -> bool:
    info = server.get("/get_server_info").json()
    return info["num_running_reqs"] == 0 and info["free_req_slots"] == info["total_req_slots"]


# -- native /generate -----------------------------------------------------------------------------
def test_generate_text_with_routed_experts_matches_reference(server, model_info, reference):
    text = "The experts of a mixture"
    res = server.post("/generate", json={
        "text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_routed_experts": True, "routed_experts_start_len": 2,
    })
    assert res.status_code == 200, res.text
    out = res.json()
    meta = out["meta_info"]
    prompt_ids = Tokenizer.from_pretrained(model_info["model_path"]).encode(text)
    assert meta["prompt_tokens"] == len(prompt_ids)
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["finish_reason"]["type"] == "length"
    rows = rows_of(out, model_info)
    assert rows.shape[0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1 - 2
    expected = routed_experts_rows(reference, prompt_ids, out["output_ids"], start_len=2)
    np.testing.assert_array_equal(rows, expected)


def test_generate_batch_of_ids_and_stream_agree(server, model_info):
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    params = {"max_new_tokens": 5, "temperature": 0}
    res = server.post("/generate", json={"input_ids": prompts, "sampling_params": params,
                                         "rid": ["batch-a", "batch-b"]})
    assert res.status_code == 200, res.text
    batch = res.json()
    assert [r["index"] for r in batch] == [0, 1]
    assert [r["meta_info"]["id"] for r in batch] == ["batch-a", "batch-b"]
    assert all("routed_experts" not in r["meta_info"] for r in batch)

    res = server.post("/generate", stream=True, json={
        "input_ids": prompts, "sampling_params": params, "stream": True,
        "return_routed_experts": True,
    })
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
    events = sse_events(res)
    assert events[-1] == "[DONE]"
    for i, expected in enumerate(batch):
        mine = [e for e in events[:-1] if e["index"] == i]
        assert sum((e["output_ids"] for e in mine), []) == expected["output_ids"]
        assert "".join(e["text"] for e in mine) == expected["text"]
        assert all(e["meta_info"]["finish_reason"] is None for e in mine[:-1])
        final = mine[-1]["meta_info"]
        # Each chunk carries the rows completed since the previous one, none twice.
        starts = [e["meta_info"]["routed_experts_start"] for e in mine]
        parts = [rows_of(e, model_info) for e in mine]
        assert starts == [sum(len(p) for p in parts[:j]) for j in range(len(parts))]
        rows = np.concatenate(parts)
        assert rows.shape[0] == final["prompt_tokens"] + final["completion_tokens"] - 1


def test_generate_stream_rows_equal_the_whole_and_the_reference(server, model_info, reference):
    """/generate over real HTTP: streamed chunks of int16 rows join to the non-streamed rows,
    which equal the float64 reference; dtype and shape describe every chunk."""
    ids = [11, 12, 13, 14, 15, 16, 17]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_routed_experts": True, "routed_experts_dtype": "int16",
            "routed_experts_start_len": 3}
    res = server.post("/generate", json=body)
    assert res.status_code == 200, res.text
    whole = res.json()
    meta = whole["meta_info"]
    L, k = model_info["num_hidden_layers"], model_info["num_experts_per_tok"]
    assert meta["routed_experts_dtype"] == "int16"
    assert meta["routed_experts_shape"] == [len(ids) + 6 - 1 - 3, L, k]
    rows = extract_routed_experts_from_meta_info(whole)
    assert rows.dtype == np.int16 and rows.shape == tuple(meta["routed_experts_shape"])
    np.testing.assert_array_equal(
        rows, routed_experts_rows(reference, ids, whole["output_ids"], start_len=3))
    res = server.post("/generate", stream=True, json={**body, "stream": True})
    events = sse_events(res)[:-1]
    assert len(events) == 6
    assert [e["meta_info"]["routed_experts_start"] for e in events] == [3, 7, 8, 9, 10, 11]
    parts = [extract_routed_experts_from_meta_info(e) for e in events]
    assert all(p.dtype == np.int16 for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), rows)


def test_generate_routing_weights_streamed_and_whole(server, model_info, reference):
    """return_routed_expert_weights over real HTTP: the float64 reference's top-k weights
    (float32 on the wire), and float16 chunks that join to the same rows."""
    ids = [21, 22, 23, 24, 25]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_routed_experts": True, "return_routed_expert_weights": True}
    res = server.post("/generate", json=body)
    assert res.status_code == 200, res.text
    whole = res.json()
    meta = whole["meta_info"]
    weights = extract_routed_expert_weights_from_meta_info(whole)
    assert weights.dtype == np.float32
    assert meta["routed_expert_weights_shape"] == meta["routed_experts_shape"] == list(
        weights.shape)
    want = reference.forward(ids + whole["output_ids"][:-1]).topk_weights
    np.testing.assert_allclose(weights, want, rtol=1e-5, atol=1e-6)
    res = server.post("/generate", stream=True, json={
        **body, "stream": True, "routed_expert_weights_dtype": "float16"})
    events = sse_events(res)[:-1]
    parts = [extract_routed_expert_weights_from_meta_info(e) for e in events]
    assert all(p.dtype == np.float16 for p in parts) and len(parts) == 4
    np.testing.assert_array_equal(np.concatenate(parts), weights.astype(np.float16))


# -- errors -------------------------------------------------------------------------------------
_CHAT = [{"role": "user", "content": "hi"}]
ERROR_CASES = [
    ("malformed-json", "/generate", b'{"text": ', 400),
    ("body-not-object", "/generate", [], 400),
    ("empty-body", "/generate", b"", 400),
    ("text-wrong-type", "/generate", {"text": 5}, 400),
    ("text-and-ids", "/generate", {"text": "a", "input_ids": [1]}, 400),
    ("no-prompt", "/generate", {}, 400),
    ("empty-ids", "/generate", {"input_ids": []}, 400),
    ("empty-batch", "/generate", {"text": []}, 400),
    ("id-out-of-vocab", "/generate", {"input_ids": [10**6]}, 400),
    ("prompt-too-long", "/generate", {"input_ids": [1] * 5000}, 400),
    ("bad-temperature", "/generate", {"text": "a", "sampling_params": {"temperature": -1}}, 400),
    ("max-tokens-string", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": "8"}},
     400),
    ("unknown-sampling-key", "/generate", {"text": "a", "sampling_params": {"nope": 1}}, 400),
    ("unknown-field", "/generate", {"text": "a", "return_logprobs": True}, 400),
    ("start-len-out-of-range", "/generate",
     {"text": "a", "return_routed_experts": True, "routed_experts_start_len": 99}, 400),
    ("start-len-without-flag", "/generate", {"text": "a", "routed_experts_start_len": 0}, 400),
    ("unknown-routed-dtype", "/generate",
     {"text": "a", "return_routed_experts": True, "routed_experts_dtype": "int8"}, 400),
    ("routed-dtype-not-a-string", "/v1/completions",
     {"prompt": "a", "return_routed_experts": True, "routed_experts_dtype": 8}, 400),
    ("duplicate-rids", "/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, 400),
    ("non-utf8", "/generate", b'{"text": "\xff\xfe"}', 400),
    ("too-large", "/generate", b"x" * (33 * 1024 * 1024), 413),
    ("unknown-model", "/v1/completions", {"model": "nope", "prompt": "a"}, 404),
    ("logprobs-too-many", "/v1/completions", {"prompt": "a", "logprobs": 21}, 400),
    ("n-zero", "/v1/completions", {"prompt": "a", "n": 0}, 400),
    ("prompt-wrong-type", "/v1/completions", {"prompt": {"a": 1}}, 400),
    ("no-messages", "/v1/chat/completions", {"messages": []}, 400),
    ("image-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
    ("chat-top-logprobs-negative", "/v1/chat/completions",
     {"messages": _CHAT, "logprobs": True, "top_logprobs": -1}, 400),
    ("abort-no-rid", "/abort_request", {}, 400),
]


@pytest.mark.parametrize("path,body,status", [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_bad_request_gets_error_body(server, path, body, status):
    if isinstance(body, bytes):
        res = server.post(path, data=body)
    else:
        res = server.post(path, json=body)
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"type", "param", "code"} <= set(error)
    assert server.get("/health_generate").status_code == 200


def test_unknown_route_and_method(server):
    res = server.get("/nope")
    assert res.status_code == 404 and "error" in res.json()
    res = server.get("/generate")
    assert res.status_code == 405 and "error" in res.json()


def test_errors_do_not_disturb_a_running_request(server):
    res = server.post("/generate", stream=True, json={
        "text": "steady", "stream": True, "sampling_params": {"max_new_tokens": 64,
                                                              "ignore_eos": True}})
    for _ in range(5):
        assert server.post("/generate", data=b"{oops").status_code == 400
        assert server.post("/generate", json={"input_ids": [10**6]}).status_code == 400
    events = sse_events(res)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["completion_tokens"] == 64


def test_api_key_required_except_health(server):
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        res = requests.post(url + "/generate", json={"text": "a"}, headers=headers, timeout=10)
        assert res.status_code == 401, res.text
        assert res.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(url + "/v1/models", headers=headers, timeout=10).status_code == 401
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/health_generate", timeout=30).status_code == 200


# -- information and control --------------------------------------------------------------------
def test_model_and_server_info(server, model_info):
    assert model_info["num_hidden_layers"] == 4 and model_info["num_experts_per_tok"] == 4
    assert model_info["moe_layers"] == [0, 1, 2, 3]
    assert model_info["enable_return_routed_experts"] is True
    assert model_info["routed_experts_dtype"] == "int32"
    assert model_info["enable_return_routed_expert_weights"] is True
    for key in ("model_path", "served_model_name", "architecture", "num_experts", "vocab_size",
                "context_length"):
        assert key in model_info
    info = server.get("/get_server_info").json()
    assert set(info["pids"]) == {"scheduler", "detokenizer"}
    assert info["server_args"]["api_key"] == "<redacted>"  # as Engine.get_server_info()
    assert info["served_model_name"] == model_info["served_model_name"] and info["pid"] > 0
    assert set(info["server_args"]) == {f.name for f in dataclasses.fields(ServerArgs)}
    models = server.get("/v1/models").json()
    assert models["data"][0]["id"] == model_info["served_model_name"]


def test_flush_cache(server):
    server.post("/generate", json={"text": "cache me", "sampling_params": {"max_new_tokens": 1}})
    res = server.post("/flush_cache")
    assert res.status_code == 200 and res.json()["success"] is True
    info = server.get("/get_server_info").json()
    assert info["evictable_kv_slots"] == 0


def test_abort_request_by_rid(server):
    result = {}

    def run():
        result["res"] = server.post("/generate", json={"text": "abort me", "rid": "to-abort",
                                                       "sampling_params": LONG})

    thread = threading.Thread(target=run)
    thread.start()
    assert wait_until(lambda: server.get("/get_server_info").json()["num_running_reqs"] == 1)
    res = server.post("/abort_request", json={"rid": "to-abort"})
    assert res.status_code == 200 and res.json()["success"] is True
    thread.join(10)
    out = result["res"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
    assert wait_until(lambda: idle(server), timeout=5)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_client_disconnect_aborts(server, stream):
    body = {"text": "going away", "sampling_params": LONG, "stream": stream}
    if stream:
        res = server.post("/generate", json=body, stream=True)
        next(res.iter_lines())  # generation is under way
        res.close()
    else:
        with pytest.raises(requests.exceptions.ReadTimeout):
            server.post("/generate", json=body, timeout=(5, 0.5))
    t0 = time.monotonic()
    assert wait_until(lambda: idle(server), timeout=3), server.get("/get_server_info").json()
    assert time.monotonic() - t0 < 3  # an unaborted request would run for ~10 s more
    tokens = server.get("/get_server_info").json()["num_generated_tokens"]
    time.sleep(0.3)
    assert server.get("/get_server_info").json()["num_generated_tokens"] == tokens


# -- process life cycle -------------------------------------------------------------------------
def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_aborts_requests_and_stops_children(sig):
    """SIGINT stops at once; a first SIGTERM drains (tests/test_drain.py), a second one stops
    at once too."""
    server = start_server(ARGS)
    try:
        pids = server.get("/get_server_info").json()["pids"]
        res = server.post("/generate", json={"text": "x", "stream": True, "sampling_params": LONG},
                          stream=True)
        lines = res.iter_lines(decode_unicode=True)
        next(lines)
        if sig == signal.SIGTERM:
            server.proc.send_signal(sig)
            assert wait_until(lambda: requests.get(server.url + "/health", timeout=5)
                              .status_code == 503, timeout=5)
        t0 = time.monotonic()
        server.proc.send_signal(sig)
        events = sse_events(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        assert server.proc.wait(10) == 0
        assert time.monotonic() - t0 < 6
        assert all(gone(pid) for pid in pids.values()), pids
        assert "Server ready on http://127.0.0.1" in server.log()
    finally:
        server.stop()


def test_child_death_gives_503_and_nonzero_exit():
    server = start_server(ARGS)
    try:
        pids = server.get("/get_server_info").json()["pids"]
        result = {}
        thread = threading.Thread(target=lambda: result.update(res=server.post(
            "/generate", json={"text": "x", "sampling_params": LONG})))
        thread.start()
        assert wait_until(lambda: server.get("/get_server_info").json()["num_running_reqs"] == 1)
        os.kill(pids["scheduler"], signal.SIGKILL)
        thread.join(10)
        assert result["res"].status_code == 503
        assert "scheduler" in result["res"].json()["error"]["message"]
        for res in (server.get("/health"), server.post("/generate", json={"text": "a"})):
            assert res.status_code == 503 and "died" in res.json()["error"]["message"]
        assert server.proc.wait(10) != 0
        assert all(gone(pid) for pid in pids.values()), pids
    finally:
        server.stop()


def test_signal_during_start_up_exits_cleanly():
    cmd = [sys.executable, "-m", "sgl_jax.launch_server", "--port", str(free_port()),
           *server_flags()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: len(psutil.Process(proc.pid).children()) == 2, timeout=10)
        children = [c.pid for c in psutil.Process(proc.pid).children()]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "Interrupted by SIGTERM" in out
    # The children notice that their parent is gone and exit on their own.
    assert wait_until(lambda: all(gone(pid) for pid in children), timeout=5)


def test_dtype_too_narrow_for_the_model_is_a_400(tmp_path):
    """300 experts: uint8 (the server's default here) cannot hold them, so a request that asks
    for routed experts gets a 400 naming the limit on every route, never a 500; int16 works,
    with ids above 255 and the same rows as int32."""
    path = str(tmp_path / "wide")
    write_random_model(path, "tiny", {"num_experts": 300}, seed=7)
    server = start_server(server_flags(model_path=path, enable_return_routed_experts=True,
                                       routed_experts_dtype="uint8",
                                       precompile_bs_paddings=[1]))
    try:
        body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 3,
                                                              "temperature": 0},
                "return_routed_experts": True}
        for route, req in (("/generate", body),
                           ("/generate", {**body, "routed_experts_dtype": "uint8"}),
                           ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2,
                                                "return_routed_experts": True}),
                           ("/v1/chat/completions", {
                               "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2, "return_routed_experts": True})):
            res = server.post(route, json=req)
            assert res.status_code == 400, (route, res.text)
            error = res.json()["error"]
            assert "holds at most 255 expert ids" in error["message"]
            assert "300 experts" in error["message"] and "int16" in error["message"]
            assert error["param"] == "routed_experts_dtype"
        plain = server.post("/generate", json={**body, "return_routed_experts": False})
        assert plain.status_code == 200, plain.text  # a request that does not ask is served
        wide = {}
        for dtype in ("int16", "int32"):
            res = server.post("/generate", json={**body, "routed_experts_dtype": dtype})
            assert res.status_code == 200, res.text
            wide[dtype] = extract_routed_experts_from_meta_info(res.json())
            assert wide[dtype].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(wide["int16"], wide["int32"])
        assert (wide["int32"] > 255).any()
        ref = ReferenceModel(path)
        out = res.json()["output_ids"]
        np.testing.assert_array_equal(wide["int32"], routed_experts_rows(ref, [1, 2, 3, 4], out))
    finally:
        server.stop()


def test_port_in_use_fails_fast():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "sgl_jax.launch_server", "--port", str(port)],
            capture_output=True, text=True, timeout=30,
        )
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_help_explains_every_flag_without_importing_jax():
    code = ("import runpy, sys\nsys.argv = ['launch_server', '--help']\n"
            "try:\n    runpy.run_module('sgl_jax.launch_server', run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint('JAX_IMPORTED', 'jax' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "JAX_IMPORTED False" in proc.stdout
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in proc.stdout
