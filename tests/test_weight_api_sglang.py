"""SGLang's tensor weight API (M18 item 6): ``/update_weights_from_tensor`` with safetensors.

A real server on 127.0.0.1 with an admin key. New weights arrive as safetensors bytes (the
body, or base64 in SGLang's JSON fields); afterwards greedy tokens and routed experts equal the
float64 reference of a checkpoint holding exactly those weights. Pickles, oversize bodies,
unknown names and the NCCL routes are refused, and a refused update changes nothing.
"""

from __future__ import annotations

import base64
import os
import pickle
import shutil

import ml_dtypes
import numpy as np
import pytest
import requests
from safetensors.numpy import load_file, save, save_file

from sgl_jax import Engine
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.testing import TEST_MODEL_PATH, engine_args, server_flags
from sgl_jax.tools.make_random_model import write_random_model
from sgl_jax.tools.reference_forward import routed_experts_rows
from tests.engine_utils import reference, reference_greedy
from tests.server_utils import server_fixture

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], list(range(30, 70))]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
ADMIN, USER = "admin-secret", "user-secret"
LIMIT = 4 * 1024 * 1024  # --max-weight-update-bytes: the tiny model is 2 MiB of float32
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
OCTET = {**ADMIN_HEADERS, "Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def new_ckpt(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """Another model of the same shapes, its weights rounded to bfloat16 (sent as BF16), and a
    checkpoint directory holding exactly those values (as float32) for the reference."""
    second = str(tmp_path_factory.mktemp("second"))
    write_random_model(second, "tiny", seed=1)
    bf16 = {k: v.astype(ml_dtypes.bfloat16)
            for k, v in load_file(f"{second}/model.safetensors").items()}
    path = str(tmp_path_factory.mktemp("second_bf16"))
    shutil.copytree(second, path, dirs_exist_ok=True)
    save_file({k: v.astype(np.float32) for k, v in bf16.items()}, f"{path}/model.safetensors")
    return path, bf16


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(
        request, server_flags(enable_return_routed_experts=True, admin_api_key=ADMIN,
                              max_weight_update_bytes=LIMIT), api_key=USER)


def generate(server) -> list[dict]:
    res = server.post("/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY,
                                         "return_routed_experts": True})
    assert res.status_code == 200, res.text
    return res.json()


def assert_serves(server, path: str) -> list[dict]:
    """The server's greedy tokens and routed experts are those of the reference of ``path``."""
    outs = generate(server)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out["output_ids"] == reference_greedy(prompt, GREEDY["max_new_tokens"], path)
        np.testing.assert_array_equal(
            extract_routed_experts_from_meta_info(out),
            routed_experts_rows(reference(path), prompt, out["output_ids"]))
    return outs


def base_tensors() -> dict[str, np.ndarray]:
    return load_file(f"{TEST_MODEL_PATH}/model.safetensors")


def test_octet_stream_then_json_base64_updates(server, new_ckpt):
    path, bf16 = new_ckpt
    before = assert_serves(server, TEST_MODEL_PATH)
    compiles = server.get("/get_server_info").json()["num_compiles"]
    res = server.post("/update_weights_from_tensor?weight_version=step-1", data=save(bf16),
                      headers=OCTET)
    assert res.status_code == 200, res.text
    assert res.json()["success"] and res.json()["num_parameters"] > 0
    after = assert_serves(server, path)
    assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
    assert all(o["meta_info"]["weight_version"] == "step-1" for o in after)
    # SGLang's JSON fields, the payload split in two entries: back to the first model.
    tensors = sorted(base_tensors().items())
    half = len(tensors) // 2
    entries = [base64.b64encode(save(dict(part))).decode() for part in
               (tensors[:half], tensors[half:])]
    res = server.post("/update_weights_from_tensor", headers=ADMIN_HEADERS, json={
        "serialized_named_tensors": entries, "load_format": None, "flush_cache": True,
        "abort_all_requests": False, "weight_version": "step-2"})
    assert res.status_code == 200, res.text
    assert [o["output_ids"] for o in assert_serves(server, TEST_MODEL_PATH)] == \
        [o["output_ids"] for o in before]
    assert server.get("/get_server_info").json()["num_compiles"] == compiles


def test_admin_key_required(server):
    body = save({"model.norm.weight": base_tensors()["model.norm.weight"]})
    octet = {"Content-Type": "application/octet-stream"}
    res = requests.post(server.url + "/update_weights_from_tensor", data=body, headers=octet,
                        timeout=60)
    assert res.status_code == 401, res.text
    res = server.post("/update_weights_from_tensor", data=body, headers=octet)  # the user key
    assert res.status_code == 403 and res.json()["error"]["code"] == "admin_key_required"
    res = requests.post(server.url + "/init_weights_update_group", json={}, timeout=60)
    assert res.status_code == 401


def refused(server, status: int, needle: str, **kwargs) -> dict:
    """Posts an update that must be refused, and checks that nothing changed."""
    version = server.get("/get_server_info").json()["weight_version"]
    before = generate(server)
    res = server.post("/update_weights_from_tensor", **kwargs)
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert needle in error["message"], error
    assert server.get("/get_server_info").json()["weight_version"] == version
    after = generate(server)
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]
    assert [o["meta_info"]["routed_experts"] for o in after] == \
        [o["meta_info"]["routed_experts"] for o in before]
    return error


def test_pickle_payloads_are_refused(server):
    """SGLang's own format (a pickle) is never unpickled: 400 naming safetensors. The pickle
    here would create a file if it were loaded."""

    class Boom:
        def __reduce__(self):
            return (open, ("/tmp/sgl_jax_pickle_was_loaded", "w"))

    payload = pickle.dumps([("model.norm.weight", Boom())])
    refused(server, 400, "never unpickles", data=payload, headers=OCTET)
    refused(server, 400, "never unpickles", headers=ADMIN_HEADERS,
            json={"serialized_named_tensors": [base64.b64encode(payload).decode()]})
    refused(server, 400, "flattened_bucket", headers=ADMIN_HEADERS,
            json={"serialized_named_tensors": [base64.b64encode(payload).decode()],
                  "load_format": "flattened_bucket"})
    assert not os.path.exists("/tmp/sgl_jax_pickle_was_loaded")


def test_oversize_bodies_are_413(server):
    refused(server, 413, f"exceeds {LIMIT} bytes", data=b"\0" * (LIMIT + 1), headers=OCTET)
    text = base64.b64encode(b"\0" * LIMIT).decode()
    refused(server, 413, f"exceeds {LIMIT} bytes", headers=ADMIN_HEADERS,
            json={"serialized_named_tensors": [text]})


def test_bad_payloads_are_400_and_change_nothing(server):
    tensors = base_tensors()
    norm = "model.norm.weight"
    # A good tensor (changed) beside an unknown name: neither is applied.
    error = refused(server, 400, "lm_head.bias", data=save({
        norm: tensors[norm] * 2, "lm_head.bias": np.zeros(512, np.float32)}), headers=OCTET)
    assert error["param"] == "serialized_named_tensors"
    refused(server, 400, "has shape", data=save({norm: tensors[norm][:3] * 2}), headers=OCTET)
    refused(server, 400, "not a safetensors payload", data=b"garbage!" * 4, headers=OCTET)
    refused(server, 400, "not standard base64", headers=ADMIN_HEADERS,
            json={"serialized_named_tensors": ["***"]})
    one = base64.b64encode(save({norm: tensors[norm] * 2})).decode()
    refused(server, 400, "given twice", headers=ADMIN_HEADERS,
            json={"serialized_named_tensors": [one, one]})
    refused(server, 400, "weight_version", headers=ADMIN_HEADERS,
            json={"serialized_named_tensors": [one], "weight_version": "x" * 1000})


@pytest.mark.parametrize("path", ["/init_weights_update_group",
                                  "/update_weights_from_distributed",
                                  "/destroy_weights_update_group"])
def test_nccl_routes_say_what_to_use_instead(server, path):
    res = server.post(path, headers=ADMIN_HEADERS, json={"master_address": "127.0.0.1"})
    assert res.status_code == 501, res.text
    message = res.json()["error"]["message"]
    assert "NCCL" in message and "/update_weights_from_tensor" in message


def test_engine_update_weights_from_tensor(new_ckpt):
    path, bf16 = new_ckpt
    with Engine(**engine_args(enable_return_routed_experts=True)) as engine:
        out = engine.update_weights_from_tensor(sorted(bf16.items()), weight_version="pairs")
        assert out["weight_version"] == "pairs"
        got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY,
                              return_routed_experts=True)
        for r, prompt in zip(got, PROMPTS, strict=True):
            assert r["output_ids"] == reference_greedy(prompt, GREEDY["max_new_tokens"], path)
            np.testing.assert_array_equal(
                extract_routed_experts_from_meta_info(r),
                routed_experts_rows(reference(path), prompt, r["output_ids"]))
        norm = "model.norm.weight"
        with pytest.raises(ValueError, match="given twice"):
            engine.update_weights_from_tensor([(norm, bf16[norm]), (norm, bf16[norm])])
        with pytest.raises(ValueError, match="load_format"):
            engine.update_weights_from_tensor({norm: bf16[norm]}, load_format="direct")
        with pytest.raises(NotImplementedError, match="NCCL"):
            engine.init_weights_update_group("127.0.0.1", 1234, 1, 2)
        assert engine.get_server_info()["weight_version"] == "pairs"


def test_flush_cache_by_get_as_sglang_clients_send_it(server):
    """SGLang's HTTP engine adapter (slime's) flushes with GET; admin route either way."""
    res = requests.get(server.url + "/flush_cache", headers=ADMIN_HEADERS, timeout=60)
    assert res.status_code == 200 and res.json()["success"], res.text
    assert requests.get(server.url + "/flush_cache", timeout=60).status_code == 401


def test_other_sglang_rl_calls_as_docs_say(server):
    """docs/rl_rollouts.md's table: what SGLang's RL clients send that differs here."""
    res = server.post("/abort_request", headers=ADMIN_HEADERS, json={"rid": "", "abort_all": True})
    assert res.status_code == 400  # abort by rid
    res = server.post("/update_weights_from_disk", headers=ADMIN_HEADERS, json={
        "model_path": TEST_MODEL_PATH, "abort_all_request": True})  # AReaL 0.3's spelling
    assert res.status_code == 400 and "abort_all_request" in res.text
    res = server.post("/pause_generation", headers=ADMIN_HEADERS, json={"mode": "abort"})
    assert res.status_code == 200  # in place; the mode is not read
    assert server.get("/get_server_info").json()["paused"]
    assert server.post("/continue_generation", headers=ADMIN_HEADERS).status_code == 200
    assert server.post("/get_weights_by_name", headers=ADMIN_HEADERS,
                       json={"name": "lm_head.weight"}).status_code == 404


def test_a_second_upload_is_refused_while_one_arrives(server):
    """While one upload's body is still arriving, a second upload is refused (409) before its
    body is read; the first, once complete, is answered as usual."""
    import socket

    body = save({"lm_head.weight": np.zeros((4, 4), np.float32)})  # a wrong shape: a 400
    head = (f"POST /update_weights_from_tensor HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {ADMIN}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as first:
        first.sendall(head + body[:10])  # the rest comes later
        for _ in range(50):  # until the server has taken the first upload's lock
            second = requests.post(server.url + "/update_weights_from_tensor", data=body,
                                   headers=OCTET, timeout=30)
            if second.status_code == 409:
                break
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "update_in_progress"
        first.sendall(body[10:])
        reply = first.makefile("rb").read().decode()
    assert reply.startswith("HTTP/1.1 400") and "lm_head.weight" in reply
    after = requests.post(server.url + "/update_weights_from_tensor", data=body,
                          headers=OCTET, timeout=30)
    assert after.status_code == 400  # the lock was released
