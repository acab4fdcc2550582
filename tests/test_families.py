"""The MoE families of M11 (Qwen2-MoE, Mixtral, DeepSeek-V3 with MLA, GLM-4.5), each against
the independent float64 reference forward (``sgl_jax/tools/reference_forward.py``).

Each family's tiny random checkpoint (``make_random_model --preset tiny-<family>``, routers
redrawn until every selection gap on the sample prompts clears the preset's threshold) runs:

- the scenario of tests/backend_scenario.py on a ModelRunner: a prompt alone and chunked, a
  cached prefix, a mixed extend batch, then batched decode; routed experts exactly, logits to
  1e-5 relative; with the dense and the ragged expert backends, pages of 1 and 16, the Pallas
  kernel (interpret mode) for a GQA family with head_dim 128; no compile after precompile;
- an Engine: greedy tokens and every returned row equal the reference's, concurrently, with a
  prefix-cache hit, nothing leaked;
- an HTTP server: ``/get_model_info`` describes the rows, ``/generate`` returns them.

Multi-device layouts (tp x ep on fake CPU devices) of every family are in tests/test_parallel.py.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import requests

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.testing import engine_args, server_flags
from sgl_jax.tools.make_random_model import write_random_model
from tests.backend_scenario import assert_matches, reference_scenario, run_scenario
from tests.engine_utils import (
    assert_no_leak,
    decoded_rows,
    expected_rows,
    prompt_ids,
    reference_greedy,
)
from tests.server_utils import server_fixture

REL_TOL = 1e-5
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}

# family -> (make_random_model preset, overrides, seed)
FAMILIES: dict[str, tuple[str, dict, int]] = {
    "qwen2_moe": ("tiny-qwen2-moe", {}, 0),
    "mixtral": ("tiny-mixtral", {}, 0),
    # rms_norm_eps off its 1e-6 default: the latent norms keep 1e-6 (as transformers does).
    "deepseek_v3": ("tiny-deepseek-v3", {"rms_norm_eps": 1e-4}, 0),
    "glm4_moe": ("tiny-glm4-moe", {}, 0),
    # The Pallas kernel needs head_dim % 128 == 0: GLM's partial rotary at head_dim 128.
    "glm4_moe_head128": ("tiny-glm4-moe", {"head_dim": 128}, 1),
}
ENGINE_FAMILIES = ["qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe"]

# (family, attention backend, moe backend, page size)
COMBINATIONS = [
    *[(f, "native", "dense", 1) for f in ENGINE_FAMILIES],
    *[(f, "native", "ragged", 16) for f in ENGINE_FAMILIES],
    ("glm4_moe_head128", "pallas", "ragged", 16),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    paths = {}
    for name, (preset, overrides, seed) in FAMILIES.items():
        paths[name] = str(root / name)
        write_random_model(paths[name], preset, overrides, seed=seed)
    return paths


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, dict]:
    return {name: reference_scenario(path) for name, path in checkpoints.items()}


def test_configs_describe_each_family(checkpoints):
    cfgs = {name: ModelConfig.from_hf(path) for name, path in checkpoints.items()}
    assert cfgs["qwen2_moe"].router == "softmax_topk" and cfgs["qwen2_moe"].shared_expert_gated
    assert cfgs["mixtral"].router == "topk_softmax" and all(cfgs["mixtral"].moe_layers)
    ds = cfgs["deepseek_v3"]
    assert ds.router == "sigmoid_grouped" and ds.attention == "mla" and ds.n_group > 1
    assert ds.kv_cache_heads == 1 and ds.kv_cache_head_dim == ds.kv_lora_rank + ds.qk_rope_head_dim
    glm = cfgs["glm4_moe"]
    assert glm.router == "sigmoid_grouped" and glm.rope_dim < glm.head_dim
    for name in ("deepseek_v3", "glm4_moe", "qwen2_moe"):
        assert not all(cfgs[name].moe_layers), f"{name}'s preset should have a dense layer"


@pytest.mark.parametrize("combo", COMBINATIONS, ids=["-".join(map(str, c)) for c in COMBINATIONS])
def test_family_matches_reference(checkpoints, references, combo):
    name, attention, moe, page = combo
    args = ServerArgs(
        model_path=checkpoints[name], attention_backend=attention, moe_backend=moe,
        page_size=page, max_running_requests=4, chunked_prefill_size=32,
        precompile_token_paddings=[32], precompile_bs_paddings=[4], max_total_tokens=512,
        attention_block_size=16, context_length=256, enable_return_routed_experts=True,
    )
    runner = ModelRunner(args, ModelConfig.from_hf(checkpoints[name], args.context_length))
    runner.precompile()
    compiled = runner.num_compiles
    got = run_scenario(runner)
    want = references[name]
    assert_matches(got, want, REL_TOL)
    assert runner.num_compiles == compiled
    # Dense layers hold -1; every MoE layer routed real experts.
    cfg = runner.model_config
    rows = got["rows_0_a"]
    for layer, is_moe in enumerate(cfg.moe_layers):
        if is_moe:
            assert rows[:, layer].min() >= 0 and rows[:, layer].max() < cfg.num_experts
        else:
            assert (rows[:, layer] == -1).all()


def test_mla_refuses_pallas(checkpoints):
    args = ServerArgs(model_path=checkpoints["deepseek_v3"], attention_backend="pallas")
    with pytest.raises(ValueError, match="latent attention.*native"):
        ModelRunner(args, ModelConfig.from_hf(checkpoints["deepseek_v3"]))


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_engine_serves_family(checkpoints, name):
    path = checkpoints[name]
    cfg = ModelConfig.from_hf(path)
    prompts = [prompt_ids(100 + i, n) for i, n in enumerate((23, 9, 40))]
    prompts.append(prompts[2][:32] + prompt_ids(7, 5))  # a prefix-cache hit on prompt 2
    engine = Engine(**engine_args(model_path=path, enable_return_routed_experts=True))
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(
                lambda ids: engine.generate(input_ids=ids, sampling_params=GREEDY,
                                            return_routed_experts=True),
                prompts[:3],
            ))
        outs.append(engine.generate(input_ids=prompts[3], sampling_params=GREEDY,
                                    return_routed_experts=True))
        for ids, out in zip(prompts, outs, strict=True):
            assert out["output_ids"] == reference_greedy(ids, 6, path)
            rows = decoded_rows(out, cfg.num_hidden_layers, cfg.num_experts_per_tok)
            np.testing.assert_array_equal(rows, expected_rows(ids, out["output_ids"], path))
        assert outs[3]["meta_info"]["cached_tokens"] >= 32
        assert_no_leak(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=ENGINE_FAMILIES)
def server(request, checkpoints):
    flags = server_flags(model_path=checkpoints[request.param],
                         enable_return_routed_experts=True)
    for s in server_fixture(request, flags):
        yield request.param, s


def test_http_serves_family(server, checkpoints):
    name, srv = server
    path = checkpoints[name]
    cfg = ModelConfig.from_hf(path)
    info = requests.get(f"{srv.url}/get_model_info", timeout=30).json()
    assert info["architecture"] == cfg.architecture and info["family"] == name
    assert info["num_hidden_layers"] == cfg.num_hidden_layers
    assert info["num_experts"] == cfg.num_experts
    assert info["num_experts_per_tok"] == cfg.num_experts_per_tok
    assert info["moe_layers"] == list(cfg.moe_layer_ids) and info["router"] == cfg.router
    ids = prompt_ids(5, 17)
    res = requests.post(f"{srv.url}/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": GREEDY, "return_routed_experts": True,
    })
    assert res.status_code == 200, res.text
    out = res.json()
    assert out["output_ids"] == reference_greedy(ids, 6, path)
    rows = decoded_rows(out, info["num_hidden_layers"], info["num_experts_per_tok"])
    np.testing.assert_array_equal(rows, expected_rows(ids, out["output_ids"], path))


def test_capture_keeps_top_k_of_fused_shared_columns(checkpoints):
    """A router output with fused shared-expert columns (ids E..E+S-1 after the top-k, as in
    the design's ``k + num_fused_shared_experts`` buffer) is captured as its top-k only."""
    import jax.numpy as jnp

    from sgl_jax.srt.layers.moe.routed_experts_capturer import RoutedExpertsCapturer
    from sgl_jax.srt.layers.moe.routing import stack_routing

    cfg = ModelConfig.from_hf(checkpoints["deepseek_v3"])
    k, experts = cfg.num_experts_per_tok, cfg.num_experts
    capturer = RoutedExpertsCapturer.create(True, cfg, num_fused_shared_experts=1,
                                            num_tokens=8, max_running_requests=2)
    ids = np.array([[3, 1, 7, 0, experts], [5, 2, 9, 4, experts]], np.int32)
    assert ids.shape[1] == k + 1
    # The decoder's layer loop: each MoE layer's router choice, None for the dense layers.
    weights = jnp.ones(ids.shape, jnp.float32)
    layers = [(jnp.asarray(ids), weights) if layer in cfg.moe_layer_ids else None
              for layer in range(cfg.num_hidden_layers)]
    routing = stack_routing(layers, k, capturer.routing_spec)
    rows = np.asarray(capturer.step_rows(routing).ids).astype(np.int64)
    assert rows.shape == (2, cfg.num_hidden_layers, k)
    for layer in range(cfg.num_hidden_layers):
        want = ids[:, :k] if layer in cfg.moe_layer_ids else np.full((2, k), -1)
        got = np.where(rows[:, layer] == np.iinfo(capturer.host_cache.dtype).max, -1,
                       rows[:, layer])
        np.testing.assert_array_equal(got, want)
