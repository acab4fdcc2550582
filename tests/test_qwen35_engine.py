"""Qwen3.5-MoE served end to end against the float64 reference forward
(``sgl_jax/tools/reference_qwen35.py``, which shares no code with the engine).

A ``tiny-qwen3.5-moe`` random checkpoint (three Gated DeltaNet layers, then one gated-attention
layer; routers redrawn until every selection gap clears 1e-3) is served by an Engine with
``--enable-return-routed-experts`` and prefill chunks of 96 tokens:

- a 150-token prompt (two prefill chunks: the linear layers' conv and recurrent states carried
  from the first chunk to the second, and the first chunk spanning more than the delta rule's
  64-token chunk) and a 23-token one, batched, then decoded greedily: every token and every
  routed-expert row equal the reference's;
- four requests in a KV pool too small for them: decode retracts, and the resumed requests
  (their states rebuilt by a prefill from position 0) still match;
- the same long prompt again after the slot was used (a fresh request starts from zero
  states, whatever its slot's previous owner left);
- the released form (``Qwen3_5MoeForConditionalGeneration``: ``text_config``,
  ``model.language_model.*`` names, fused experts, vision and MTP tensors) loads the same
  parameters; a weight update given in that form is read the same way, and MTP tensors in an
  update are refused by name;
- tp 2 x ep 2 on fake CPU devices (a ModelRunner in a subprocess): a prompt in two chunks
  batched with a short one, then batched decode: tokens and rows equal the reference's, with
  the linear layers' state tables split by head over "tensor";
- the refusals by name (EAGLE, DP attention) and the prefix cache turned off (NGRAM and NEXTN:
  ``tests/test_qwen35_speculative.py``).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.distributed import make_mesh
from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.model_loader.loader import load_model
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.server_args_checks import check_for_linear_attention
from sgl_jax.testing import engine_args, fake_devices_flags
from sgl_jax.tools.make_random_model import write_random_model
from sgl_jax.tools.reference_qwen35 import Qwen35Reference
from tests.engine_utils import assert_no_leak, decoded_rows, prompt_ids
from tests.model_driver import ModelDriver

REPO = Path(__file__).absolute().parents[1]

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen35") / "tiny-qwen3.5-moe")
    # Seed 4: its routers clear the 1e-3 gap in 7 draws (seed 0 needs 29: ~15 s more).
    write_random_model(path, "tiny-qwen3.5-moe", seed=4)
    return path


@functools.lru_cache(maxsize=8)
def _reference(path: str) -> Qwen35Reference:
    return Qwen35Reference(path)


def reference_check(path: str, ids: list[int], output_ids: list[int]) -> tuple[list[int], np.ndarray]:
    """One float64 forward of prompt + output[:-1]: the greedy token after each prefix ending
    at or past the prompt's last token, and every position's routed rows. Equal greedy tokens
    at every position mean the output is the reference's greedy continuation."""
    out = _reference(path).forward(list(ids) + list(output_ids[:-1]))
    return np.argmax(out.logits[len(ids) - 1:], axis=1).tolist(), out.topk_ids


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = Engine(**engine_args(model_path=checkpoint, enable_return_routed_experts=True,
                               chunked_prefill_size=96, precompile_token_paddings=[32, 96],
                               precompile_bs_paddings=[1, 4], max_total_tokens=256,
                               schedule_conservativeness=0.0))
    yield eng
    eng.shutdown()


def _check(out: dict, ids: list[int], path: str, new_tokens: int = NEW_TOKENS) -> None:
    cfg = ModelConfig.from_hf(path)
    assert len(out["output_ids"]) == new_tokens
    tokens, rows = reference_check(path, ids, out["output_ids"])
    assert out["output_ids"] == tokens
    got = decoded_rows(out, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert got.shape == rows.shape
    np.testing.assert_array_equal(got, rows)  # every row of every layer


def test_chunked_prefill_then_decode_matches_reference(engine, checkpoint):
    long_prompt, short_prompt = prompt_ids(300, 150), prompt_ids(301, 23)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    outs = engine.generate(input_ids=[long_prompt, short_prompt], sampling_params=params,
                           return_routed_experts=True)
    for out, ids in zip(outs, (long_prompt, short_prompt), strict=True):
        _check(out, ids, checkpoint)
    # The long prompt again: a new request on a used slot starts from zero states, and no
    # prefix is reused (the prefix cache is off for linear-attention models).
    again = engine.generate(input_ids=long_prompt, sampling_params=params,
                            return_routed_experts=True)
    assert again["meta_info"].get("cached_tokens", 0) == 0
    _check(again, long_prompt, checkpoint)
    assert_no_leak(engine)


def test_retraction_rebuilds_the_states(engine, checkpoint):
    """A KV pool of 256 tokens for 4 requests of ~100: decode retracts; a retracted request
    resumes by prefilling every token it has (prefix 0), which rebuilds its states."""
    before = engine.get_server_info()["num_retractions"]
    prompts = [prompt_ids(80 + i, 30 + 5 * i) for i in range(4)]
    lens = [70, 60, 65, 55]
    outs = engine.generate(
        input_ids=prompts, return_routed_experts=True,
        sampling_params=[{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": n}
                         for n in lens])
    assert engine.get_server_info()["num_retractions"] > before
    for ids, n, out in zip(prompts, lens, outs, strict=True):
        _check(out, ids, checkpoint, n)
    assert_no_leak(engine)


def test_refusals_name_the_flag(checkpoint):
    cfg = ModelConfig.from_hf(checkpoint)
    for flags, flag in (({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": checkpoint},
                         "--speculative-algorithm"),
                        ({"dp_size": 2, "enable_dp_attention": True, "ep_size": 2},
                         "--dp-size")):
        args = ServerArgs(model_path=checkpoint, **flags)
        with pytest.raises(ValueError, match=f"{flag}.*qwen3_5_moe"):
            check_for_linear_attention(args, cfg.linear_layers, cfg.family)
    args = ServerArgs(model_path=checkpoint)
    check_for_linear_attention(args, cfg.linear_layers, cfg.family)
    assert args.disable_radix_cache


def released_tensors(path: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as the released form names them: ``model.language_model.*``,
    experts fused (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), plus a vision and
    an MTP tensor (which the language model does not read)."""
    cfg = ModelConfig.from_hf(path)
    flat = load_file(os.path.join(path, "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        e = range(cfg.num_experts)
        out[p + "gate_up_proj"] = np.stack([np.concatenate(
            [flat.pop(f"{p}{i}.gate_proj.weight"), flat.pop(f"{p}{i}.up_proj.weight")])
            for i in e])
        out[p + "down_proj"] = np.stack([flat.pop(f"{p}{i}.down_proj.weight") for i in e])
    out.update(flat)
    out = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): a
           for n, a in out.items()}
    out["model.visual.patch_embed.proj.weight"] = np.ones((4, 3), np.float32)
    out["mtp.fc.weight"] = np.ones((4, 4), np.float32)
    return out


@pytest.fixture(scope="module")
def released(checkpoint, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen35_released"))
    for name in os.listdir(checkpoint):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(checkpoint, name), path)
    with open(os.path.join(checkpoint, "config.json")) as f:
        text = json.load(f)
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "model_type": "qwen3_5_moe", "text_config": text,
              "vision_config": {"depth": 1}, "tie_word_embeddings": text.get(
                  "tie_word_embeddings", False)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(released_tensors(checkpoint), os.path.join(path, "model.safetensors"))
    return path


def test_released_form_loads_the_same_parameters(checkpoint, released):
    mesh = make_mesh(jax.devices()[:1], 1, 1)
    models = [load_model(ModelConfig.from_hf(p), mesh, jnp.float32)
              for p in (checkpoint, released)]
    flat, rel = ([np.asarray(x) for x in jax.tree.leaves(nnx.state(m, nnx.Param))]
                 for m in models)
    assert len(flat) == len(rel)
    for a, b in zip(flat, rel, strict=True):
        np.testing.assert_array_equal(a, b)


def test_update_in_released_form_and_mtp_refused(engine, checkpoint):
    arrays = {n: a for n, a in released_tensors(checkpoint).items()
              if n.startswith("model.language_model.layers.0.")}
    done = engine.update_weights_from_arrays(arrays)
    assert done["num_parameters"] > 0
    ids = prompt_ids(302, 30)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": NEW_TOKENS,
                                                          "temperature": 0.0,
                                                          "ignore_eos": True},
                          return_routed_experts=True)
    _check(out, ids, checkpoint)  # the same values: the same tokens and rows
    with pytest.raises(ValueError, match="MTP.*mtp.fc.weight"):
        engine.update_weights_from_arrays({"mtp.fc.weight": np.ones((4, 4), np.float32)})


# -- tp 2 x ep 2 on fake CPU devices (one worker process) -------------------------------------
def _worker(path: str, out: str) -> None:
    """Two requests on a tp 2 x ep 2 runner: the long one's first chunk alone, its second
    chunk with the short prompt, then batched decode; saves each request's tokens and rows."""
    args = ServerArgs(model_path=path, tp_size=2, ep_size=2, max_running_requests=4,
                      chunked_prefill_size=96, precompile_token_paddings=[96],
                      precompile_bs_paddings=[4], max_total_tokens=512,
                      enable_return_routed_experts=True)
    driver = ModelDriver(ModelRunner(args, ModelConfig.from_hf(path)))
    # Layer 0 is linear: its weights and state tables split by head over "tensor", each
    # device holding half of their heads (checked before any step, whose outputs GSPMD places).
    linear = driver.runner.model.model.layers[0].linear_attn
    split = [(a.addressable_shards[0].data.shape[axis], a.shape[axis]) for a, axis in (
        (linear.in_proj_q[...], 0), (linear.in_proj_v[...], 0), (linear.out_proj[...], 1),
        *((t, 1) for t in jax.tree.leaves(driver.runner.kv_caches[0])))]
    long_prompt, short_prompt = prompt_ids(300, 150), prompt_ids(301, 23)
    a, b = driver.new_seq(), driver.new_seq()
    _, rows_a = driver.step(ForwardMode.EXTEND, [a], [long_prompt[:96]])
    _, rows = driver.step(ForwardMode.EXTEND, [a, b], [long_prompt[96:], short_prompt])
    rows_a, rows_b = rows_a + [rows[0]], [rows[1]]
    tokens: list[list[int]] = [[], []]
    for _ in range(NEW_TOKENS):
        nxt = [int(t) for t in driver.last_next_ids]
        tokens[0].append(nxt[0])
        tokens[1].append(nxt[1])
        _, rows = driver.step(ForwardMode.DECODE, [a, b], [[nxt[0]], [nxt[1]]])
        rows_a.append(rows[0])
        rows_b.append(rows[1])
    np.savez(out, tokens=np.asarray(tokens), rows_a=np.concatenate(rows_a[:-1]),
             rows_b=np.concatenate(rows_b[:-1]), split=np.asarray(split))


def test_tp2_ep2_matches_reference(checkpoint, tmp_path):
    out = str(tmp_path / "tp2ep2.npz")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fake_devices_flags(4)}
    proc = subprocess.run([sys.executable, "-m", "tests.test_qwen35_engine", checkpoint, out],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(out) as got:
        # (shard, whole) sizes of the linear layer's head axes: halves at tp 2.
        np.testing.assert_array_equal(got["split"][:, 0] * 2, got["split"][:, 1])
        for ids, tokens, rows in ((prompt_ids(300, 150), got["tokens"][0], got["rows_a"]),
                                  (prompt_ids(301, 23), got["tokens"][1], got["rows_b"])):
            want_tokens, want_rows = reference_check(checkpoint, ids, tokens.tolist())
            assert tokens.tolist() == want_tokens
            np.testing.assert_array_equal(rows, want_rows)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
