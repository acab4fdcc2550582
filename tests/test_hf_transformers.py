"""Hugging Face transformers reads the bundled checkpoint as a real Qwen3-MoE model.

Optional: skipped unless both transformers and torch are installed (they are not project
dependencies). This is the check that our "HF layout" really is HF's: the same weights give
transformers' Qwen3MoeForCausalLM the logits and routing of our float64 reference.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from sgl_jax.tools.make_random_model import BUNDLED_DIR  # noqa: E402
from sgl_jax.tools.reference_forward import ReferenceModel  # noqa: E402
from sgl_jax.tools.train_tokenizer import CORPUS_PATH  # noqa: E402

PATH = str(BUNDLED_DIR)
TEXTS = [
    "The lighthouse keeper climbed the ninety-two steps.",
    "Crème brûlée, Þórunn, Żubrówka; 静かにしてください 交通安全; 감사합니다 🐈 ☕ ✨",
    "def f(x):\n    return {'a': [1, 2.5, -3e4]}  # tabs\tand  spaces\n",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
    "",
]


def _dtype_kwargs() -> dict:
    # transformers 5 renamed torch_dtype to dtype (the old name still works, with a warning).
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        PATH, output_loading_info=True, **_dtype_kwargs()
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PATH)


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(f"{PATH}/tokenizer.json")


def test_config_is_read_as_written(model) -> None:
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (4, 16, 4)
    assert cfg.hidden_size == 64 and cfg.vocab_size == 512 and cfg.norm_topk_prob
    rope_theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert rope_theta == 1000000.0


def test_tokenizer_matches_tokenizers_library(hf_tokenizer, raw_tokenizer) -> None:
    corpus = CORPUS_PATH.read_text(encoding="utf-8")
    for text in TEXTS + [corpus[:3000]]:
        ids = raw_tokenizer.encode(text).ids
        assert hf_tokenizer(text, add_special_tokens=True)["input_ids"] == ids, repr(text)
        assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.eos_token_id == raw_tokenizer.token_to_id("<|im_end|>")
    assert hf_tokenizer.pad_token_id == raw_tokenizer.token_to_id("<|endoftext|>")
    assert hf_tokenizer.bos_token is None
    assert len(hf_tokenizer) == 512


def test_chat_template(hf_tokenizer, raw_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ☕"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ☕<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert list(ids) == raw_tokenizer.encode(text).ids


def test_logits_and_routing_match_reference(model, raw_tokenizer) -> None:
    ids = raw_tokenizer.encode(CORPUS_PATH.read_text(encoding="utf-8")).ids[:200]
    ref = ReferenceModel(PATH).forward(ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    logits = out.logits[0].double().numpy()
    # float32 vs float64 through 4 layers: ~3e-5 absolute on logits of std ~3.
    np.testing.assert_allclose(logits, ref.logits, rtol=0, atol=3e-4)
    assert np.array_equal(logits.argmax(-1), ref.logits.argmax(-1))
    for layer, router_logits in enumerate(out.router_logits):
        r = router_logits.double().numpy().reshape(len(ids), -1)
        np.testing.assert_allclose(r, ref.router_logits[:, layer], rtol=0, atol=3e-4)
        # Same experts in the same order (descending weight) for every token.
        top = np.argsort(-r, axis=-1, kind="stable")[:, : model.config.num_experts_per_tok]
        np.testing.assert_array_equal(top, ref.topk_ids[:, layer])
