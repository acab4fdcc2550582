"""Hugging Face transformers agrees with our float64 reference forward.

Optional: skipped unless both transformers and torch are installed (they are not project
dependencies; use a side venv, e.g. /work/hfvenv with torch==2.13.0 CPU and transformers,
plus PYTHONPATH=<repo>). Checked with transformers 5.23.0.

- The bundled (trained) checkpoint is read by transformers as a real Qwen3-MoE model: same
  logits and router logits as the reference (our "HF layout" really is HF's), tokenizer and
  chat template. The exact comparison of routed experts (and of the argmax) runs on the tests'
  random checkpoint (``TEST_MODEL_PATH``): the trained router has near-ties below float32
  rounding (docs/trained_model.md), where float32 transformers and the float64 reference may
  legitimately disagree.
- For every other family (Qwen2-MoE, Mixtral, DeepSeek-V3 with MLA/YaRN, GLM-4.5 MoE) a tiny
  random model is built and saved by transformers itself; the reference reads the saved
  directory and must give the same logits (relative error < 1e-5, float32 HF vs float64) and
  the same routed experts for every token and MoE layer (same order for the softmax routers;
  the same set for the grouped sigmoid routers, whose HF topk is unsorted).
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from sgl_jax.testing import TEST_MODEL_PATH, ensure_test_model  # noqa: E402
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


def _load(path: str):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, **_dtype_kwargs()
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return _load(PATH)


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


@pytest.mark.parametrize("which", ["bundled", "test"])
def test_logits_and_routing_match_reference(which, model, raw_tokenizer) -> None:
    path = PATH if which == "bundled" else ensure_test_model()
    hf = model if which == "bundled" else _load(TEST_MODEL_PATH)
    ids = raw_tokenizer.encode(CORPUS_PATH.read_text(encoding="utf-8")).ids[:200]
    ref = ReferenceModel(path).forward(ids)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    logits = out.logits[0].double().numpy()
    # float32 vs float64 through 4 layers: ~3e-5 absolute on logits of std ~3.
    np.testing.assert_allclose(logits, ref.logits, rtol=0, atol=3e-4)
    exact = which == "test"  # router gaps >= 1e-3 on these tokens (make_random_model)
    if exact:
        assert np.array_equal(logits.argmax(-1), ref.logits.argmax(-1))
    for layer, router_logits in enumerate(out.router_logits):
        r = router_logits.double().numpy().reshape(len(ids), -1)
        np.testing.assert_allclose(r, ref.router_logits[:, layer], rtol=0, atol=3e-4)
        if exact:
            # Same experts in the same order (descending weight) for every token.
            top = np.argsort(-r, axis=-1, kind="stable")[:, : hf.config.num_experts_per_tok]
            np.testing.assert_array_equal(top, ref.topk_ids[:, layer])


# --------------------------------------------------------------------------------------------
# The other families: tiny random models built and saved by transformers itself
# --------------------------------------------------------------------------------------------

_COMMON = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

# model_type -> config kwargs (besides _COMMON). Several variants per family where the
# architecture has options (MLA with/without q LoRA, YaRN, rope_interleave; GLM partial rotary
# with/without bias and q/k norm, grouped routing).
HF_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_theta=10000.0,
        ),
    ),
    "qwen2_moe_norm": (
        "qwen2_moe",
        dict(
            num_key_value_heads=4,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[],
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            num_key_value_heads=4,  # HF's MLA needs kv heads == heads
            n_routed_experts=16,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rms_norm_eps=1e-4,  # != 1e-6: the q_a/kv_a norms keep 1e-6 (as transformers)
            rope_interleave=True,
            max_position_embeddings=64,  # = factor * original_max_position_embeddings
            rope_scaling={
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.7,  # != mscale_all_dim: cos/sin scaled by mscale(0.7)/mscale(1)
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    "deepseek_v3_no_q_lora": (
        "deepseek_v3",
        dict(
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=2,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            rope_interleave=False,
        ),
    ),
    "glm4_moe": (
        "glm4_moe",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=24,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    "glm4_moe_plain": (
        "glm4_moe",
        dict(
            num_key_value_heads=2,
            head_dim=24,
            attention_bias=False,
            use_qk_norm=False,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
        ),
    ),
}

GROUPED = ("deepseek_v3", "glm4_moe")


def _randomize(model, seed: int) -> None:
    """Replace transformers' tiny init (std 0.02, which makes every router logit ~0 and routing
    a coin toss at float32 noise) by unit-scale weights, and give the grouped routers' score
    correction bias small random values so it matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms (and biases): around 1 / around 0
                noise = 0.1 * torch.randn(p.shape, generator=gen)
                p.copy_(noise if name.endswith("bias") else 1.0 + noise)
            else:
                fan_in = p.shape[-1]
                scale = 3.0 if name.endswith("gate.weight") else 1.0  # routers: clear margins
                p.copy_(scale * torch.randn(p.shape, generator=gen) / fan_in**0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def _build(model_type: str, kwargs: dict, path, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **kwargs})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, **_dtype_kwargs()).eval()
    _randomize(model, seed)
    model.save_pretrained(str(path))
    loaded, info = AutoModelForCausalLM.from_pretrained(
        str(path), output_loading_info=True, attn_implementation="eager", **_dtype_kwargs()
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    return loaded.eval()


def _hf_routing(model, ids: list[int]):
    """HF logits [T, V] and per MoE layer (router logits, weights, ids) from hooks on routers."""
    routed: dict[int, tuple] = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None)
        if gate is None or not type(gate).__name__.endswith("Router"):
            continue

        def hook(_module, _args, out, li=li):
            routed[li] = tuple(t.detach().double().numpy() for t in out)

        hooks.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double().numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, routed


FAMILY_IDS = [
    5,
    17,
    42,
    3,
    9,
    60,
    1,
    33,
    20,
    11,
    7,
    48,
    95,
    0,
    64,
    21,
    88,
    13,
    70,
    2,
    44,
    31,
    6,
    77,
]


@pytest.mark.parametrize("variant", sorted(HF_FAMILIES))
def test_family_matches_transformers(variant: str, tmp_path) -> None:
    model_type, kwargs = HF_FAMILIES[variant]
    model = _build(model_type, kwargs, tmp_path)
    ref = ReferenceModel(str(tmp_path))
    assert ref.family == model_type
    out = ref.forward(FAMILY_IDS)
    logits, routed = _hf_routing(model, FAMILY_IDS)

    scale = np.max(np.abs(out.logits))
    rel_err = np.max(np.abs(logits - out.logits)) / scale
    moe_layers = [li for li in range(ref.num_layers) if ref.is_moe_layer(li)]
    assert sorted(routed) == moe_layers
    dense = [li for li in range(ref.num_layers) if li not in moe_layers]
    assert np.all(out.topk_ids[:, dense] == -1)

    mismatches = 0
    for li in moe_layers:
        hf_logits, hf_weights, hf_ids = routed[li]
        np.testing.assert_allclose(hf_logits, out.router_logits[:, li], rtol=0, atol=1e-4)
        ref_ids = out.topk_ids[:, li]
        hf_ids = hf_ids.astype(np.int64)
        if model_type in GROUPED:
            # topk(sorted=False): compare the sets (and each expert's weight).
            order = np.argsort(hf_ids, axis=-1)
            hf_ids = np.take_along_axis(hf_ids, order, -1)
            hf_weights = np.take_along_axis(hf_weights, order, -1)
            ref_order = np.argsort(ref_ids, axis=-1)
            ref_ids = np.take_along_axis(ref_ids, ref_order, -1)
            ref_w = np.take_along_axis(out.topk_weights[:, li], ref_order, -1)
        else:
            ref_w = out.topk_weights[:, li]
        same = np.all(hf_ids == ref_ids, axis=-1)
        mismatches += int(np.sum(~same))
        np.testing.assert_allclose(hf_weights[same], ref_w[same], rtol=1e-4, atol=1e-6)
    print(
        f"{variant}: transformers {transformers.__version__}, max |logit err| / max |logit| = "
        f"{rel_err:.2e}, routing rows differing: {mismatches} of "
        f"{len(FAMILY_IDS) * len(moe_layers)}, min selection_gap "
        f"{np.min(out.selection_gap[:, moe_layers]):.2e}"
    )
    assert mismatches == 0
    assert rel_err < 1e-5


# --------------------------------------------------------------------------------------------
# Our own tiny checkpoints of each family (make_random_model presets), read by transformers
# --------------------------------------------------------------------------------------------

PRESETS = ["tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v3", "tiny-glm4-moe"]


@pytest.mark.parametrize("preset", PRESETS)
def test_tiny_preset_loads_and_agrees(preset: str, tmp_path) -> None:
    """transformers loads the preset with no missing or unexpected tensor, and its logits and
    routed sets equal our float64 reference's on a corpus prompt."""
    from transformers import AutoModelForCausalLM

    from sgl_jax.tools.make_random_model import write_random_model

    cfg = write_random_model(str(tmp_path), preset)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), output_loading_info=True, attn_implementation="eager", **_dtype_kwargs()
    )
    # DeepSeek-V3 / GLM-4.5 presets hold an MTP layer at index L, which transformers does not
    # build (it ignores only the released models' layer 61 / 46 / 92 by name).
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    info["unexpected_keys"] = [k for k in info["unexpected_keys"] if not k.startswith(mtp)]
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    ids = Tokenizer.from_file(f"{tmp_path}/tokenizer.json").encode(
        CORPUS_PATH.read_text(encoding="utf-8")).ids[:64]
    ref = ReferenceModel(str(tmp_path)).forward(ids)
    with torch.no_grad():
        out = model.eval()(torch.tensor([ids]), output_router_logits=True)
    logits = out.logits[0].double().numpy()
    assert np.max(np.abs(logits - ref.logits)) / np.max(np.abs(ref.logits)) < 1e-5
    moe_layers = [li for li in range(ref.topk_ids.shape[1]) if ref.topk_ids[0, li, 0] >= 0]
    k = ref.topk_ids.shape[2]
    router_logits = [r for r in (out.router_logits or ()) if r is not None]
    if len(router_logits) == len(moe_layers):  # families whose HF model returns them
        for li, r in zip(moe_layers, router_logits, strict=True):
            r = r.double().numpy().reshape(len(ids), -1)
            np.testing.assert_allclose(r, ref.router_logits[:, li], rtol=0, atol=1e-4)
    # The routed sets through HF's own routers (hooks), for every family.
    _, routed = _hf_routing(model, ids)
    assert sorted(routed) == moe_layers
    for li, (_, _, hf_ids) in routed.items():
        np.testing.assert_array_equal(np.sort(hf_ids.astype(np.int64), -1)[:, :k],
                                      np.sort(ref.topk_ids[:, li], -1))
