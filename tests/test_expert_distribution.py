"""Expert distribution recorder (M12 item 1) and the live /expert_load endpoints (item 3).

Baselines are the routed experts the engine returns for the same requests (themselves checked
against the float64 reference in test_routed_experts.py), or the reference rows directly when
routed experts are off. Requests are greedy with ``ignore_eos`` and distinct prompts, so every
token the model forwarded while recording is a returned row: each prompt token (no prefix-cache
hit) and each generated token but the last (never fed: a request at its length limit gets no
further decode step).
"""

from __future__ import annotations

import numpy as np
import pytest
import requests

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.testing import TEST_MODEL_PATH, engine_args, server_flags
from sgl_jax.tools.make_random_model import write_random_model
from tests.engine_utils import decoded_rows, expected_rows, prompt_ids
from tests.server_utils import server_fixture

GREEDY = {"temperature": 0.0, "ignore_eos": True}
CFG = ModelConfig.from_hf(TEST_MODEL_PATH)


def bincount(rows: np.ndarray, moe_layers: list[int], num_experts: int) -> np.ndarray:
    """[moe_layers, E]: rows [tokens, layers, k] counted per MoE layer."""
    return np.stack([np.bincount(rows[:, layer].ravel(), minlength=num_experts)
                     for layer in moe_layers])


def run(engine: Engine, prompts: list[list[int]], max_new: list[int], routed: bool = True):
    return engine.generate(input_ids=prompts,
                           sampling_params=[{**GREEDY, "max_new_tokens": n} for n in max_new],
                           return_routed_experts=routed)


def returned_rows(outs: list[dict], cfg: ModelConfig) -> list[np.ndarray]:
    return [decoded_rows(o, cfg.num_hidden_layers, cfg.num_experts_per_tok) for o in outs]


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ds") / "tiny-deepseek-v3"
    write_random_model(str(path), "tiny-deepseek-v3", seed=3)
    return str(path)


# -- stat -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stat_engine(tmp_path_factory):
    eng = Engine(**engine_args(expert_distribution_recorder_mode="stat",
                               enable_return_routed_experts=True,
                               expert_distribution_recorder_dir=str(tmp_path_factory.mktemp("d"))))
    yield eng
    eng.shutdown()


def test_stat_counts_equal_returned_rows_without_recompiling(stat_engine):
    eng = stat_engine
    compiles = eng.get_server_info()["num_compiles"]
    with pytest.raises(ValueError, match="not recording"):
        eng.stop_expert_distribution_record()
    with pytest.raises(ValueError, match="nothing recorded"):
        eng.dump_expert_distribution_record()
    run(eng, [prompt_ids(90, 7)], [3])  # before the window: not counted
    eng.start_expert_distribution_record()
    with pytest.raises(ValueError, match="already recording"):
        eng.start_expert_distribution_record()
    # A batch (prefill of several, decode of up to 4 with padding rows), then one more.
    prompts = [prompt_ids(100 + i, n) for i, n in enumerate([5, 17, 40])]
    outs = run(eng, prompts, [6, 3, 9]) + run(eng, [prompt_ids(200, 70)], [4])
    live = eng.get_expert_load()
    assert live["recording"] is True
    eng.stop_expert_distribution_record()
    run(eng, [prompt_ids(91, 9)], [5])  # after the window: not counted
    rows = np.concatenate(returned_rows(outs, CFG))
    load = eng.get_expert_load()
    want = bincount(rows, load["moe_layers"], CFG.num_experts)
    assert load["moe_layers"] == list(CFG.moe_layer_ids)
    assert load["num_tokens"] == len(rows) == live["num_tokens"]
    np.testing.assert_array_equal(np.array(load["counts"]), want)
    assert load["recording"] is False
    path = eng.dump_expert_distribution_record()
    with np.load(path) as f:
        assert str(f["mode"]) == "stat" and str(f["architecture"]) == CFG.architecture
        assert f["counts"].dtype == np.int64 and f["counts"].shape == want.shape
        np.testing.assert_array_equal(f["counts"], want)
        assert int(f["num_tokens"]) == len(rows)
        assert f["moe_layers"].tolist() == list(CFG.moe_layer_ids)
        assert int(f["num_experts"]) == CFG.num_experts
        assert int(f["num_experts_per_tok"]) == CFG.num_experts_per_tok
    # Starting and stopping never changes a shape: nothing was compiled.
    assert eng.get_server_info()["num_compiles"] == compiles


def test_stat_counts_without_asking_for_routed_experts(stat_engine):
    eng = stat_engine
    prompts = [prompt_ids(300 + i, n) for i, n in enumerate([11, 23])]
    eng.start_expert_distribution_record()
    run(eng, prompts, [5, 2], routed=False)
    eng.stop_expert_distribution_record()
    load = eng.get_expert_load()
    assert eng.flush_cache()  # the same prompts again, recomputed (no prefix-cache hit)
    rows = np.concatenate(returned_rows(run(eng, prompts, [5, 2]), CFG))
    np.testing.assert_array_equal(np.array(load["counts"]),
                                  bincount(rows, load["moe_layers"], CFG.num_experts))
    assert load["num_tokens"] == len(rows)


# -- per_pass -------------------------------------------------------------------------------------
def test_per_pass_rows_sum_to_counts_with_modes_and_tokens(tmp_path):
    with Engine(**engine_args(expert_distribution_recorder_mode="per_pass",
                              enable_return_routed_experts=True,
                              expert_distribution_recorder_dir=str(tmp_path))) as eng:
        with pytest.raises(ValueError, match="stat"):
            eng.get_expert_load()
        eng.start_expert_distribution_record()
        prompt = prompt_ids(400, 30)
        (out,) = run(eng, [prompt], [5])
        eng.stop_expert_distribution_record()
        path = eng.dump_expert_distribution_record()
        assert path.startswith(str(tmp_path)) and path.endswith(".npz")
    rows = returned_rows([out], CFG)[0]
    with np.load(path) as f:
        assert str(f["mode"]) == "per_pass"
        counts, modes, tokens = f["counts"], f["forward_mode"], f["num_tokens"]
    # One prefill of the prompt (extend: 0), then one decode (1) per fed generated token.
    assert modes.tolist() == [0] + [1] * 4
    assert tokens.tolist() == [30] + [1] * 4
    assert counts.shape == (5, len(CFG.moe_layer_ids), CFG.num_experts)
    np.testing.assert_array_equal(counts.sum(0), bincount(rows, CFG.moe_layer_ids,
                                                          CFG.num_experts))
    np.testing.assert_array_equal(counts[0], bincount(rows[:30], CFG.moe_layer_ids,
                                                      CFG.num_experts))
    assert (counts.sum(axis=2) == tokens[:, None] * CFG.num_experts_per_tok).all()


# -- speculative decoding: every verified token is counted ---------------------------------------
def test_recorder_counts_every_verified_token_under_speculation(tmp_path):
    """Verify steps are passes of mode 2 and record every token the target computed,
    rejected drafts included; the last record of each position is the returned row."""
    with Engine(**engine_args(expert_distribution_recorder_mode="per_token",
                              enable_return_routed_experts=True, speculative_algorithm="NGRAM",
                              expert_distribution_recorder_dir=str(tmp_path))) as eng:
        eng.start_expert_distribution_record()
        prompt = prompt_ids(450, 8) * 4  # NGRAM drafts from the repeated phrase
        (out,) = eng.generate(input_ids=[prompt], rid=["s"], return_routed_experts=True,
                              sampling_params=[{**GREEDY, "max_new_tokens": 40}])
        path = eng.dump_expert_distribution_record()
    rows = returned_rows([out], CFG)[0]
    with np.load(path) as f:
        ids, rid, pos = f["topk_ids"], f["rid"], f["position"]
    ids, pos = ids[rid == "s"], pos[rid == "s"]
    assert len(pos) > len(rows)  # rejected drafts were computed (and counted) too
    for p in range(len(rows)):
        (where,) = np.nonzero(pos == p)
        np.testing.assert_array_equal(ids[where[-1]], rows[p])
    assert pos.max() == len(rows) - 1  # drafts never run past max_new_tokens


# -- per_token, on a family with dense layers -----------------------------------------------------
def test_per_token_ids_rids_positions_with_dense_layers(deepseek_path, tmp_path):
    cfg = ModelConfig.from_hf(deepseek_path)
    assert not all(cfg.moe_layers)  # the test is about the -1 of dense layers
    with Engine(**engine_args(model_path=deepseek_path, expert_distribution_recorder_mode=
                              "per_token", enable_return_routed_experts=True,
                              expert_distribution_recorder_dir=str(tmp_path))) as eng:
        eng.start_expert_distribution_record()
        prompts = [prompt_ids(500 + i, n) for i, n in enumerate([6, 13])]
        outs = eng.generate(input_ids=prompts, rid=["a", "b"], return_routed_experts=True,
                            sampling_params=[{**GREEDY, "max_new_tokens": n} for n in (4, 3)])
        path = eng.dump_expert_distribution_record()  # while recording: the window so far
        eng.stop_expert_distribution_record()
    with np.load(path) as f:
        assert str(f["mode"]) == "per_token" and bool(f["recording"])
        ids, rid, pos = f["topk_ids"], f["rid"], f["position"]
        assert f["moe_layers"].tolist() == list(cfg.moe_layer_ids)
    assert ids.shape[1:] == (cfg.num_hidden_layers, cfg.num_experts_per_tok)
    for name, rows in zip(["a", "b"], returned_rows(outs, cfg), strict=True):
        mine = rid == name
        order = np.argsort(pos[mine], kind="stable")
        assert pos[mine][order].tolist() == list(range(len(rows)))
        np.testing.assert_array_equal(ids[mine][order], rows)
    assert mine.sum() + (rid == "a").sum() == len(rid)
    dense = [i for i, moe in enumerate(cfg.moe_layers) if not moe]
    assert (ids[:, dense] == -1).all() and (ids[:, cfg.moe_layer_ids] >= 0).all()


def test_per_token_buffer_keeps_the_newest(tmp_path):
    with Engine(**engine_args(expert_distribution_recorder_mode="per_token",
                              expert_distribution_recorder_buffer_size=10,
                              expert_distribution_recorder_dir=str(tmp_path))) as eng:
        eng.start_expert_distribution_record()
        prompt = prompt_ids(600, 8)
        (out,) = eng.generate(input_ids=[prompt], rid=["x"],
                              sampling_params={**GREEDY, "max_new_tokens": 6})
        eng.stop_expert_distribution_record()
        path = eng.dump_expert_distribution_record()
    # 8 prompt tokens + 5 fed generated ones: the oldest 3 are dropped.
    want = expected_rows(prompt, out["output_ids"])[3:]
    with np.load(path) as f:
        assert int(f["dropped"]) == 3 and int(f["buffer_size"]) == 10
        np.testing.assert_array_equal(f["position"], np.arange(3, 13))
        np.testing.assert_array_equal(f["topk_ids"], want)
        assert set(f["rid"].tolist()) == {"x"}


def test_stat_without_routed_experts_on_a_family_with_dense_layers(deepseek_path):
    cfg = ModelConfig.from_hf(deepseek_path)
    with Engine(**engine_args(model_path=deepseek_path,
                              expert_distribution_recorder_mode="stat")) as eng:
        prompts = [prompt_ids(700 + i, n) for i, n in enumerate([9, 21, 4])]
        eng.start_expert_distribution_record()
        outs = run(eng, prompts, [3, 5, 2], routed=False)
        eng.stop_expert_distribution_record()
        load = eng.get_expert_load()
    rows = np.concatenate([expected_rows(p, o["output_ids"], path=deepseek_path)
                           for p, o in zip(prompts, outs, strict=True)])
    assert load["moe_layers"] == list(cfg.moe_layer_ids)
    np.testing.assert_array_equal(np.array(load["counts"]),
                                  bincount(rows, cfg.moe_layer_ids, cfg.num_experts))
    assert load["num_tokens"] == len(rows)


@pytest.mark.parametrize("one_hot", [False, True])
def test_pass_counts_scatter_and_one_hot_equal_numpy(deepseek_path, one_hot):
    """A pass's [moe_layers, E] counts, by the scatter-add (CPU) and by one-hot compares
    (compiled for TPU), equal numpy's count of the real tokens' ids; the dense layers' -1
    ids and the padding tokens are not counted."""
    import jax

    from sgl_jax.srt.layers.moe.expert_distribution import ExpertDistributionRecorder

    cfg = ModelConfig.from_hf(deepseek_path)
    recorder = ExpertDistributionRecorder("per_pass", cfg, one_hot_counts=one_hot)
    rng = np.random.default_rng(7)
    tokens, k = 29, cfg.num_experts_per_tok
    ids = rng.integers(0, cfg.num_experts, (tokens, cfg.num_hidden_layers, k)).astype(np.int32)
    moe = list(cfg.moe_layer_ids)
    dense = [i for i in range(cfg.num_hidden_layers) if i not in moe]
    assert dense  # the family with dense layers first
    ids[:, dense] = -1
    real = np.arange(tokens) < 23
    _, counts = jax.jit(recorder.record_step)(None, ids, real)
    want = np.zeros((len(moe), cfg.num_experts), np.int64)
    for j, layer in enumerate(moe):
        np.add.at(want[j], ids[real][:, layer].reshape(-1), 1)
    np.testing.assert_array_equal(np.asarray(counts), want)


def test_recorder_off_refuses():
    with Engine(**engine_args()) as eng:
        for call in (eng.start_expert_distribution_record, eng.stop_expert_distribution_record,
                     eng.dump_expert_distribution_record, eng.get_expert_load):
            with pytest.raises(ValueError, match="--expert-distribution-recorder-mode"):
                call()
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})  # still serves


# -- HTTP -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dumps"))
    yield from server_fixture(request, server_flags(
        expert_distribution_recorder_mode="stat", enable_return_routed_experts=True,
        expert_distribution_recorder_dir=folder))


def _post(server, path: str) -> requests.Response:
    return requests.post(server.url + path, timeout=30)


def test_http_start_stop_dump_and_expert_load(server):
    r = requests.get(server.url + "/expert_load", timeout=30)
    assert r.status_code == 400 and "start_expert_distribution_record" in \
        r.json()["error"]["message"]
    assert _post(server, "/stop_expert_distribution_record").status_code == 400
    assert _post(server, "/start_expert_distribution_record").json()["success"] is True
    err = _post(server, "/start_expert_distribution_record")
    assert err.status_code == 400 and err.json()["error"]["type"] == "invalid_request_error"
    prompt = prompt_ids(800, 12)
    out = requests.post(server.url + "/generate", timeout=60, json={
        "input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 4},
        "return_routed_experts": True}).json()
    assert _post(server, "/stop_expert_distribution_record").status_code == 200
    load = requests.get(server.url + "/expert_load", timeout=30).json()
    rows = returned_rows([out], CFG)[0]
    assert load["num_tokens"] == len(rows) == 15
    assert load["moe_layers"] == list(CFG.moe_layer_ids)
    np.testing.assert_array_equal(np.array(load["counts"]),
                                  bincount(rows, CFG.moe_layer_ids, CFG.num_experts))
    dumped = _post(server, "/dump_expert_distribution_record").json()
    with np.load(dumped["path"]) as f:
        np.testing.assert_array_equal(f["counts"], np.array(load["counts"]))
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


def test_http_expert_load_png(server):
    pytest.importorskip("matplotlib")
    pytest.importorskip("sgl_jax.tools.expert_load")
    if requests.get(server.url + "/expert_load", timeout=30).status_code != 200:
        _post(server, "/start_expert_distribution_record")
    r = requests.get(server.url + "/expert_load.png", timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png" and r.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_flags():
    import argparse

    from sgl_jax.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([
        "--expert-distribution-recorder-mode", "per_pass",
        "--expert-distribution-recorder-buffer-size", "7",
        "--expert-distribution-recorder-dir", "/tmp/x"]))
    assert (args.expert_distribution_recorder_mode, args.expert_distribution_recorder_buffer_size,
            args.expert_distribution_recorder_dir) == ("per_pass", 7, "/tmp/x")
    defaults = ServerArgs()
    assert defaults.expert_distribution_recorder_mode is None
    assert defaults.expert_distribution_recorder_dir is None  # a private directory (M26)
    with pytest.raises(ValueError, match="expert_distribution_recorder_mode"):
        ServerArgs(expert_distribution_recorder_mode="bogus")
    with pytest.raises(ValueError, match="buffer_size"):
        ServerArgs(expert_distribution_recorder_buffer_size=0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--expert-distribution-recorder-mode", "bogus"])
