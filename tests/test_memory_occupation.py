"""release_memory_occupation / resume_memory_occupation (M18 item 3), SGLang's names.

Through the Engine and through HTTP on the bundled model: a release frees the KV cache (and the
weights) in the scheduler's process, by at least their sizes in live device bytes; while
released, generation fails fast with a clear error and nothing leaks; a resume restores the
memory without recompiling any step, and the outputs (greedy tokens, routed experts) equal
those before the release and the independent reference's. Refusals are clear: bad tags, a
second release, a resume of what is held, a release while requests run, a weight update while
the weights are released; the routes need the admin key.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests

from sgl_jax import Engine
from sgl_jax.srt.managers.control import MemoryReleasedError
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.testing import TEST_MODEL_PATH, ServerProcess, engine_args, server_flags, wait_until
from tests.engine_utils import assert_no_leak, expected_rows, prompt_ids, reference_greedy
from tests.server_utils import server_fixture

PROMPTS = [prompt_ids(1, 9), prompt_ids(2, 40)]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
USER, ADMIN = "user-key", "admin-key"


def rows_of(result: dict[str, Any]) -> np.ndarray:
    return extract_routed_experts_from_meta_info(result)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(**engine_args(enable_return_routed_experts=True))
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        assert engine.get_server_info()["released_memory"] == []
        assert_no_leak(engine)


def generate(engine: Engine) -> list[dict[str, Any]]:
    return engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_routed_experts=True)


def assert_same(before: list[dict], after: list[dict]) -> None:
    for a, b in zip(before, after, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert np.array_equal(rows_of(a), rows_of(b))


def test_outputs_are_the_reference_before_and_after(engine):
    """The outputs the other tests compare across a release are the reference's."""
    outs = generate(engine)
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == reference_greedy(ids, GREEDY["max_new_tokens"])
        want = expected_rows(ids, out["output_ids"])
        assert np.array_equal(rows_of(out).reshape(want.shape), want)


@pytest.mark.parametrize("tags", [None, ["kv_cache", "weights"], ["kv_cache"], ["weights"]])
def test_release_frees_the_device_bytes_and_resume_restores_the_outputs(engine, tags):
    before = generate(engine)
    info = engine.get_server_info()
    compiles, sizes = info["num_compiles"], info["memory_bytes"]
    want = {"kv_cache", "weights"} if tags is None else set(tags)
    freed = (sizes["kv_cache"] if "kv_cache" in want else 0) + \
        (sizes["parameters"] if "weights" in want else 0)

    out = engine.release_memory_occupation(tags)
    assert out["success"] and set(out["released"]) == want, out
    drop = out["device_bytes_before"] - out["device_bytes_after"]
    print(f"\nrelease {tags}: live device bytes {out['device_bytes_before']} -> "
          f"{out['device_bytes_after']} (-{drop}; KV cache {sizes['kv_cache']}, parameters "
          f"{sizes['parameters']}) in {out['seconds']:.3f}s")
    assert drop >= freed
    if want == {"kv_cache"}:  # the weights stay
        assert drop < freed + sizes["parameters"]
    assert engine.get_server_info()["released_memory"] == sorted(want)

    with pytest.raises(MemoryReleasedError, match="resume_memory_occupation"):
        generate(engine)
    assert not engine.tokenizer_manager.states
    assert_no_leak(engine)

    back = engine.resume_memory_occupation(tags)
    assert back["success"] and back["released"] == [], back
    print(f"resume {tags}: live device bytes {back['device_bytes_before']} -> "
          f"{back['device_bytes_after']} in {back['seconds']:.3f}s")
    assert back["device_bytes_after"] - back["device_bytes_before"] >= freed
    assert_same(before, generate(engine))
    assert engine.get_server_info()["num_compiles"] == compiles


def test_weights_then_kv_cache_as_rl_frameworks_resume(engine):
    """verl / slime: release everything, resume the weights (to update them), then the KV."""
    before = generate(engine)
    engine.release_memory_occupation()
    assert engine.resume_memory_occupation(["weights"])["released"] == ["kv_cache"]
    with pytest.raises(MemoryReleasedError, match="kv_cache"):
        generate(engine)
    # The weights are back: an update works while the KV cache is still released.
    out = engine.update_weights_from_disk(TEST_MODEL_PATH, weight_version="same")
    assert out["success"]
    assert engine.resume_memory_occupation()["released"] == []
    assert_same(before, generate(engine))


def test_a_request_racing_a_release_is_ended_by_the_scheduler(engine):
    """A request sent after a release was sent but before its reply came back passes the
    tokenizer manager's check (simulated: its record of the release cleared); the scheduler
    ends it with the same reason, holding nothing."""
    engine.release_memory_occupation(["kv_cache"])
    tm = engine.tokenizer_manager
    try:
        tm.released_memory = []
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert out["output_ids"] == []
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "resume_memory_occupation" in reason["message"]
        assert_no_leak(engine)
    finally:
        engine.resume_memory_occupation()


def test_double_release_and_resume_without_release_are_refused(engine):
    with pytest.raises(ValueError, match="nothing is released"):
        engine.resume_memory_occupation()
    with pytest.raises(ValueError, match="kv_cache is not released"):
        engine.resume_memory_occupation(["kv_cache"])
    engine.release_memory_occupation(["kv_cache"])
    with pytest.raises(ValueError, match="kv_cache is released already"):
        engine.release_memory_occupation(["kv_cache"])
    with pytest.raises(ValueError, match="weights is not released"):
        engine.resume_memory_occupation(["weights"])
    # No tags: what is still held; then nothing is left.
    assert engine.release_memory_occupation()["released"] == ["kv_cache", "weights"]
    with pytest.raises(ValueError, match="everything is released already"):
        engine.release_memory_occupation()
    assert engine.resume_memory_occupation()["released"] == []


@pytest.mark.parametrize("tags, match", [
    (["gpu"], "unknown memory tag 'gpu'"),
    ("kv_cache", "tags must be a list of strings"),
    ([1], "tags must be a list of strings"),
])
def test_bad_tags_are_refused(engine, tags, match):
    with pytest.raises(ValueError, match=match):
        engine.release_memory_occupation(tags)
    with pytest.raises(ValueError, match=match):
        engine.resume_memory_occupation(tags)


def test_sglang_cuda_graph_tag_frees_nothing(engine):
    out = engine.release_memory_occupation(["cuda_graph"])
    assert out["success"] and out["released"] == [] and out["message"] == "nothing to release"


def test_release_is_refused_while_requests_run(engine):
    engine.pause_generation()
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(out=generate(engine)[0]))
    thread.start()
    try:
        assert wait_until(lambda: engine.get_server_info()["num_waiting_reqs"]
                          + engine.get_server_info()["num_running_reqs"] > 0, timeout=30)
        with pytest.raises(ValueError, match="not idle"):
            engine.release_memory_occupation()
        assert engine.get_server_info()["released_memory"] == []
    finally:
        engine.continue_generation()
        thread.join(60)
    assert result["out"]["output_ids"] == reference_greedy(PROMPTS[0], GREEDY["max_new_tokens"])


def test_weight_changes_are_refused_while_the_weights_are_released(engine):
    engine.release_memory_occupation(["weights"])
    try:
        with pytest.raises(ValueError, match="weights are released"):
            engine.update_weights_from_disk(TEST_MODEL_PATH)
    finally:
        engine.resume_memory_occupation()


# -- HTTP -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    yield from server_fixture(
        request, server_flags(enable_return_routed_experts=True, admin_api_key=ADMIN),
        api_key=USER)


def call(server: ServerProcess, path: str, key: str | None = ADMIN, **kw: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(server.url + path, headers=headers, timeout=120, **kw)


def http_generate(server: ServerProcess) -> requests.Response:
    return call(server, "/generate", USER, json={
        "input_ids": PROMPTS, "sampling_params": GREEDY, "return_routed_experts": True})


def test_http_release_refuse_resume(server):
    before = http_generate(server)
    assert before.status_code == 200, before.text
    compiles = server.get("/get_server_info").json()["num_compiles"]

    res = call(server, "/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert res.status_code == 200, res.text
    out = res.json()
    assert out["released"] == ["kv_cache", "weights"]
    assert out["device_bytes_after"] < out["device_bytes_before"]

    refused = http_generate(server)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "memory_released" and "resume_memory_occupation" in error["message"]
    res = call(server, "/v1/completions", USER, json={"prompt": "Hi", "max_tokens": 2})
    assert res.status_code == 503 and res.json()["error"]["code"] == "memory_released"
    info = server.get("/get_server_info").json()
    assert info["released_memory"] == ["kv_cache", "weights"]
    assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0
    assert info["locked_kv_slots"] == 0

    res = call(server, "/resume_memory_occupation")  # no body: every released tag
    assert res.status_code == 200, res.text
    assert res.json()["released"] == []
    after = http_generate(server)
    assert after.status_code == 200, after.text
    assert_same(before.json(), after.json())
    assert server.get("/get_server_info").json()["num_compiles"] == compiles


@pytest.mark.parametrize("body, param", [
    ({"tags": ["nope"]}, "tags"),
    ({"tags": "kv_cache"}, "tags"),
    ({"tags": ["kv_cache"], "extra": 1}, "extra"),
])
def test_http_bad_bodies_are_400(server, body, param):
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        res = call(server, path, json=body)
        assert res.status_code == 400, res.text
        assert res.json()["error"]["param"] == param
    assert server.get("/get_server_info").json()["released_memory"] == []


def test_http_wrong_state_is_400(server):
    res = call(server, "/resume_memory_occupation", json={})
    assert res.status_code == 400 and "nothing is released" in res.json()["error"]["message"]
    assert call(server, "/release_memory_occupation", json={"tags": ["kv_cache"]}).ok
    try:
        res = call(server, "/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert res.status_code == 400 and "released already" in res.json()["error"]["message"]
    finally:
        assert call(server, "/resume_memory_occupation", json={"tags": ["kv_cache"]}).ok
    assert http_generate(server).status_code == 200


@pytest.mark.parametrize("path", ["/release_memory_occupation", "/resume_memory_occupation"])
def test_http_routes_need_the_admin_key(server, path):
    assert call(server, path, None).status_code == 401
    res = call(server, path, USER)
    assert res.status_code == 403 and res.json()["error"]["code"] == "admin_key_required"
    assert server.get("/get_server_info").json()["released_memory"] == []


def test_a_failed_resume_keeps_the_host_copy(monkeypatch):
    """Resume out of device memory (simulated by JAX's device_put failing on the second
    array) leaves the weights released with their host copy, and a retry restores them."""
    import jax
    import jax.numpy as jnp

    from sgl_jax.srt.model_executor import memory_occupation

    occupation = memory_occupation.MemoryOccupation()
    arrays = [jnp.arange(8.0), jnp.ones((2, 3), jnp.int32)]
    want = [np.asarray(a) for a in arrays]
    occupation.release("weights", arrays, keep=True)
    real_put, calls = jax.device_put, []

    def failing_put(x: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return real_put(x, *args, **kwargs)

    monkeypatch.setattr(memory_occupation.jax, "device_put", failing_put)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        occupation.resume("weights")
    assert occupation.released() == {"weights"}
    monkeypatch.setattr(memory_occupation.jax, "device_put", real_put)
    back = occupation.resume("weights")
    assert occupation.released() == frozenset()
    for got, expected in zip(back, want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), expected)
