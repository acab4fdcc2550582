"""The bundled model is trained (``tools/train_tiny``): it speaks corpus English, uses every
expert, and was trained as the engine's own model.

- ``train_forward`` is the engine's model run as a plain causal LM: its logits and routed
  experts equal the float64 reference's on the tests' random checkpoint (large router gaps).
- ``train_tiny`` writes the names the loader reads (an exact round trip) and is deterministic.
- The bundled checkpoint, served by a real Engine: greedy continuations of plain English
  prompts are corpus words without control characters, and the README's example answer is
  what the engine says. Over the corpus every expert of every layer receives tokens, and code
  is routed differently from prose.

These tests never compare the trained model's routed experts with the reference: its router
has near-ties (see ``sgl_jax/testing.py``); the exactness tests use ``TEST_MODEL_PATH``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH, ModelConfig
from sgl_jax.testing import TEST_MODEL_PATH, engine_args
from sgl_jax.tools.make_random_model import sample_prompts
from sgl_jax.tools.reference_forward import ReferenceModel

optax = pytest.importorskip("optax")  # the train extra (also in the test extra)

import jax.numpy as jnp  # noqa: E402

from sgl_jax.tools import train_forward, train_tiny  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPTS = [
    "Explain how mixture of experts models work",
    "The weather today is",
    "Once upon a time",
    "I walked down to the harbour and",
    "My favourite food is",
    "Tell me about your day.",
]
# Control characters other than newline and tab, and the replacement character of a
# byte sequence that is not UTF-8: what the untrained model produced.
BAD_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ufffd]")


def corpus_words() -> set[str]:
    return set(re.findall(r"[a-z]+", train_tiny.corpus_text().lower()))


# ---- the training forward and the checkpoint writer ----------------------------------------


def test_training_forward_matches_reference() -> None:
    """Two windows in one batch (prefixes of the tool's sample prompts, whose router gaps are
    >= 1e-3): the same logits as the float64 reference and the same experts in the same order."""
    config = ModelConfig.from_hf(TEST_MODEL_PATH)
    model = train_tiny.load_trainable(config)
    tok = Tokenizer.from_file(f"{TEST_MODEL_PATH}/tokenizer.json")
    rows = [p[:56] for p in sample_prompts(tok)[:2]]
    out = train_forward.forward(model, jnp.asarray(rows, dtype=jnp.int32))
    ref = ReferenceModel(TEST_MODEL_PATH)
    for b, ids in enumerate(rows):
        want = ref.forward(ids)
        np.testing.assert_allclose(np.asarray(out.logits[b]), want.logits, rtol=0, atol=1e-4)
        got_ids = np.asarray(out.topk_ids)[:, b * 56:(b + 1) * 56].transpose(1, 0, 2)
        np.testing.assert_array_equal(got_ids, want.topk_ids)
        probs = np.asarray(out.router_probs)[:, b * 56:(b + 1) * 56].transpose(1, 0, 2)
        np.testing.assert_allclose(np.log(probs) - np.log(probs).max(-1, keepdims=True),
                                   want.router_logits - want.router_logits.max(-1, keepdims=True),
                                   rtol=0, atol=1e-4)


def test_hf_tensors_round_trip() -> None:
    """The loader's names inverted: writing the loaded model gives back the file's tensors."""
    model = train_tiny.load_trainable(ModelConfig.from_hf(TEST_MODEL_PATH))
    written = train_tiny.hf_tensors(model)
    original = load_file(f"{TEST_MODEL_PATH}/model.safetensors")
    assert written.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


def test_load_balance_loss_is_one_when_uniform() -> None:
    experts, k = 8, 2
    ids = jnp.asarray(np.arange(16 * k).reshape(1, 16, k) % experts, dtype=jnp.int32)
    uniform = jnp.full((1, 16, experts), 1 / experts)
    assert float(train_forward.load_balance_loss(uniform, ids)) == pytest.approx(1.0)
    skewed = jnp.zeros((1, 16, experts)).at[..., 0].set(1.0)
    one = jnp.zeros((1, 16, k), dtype=jnp.int32).at[..., 1].set(1)
    assert float(train_forward.load_balance_loss(skewed, one)) == pytest.approx(experts / k)


def _short_run(out: Path) -> dict[str, np.ndarray]:
    cfg = train_tiny.TrainConfig(steps=3, batch_size=2, seq_len=32, warmup=1, seed=3)
    config = train_tiny.init_checkpoint(str(out), cfg)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    model = train_tiny.load_trainable(config)
    train_tiny.train(model, train_tiny.Corpus.build(tok, train_tiny.corpus_text()), cfg,
                     progress=False)
    train_tiny.save_weights(model, str(out))
    return load_file(str(out / "model.safetensors"))


def test_training_is_deterministic_and_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    first, second = _short_run(tmp_path / "a"), _short_run(tmp_path / "b")
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    # The float64 reference reads it, and training moved the weights off the initial ones.
    ReferenceModel(str(tmp_path / "a")).forward([1, 2, 3])
    initial = train_tiny.hf_tensors(train_tiny.load_trainable(
        train_tiny.init_checkpoint(str(tmp_path / "init"), train_tiny.TrainConfig(seed=3))))
    assert not np.array_equal(initial["lm_head.weight"], first["lm_head.weight"])


def test_chat_exchanges_come_from_headings_and_questions() -> None:
    chats = train_tiny.chat_exchanges(train_tiny.corpus_text())
    assert len(chats) >= 30
    assert any("user\nOn learning to bake bread<|im_end|>" in c for c in chats)
    assert any("user\nHow far can the light be seen?<|im_end|>" in c for c in chats)
    assert all(c.endswith("<|im_end|>\n") for c in chats)


# ---- the bundled, trained model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    eng = Engine(**engine_args(model_path=None, precompile_bs_paddings=[1, 8]))
    yield eng
    eng.shutdown()


def test_greedy_continuations_are_corpus_words(engine) -> None:
    words = corpus_words()
    outs = engine.generate(PROMPTS, {"max_new_tokens": 24, "temperature": 0.0})
    found = known = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        text = out["text"]
        assert not BAD_CHARS.search(text), (prompt, text)
        generated = re.findall(r"[a-z]+", text.lower())
        assert len(generated) >= 4, (prompt, text)
        found += len(generated)
        known += sum(w in words for w in generated)
    assert known / found >= 0.8, [o["text"] for o in outs]


def test_readme_example_answer_is_what_the_engine_says(engine) -> None:
    """The README's curl example and the answer it shows (greedy, so reproducible)."""
    readme = README.read_text(encoding="utf-8")
    request = json.loads(re.search(r"-d '(\{.*?\})'", readme, re.S).group(1))
    shown = json.loads(re.search(r'^\{"text": ("(?:[^"\\]|\\.)*"), ', readme, re.M).group(1))
    out = engine.generate(request["text"], request["sampling_params"])
    assert out["text"] == shown


def _share(ref: ReferenceModel, windows: list[list[int]]) -> np.ndarray:
    """[layers, experts]: the share of the windows' (token, slot) picks each expert got."""
    counts = np.zeros((ref.num_layers, ref.num_experts))
    for ids in windows:
        topk = ref.forward(ids).topk_ids  # [T, L, k]
        for layer in range(ref.num_layers):
            counts[layer] += np.bincount(topk[:, layer].ravel(), minlength=ref.num_experts)
    return counts / counts.sum(axis=1, keepdims=True)


def test_every_expert_is_used_and_code_is_routed_apart() -> None:
    ref = ReferenceModel(BUNDLED_MODEL_PATH)
    tok = Tokenizer.from_file(f"{BUNDLED_MODEL_PATH}/tokenizer.json")
    corpus = train_tiny.Corpus.build(tok, train_tiny.corpus_text())
    share = _share(ref, corpus.eval_windows(128).tolist())
    # Uniform is 1/16 = 6.25%; the load-balancing loss keeps every expert busy.
    assert share.min() > 0.01, share.min(axis=1)
    text = train_tiny.corpus_text()
    code = text[text.index("def summarise"):text.index("When I ran it")]
    prose = text[text.index("A day in the harbour."):text.index("The ferry.")]
    code_share = _share(ref, [tok.encode(code).ids])
    prose_share = _share(ref, [tok.encode(prose).ids])
    # Total variation distance between the two texts' expert loads, in the most specialised
    # layer: a router that ignored the text would give ~0 (up to sampling noise, ~0.1 here).
    distance = 0.5 * np.abs(code_share - prose_share).sum(axis=1)
    assert distance.max() > 0.3, distance
