"""Speculative decoding on Qwen3.5-MoE (Gated DeltaNet layers), against the float64 reference
(``sgl_jax/tools/reference_qwen35.py``).

A verify step must leave each linear layer's conv and recurrent states as they are after the
accepted tokens only (``layers/linear_attention/verify.py``): a rejected draft that advanced
them would change every later token. Here the tiny random ``tiny-qwen3.5-moe`` (with its MTP
layer) is served with:

- NGRAM on repetitive prompts (drafts accepted, and rejected at every position) batched with
  plain ones: every greedy token and every routed row equal the reference's;
- NEXTN (the checkpoint's MTP layer as the draft; random weights, so its drafts are mostly
  rejected, the rollback case): the same check, and the draft's forward by hand.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.testing import engine_args
from sgl_jax.tools.make_random_model import write_random_model
from sgl_jax.tools.reference_eagle import accept_length
from sgl_jax.tools.reference_qwen35_mtp import Qwen35MtpReference
from tests.engine_utils import assert_no_leak, decoded_rows, prompt_ids
from tests.test_qwen35_engine import _reference, reference_check

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen35_spec") / "tiny-qwen3.5-moe")
    write_random_model(path, "tiny-qwen3.5-moe", seed=4)
    return path


def _engine(path: str, algorithm: str) -> Engine:
    return Engine(**engine_args(model_path=path, enable_return_routed_experts=True,
                                chunked_prefill_size=64, precompile_token_paddings=[64],
                                precompile_bs_paddings=[8], speculative_algorithm=algorithm,
                                speculative_num_steps=3))


def _check(out: dict, ids: list[int], path: str, n: int) -> None:
    cfg = ModelConfig.from_hf(path)
    assert len(out["output_ids"]) == n
    tokens, rows = reference_check(path, ids, out["output_ids"])
    assert out["output_ids"] == tokens
    got = decoded_rows(out, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    np.testing.assert_array_equal(got, rows)  # every row of every layer


def _greedy(path: str, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(_reference(path).forward(seq).logits[-1])))
    return seq[len(ids):]


def guessable(path: str, seed: int, n: int) -> list[int]:
    """``p + g + p``: a random phrase ``p``, the reference's greedy continuation ``g`` of it,
    ``p`` again. NGRAM then drafts ``g``; this tiny model continues the second ``p`` with
    ``g``'s first 1 to 4 tokens for the seeds used here (found by search), so drafts are
    accepted in part or whole, then rejected."""
    p = prompt_ids(100 + seed, n)
    return p + _greedy(path, p, 4) + p


def PROMPTS(path: str) -> list[list[int]]:  # noqa: N802 (a constant, computed once)
    # NGRAM accepts 3, 2, 2 and 1 leading drafts on the first four, none on the last.
    return [guessable(path, s, n) for s, n in ((34, 8), (19, 8), (21, 4), (3, 4))] + [
        prompt_ids(50, 21)]


LENS = [12, 9, 8, 7, 10]


def _run(engine: Engine, path: str) -> list[dict]:
    prompts, lens = PROMPTS(path), LENS
    outs = engine.generate(input_ids=prompts, return_routed_experts=True,
                           sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens])
    for ids, n, out in zip(prompts, lens, outs, strict=True):
        _check(out, ids, path, n)
    assert_no_leak(engine)
    return outs


@pytest.fixture(scope="module")
def ngram(checkpoint):
    eng = _engine(checkpoint, "NGRAM")
    yield eng
    eng.shutdown()


def test_ngram_rollback_matches_reference(ngram, checkpoint):
    outs = _run(ngram, checkpoint)
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    generated = sum(len(o["output_ids"]) - 1 for o in outs)
    assert generated > steps, "no draft was accepted"


@pytest.fixture(scope="module")
def nextn(checkpoint):
    eng = _engine(checkpoint, "NEXTN")
    yield eng
    eng.shutdown()


def _mtp(path: str) -> Qwen35MtpReference:
    return Qwen35MtpReference(_reference(path), path)


def test_nextn_matches_reference(nextn, checkpoint):
    """The MTP draft of random weights is mostly wrong: every rejected draft must leave the
    linear states as the accepted tokens did; each request takes the verify steps a float64
    simulation of the MTP chain takes."""
    outs = _run(nextn, checkpoint)
    for ids, out in zip(PROMPTS(checkpoint), outs, strict=True):
        assert out["meta_info"]["spec_verify_ct"] == accept_length(
            _mtp(checkpoint), ids, out["output_ids"], 3)[1]
    # One request alone, long enough for verify steps launched with their predecessor in
    # flight (overlap scheduling: their inputs and first positions read on the device).
    before = nextn.get_server_info()["spec_overlapped_steps"]
    ids = prompt_ids(60, 12)
    out = nextn.generate(input_ids=ids, return_routed_experts=True,
                         sampling_params={**GREEDY, "max_new_tokens": 20})
    _check(out, ids, checkpoint, 20)
    assert nextn.get_server_info()["spec_overlapped_steps"] > before


def echo_update(path: str) -> dict[str, np.ndarray]:
    """MTP tensors that make the draft propose the target's own greedy token at the kept
    position again (the last token, repeated): ``fc`` passes the normed hidden state through,
    the layer adds nothing (``o_proj`` and every expert's ``down_proj`` zero), the norms'
    ``w`` 0; so the draft's logits are the target's, scaled. A target that repeats a token
    then accepts drafts."""
    cfg = ModelConfig.from_hf(path)
    h, p = cfg.hidden_size, "mtp.layers.0."
    fc = np.zeros((h, 2 * h), np.float32)
    fc[:, h:] = np.eye(h, dtype=np.float32)
    out = {"mtp.fc.weight": fc, "mtp.pre_fc_norm_hidden.weight": np.zeros(h, np.float32),
           "mtp.norm.weight": np.zeros(h, np.float32),
           p + "self_attn.o_proj.weight": np.zeros(
               (h, cfg.num_attention_heads * cfg.head_dim), np.float32),
           p + "mlp.shared_expert.down_proj.weight": np.zeros(
               (h, cfg.shared_expert_intermediate_size), np.float32)}
    for e in range(cfg.num_experts):
        out[f"{p}mlp.experts.{e}.down_proj.weight"] = np.zeros(
            (h, cfg.moe_intermediate_size), np.float32)
    return out


def test_update_of_mtp_tensors_changes_the_draft(nextn, checkpoint):
    """An update's ``mtp.*`` tensors update the draft: after the echo update, a prompt whose
    greedy continuation repeats a token accepts drafts (the random draft accepted none), in
    the verify steps the float64 simulation of the new layer takes; a misnamed MTP tensor is
    refused by name and changes nothing."""
    ids = prompt_ids(119, 8)  # its greedy continuation: 308, 222, 222, 222, ...
    params = {**GREEDY, "max_new_tokens": 10}
    before = nextn.generate(input_ids=ids, sampling_params=params)
    original = {n: a for n, a in load_file(f"{checkpoint}/model.safetensors").items()
                if n in echo_update(checkpoint)}
    with pytest.raises(ValueError, match=r"q_prj\.weight"):
        nextn.update_weights_from_arrays({"mtp.layers.0.self_attn.q_prj.weight":
                                          np.zeros((4, 4), np.float32)})
    update = echo_update(checkpoint)
    done = nextn.update_weights_from_arrays(update)
    try:
        assert done["num_parameters"] == 6  # fc, 2 norms, o_proj, the experts' and shared down
        after = nextn.generate(input_ids=ids, sampling_params=params)
        assert after["output_ids"] == before["output_ids"] == _greedy(checkpoint, ids, 10)
        echo = _mtp(checkpoint)
        echo.w.update({n[len("mtp."):]: a.astype(np.float64) for n, a in update.items()})
        steps = after["meta_info"]["spec_verify_ct"]
        assert steps == accept_length(echo, ids, after["output_ids"], 3)[1]
        assert steps < before["meta_info"]["spec_verify_ct"] == 9  # drafts now accepted
    finally:
        nextn.update_weights_from_arrays(original)  # the module's engine as it was


def test_mtp_tensors_refused_without_a_nextn_draft(ngram, checkpoint):
    with pytest.raises(ValueError, match=r"MTP layers.*mtp\.fc\.weight.*NEXTN"):
        ngram.update_weights_from_arrays(
            {"mtp.fc.weight": load_file(f"{checkpoint}/model.safetensors")["mtp.fc.weight"]})


def test_nextn_refused_without_mtp_layers(tmp_path):
    from sgl_jax.srt.speculative.nextn import mtp_config

    path = str(tmp_path / "no-mtp")
    write_random_model(path, "tiny-qwen3.5-moe", {"mtp_num_hidden_layers": 0}, check_routing=False)
    assert not any(n.startswith("mtp.") for n in load_file(f"{path}/model.safetensors"))
    with pytest.raises(ValueError, match="NEXTN.*no MTP layer.*mtp_num_hidden_layers"):
        mtp_config(ModelConfig.from_hf(path))
    # A config that promises an MTP layer the tensors lack: the missing ones are named.
    import json

    import jax
    import jax.numpy as jnp

    from sgl_jax.srt.distributed import make_mesh
    from sgl_jax.srt.speculative.nextn import load_mtp

    config = json.loads((tmp_path / "no-mtp" / "config.json").read_text())
    (tmp_path / "no-mtp" / "config.json").write_text(json.dumps(
        {**config, "mtp_num_hidden_layers": 1}))
    cfg = ModelConfig.from_hf(path)
    with pytest.raises(ValueError, match=r"MTP tensors.*missing.*fc\.weight"):
        load_mtp(mtp_config(cfg), cfg, make_mesh(jax.devices()[:1], 1, 1), jnp.float32)


def test_released_form_mtp_layer_loads_the_same_draft(checkpoint, tmp_path):
    """The released form (``text_config``, ``model.language_model.*``, fused experts, the
    MTP layer's experts fused too) gives the draft the same parameters as the flat form."""
    import json
    import shutil

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import save_file

    from sgl_jax.srt.distributed import make_mesh
    from sgl_jax.srt.speculative.nextn import load_mtp, mtp_config
    from tests.test_qwen35_engine import released_tensors

    flat = load_file(f"{checkpoint}/model.safetensors")
    tensors = released_tensors(checkpoint)
    tensors["mtp.fc.weight"] = flat["mtp.fc.weight"]  # (released_tensors puts a stand-in)
    p, n = "mtp.layers.0.mlp.experts.", ModelConfig.from_hf(checkpoint).num_experts
    tensors[p + "gate_up_proj"] = np.stack([np.concatenate(
        [tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
        for e in range(n)])
    tensors[p + "down_proj"] = np.stack([tensors.pop(f"{p}{e}.down_proj.weight")
                                         for e in range(n)])
    released = tmp_path / "released"
    released.mkdir()
    for name in os.listdir(checkpoint):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(checkpoint, name), released)
    text = json.loads((released / "config.json").read_text())
    (released / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": text, "tie_word_embeddings": False}))
    save_file(tensors, str(released / "model.safetensors"))
    mesh = make_mesh(jax.devices()[:1], 1, 1)
    drafts = []
    for path in (checkpoint, str(released)):
        cfg = ModelConfig.from_hf(path)
        assert cfg.mtp_num_hidden_layers == 1
        drafts.append([np.asarray(x) for x in jax.tree.leaves(nnx.state(
            load_mtp(mtp_config(cfg), cfg, mesh, jnp.float32), nnx.Param))])
    assert len(drafts[0]) == len(drafts[1]) > 10
    for a, b in zip(*drafts, strict=True):
        np.testing.assert_array_equal(a, b)


def test_update_from_disk_reads_the_mtp_layer(nextn, ngram, checkpoint):
    """A checkpoint update reads the MTP layer into the NEXTN draft (its parameters counted
    with the target's); without a draft the same checkpoint updates the target only."""
    with_draft = nextn.update_weights_from_disk(checkpoint)["num_parameters"]
    target_only = ngram.update_weights_from_disk(checkpoint)["num_parameters"]
    # fc, 3 norms; the layer: 2 norms, q/k/v/o, q/k norms, router, 3 stacked expert
    # projections, the shared expert's 3 and its gate
    assert with_draft - target_only == 20
    out = nextn.generate(input_ids=prompt_ids(61, 9), return_routed_experts=True,
                         sampling_params={**GREEDY, "max_new_tokens": 6})
    _check(out, prompt_ids(61, 9), checkpoint, 6)
