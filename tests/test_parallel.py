"""Tensor and expert parallelism on fake CPU devices (M7), with every expert backend (M8).

Every configuration runs the real ModelRunner in a subprocess whose
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` is set before JAX starts (one process
per device count, all started at once). Each runs the scenario of tests/backend_scenario.py (a
prompt prefilled in two chunks, a request on a cached prefix, a mixed extend batch, decode
steps). The logits must match the float64 reference forward to 1e-5 relative error and the
routed top-k ids exactly; the workers also report how the parameters and the KV cache are
really laid out over the devices. A random checkpoint with 8 KV heads takes tp to 4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.distributed import check_parallel_layout, maybe_initialize_distributed
from sgl_jax.srt.layers.moe.balancing import balanced_mapping, expert_load
from sgl_jax.srt.layers.moe.placement import ExpertPlacement
from sgl_jax.testing import TEST_MODEL_PATH, fake_devices_flags
from tests.backend_scenario import assert_matches, reference_scenario, run_scenario

REPO = Path(__file__).absolute().parents[1]
REL_TOL = 1e-5
STRIDED = [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
REVERSED = [[15, 11, 7, 3], [14, 10, 6, 2], [13, 9, 5, 1], [12, 8, 4, 0]]
# ep4: a non-contiguous mapping for every layer, and a different one for layer 2.
EP4_MAPPING = json.dumps({"default": STRIDED, "2": REVERSED})
WIDE = "wide"  # a random checkpoint with 8 KV heads, so that tp can reach 4
HEAD128 = "head128"  # head_dim 128: the Pallas attention kernel's minimum

RAGGED = {"moe_backend": "ragged"}
DP2 = {"enable_dp_attention": True, "dp_size": 2}
A2A = {"moe_dispatch": "ragged_all_to_all"}
SP = {"sequence_parallel_min_tokens": 1}  # every step whose tokens tp divides split by token
# name -> (devices of the worker process that runs it, model, tp, ep, mapping, other server
# args). A worker runs its configurations one after the other; the single-device references
# use a 1-device mesh (devices[:1]) of a multi-device process, the same single-device program.
CONFIGS: dict[str, tuple[int, str, int, int, str | None, dict[str, Any]]] = {
    "single": (2, TEST_MODEL_PATH, 1, 1, None, {}),
    "tp2": (2, TEST_MODEL_PATH, 2, 1, None, {}),
    "ep2": (2, TEST_MODEL_PATH, 1, 2, None, {}),
    "tp2_ep2": (4, TEST_MODEL_PATH, 2, 2, None, {}),
    "ep4_mapped": (4, TEST_MODEL_PATH, 1, 4, EP4_MAPPING, {}),
    "ep8": (8, TEST_MODEL_PATH, 1, 8, None, {}),
    "wide_tp4_ep2": (8, WIDE, 4, 2, None, {}),
    # The sparse expert backend: each device sorts and computes only its experts' assignments.
    "single_ragged": (2, TEST_MODEL_PATH, 1, 1, None, RAGGED),
    "tp2_ragged": (2, TEST_MODEL_PATH, 2, 1, None, RAGGED),
    "tp2_ep2_ragged": (4, TEST_MODEL_PATH, 2, 2, None, RAGGED),
    "ep4_mapped_ragged": (4, TEST_MODEL_PATH, 1, 4, EP4_MAPPING, RAGGED),
    "wide_tp4_ep2_ragged": (8, WIDE, 4, 2, None, RAGGED),
    # Pages of 16, and the Pallas kernel (interpret mode) per device under shard_map.
    "tp2_ep2_ragged_p16": (4, TEST_MODEL_PATH, 2, 2, None, {**RAGGED, "page_size": 16}),
    "head128_tp2_pallas_p16": (
        2, HEAD128, 2, 1, None, {"attention_backend": "pallas", "page_size": 16}),
    "head128_tp2_ep2_pallas_ragged": (
        4, HEAD128, 2, 2, None, {**RAGGED, "attention_backend": "pallas"}),
    # The M11 families on tp2 x ep2 (tests/test_families.py has them on one device).
    **{f"{family}_tp2_ep2_ragged": (4, family, 2, 2, None, RAGGED)
       for family in ("qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe")},
    # Data-parallel attention (M19): each rank its own rows and KV pages, experts over all.
    "tp2_ep2_dp2": (4, TEST_MODEL_PATH, 2, 2, None, DP2),
    "ep4_dp4": (4, TEST_MODEL_PATH, 1, 4, None, {"enable_dp_attention": True, "dp_size": 4}),
    "tp2_ep2_dp2_ragged_p16": (4, TEST_MODEL_PATH, 2, 2, None,
                               {**DP2, **RAGGED, "page_size": 16}),
    "deepseek_v3_tp2_ep2_dp2": (4, "deepseek_v3", 2, 2, None, DP2),
    # The all-to-all dispatch (each device receives only its experts' assignments).
    "tp2_ep2_dp2_a2a": (4, TEST_MODEL_PATH, 2, 2, None, {**DP2, **A2A}),
    "ep4_dp4_a2a_ragged": (4, TEST_MODEL_PATH, 1, 4, None, {
        "enable_dp_attention": True, "dp_size": 4, **A2A, **RAGGED}),
    "deepseek_v3_tp2_ep2_dp2_a2a_ragged": (4, "deepseek_v3", 2, 2, None,
                                           {**DP2, **A2A, **RAGGED}),
    "head128_tp2_ep2_dp2_pallas_p16": (
        4, HEAD128, 2, 2, None, {**DP2, "attention_backend": "pallas", "page_size": 16}),
    # EPLB's dynamic placement (4 redundant rows) under DP attention.
    "ep4_dp4_eplb": (4, TEST_MODEL_PATH, 1, 4, None, {
        "enable_dp_attention": True, "dp_size": 4, "enable_eplb": True,
        "ep_num_redundant_experts": 4}),
    "ep4_dp4_eplb_a2a": (4, TEST_MODEL_PATH, 1, 4, None, {
        "enable_dp_attention": True, "dp_size": 4, "enable_eplb": True,
        "ep_num_redundant_experts": 4, **A2A}),
    # Sequence parallelism: the residual stream split by token over "tensor" (shared
    # experts, MLA and dense layers included).
    "tp2_sp": (2, TEST_MODEL_PATH, 2, 1, None, SP),
    "wide_tp4_ep2_sp_ragged": (8, WIDE, 4, 2, None, {**SP, **RAGGED}),
    "qwen2_moe_tp2_ep2_sp": (4, "qwen2_moe", 2, 2, None, SP),
    "deepseek_v3_tp2_ep2_sp_ragged": (4, "deepseek_v3", 2, 2, None, {**SP, **RAGGED}),
    "tp2_ep2_sp_gmm": (4, TEST_MODEL_PATH, 2, 2, None, {**SP, "moe_backend": "gmm"}),
    # ... and under DP attention: each rank's tokens split over its "tensor" devices, gathered
    # within the rank for attention; the MoE sums reduce-scattered over both axes. (gmm under
    # DP x SP: tests/test_moe_gmm.py; its interpret-mode passes are slow in a whole model.)
    "tp2_ep2_dp2_sp": (4, TEST_MODEL_PATH, 2, 2, None, {**DP2, **SP}),
    "deepseek_v3_tp2_ep2_dp2_sp": (4, "deepseek_v3", 2, 2, None, {**DP2, **SP}),
    # Extend steps padded to 128 tokens, more than a device's 64 q/k/v columns at tp 2: q, k
    # and v as one matmul (GqaAttention._fused_qkv), with the residual stream split.
    "tp2_sp_fused_qkv": (2, TEST_MODEL_PATH, 2, 1, None,
                         {**SP, "precompile_token_paddings": [128]}),
    "deepseek_v3_tp2_ep2_mapped": (4, "deepseek_v3", 2, 2, json.dumps(
        {"default": [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]}), {}),
}
SPLIT_CHECKED = ("tp2", "tp2_sp", "tp2_ep2_dp2", "tp2_ep2_dp2_sp", "deepseek_v3_tp2_ep2_dp2",
                 "deepseek_v3_tp2_ep2_dp2_sp")  # their extend steps' collectives are compared
# Random checkpoints: name -> (make_random_model preset, overrides, seed).
RANDOM_MODELS = {
    WIDE: ("tiny", {"num_attention_heads": 8, "num_key_value_heads": 8}, 11),
    HEAD128: ("tiny", {"head_dim": 128}, 5),
    "qwen2_moe": ("tiny-qwen2-moe", {}, 0),
    "mixtral": ("tiny-mixtral", {}, 0),
    "deepseek_v3": ("tiny-deepseek-v3", {}, 0),
    "glm4_moe": ("tiny-glm4-moe", {}, 0),
}
HEAD_DIM = {WIDE: 16, HEAD128: 128, TEST_MODEL_PATH: 16}
HEADS = {WIDE: (8, 8), HEAD128: (4, 2), TEST_MODEL_PATH: (4, 2)}


def _layout(runner: Any, mapping_spec: str | None) -> dict[str, Any]:
    """Where the parameters and the KV cache really are, checked shard by shard."""
    from safetensors import safe_open

    mesh = runner.mesh
    cfg = runner.model_config
    ep, tp = mesh.shape["expert"], mesh.shape["tensor"]
    mapping = (
        ExpertPlacement.parse(mapping_spec) if mapping_spec
        else runner.expert_placement if runner.eplb is not None  # EPLB's initial placement
        else ExpertPlacement.contiguous(cfg.num_experts, ep)
    )
    position = {dev: idx for idx, dev in np.ndenumerate(mesh.devices)}
    info: dict[str, Any] = {"num_devices_used": mesh.devices.size}
    layers = runner.model.model.layers
    placement_ok = True
    with safe_open(os.path.join(cfg.model_path, "model.safetensors"), "numpy") as f:
        for layer_id in cfg.moe_layer_ids:
            block = getattr(layers[layer_id], layers[layer_id].ffn_name)
            gate_name = block.w_gate.get_metadata()["hf"][0]  # gate_proj (Mixtral: w1)
            logical = np.stack([
                f.get_tensor(f"model.layers.{layer_id}.{layers[layer_id].ffn_name}.experts.{e}."
                             f"{gate_name}.weight").T
                for e in range(cfg.num_experts)
            ])
            table = mapping.for_layer(layer_id)
            for shard in block.w_gate[...].addressable_shards:
                d, t = position[shard.device]
                # device (d, t): experts mapping[d], intermediate slice t of tp
                inter = logical.shape[2] // tp
                want = logical[table[d]][:, :, t * inter:(t + 1) * inter]
                placement_ok &= np.array_equal(np.asarray(shard.data), want)
            if runner.eplb is None:  # a static placement is the block's compile-time order
                placement_ok &= block.expert_order == tuple(table.reshape(-1).tolist())
    info["expert_placement_ok"] = bool(placement_ok)
    if cfg.architecture != "Qwen3MoeForCausalLM":  # the shapes below are the tiny Qwen3's
        return info
    attn, moe = layers[0].self_attn, layers[0].mlp
    for name, arr in [
        ("q_proj", attn.q_proj[...]), ("o_proj", attn.o_proj[...]), ("w_gate", moe.w_gate[...]),
        ("w_down", moe.w_down[...]),
        ("kv_cache", runner.kv_caches[0]),
    ]:
        info[name] = {
            "spec": [a if a is None or isinstance(a, str) else list(a) for a in arr.sharding.spec],
            "shard_shape": list(arr.addressable_shards[0].data.shape),
            "num_shards": len({repr(s.index) for s in arr.addressable_shards}),
        }
    return info


def _worker(job: dict[str, Any]) -> None:
    from sgl_jax.srt.model_executor.model_runner import ModelRunner
    from sgl_jax.srt.server_args import ServerArgs
    from sgl_jax.srt.utils import enable_compilation_cache

    # The engine's persistent compilation cache (as in the engine tests): reruns skip XLA.
    enable_compilation_cache(ServerArgs())
    results: dict[str, Any] = {}
    for name in job["configs"]:
        _, model, tp, ep, mapping, extra = CONFIGS[name]
        model_path = os.path.join(job["out"], model) if model in RANDOM_MODELS else model
        args = ServerArgs(
            model_path=model_path, tp_size=tp, ep_size=ep, ep_expert_mapping=mapping,
            # With DP attention, 4 requests per rank (the buckets are per rank).
            max_running_requests=4 * extra.get("dp_size", 1), precompile_bs_paddings=[4],
            max_total_tokens=256, attention_block_size=16, enable_return_routed_experts=True,
            **{"chunked_prefill_size": 32, "precompile_token_paddings": [32], **extra},
        )
        runner = ModelRunner(args, ModelConfig.from_hf(model_path))
        arrays = run_scenario(runner)
        np.savez(os.path.join(job["out"], f"{name}.npz"), **arrays)
        results[name] = {**_layout(runner, mapping), "num_compiles": runner.num_compiles}
        if name in SPLIT_CHECKED:  # how the extend step adds the tensor-parallel partial sums
            from sgl_jax.srt.forward_batch_info import ForwardMode

            text = runner.lower_bucket(ForwardMode.EXTEND, 32, 4).compile().as_text()
            results[name]["collectives"] = {
                op: text.count(f" {op}(") for op in ("all-reduce", "reduce-scatter")}
            results[name]["moe_layers"] = sum(runner.model_config.moe_layers)
        if name == "tp2_sp_fused_qkv":  # the extend step's q/k/v projections, by source op
            from sgl_jax.srt.forward_batch_info import ForwardMode

            text = runner.lower_bucket(ForwardMode.EXTEND, 128, 4).compile().as_text()
            results[name]["fused_qkv_dots"] = text.count("th,hsd->tsd")
    # A layout that does not fit this process's devices fails at start-up, clearly.
    n = job["devices"]
    try:
        ModelRunner(ServerArgs(tp_size=2, ep_size=n), ModelConfig.from_hf(TEST_MODEL_PATH))
        results["too_many_devices_error"] = None
    except ValueError as e:
        results["too_many_devices_error"] = str(e)
    with open(os.path.join(job["out"], f"layout_{n}.json"), "w") as f:
        json.dump(results, f)


# -- parent side -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    from sgl_jax.tools.make_random_model import write_random_model

    with tempfile.TemporaryDirectory() as tmp:
        for name, (preset, overrides, seed) in RANDOM_MODELS.items():
            write_random_model(os.path.join(tmp, name), preset, overrides, seed=seed)
        by_devices: dict[int, list[str]] = {}
        for name, (devices, *_) in CONFIGS.items():
            by_devices.setdefault(devices, []).append(name)

        def run(devices: int) -> subprocess.CompletedProcess:
            job = {"devices": devices, "configs": by_devices[devices], "out": tmp}
            env = {**os.environ, "JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": fake_devices_flags(devices)}
            return subprocess.run(
                [sys.executable, "-m", "tests.test_parallel", json.dumps(job)],
                cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
            )

        with ThreadPoolExecutor(len(by_devices)) as pool:
            procs = dict(zip(by_devices, pool.map(run, by_devices), strict=True))
        for devices, proc in procs.items():
            assert proc.returncode == 0, f"{devices}-device worker failed:\n{proc.stderr[-4000:]}"
        out: dict[str, Any] = {"layout": {}, "arrays": {}}
        for devices in by_devices:
            with open(os.path.join(tmp, f"layout_{devices}.json")) as f:
                out["layout"][devices] = json.load(f)
        for name in CONFIGS:
            with np.load(os.path.join(tmp, f"{name}.npz")) as z:
                out["arrays"][name] = dict(z)
        # Every layout is checked against the independent float64 reference forward.
        out["reference"] = {
            model: reference_scenario(
                os.path.join(tmp, model) if model in RANDOM_MODELS else model
            )
            for model in {CONFIGS[name][1] for name in CONFIGS}
        }
        return out


def _layout_of(results: dict[str, Any], name: str) -> dict[str, Any]:
    return results["layout"][CONFIGS[name][0]][name]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference(results, name):
    assert_matches(results["arrays"][name], results["reference"][CONFIGS[name][1]], REL_TOL)


def test_scenario_routes_real_experts(results):
    arrays = results["arrays"]["single"]
    rows = np.concatenate([arrays["rows_0_a"], arrays["rows_1_b"]])
    assert rows.shape[1:] == (4, 4) and rows.min() >= 0 and rows.max() < 16
    # the batch really spreads over the experts of every device, also under ep8
    assert len(np.unique(rows)) == 16


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameters_really_sharded(results, name):
    _, model, tp, ep, _, _ = CONFIGS[name]
    lay = _layout_of(results, name)
    assert lay["num_devices_used"] == tp * ep
    assert lay["expert_placement_ok"]
    if model not in HEADS:  # an M11 family: experts placed as mapped; shapes differ
        return
    model = CONFIGS[name][1]
    heads, kv_heads = HEADS[model]
    head_dim = HEAD_DIM[model]
    assert lay["q_proj"]["spec"] == [None, "tensor"]
    assert lay["o_proj"]["spec"] == ["tensor", None]
    assert lay["w_gate"]["spec"] == ["expert", None, "tensor"]
    assert lay["w_down"]["spec"] == ["expert", "tensor", None]
    # What each device really holds (hidden 64, 16 experts of width 32):
    assert lay["q_proj"]["shard_shape"] == [64, heads * head_dim // tp]
    assert lay["o_proj"]["shard_shape"] == [heads * head_dim // tp, 64]
    rows = 16 + CONFIGS[name][5].get("ep_num_redundant_experts", 0)  # EPLB: + redundant
    assert lay["w_gate"]["shard_shape"] == [rows // ep, 64, 32 // tp]
    assert lay["w_down"]["shard_shape"] == [rows // ep, 32 // tp, 64]
    assert lay["w_gate"]["num_shards"] == tp * ep
    # the KV cache [pages, page_size, 2 * kv_heads, head_dim], after the steps that donated
    # and returned it: split by KV head (each device holds the K and V of its heads)
    assert lay["kv_cache"]["shard_shape"][2:] == [2 * kv_heads // tp, head_dim]
    # ... and, with DP attention, by page over the ranks ("expert"): nothing replicated
    dp = CONFIGS[name][5].get("dp_size", 1)
    assert (lay["kv_cache"]["spec"] + [None])[0] == ("expert" if dp > 1 else None)
    assert lay["kv_cache"]["num_shards"] == tp * dp
    # two shapes (one extend bucket, one decode bucket): sharding never forced a recompile
    assert lay["num_compiles"] == 2


def test_sequence_parallel_reduce_scatters(results):
    """With the residual stream split by token, each MoE block's tensor-parallel partial
    sums are reduce-scattered, where the replicated layout all-reduces them. (The attention
    output projection's all-reduce followed by the split is XLA's to turn into a
    reduce-scatter: XLA:TPU does, XLA:CPU keeps the all-reduce; docs/parallelism.md.)"""
    replicated = _layout_of(results, "tp2")["collectives"]
    split = _layout_of(results, "tp2_sp")["collectives"]
    moe_layers = sum(ModelConfig.from_hf(TEST_MODEL_PATH).moe_layers)
    assert replicated["reduce-scatter"] == 0 and replicated["all-reduce"] >= 2 * moe_layers
    assert split["reduce-scatter"] >= moe_layers


@pytest.mark.parametrize("replicated,split", [
    ("tp2_ep2_dp2", "tp2_ep2_dp2_sp"), ("deepseek_v3_tp2_ep2_dp2", "deepseek_v3_tp2_ep2_dp2_sp")])
def test_sequence_parallel_under_dp_attention(results, replicated, split):
    """With DP attention and the residual stream split within each rank (the scenario
    checked against the reference above), the MoE block's "tensor" partial sums are
    reduce-scattered after the "expert" ones instead of all-reduced: one more
    reduce-scatter per MoE layer in the extend step."""
    moe_layers = _layout_of(results, split)["moe_layers"]
    assert _layout_of(results, replicated)["collectives"]["reduce-scatter"] == moe_layers
    assert _layout_of(results, split)["collectives"]["reduce-scatter"] == 2 * moe_layers


def test_fused_qkv_projection_runs(results):
    """The scenario checked against the reference above ran q, k and v as one matmul in its
    128-token extend steps (an einsum per attention layer in the lowered step)."""
    layers = ModelConfig.from_hf(TEST_MODEL_PATH).num_hidden_layers
    assert _layout_of(results, "tp2_sp_fused_qkv")["fused_qkv_dots"] >= layers


def test_too_many_devices_fails_clearly(results):
    for devices, lay in results["layout"].items():
        msg = lay["too_many_devices_error"]
        assert msg is not None and "invalid parallel layout" in msg
        assert f"needs {2 * devices} devices but only {devices} are available" in msg


# -- layout checks and mapping helpers (no devices needed) ------------------------------------
@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_hf(TEST_MODEL_PATH)


def test_valid_layouts_pass(tiny):
    for tp, ep in [(1, 1), (2, 1), (1, 16), (2, 8), (2, 4)]:
        check_parallel_layout(tiny, tp, ep, 32)


@pytest.mark.parametrize("tp,ep,devices,message", [
    (1, 3, 8, "ep_size=3 does not divide num_experts=16"),
    (4, 1, 8, r"tp_size=4 does not divide num_key_value_heads=2 \(the KV cache is sharded by "
              r"KV head\)"),
    (3, 1, 8, "tp_size=3 does not divide num_attention_heads=4"),
    (2, 4, 4, "needs 8 devices but only 4 are available"),
    (1, 32, 32, "ep_size=32 does not divide num_experts=16"),
])
def test_bad_layouts_fail_clearly(tiny, tp, ep, devices, message):
    with pytest.raises(ValueError, match=message) as info:
        check_parallel_layout(tiny, tp, ep, devices)
    assert "this model accepts tp_size in [1, 2]" in str(info.value)


def test_mapping_parse_and_errors():
    m = ExpertPlacement.parse(EP4_MAPPING)
    np.testing.assert_array_equal(m.for_layer(0), STRIDED)
    np.testing.assert_array_equal(m.for_layer(2), REVERSED)
    np.testing.assert_array_equal(m.physical_order(1), np.array(STRIDED).reshape(-1))
    np.testing.assert_array_equal(m.device_of(0), np.arange(16) % 4)
    assert ExpertPlacement.parse(m.to_json()).to_json() == m.to_json()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(STRIDED, f)
    try:
        np.testing.assert_array_equal(ExpertPlacement.parse(f.name).for_layer(3), STRIDED)
    finally:
        os.unlink(f.name)
    with pytest.raises(ValueError, match=r"exactly once; duplicated \[0\], missing .* \[1\]"):
        ExpertPlacement([[0, 0], [2, 3]])
    with pytest.raises(ValueError, match="2-D integer array"):
        ExpertPlacement([0, 1, 2, 3])
    with pytest.raises(ValueError, match="num_experts=16 and ep_size=2"):
        m.check(16, 2)
    with pytest.raises(ValueError, match="neither JSON nor a file"):
        ExpertPlacement.parse("/no/such/mapping.json")


def test_balanced_mapping_from_routed_experts():
    rng = np.random.default_rng(0)
    skew = np.array([40, 30, 20, 10] + [1] * 12, dtype=float)
    routed = rng.choice(16, size=(500, 4, 1), p=skew / skew.sum())  # [tokens, layers, k]
    load = expert_load(routed, 16)
    assert load.shape == (4, 16) and load.sum() == 2000
    table = balanced_mapping(load[0], 4)
    mapping = ExpertPlacement(table)  # a valid mapping
    # the four hot experts land on four different devices
    assert sorted(mapping.device_of(0)[:4].tolist()) == [0, 1, 2, 3]
    per_device = load[0][table].sum(axis=1)
    assert per_device.max() < load[0].reshape(4, 4).sum(axis=1).max() / 2  # vs contiguous


def test_distributed_single_node_is_a_no_op():
    assert maybe_initialize_distributed(None, 1, 0) is False
    with pytest.raises(ValueError, match="dist_init_addr"):
        maybe_initialize_distributed(None, 2, 0)
    with pytest.raises(ValueError, match="node_rank=2"):
        maybe_initialize_distributed("127.0.0.1:1234", 2, 2)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
