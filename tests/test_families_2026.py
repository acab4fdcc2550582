"""The M23 families MiniMax-M2 and gpt-oss against the independent float64 reference forward
(``sgl_jax/tools/reference_forward.py``); no torch needed (tests/test_hf_families_2026.py
checks the reference and the engine against transformers itself).

Each family's tiny random checkpoint (``make_random_model --preset tiny-minimax-m2`` /
``tiny-gpt-oss``: routers redrawn until every selection gap clears the preset's threshold; the
gpt-oss one with sliding windows of 16 keys, shorter than the prompts) runs:

- the scenario of tests/backend_scenario.py on a ModelRunner (a prompt in two chunks, a cached
  prefix, a mixed extend batch, batched decode): routed experts exactly, logits to 1e-5
  relative, with the dense, ragged and gmm (interpret mode) expert backends, pages of 1 and
  16, gpt-oss from MXFP4 experts, MiniMax-M2 on the Pallas kernel (interpret mode);
- multi-device layouts on fake CPU devices (tp x ep, DP attention with both dispatches,
  EPLB, sequence parallelism), in a subprocess;
- an Engine with small prefill chunks: greedy tokens, every routed row and every logprob
  (prompt and output) equal the reference's, prompts longer than the window, a prefix hit;
- the refusals: gpt-oss on the Pallas backend (by family), NEXTN without MTP layers, the
  on-device update path for gpt-oss's fused experts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.testing import engine_args, fake_devices_flags
from sgl_jax.tools.make_random_model import write_random_model
from tests.backend_scenario import assert_matches, reference_scenario, run_scenario
from tests.engine_utils import (
    assert_no_leak,
    decoded_rows,
    expected_rows,
    prompt_ids,
    reference,
    reference_greedy,
)

REPO = Path(__file__).absolute().parents[1]
REL_TOL = 1e-5
MXFP4 = {"quantization_config": {"quant_method": "mxfp4"}}
# name -> (make_random_model preset, overrides, seed)
FAMILIES: dict[str, tuple[str, dict, int]] = {
    "minimax_m2": ("tiny-minimax-m2", {}, 0),
    "gpt_oss": ("tiny-gpt-oss", {}, 0),
    "gpt_oss_mxfp4": ("tiny-gpt-oss", MXFP4, 0),
    # The Pallas kernel needs head_dim % 128 == 0 (MiniMax-M2's own: 128, rotary 64).
    "minimax_m2_head128": ("tiny-minimax-m2", {"head_dim": 128, "rotary_dim": 64}, 1),
}
# (checkpoint, attention backend, moe backend, page size)
COMBINATIONS = [
    ("minimax_m2", "native", "dense", 1),
    ("minimax_m2", "native", "ragged", 16),
    ("gpt_oss", "native", "dense", 1),
    ("gpt_oss", "native", "ragged", 16),
    ("gpt_oss", "native", "gmm", 16),
    ("gpt_oss_mxfp4", "native", "ragged", 4),
    ("minimax_m2_head128", "pallas", "ragged", 16),
]
RAGGED = {"moe_backend": "ragged"}
DP2 = {"enable_dp_attention": True, "dp_size": 2}
# name -> (checkpoint, tp, ep, other server args); one 4-device worker process runs them all.
LAYOUTS: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    **{f"{f}_tp2_ep2_ragged": (f, 2, 2, RAGGED) for f in ("minimax_m2", "gpt_oss")},
    **{f"{f}_tp2_ep2_dp2": (f, 2, 2, DP2) for f in ("minimax_m2", "gpt_oss")},
    "gpt_oss_ep4_dp4_a2a_ragged": ("gpt_oss", 1, 4, {
        "enable_dp_attention": True, "dp_size": 4, "moe_dispatch": "ragged_all_to_all",
        **RAGGED}),
    **{f"{f}_ep4_eplb": (f, 1, 4, {"enable_eplb": True, "ep_num_redundant_experts": 4})
       for f in ("minimax_m2", "gpt_oss")},
    **{f"{f}_tp2_sp": (f, 2, 1, {"sequence_parallel_min_tokens": 1})
       for f in ("minimax_m2", "gpt_oss")},
}
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families_2026")
    paths = {}
    for name, (preset, overrides, seed) in FAMILIES.items():
        paths[name] = str(root / name)
        write_random_model(paths[name], preset, overrides, seed=seed)
    return paths


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, dict]:
    return {name: reference_scenario(path) for name, path in checkpoints.items()}


def _args(path: str, **overrides: Any) -> ServerArgs:
    settings = dict(
        model_path=path, max_running_requests=4, chunked_prefill_size=32,
        precompile_token_paddings=[32], precompile_bs_paddings=[4], max_total_tokens=512,
        attention_block_size=16, context_length=256, enable_return_routed_experts=True)
    return ServerArgs(**{**settings, **overrides})


def test_configs_describe_each_family(checkpoints):
    mm = ModelConfig.from_hf(checkpoints["minimax_m2"])
    assert (mm.family, mm.router, mm.n_group, mm.norm_topk_prob) == (
        "minimax_m2", "sigmoid_grouped", 1, True)
    assert mm.score_bias_on_block and mm.qk_norm_per_layer and mm.rope_dim == 8 < mm.head_dim
    assert all(mm.moe_layers) and mm.routing_info()["router"] == "sigmoid_grouped"
    go = ModelConfig.from_hf(checkpoints["gpt_oss"])
    assert (go.family, go.router, go.router_bias) == ("gpt_oss", "topk_softmax", True)
    assert go.attention_sinks and go.o_proj_bias and go.qkv_bias and go.expert_bias
    assert [go.layer_window(i) for i in range(4)] == [16, 0, 16, 0]
    assert go.rope_scaling is not None and not go.rope_scaling.truncate
    assert go.expert_activation == "clamped_swiglu" and go.swiglu_limit == 2.5
    assert go.routing_info()["router_bias"] is True
    # The MXFP4 checkpoint is accepted (dequantised at load); other quantisations are not.
    assert ModelConfig.from_hf(checkpoints["gpt_oss_mxfp4"]).family == "gpt_oss"
    with open(os.path.join(checkpoints["gpt_oss"], "config.json")) as f:
        raw = json.load(f)
    with pytest.raises(ValueError, match="quantised checkpoint.*fp8"):
        ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "fp8"}}, "x")
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict({**raw, "layer_types": ["sliding_attention"]}, "x")


@pytest.mark.parametrize("combo", COMBINATIONS, ids=["-".join(map(str, c)) for c in COMBINATIONS])
def test_family_matches_reference(checkpoints, references, combo):
    name, attention, moe, page = combo
    args = _args(checkpoints[name], attention_backend=attention, moe_backend=moe,
                 page_size=page)
    runner = ModelRunner(args, ModelConfig.from_hf(checkpoints[name], args.context_length))
    runner.precompile()
    compiled = runner.num_compiles
    got = run_scenario(runner)
    assert_matches(got, references[name], REL_TOL)
    assert runner.num_compiles == compiled
    rows = got["rows_0_a"]
    assert rows.min() >= 0 and rows.max() < runner.model_config.num_experts


def test_mxfp4_dequantisation_agrees_with_the_reference():
    """The loader's MXFP4 decoding (a table of E2M1 values) equals the reference's (from the
    format's bit fields) on every byte and a range of exponents, and known values."""
    from sgl_jax.srt.model_loader.fused_experts import dequantize_mxfp4 as ours
    from sgl_jax.tools.reference_layers import dequantize_mxfp4 as ref

    rng = np.random.default_rng(0)
    blocks = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16)
    blocks = np.concatenate([blocks, rng.integers(0, 256, (1, 1, 16, 16), dtype=np.uint8)], 1)
    scales = rng.integers(100, 140, (1, 2, 16)).astype(np.uint8)
    got = ours(blocks, scales)  # [1, 16 * 32, 2]: transposed to [in, out]
    np.testing.assert_array_equal(got, ref(blocks, scales).transpose(0, 2, 1))
    # Byte 0x2F: low nibble 0xF = -6, high nibble 0x2 = 1.0; exponent 128 - 127 = 1.
    one = ours(np.full((1, 1, 1, 16), 0x2F, np.uint8), np.full((1, 1, 1), 128, np.uint8))
    np.testing.assert_array_equal(one[0, :2, 0], [-12.0, 2.0])


def test_gpt_oss_refuses_pallas_by_family(tmp_path):
    path = str(tmp_path / "gpt_oss_head128")
    write_random_model(path, "tiny-gpt-oss", {"head_dim": 128}, check_routing=False)
    runner = ModelRunner(_args(path, attention_backend="pallas", page_size=16),
                         ModelConfig.from_hf(path))
    with pytest.raises(ValueError, match="gpt_oss: attention sinks run on --attention-backend "
                                         "native only"):
        runner.precompile()


@pytest.mark.parametrize("name", ["minimax_m2", "gpt_oss"])
def test_nextn_is_refused_without_mtp_layers(checkpoints, name):
    args = _args(checkpoints[name], speculative_algorithm="NEXTN", page_size=4)
    with pytest.raises(ValueError, match="no MTP layer"):
        ModelRunner(args, ModelConfig.from_hf(checkpoints[name]))


def test_fused_experts_refuse_the_on_device_update_path(checkpoints):
    """gpt-oss's fused expert tensors are converted on the host (interleaved columns, biases):
    the on-device update path's check refuses them by name instead of misplacing them."""
    import jax.numpy as jnp

    from sgl_jax.srt.model_loader.loader import ArraySource, CheckpointError, check_tensors

    runner = ModelRunner(_args(checkpoints["gpt_oss"]), ModelConfig.from_hf(checkpoints["gpt_oss"]))
    block = runner.model.model.layers[0].mlp
    name = "model.layers.0.mlp.experts.gate_up_proj"
    source = ArraySource({name: jnp.zeros((16, 64, 64)),
                          name + "_bias": jnp.zeros((16, 64))})
    with pytest.raises(CheckpointError, match="fused expert tensors.*from disk"):
        check_tensors(block.w_gate, [name, name + "_bias"], source, False,
                      "GptOssForCausalLM")


def _logprob_rows(path: str, ids: list[int]) -> np.ndarray:
    logits = reference(path).forward(ids).logits
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.mark.parametrize("name", ["minimax_m2", "gpt_oss"])
def test_engine_serves_family(checkpoints, name):
    """Chunks of 16 tokens (the gpt-oss window), prompts of up to 60, a prefix hit: tokens,
    every routed row and every logprob equal the reference's."""
    path = checkpoints[name]
    cfg = ModelConfig.from_hf(path)
    prompts = [prompt_ids(200 + i, n) for i, n in enumerate((60, 23, 41))]
    prompts.append(prompts[0][:48] + prompt_ids(9, 7))  # a prefix-cache hit on prompt 0
    engine = Engine(**engine_args(model_path=path, enable_return_routed_experts=True,
                                  chunked_prefill_size=16, precompile_token_paddings=[16, 64],
                                  page_size=4))
    # Input logprobs from 0, but for the prefix hit from position 52: the cache serves only
    # positions whose logits no input logprob needs (before logprob_start_len - 1).
    starts = [0, 0, 0, 52]
    try:
        outs = [engine.generate(input_ids=ids, sampling_params=GREEDY,
                                return_routed_experts=True, return_logprob=True,
                                logprob_start_len=start)
                for ids, start in zip(prompts, starts, strict=True)]
        for ids, start, out in zip(prompts, starts, outs, strict=True):
            assert out["output_ids"] == reference_greedy(ids, 6, path)
            rows = decoded_rows(out, cfg.num_hidden_layers, cfg.num_experts_per_tok)
            np.testing.assert_array_equal(rows, expected_rows(ids, out["output_ids"], path))
            seq = ids + out["output_ids"]
            lp = _logprob_rows(path, seq[:-1])  # row p: log p(token p + 1 | tokens <= p)
            meta = out["meta_info"]
            first = max(start, 1)  # position 0 has no logprob
            got = [v for v, _, _ in meta["input_token_logprobs"][first - start:]]
            got += [v for v, _, _ in meta["output_token_logprobs"]]
            want = lp[np.arange(first - 1, len(seq) - 1), seq[first:]]
            # float32 against float64: 1e-5, plus float32's relative rounding of ~10-nat
            # logprobs (the logits' own test is relative: backend_scenario.assert_matches).
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5)
        assert outs[3]["meta_info"]["cached_tokens"] >= 48
        assert_no_leak(engine)
    finally:
        engine.shutdown()


# -- multi-device layouts on fake CPU devices (one worker process) ---------------------------
def _worker(job: dict[str, Any]) -> None:
    from sgl_jax.srt.utils import enable_compilation_cache

    enable_compilation_cache(ServerArgs())
    for name in job["layouts"]:
        model, tp, ep, extra = LAYOUTS[name]
        path = job["paths"][model]
        args = _args(path, tp_size=tp, ep_size=ep, max_total_tokens=256,
                     max_running_requests=4 * extra.get("dp_size", 1), **extra)
        runner = ModelRunner(args, ModelConfig.from_hf(path))
        np.savez(os.path.join(job["out"], f"{name}.npz"), **run_scenario(runner))


def test_parallel_layouts_match_reference(checkpoints, references, tmp_path):
    paths = {f: checkpoints[f] for f in ("minimax_m2", "gpt_oss")}
    job = {"layouts": list(LAYOUTS), "paths": paths, "out": str(tmp_path)}
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fake_devices_flags(4)}
    proc = subprocess.run([sys.executable, "-m", "tests.test_families_2026", json.dumps(job)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name, (model, *_) in LAYOUTS.items():
        with np.load(os.path.join(tmp_path, f"{name}.npz")) as got:
            assert_matches(dict(got), references[model], REL_TOL)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
