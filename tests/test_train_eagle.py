"""The bundled EAGLE draft (``tools/train_eagle``) and its float64 reference (``reference_eagle``).

- The shipped checkpoint ``assets/tiny-qwen3-moe-eagle`` has exactly the draft format the
  engine's runtime reads (config keys, tensor names, shapes, float32), with the target's
  attention shape, RoPE and eps.
- The training forward (every chain step, with its training-time-test attention mask) equals
  the float64 reference's chain on the same inputs, so the trained weights mean what the
  reference (and the engine) compute.
- The draft is trained: a simulated 3-step chain on a few corpus prompts accepts > 1.5 tokens
  per verify step (an untrained or broken draft gets about 1).
- A very short training run is deterministic and writes a checkpoint the reference loads.
- ``ReferenceOutput.hidden`` (what the draft reads) is the target's pre-norm output.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from sgl_jax.tools.reference_eagle import (
    ARCHITECTURE,
    EagleReference,
    accept_length,
    tensor_shapes,
)
from sgl_jax.tools.reference_forward import ReferenceModel

optax = pytest.importorskip("optax")  # the train extra (also in the test extra)

import jax.numpy as jnp  # noqa: E402

from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.tools import train_eagle, train_tiny  # noqa: E402

DRAFT = train_eagle.DRAFT_PATH
TARGET = train_eagle.TARGET_PATH
CONFIG_KEYS = {
    "architectures", "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size",
    "max_position_embeddings", "hidden_act", "torch_dtype",
}


@pytest.fixture(scope="module")
def target() -> ReferenceModel:
    return ReferenceModel(str(TARGET))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TARGET / "tokenizer.json"))


def test_shipped_draft_has_the_format() -> None:
    cfg = json.loads((DRAFT / "config.json").read_text())
    assert set(cfg) == CONFIG_KEYS
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["model_type"] == "sgl_jax_eagle"
    assert cfg["hidden_act"] == "silu" and cfg["torch_dtype"] == "float32"
    target_cfg = json.loads((TARGET / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings"):
        assert cfg[key] == target_cfg[key], key
    tensors = load_file(str(DRAFT / "model.safetensors"))
    want = tensor_shapes(cfg)
    assert sorted(tensors) == sorted(want)
    assert len(want) == 13 and want["fc.weight"] == (64, 128)
    for name, t in tensors.items():
        assert t.dtype == np.float32 and t.shape == want[name], name
        assert np.isfinite(t).all(), name
    assert sorted(p.name for p in DRAFT.iterdir()) == ["config.json", "model.safetensors"]


def _corpus_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    openings = train_eagle.corpus_openings(train_tiny.corpus_text(), 8)[:count]
    return [tokenizer.encode(s).ids for s in openings]


def test_reference_hidden_is_the_pre_norm_output(target, tokenizer) -> None:
    """ReferenceOutput.hidden: the final norm and lm_head of it give the logits; a chunked
    forward gives the same rows."""
    from sgl_jax.tools.reference_layers import rms_norm

    tokens = _corpus_prompts(tokenizer, 1)[0]
    out = target.forward(tokens)
    assert out.hidden.shape == (len(tokens), 64)
    logits = rms_norm(out.hidden, target.final_norm, target.eps) @ target.lm_head.T
    np.testing.assert_allclose(logits, out.logits, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(target.forward(tokens, chunk_size=3).hidden, out.hidden,
                               rtol=1e-10, atol=1e-10)


def test_reference_logits_are_finite_and_chains_are_consistent(target, tokenizer) -> None:
    draft = EagleReference(str(DRAFT), target)
    tokens = _corpus_prompts(tokenizer, 1)[0]
    hidden = target.forward(tokens).hidden
    out = draft.features(tokens, hidden)
    assert out.logits.shape == (len(tokens) - 1, 512) and np.isfinite(out.logits).all()
    assert np.isfinite(out.g).all()
    # The target ran on all tokens (T rows) or on all but the newest (T - 1): the same drafts.
    chain = draft.chain(tokens, hidden, 3)
    assert chain == draft.chain(tokens, hidden[:-1], 3)
    assert chain[0] == int(np.argmax(out.logits[-1]))
    # The second draft reads the first one's token and the draft's own feature.
    second = draft.forward(tokens[1:] + chain[:1], np.concatenate([hidden[:-1], out.g[-1:]]))
    assert chain[1] == int(np.argmax(second.logits[-1]))


def test_training_forward_equals_the_reference_chain(target, tokenizer) -> None:
    """draft_levels' chain step k at position p (target features up to p - k, then the draft's
    own) equals reference_eagle fed the same tokens and features, float32 against float64."""
    cfg = train_eagle.TrainConfig()
    dcfg = json.loads((DRAFT / "config.json").read_text())
    params = {k: jnp.asarray(v) for k, v in load_file(str(DRAFT / "model.safetensors")).items()}
    model = train_tiny.load_trainable(ModelConfig.from_hf(str(TARGET)))
    shared = train_eagle.Shared(model.model.embed_tokens[...], model.lm_head[...])
    tokens = tokenizer.encode(train_tiny.corpus_text()[:200]).ids[:24]
    ids = jnp.asarray([tokens], jnp.int32)
    hidden32, _ = train_eagle.target_pass(model, ids)
    gs, logits = train_eagle.draft_levels(params, dcfg, shared, ids[:, 1:], hidden32[:, :-1],
                                          cfg.levels)
    draft = EagleReference(str(DRAFT), target)
    hidden = target.forward(tokens).hidden
    np.testing.assert_allclose(np.asarray(hidden32[0]), hidden, rtol=1e-4, atol=1e-4)
    for level in range(cfg.levels):
        for p in (level, 10, len(tokens) - 2):
            real = p - level  # the last position with target features
            feats = list(hidden[: real + 1])
            for q in range(real, p):  # the chain's own features, fed the true tokens
                feats.append(draft.forward(tokens[1: q + 2], np.stack(feats)).g[-1])
            want = draft.forward(tokens[1: p + 2], np.stack(feats))
            np.testing.assert_allclose(np.asarray(logits[level][0, p]), want.logits[-1],
                                       rtol=1e-3, atol=1e-3)
            np.testing.assert_allclose(np.asarray(gs[level][0, p]), want.g[-1],
                                       rtol=1e-3, atol=1e-3)


def test_shipped_draft_is_accepted(target, tokenizer) -> None:
    draft = EagleReference(str(DRAFT), target)
    emitted = steps = 0
    for prompt in _corpus_prompts(tokenizer, 3):
        cont = target.greedy_generate(prompt, 32, stop_token_ids=[511])
        e, s = accept_length(draft, prompt, cont, num_steps=3)
        emitted, steps = emitted + e, steps + s
    assert emitted / steps > 1.5, (emitted, steps)


def test_short_training_run_is_deterministic_and_loadable(target, tokenizer, tmp_path) -> None:
    cfg = train_eagle.TrainConfig(steps=3, batch_size=2, seq_len=32, warmup=1, seed=5)
    corpus = train_tiny.Corpus.build(tokenizer, train_tiny.corpus_text())
    dcfg = train_eagle.draft_config(str(TARGET), cfg)
    model = train_tiny.load_trainable(ModelConfig.from_hf(str(TARGET)))
    params, result = train_eagle.train(model, corpus, dcfg, cfg, progress=False)
    assert len(result.final) == cfg.levels and np.isfinite(result.final).all()
    initial = train_eagle.init_params(dcfg, cfg)
    assert any(not np.array_equal(params[k], initial[k]) for k in initial)  # it trained
    again, _ = train_eagle.train(model, corpus, dcfg, cfg, progress=False)  # the target is frozen
    assert all(np.array_equal(params[k], again[k]) for k in params)
    train_eagle.save_draft(params, dcfg, str(tmp_path))
    draft = EagleReference(str(tmp_path), target)
    tokens = tokenizer.encode("Once upon a time").ids
    assert len(draft.chain(tokens, target.forward(tokens).hidden, 3)) == 3
