"""The MTP layers of the DeepSeek-V3 / GLM-4.5 random checkpoints and their float64 NEXTN draft
reference (sgl_jax.tools.reference_nextn): layout, the main model unchanged by them (reference
and engine loader), and the draft's self-consistency."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.distributed import make_mesh
from sgl_jax.srt.model_loader.loader import load_model
from sgl_jax.tools.make_random_model import (
    BUNDLED_DIR,
    load_tokenizer,
    sample_prompts,
    write_random_model,
    write_random_model_report,
)
from sgl_jax.tools.reference_forward import ReferenceModel
from sgl_jax.tools.reference_nextn import NextnReference, accept_length

PRESETS = {"deepseek_v3": "tiny-deepseek-v3", "glm4_moe": "tiny-glm4-moe"}
PROMPT = [5, 77, 301, 12, 9, 250, 44, 130, 7, 402, 61, 18]


@pytest.fixture(scope="module", params=sorted(PRESETS))
def ckpts(request, tmp_path_factory) -> tuple[str, str, str]:
    """(family, checkpoint with its MTP layer, the same preset written without it)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    write_random_model(str(root / "mtp"), PRESETS[family], check_routing=False)
    write_random_model(
        str(root / "plain"), PRESETS[family], {"num_nextn_predict_layers": 0}, check_routing=False
    )
    return family, str(root / "mtp"), str(root / "plain")


@pytest.fixture(scope="module")
def nextn(ckpts) -> NextnReference:
    return NextnReference(ReferenceModel(ckpts[1]))


def _mtp_expected_names(tensors: dict[str, np.ndarray], num_layers: int) -> set[str]:
    """A main MoE layer's tensor names moved to the MTP index, plus the six MTP tensors."""
    moe_layer = num_layers - 1  # the tiny presets' last layer is a MoE layer
    src, dst = f"model.layers.{moe_layer}.", f"model.layers.{num_layers}."
    names = {dst + n[len(src):] for n in tensors if n.startswith(src)}
    extra = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens")
    return names | {f"{dst}{n}.weight" for n in extra}


def test_checkpoint_has_the_mtp_layer(ckpts) -> None:
    family, mtp, plain = ckpts
    ref = ReferenceModel(mtp)
    assert ref.config["num_nextn_predict_layers"] == 1
    assert ReferenceModel(plain).config["num_nextn_predict_layers"] == 0
    tensors, base = load_file(f"{mtp}/model.safetensors"), load_file(f"{plain}/model.safetensors")
    big_l = ref.num_layers
    p = f"model.layers.{big_l}."
    mtp_names = {n for n in tensors if n.startswith(p)}
    assert set(tensors) - mtp_names == set(base)  # nothing else added
    assert mtp_names == _mtp_expected_names(tensors, big_l)
    h, v = ref.hidden_size, ref.vocab_size
    for name, shape in {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                        "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h),
                        "embed_tokens.weight": (v, h)}.items():  # fmt: skip
        assert tensors[p + name].shape == shape, name
    # The decoder-layer part has a main MoE layer's shapes; the copies are exact.
    src = f"model.layers.{big_l - 1}."
    for name in mtp_names:
        twin = src + name[len(p):]
        if twin in tensors:
            assert tensors[name].shape == tensors[twin].shape, name
            assert not np.array_equal(tensors[name], tensors[twin]), name  # drawn, not copied
    np.testing.assert_array_equal(tensors[p + "shared_head.head.weight"], tensors["lm_head.weight"])
    np.testing.assert_array_equal(
        tensors[p + "embed_tokens.weight"], tensors["model.embed_tokens.weight"]
    )
    assert (p + "mlp.gate.e_score_correction_bias") in tensors
    assert (p + "mlp.shared_experts.gate_proj.weight") in tensors
    assert (p + ("self_attn.kv_b_proj.weight" if family == "deepseek_v3"
                 else "self_attn.q_proj.bias")) in tensors  # fmt: skip
    # Every main tensor is the one the preset writes without MTP support.
    for name, t in base.items():
        np.testing.assert_array_equal(tensors[name], t, err_msg=name)


def test_main_model_unchanged(ckpts) -> None:
    """The reference's logits, routing and hidden states ignore the MTP layer exactly."""
    _, mtp, plain = ckpts
    a, b = ReferenceModel(mtp).forward(PROMPT), ReferenceModel(plain).forward(PROMPT)
    for field in ("logits", "topk_ids", "topk_weights", "hidden"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


def test_engine_loader_skips_the_mtp_layer(ckpts, caplog) -> None:
    """The engine loads the target from the MTP checkpoint with every parameter equal to the
    checkpoint without it, and says it ignored the MTP layer."""
    _, mtp, plain = ckpts
    mesh = make_mesh(jax.devices()[:1], 1, 1)

    def params(path: str) -> dict:
        model = load_model(ModelConfig.from_hf(path), mesh, jnp.float32)
        return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    with caplog.at_level(logging.INFO):
        with_mtp = params(mtp)
    assert "MTP layers" in caplog.text
    without = params(plain)
    assert with_mtp.keys() == without.keys()
    for key, value in without.items():
        np.testing.assert_array_equal(with_mtp[key], value, err_msg=str(key))


def test_layer_forward_replays_the_target(ckpts) -> None:
    """The decoder-layer code the draft reuses: the target's layers applied one by one with
    layer_forward reproduce forward()'s hidden states and routing exactly."""
    ref = ReferenceModel(ckpts[1])
    out = ref.forward(PROMPT)
    h = ref.embed[np.asarray(PROMPT)]
    for li, layer in enumerate(ref.layers):
        h, _, r = ref.layer_forward(layer, h)
        if r is not None:
            np.testing.assert_array_equal(r.ids, out.topk_ids[:, li])
    np.testing.assert_array_equal(h, out.hidden)


def test_draft_forward_by_hand(nextn) -> None:
    """Position 0 attends to itself only: g_0 is the MTP layer applied to z_0 alone, with z_0
    fused from the raw checkpoint tensors, enorm'd embedding first."""
    target = nextn.target
    raw = load_file(f"{target.path}/model.safetensors")
    p, eps = f"model.layers.{target.num_layers}.", target.eps
    hidden = target.forward(PROMPT).hidden

    def norm(x: np.ndarray, name: str) -> np.ndarray:
        w = raw[p + name].astype(np.float64)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    e = norm(raw["model.embed_tokens.weight"][PROMPT[1]].astype(np.float64), "enorm.weight")
    z = np.concatenate([e, norm(hidden[0], "hnorm.weight")]) @ raw[p + "eh_proj.weight"].T
    g, _, _ = target.layer_forward(nextn.layer, z[None])
    logits = norm(g, "shared_head.norm.weight") @ raw[p + "shared_head.head.weight"].T
    out = nextn.forward([PROMPT[1]], hidden[:1])
    np.testing.assert_allclose(out.g, g, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.logits, logits, rtol=1e-12, atol=1e-12)
    # The row of position 0 does not depend on later positions (causal).
    longer = nextn.features(PROMPT, hidden)
    np.testing.assert_allclose(longer.logits[0], out.logits[0], rtol=1e-12, atol=1e-12)
    assert longer.logits.shape == (len(PROMPT) - 1, target.vocab_size)


def test_chain_is_step_by_step_forward(nextn) -> None:
    """chain equals recomputing forward one step at a time (argmax, own g as the next feature),
    and is deterministic."""
    target = nextn.target
    hidden = target.forward(PROMPT).hidden
    drafts = nextn.chain(PROMPT, hidden, num_steps=4)
    assert drafts == nextn.chain(PROMPT, hidden[: len(PROMPT) - 1], num_steps=4)
    assert drafts == NextnReference(ReferenceModel(target.path)).chain(PROMPT, hidden, 4)
    assert all(0 <= d < target.vocab_size for d in drafts)
    next_tokens, feats, expect = list(PROMPT[1:]), list(hidden[:-1]), []
    for _ in range(4):
        out = nextn.forward(next_tokens, np.stack(feats))
        assert np.all(np.isfinite(out.logits))
        expect.append(int(np.argmax(out.logits[-1])))
        next_tokens.append(expect[-1])
        feats.append(out.g[-1])
    assert drafts == expect
    # The first draft is the teacher-forced prediction after the prompt.
    assert drafts[0] == int(np.argmax(nextn.features(PROMPT, hidden).logits[-1]))


def test_accept_length_counts(nextn) -> None:
    target = nextn.target
    continuation = target.greedy_generate(PROMPT, 8)
    emitted, steps = accept_length(nextn, PROMPT, continuation, num_steps=3)
    assert emitted == len(continuation) - 1  # the prefill produced the first token
    assert 1 <= steps <= emitted and emitted <= 4 * steps


def test_refusals(tmp_path: Path, ckpts) -> None:
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        NextnReference(ReferenceModel(ckpts[2]))
    with pytest.raises(NotImplementedError, match="no MTP layers"):
        NextnReference(ReferenceModel(str(BUNDLED_DIR)))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        write_random_model(str(tmp_path), "tiny-mixtral", {"num_nextn_predict_layers": 1},
                           check_routing=False)


@pytest.mark.parametrize("preset", sorted(PRESETS.values()))
def test_router_search_covers_the_mtp_layer(tmp_path: Path, preset: str) -> None:
    """With the routing check, the MTP router is searched too: the teacher-forced draft's
    selection gap clears the preset's threshold on the sample prompts, and the main model is
    the one the search finds without an MTP layer."""
    report = write_random_model_report(str(tmp_path / "mtp"), preset, seed=0)
    write_random_model(str(tmp_path / "plain"), preset, {"num_nextn_predict_layers": 0}, seed=0)
    target = ReferenceModel(str(tmp_path / "mtp"))
    draft = NextnReference(target)
    for ids in sample_prompts(load_tokenizer()):
        gap = draft.routing(ids, target.forward(ids).hidden).selection_gap
        assert gap.shape == (len(ids) - 1,)
        assert float(gap.min()) >= report.min_router_gap > 0
    tensors = load_file(str(tmp_path / "mtp" / "model.safetensors"))
    for name, t in load_file(str(tmp_path / "plain" / "model.safetensors")).items():
        np.testing.assert_array_equal(tensors[name], t, err_msg=name)
