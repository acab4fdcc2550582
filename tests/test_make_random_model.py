"""The random-checkpoint tool, its tokenizer, the bundled tiny Qwen3-MoE checkpoint's layout,
and the tests' random checkpoint (``sgl_jax.testing.TEST_MODEL_PATH``: the tool's tiny preset,
seed 0, whose routing margin the exactness tests rely on).

Everything is checked on real files: checkpoints are written to tmp_path and read back with
safetensors, the tokenizer with the `tokenizers` library, the chat template with jinja2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jinja2.sandbox
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from sgl_jax.testing import TEST_MODEL_PATH, TEST_MODEL_SHA256
from sgl_jax.tools.make_random_model import (
    BUNDLED_DIR,
    PRESETS,
    build_config,
    is_moe_layer,
    main,
    measure,
    order_gaps,
    parse_set,
    sample_prompts,
    write_random_model,
    write_random_model_report,
)
from sgl_jax.tools.reference_forward import ReferenceModel
from sgl_jax.tools.train_tokenizer import CORPUS_PATH, train_tokenizer

CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

NON_ASCII = [
    "Crème brûlée, São Paulo, Þórunn, Żubrówka, Ålesund",
    "静かにしてください 交通安全 光 감사합니다",
    "emoji: 🐈 ☕ ✨ 🐈‍⬛ 👩🏽‍💻",
    "combining: e\u0301 vs \u00e9, zero-width:\u200b|, tab\tnewline\n\r\n",
    "\x00 control \x7f and a lone \ufffd replacement",
    "  leading and trailing spaces  ",
]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF Qwen3-MoE tensor names and shapes, derived from the config independently."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    q, kv = (
        cfg["num_attention_heads"] * cfg["head_dim"],
        cfg["num_key_value_heads"] * cfg["head_dim"],
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (cfg["head_dim"],),
                p + "self_attn.k_norm.weight": (cfg["head_dim"],),
            }
        )
        dense = i in cfg["mlp_only_layers"] or (i + 1) % cfg["decoder_sparse_step"] != 0
        if dense:
            inter = cfg["intermediate_size"]
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        else:
            inter = cfg["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                shapes[f"{p}mlp.experts.{e}.gate_proj.weight"] = (inter, h)
                shapes[f"{p}mlp.experts.{e}.up_proj.weight"] = (inter, h)
                shapes[f"{p}mlp.experts.{e}.down_proj.weight"] = (h, inter)
    return shapes


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


# --------------------------------------------------------------------------------------------
# The bundled (trained) checkpoint and the tests' random one: same shape, same files
# --------------------------------------------------------------------------------------------

TEST_DIR = Path(TEST_MODEL_PATH)


@pytest.mark.parametrize("directory", [BUNDLED_DIR, TEST_DIR], ids=["bundled", "test"])
def test_checkpoint_layout(directory: Path) -> None:
    for name in CHECKPOINT_FILES:
        assert (directory / name).is_file(), name
    cfg = _read_json(directory / "config.json")
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["model_type"] == "qwen3_moe"
    expected = {
        "num_hidden_layers": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "torch_dtype": "float32",
        "use_sliding_window": False,
    }
    assert {k: cfg[k] for k in expected} == expected

    path = directory / "model.safetensors"
    assert 1.5e6 < path.stat().st_size < 3e6
    assert _safetensors_header(path)["__metadata__"] == {"format": "pt"}
    tensors = load_file(str(path))
    assert {k: tuple(t.shape) for k, t in tensors.items()} == _expected_shapes(cfg)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert all(np.isfinite(t).all() for t in tensors.values())
    # Norm weights are not all 1 (random ones carry noise, trained ones moved), so a kernel
    # ignoring them is caught.
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert 0.01 < float(np.std(norm))


def test_bundled_files_besides_weights_are_the_tools() -> None:
    """Training changed only the weights: config, tokenizer, chat template and generation
    config are byte for byte what make_random_model writes for the tiny preset."""
    for name in CHECKPOINT_FILES:
        if name != "model.safetensors":
            assert (BUNDLED_DIR / name).read_bytes() == (TEST_DIR / name).read_bytes(), name


def test_bundled_special_token_ids_match_config() -> None:
    cfg = _read_json(BUNDLED_DIR / "config.json")
    tok = Tokenizer.from_file(str(BUNDLED_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == 512 <= cfg["vocab_size"]
    assert cfg["bos_token_id"] == tok.token_to_id("<|endoftext|>")
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")
    gen = _read_json(BUNDLED_DIR / "generation_config.json")
    assert gen["bos_token_id"] == cfg["bos_token_id"]
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    assert gen["do_sample"] is False

    tc = _read_json(BUNDLED_DIR / "tokenizer_config.json")
    assert tc["eos_token"] == "<|im_end|>"
    assert tc["pad_token"] == "<|endoftext|>"
    assert tc["bos_token"] is None
    assert tc["model_max_length"] == cfg["max_position_embeddings"]
    decoded = {int(i): d["content"] for i, d in tc["added_tokens_decoder"].items()}
    assert decoded == {
        tok.token_to_id(t): t for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    }
    assert all(d["special"] for d in tc["added_tokens_decoder"].values())


def test_tool_reproduces_test_checkpoint(tmp_path: Path) -> None:
    """The tests' checkpoint is exactly what the tool writes for preset tiny, seed 0 (router
    search incl.): the pinned bytes, which were the bundled model's before it was trained."""
    cfg = write_random_model(str(tmp_path), "tiny", seed=0)
    assert cfg == _read_json(TEST_DIR / "config.json")
    for name in CHECKPOINT_FILES:
        assert (tmp_path / name).read_bytes() == (TEST_DIR / name).read_bytes(), name
    digest = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert digest == TEST_MODEL_SHA256


def test_test_checkpoint_routing_margin_and_logits() -> None:
    """The documented guarantee: on the sample prompts, top-(k+1) router logits differ by >= 1e-3."""
    tok = Tokenizer.from_file(str(TEST_DIR / "tokenizer.json"))
    prompts = sample_prompts(tok)
    assert prompts[0] == tok.encode(CORPUS_PATH.read_text(encoding="utf-8")).ids[:200]
    assert 400 <= sum(len(p) for p in prompts) <= 1000
    m = measure(str(TEST_DIR), prompts)
    assert m.order_gap.min() >= 1e-3
    assert m.topk_gap.min() >= m.order_gap.min()
    # Non-degenerate next-token distributions for sampling tests.
    assert 1.5 < m.logits_std < 6.0


def test_test_checkpoint_routing_is_spread_over_experts() -> None:
    ref = ReferenceModel(str(TEST_DIR))
    tok = Tokenizer.from_file(str(TEST_DIR / "tokenizer.json"))
    out = ref.forward(sample_prompts(tok)[0])
    for layer in range(ref.num_layers):
        counts = np.bincount(out.topk_ids[:, layer].ravel(), minlength=ref.num_experts)
        assert (counts > 0).sum() >= ref.num_experts - 2, counts
        # Routing weights are neither uniform nor one-hot.
        top1 = out.topk_weights[:, layer, 0]
        assert 0.35 < float(top1.mean()) < 0.95


# --------------------------------------------------------------------------------------------
# The tool
# --------------------------------------------------------------------------------------------


def test_deterministic_and_seeded(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    overrides = {"num_hidden_layers": 2}
    write_random_model(str(a), "tiny", overrides, seed=7, check_routing=False)
    write_random_model(str(b), "tiny", dict(overrides), seed=7, check_routing=False)
    write_random_model(str(c), "tiny", overrides, seed=8, check_routing=False)
    for name in CHECKPOINT_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ta, tc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert not np.array_equal(ta["lm_head.weight"], tc["lm_head.weight"])


def test_tensors_do_not_depend_on_layer_count(tmp_path: Path) -> None:
    """Per-tensor seeding: a deeper model of the same seed shares the shallower one's layers."""
    write_random_model(
        str(tmp_path / "a"), "tiny", {"num_hidden_layers": 2}, 3, check_routing=False
    )
    write_random_model(
        str(tmp_path / "b"), "tiny", {"num_hidden_layers": 3}, 3, check_routing=False
    )
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(a) < set(b)
    for name, t in a.items():
        np.testing.assert_array_equal(t, b[name], err_msg=name)


@pytest.mark.parametrize(
    "overrides, dense, check_routing",
    [
        ({"mlp_only_layers": [0, 2]}, {0, 2}, True),  # the router search skips dense layers
        ({"decoder_sparse_step": 2}, {0, 2}, False),
        (
            {"num_hidden_layers": 6, "mlp_only_layers": [5], "decoder_sparse_step": 2},
            {0, 2, 4, 5},
            False,
        ),
    ],
)
def test_dense_layers(
    tmp_path: Path, overrides: dict, dense: set[int], check_routing: bool
) -> None:
    cfg = write_random_model(str(tmp_path), "tiny", overrides, seed=1, check_routing=check_routing)
    for key, value in overrides.items():
        assert cfg[key] == value
    saved = _read_json(tmp_path / "config.json")
    assert saved == cfg
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {k: tuple(t.shape) for k, t in tensors.items()} == _expected_shapes(cfg)
    routed = {
        i for i in range(cfg["num_hidden_layers"]) if f"model.layers.{i}.mlp.gate.weight" in tensors
    }
    assert routed == set(range(cfg["num_hidden_layers"])) - dense
    # The reference agrees on which layers route, and the router search handled dense layers.
    out = ReferenceModel(str(tmp_path)).forward([1, 2, 3, 4])
    for i in range(cfg["num_hidden_layers"]):
        assert (out.topk_ids[:, i] == -1).all() == (i in dense)


def test_tied_embeddings_and_dtypes(tmp_path: Path) -> None:
    write_random_model(
        str(tmp_path / "tied"), "tiny", {"tie_word_embeddings": True}, check_routing=False
    )
    tied = load_file(str(tmp_path / "tied" / "model.safetensors"))
    assert "lm_head.weight" not in tied

    write_random_model(
        str(tmp_path / "bf16"), "tiny", {"torch_dtype": "bfloat16", "num_hidden_layers": 1}
    )
    header = _safetensors_header(tmp_path / "bf16" / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert _read_json(tmp_path / "bf16" / "config.json")["torch_dtype"] == "bfloat16"


def test_routing_check_finds_margin_for_custom_shape(tmp_path: Path) -> None:
    overrides = {"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2}
    write_random_model(str(tmp_path), "tiny", overrides, seed=11)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    m = measure(str(tmp_path), sample_prompts(tok))
    assert m.order_gap.min() >= 1e-3


def test_presets_shapes() -> None:
    cfg, gen = build_config("qwen3-30b-a3b-routing")
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (
        48,
        128,
        8,
    )
    assert cfg["hidden_size"] == 64 and cfg["vocab_size"] == 512
    assert "router_std" not in cfg and gen["router_std"] > 0
    cfg, _ = build_config("tiny", {"router_std": 2.0, "num_experts": 8})
    assert cfg["num_experts"] == 8 and "router_std" not in cfg


@pytest.mark.parametrize(
    "overrides",
    [
        {"mlp_only_layers": [4]},
        {"vocab_size": 100},
        {"num_key_value_heads": 3},
        {"num_experts_per_tok": 17},
        {"decoder_sparse_step": 0},
        {"torch_dtype": "int8"},
    ],
)
def test_bad_overrides(overrides: dict) -> None:
    with pytest.raises(ValueError):
        build_config("tiny", overrides)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="preset"):
        build_config("llama")


def test_parse_set() -> None:
    parsed = parse_set(
        ["mlp_only_layers=[0,2]", "decoder_sparse_step=2", "torch_dtype=bfloat16", "rope_theta=1e4"]
    )
    assert parsed == {
        "mlp_only_layers": [0, 2],
        "decoder_sparse_step": 2,
        "torch_dtype": "bfloat16",
        "rope_theta": 1e4,
    }
    assert parse_set(["tie_word_embeddings=true", "name=a=b"]) == {
        "tie_word_embeddings": True,
        "name": "a=b",
    }
    with pytest.raises(ValueError):
        parse_set(["novalue"])


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            str(tmp_path),
            "--set",
            "num_hidden_layers=2",
            "--set",
            "mlp_only_layers=[0]",
            "--seed",
            "4",
        ]
    )
    printed = capsys.readouterr().out
    assert "parameters:" in printed and "min router selection gap" in printed
    assert "incl. group scores" in printed
    cfg = _read_json(tmp_path / "config.json")
    assert cfg["num_hidden_layers"] == 2 and cfg["mlp_only_layers"] == [0]


def test_order_gaps() -> None:
    logits = np.array([[5.0, 1.0, 4.0, 3.5, 0.0], [np.nan] * 5])
    np.testing.assert_allclose(order_gaps(logits, 2), [0.5, np.inf])
    np.testing.assert_allclose(order_gaps(logits[:1], 1), [1.0])


# --------------------------------------------------------------------------------------------
# Further families: Qwen2-MoE, Mixtral, DeepSeek-V3, GLM-4.5 MoE
# --------------------------------------------------------------------------------------------

TINY_FAMILY_PRESETS = {
    "tiny-qwen2-moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "tiny-mixtral": ("MixtralForCausalLM", "mixtral"),
    "tiny-deepseek-v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
    "tiny-glm4-moe": ("Glm4MoeForCausalLM", "glm4_moe"),
}

# Keys each family's transformers config class reads (transformers 4.57's __init__ parameters,
# less the generic token ids and head_dim where the class derives it), plus the released
# models' routing keys the engine reads (DeepSeek-V3: topk_method, scoring_func, moe_layer_freq).
_COMMON_KEYS = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_act",
    "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
    "tie_word_embeddings", "rope_theta", "attention_dropout", "num_experts_per_tok",
    "torch_dtype", "bos_token_id", "eos_token_id",
}  # fmt: skip
FAMILY_KEYS = {
    "qwen2_moe": _COMMON_KEYS | {
        "rope_scaling", "use_sliding_window", "sliding_window", "max_window_layers",
        "decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size",
        "num_experts", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef",
        "mlp_only_layers", "qkv_bias",
    },
    "mixtral": _COMMON_KEYS | {
        "sliding_window", "num_local_experts", "output_router_logits", "router_aux_loss_coef",
        "router_jitter_noise",
    },
    "deepseek_v3": _COMMON_KEYS | {
        "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
        "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "first_k_dense_replace",
        "norm_topk_prob", "pretraining_tp", "rope_scaling", "rope_interleave", "attention_bias",
        "topk_method", "scoring_func", "moe_layer_freq",
    },
    "glm4_moe": _COMMON_KEYS | {
        "partial_rotary_factor", "rope_scaling", "attention_bias", "moe_intermediate_size",
        "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "n_group",
        "topk_group", "first_k_dense_replace", "norm_topk_prob", "use_qk_norm", "head_dim",
    },
}  # fmt: skip


def _family_moe_layers(cfg: dict) -> set[int]:
    n = cfg["num_hidden_layers"]
    kind = cfg["model_type"]
    if kind in ("qwen2_moe", "qwen3_moe"):
        step = cfg["decoder_sparse_step"]
        return {i for i in range(n) if i not in cfg["mlp_only_layers"] and (i + 1) % step == 0}
    if kind == "mixtral":
        return set(range(n))
    freq = cfg.get("moe_layer_freq", 1)
    return {i for i in range(cfg["first_k_dense_replace"], n) if i % freq == 0}


def _family_expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The M11 spec's HF tensor names and shapes for any family, from the config alone."""
    kind = cfg["model_type"]
    if kind == "qwen3_moe":
        return _expected_shapes(cfg)
    h, v, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    moe = _family_moe_layers(cfg)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }

    def mlp(prefix: str, inter: int) -> None:
        shapes[prefix + "gate_proj.weight"] = (inter, h)
        shapes[prefix + "up_proj.weight"] = (inter, h)
        shapes[prefix + "down_proj.weight"] = (h, inter)

    n_layers = cfg["num_hidden_layers"]
    n_mtp = cfg.get("num_nextn_predict_layers") or 0  # DeepSeek-V3 / GLM-4.5 MTP layers
    for i in range(n_layers + n_mtp):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind == "deepseek_v3":
            nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            if ql is None:
                shapes[a + "q_proj.weight"] = (heads * (nope + rope), h)
            else:
                shapes[a + "q_a_proj.weight"] = (ql, h)
                shapes[a + "q_a_layernorm.weight"] = (ql,)
                shapes[a + "q_b_proj.weight"] = (heads * (nope + rope), ql)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (kvl + rope, h)
            shapes[a + "kv_a_layernorm.weight"] = (kvl,)
            shapes[a + "kv_b_proj.weight"] = (heads * (nope + vd), kvl)
            shapes[a + "o_proj.weight"] = (h, heads * vd)
        else:
            shapes[a + "q_proj.weight"] = (heads * hd, h)
            shapes[a + "k_proj.weight"] = (kv * hd, h)
            shapes[a + "v_proj.weight"] = (kv * hd, h)
            shapes[a + "o_proj.weight"] = (h, heads * hd)
            if kind == "qwen2_moe" or (kind == "glm4_moe" and cfg["attention_bias"]):
                shapes[a + "q_proj.bias"] = (heads * hd,)
                shapes[a + "k_proj.bias"] = (kv * hd,)
                shapes[a + "v_proj.bias"] = (kv * hd,)
            if kind == "glm4_moe" and cfg["use_qk_norm"]:
                shapes[a + "q_norm.weight"] = (hd,)
                shapes[a + "k_norm.weight"] = (hd,)
        if i not in moe and i < n_layers:  # an MTP layer is always MoE
            mlp(p + "mlp.", cfg["intermediate_size"])
        elif kind == "mixtral":
            e_count, inter = cfg["num_local_experts"], cfg["intermediate_size"]
            shapes[p + "block_sparse_moe.gate.weight"] = (e_count, h)
            for e in range(e_count):
                q = f"{p}block_sparse_moe.experts.{e}."
                shapes[q + "w1.weight"] = (inter, h)
                shapes[q + "w3.weight"] = (inter, h)
                shapes[q + "w2.weight"] = (h, inter)
        else:
            e_count = cfg["num_experts"] if kind == "qwen2_moe" else cfg["n_routed_experts"]
            shapes[p + "mlp.gate.weight"] = (e_count, h)
            for e in range(e_count):
                mlp(f"{p}mlp.experts.{e}.", cfg["moe_intermediate_size"])
            if kind == "qwen2_moe":
                mlp(p + "mlp.shared_expert.", cfg["shared_expert_intermediate_size"])
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
            else:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (e_count,)
                if cfg["n_shared_experts"]:
                    width = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
                    mlp(p + "mlp.shared_experts.", width)
    for i in range(n_layers, n_layers + n_mtp):
        p = f"model.layers.{i}."
        for name in ("enorm", "hnorm", "shared_head.norm"):
            shapes[f"{p}{name}.weight"] = (h,)
        shapes[p + "eh_proj.weight"] = (h, 2 * h)
        shapes[p + "shared_head.head.weight"] = (v, h)
        shapes[p + "embed_tokens.weight"] = (v, h)
    return shapes


@pytest.mark.parametrize("preset", sorted(TINY_FAMILY_PRESETS))
def test_family_preset_layout(tmp_path: Path, preset: str) -> None:
    cfg = write_random_model(str(tmp_path), preset, seed=0, check_routing=False)
    arch, model_type = TINY_FAMILY_PRESETS[preset]
    assert cfg["architectures"] == [arch] and cfg["model_type"] == model_type
    assert _read_json(tmp_path / "config.json") == cfg
    missing = FAMILY_KEYS[model_type] - set(cfg)
    assert not missing, missing
    assert "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 4 and cfg["hidden_size"] == 64
    assert cfg["vocab_size"] == 512 and cfg["torch_dtype"] == "float32"
    for name in CHECKPOINT_FILES:
        assert (tmp_path / name).is_file(), name
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {k: tuple(t.shape) for k, t in tensors.items()} == _family_expected_shapes(cfg)
    assert all(t.dtype == np.float32 for t in tensors.values())
    routed = {i for i in range(4) if is_moe_layer(cfg, i)}
    assert routed == _family_moe_layers(cfg)


def test_family_preset_values() -> None:
    """The brief's tiny shapes, key by key."""
    q2, _ = build_config("tiny-qwen2-moe")
    assert (q2["num_experts"], q2["num_experts_per_tok"]) == (16, 4)
    assert q2["shared_expert_intermediate_size"] == 48 and q2["norm_topk_prob"] is False
    assert q2["mlp_only_layers"] == [1]
    mx, _ = build_config("tiny-mixtral")
    assert (mx["num_local_experts"], mx["num_experts_per_tok"]) == (8, 2)
    ds, gen = build_config("tiny-deepseek-v3")
    assert {k: ds[k] for k in ("first_k_dense_replace", "n_routed_experts", "num_experts_per_tok",
                               "n_group", "topk_group", "n_shared_experts", "routed_scaling_factor",
                               "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                               "qk_rope_head_dim", "v_head_dim", "num_attention_heads",
                               "max_position_embeddings")} == {
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "num_attention_heads": 4, "max_position_embeddings": 4096,
    }  # fmt: skip
    assert ds["rope_scaling"] == {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert ds["topk_method"] == "noaux_tc" and ds["scoring_func"] == "sigmoid"
    assert ds["num_nextn_predict_layers"] == 1  # one MTP layer (model.layers.4.*), as released
    assert "score_bias_std" not in ds and gen["score_bias_std"] > 0
    glm, _ = build_config("tiny-glm4-moe")
    assert {k: glm[k] for k in ("first_k_dense_replace", "n_routed_experts",
                                "num_experts_per_tok", "n_group", "topk_group",
                                "n_shared_experts", "partial_rotary_factor", "head_dim",
                                "attention_bias", "use_qk_norm", "routed_scaling_factor")} == {
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "partial_rotary_factor": 0.5,
        "head_dim": 16, "attention_bias": True, "use_qk_norm": False,
        "routed_scaling_factor": 2.5,
    }  # fmt: skip


@pytest.mark.parametrize("preset", sorted(TINY_FAMILY_PRESETS))
def test_family_preset_deterministic(tmp_path: Path, preset: str) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_random_model(str(a), preset, seed=5, check_routing=False)
    write_random_model(str(b), preset, seed=5, check_routing=False)
    write_random_model(str(c), preset, seed=6, check_routing=False)
    for name in CHECKPOINT_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ta, tc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert not np.array_equal(ta["lm_head.weight"], tc["lm_head.weight"])


def test_family_weight_scales(tmp_path: Path) -> None:
    write_random_model(str(tmp_path / "ds"), "tiny-deepseek-v3", check_routing=False)
    ds = load_file(str(tmp_path / "ds" / "model.safetensors"))
    bias = np.concatenate(
        [ds[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1, 2, 3)]
    )
    assert 0.003 < float(np.std(bias)) < 0.03  # small: bias-corrected scores stay > 0
    assert float(np.std(ds["model.layers.1.mlp.gate.weight"])) * 8 == pytest.approx(1.0, rel=0.2)
    norm = ds["model.layers.0.self_attn.kv_a_layernorm.weight"]
    assert 0.01 < float(np.std(norm)) < 0.3 and abs(float(np.mean(norm)) - 1) < 0.1
    write_random_model(str(tmp_path / "q2"), "tiny-qwen2-moe", check_routing=False)
    q2 = load_file(str(tmp_path / "q2" / "model.safetensors"))
    assert q2["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert 0.02 < float(np.std(q2["model.layers.0.self_attn.k_proj.bias"])) < 0.3


@pytest.mark.parametrize("preset", sorted(TINY_FAMILY_PRESETS))
def test_family_routing_margin(tmp_path: Path, preset: str) -> None:
    """The router search clears each tiny preset's threshold on the sample prompts."""
    report = write_random_model_report(str(tmp_path), preset, seed=0)
    m = report.measurement
    assert m is not None and m.selection_gap is not None
    moe = [i for i in range(4) if is_moe_layer(report.config, i)]
    assert np.isinf(np.delete(m.selection_gap, moe, axis=1)).all()  # dense layers
    assert m.selection_gap.min() >= report.min_router_gap > 0
    assert 1.5 < m.logits_std < 6.0
    # The routing is spread over the experts and the selection gap agrees with the tool's own
    # computation from the router logits (independent of the reference's).
    ref = ReferenceModel(str(tmp_path))
    out = ref.forward(sample_prompts(Tokenizer.from_file(str(tmp_path / "tokenizer.json")))[0])
    cfg = report.config
    bias = {}
    if cfg["model_type"] in ("deepseek_v3", "glm4_moe"):
        tensors = load_file(str(tmp_path / "model.safetensors"))
        bias = {i: tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in moe}
    rule = {"qwen2_moe": "softmax_topk", "mixtral": "topk_softmax"}.get(
        cfg["model_type"], "sigmoid_grouped"
    )
    mine = selection_gaps(
        out.router_logits,
        rule,
        cfg["num_experts_per_tok"],
        cfg.get("n_group", 1),
        cfg.get("topk_group", 1),
        {i: b.astype(np.float64) for i, b in bias.items()},
    )
    np.testing.assert_allclose(mine, out.selection_gap, rtol=1e-9, atol=1e-15)
    experts = out.router_logits.shape[-1]
    for layer in moe:
        counts = np.bincount(out.topk_ids[:, layer].ravel(), minlength=experts)
        assert (counts > 0).sum() >= experts // 2, counts


ROUTING_PRESETS = {
    # preset: (layers, experts key, experts, top-k, MoE layers, n_group, topk_group, shared)
    "deepseek-v3-routing": (61, "n_routed_experts", 256, 8, 58, 8, 4, 1),
    "mixtral-8x7b-routing": (32, "num_local_experts", 8, 2, 32, None, None, None),
    "qwen2-57b-a14b-routing": (28, "num_experts", 64, 8, 28, None, None, None),
    "glm-4.5-air-routing": (46, "n_routed_experts", 128, 8, 45, 1, 1, 1),
}


@pytest.mark.parametrize("preset", sorted(ROUTING_PRESETS))
def test_routing_presets(tmp_path: Path, preset: str) -> None:
    layers, key, experts, k, moe, n_group, topk_group, shared = ROUTING_PRESETS[preset]
    cfg, gen = build_config(preset)
    assert cfg["num_hidden_layers"] == layers and cfg[key] == experts
    assert cfg["num_experts_per_tok"] == k
    assert sum(is_moe_layer(cfg, i) for i in range(layers)) == moe
    assert cfg["hidden_size"] == 64 and cfg["vocab_size"] == 512
    assert gen["min_router_gap"] == 0  # measured only
    if n_group is not None:
        assert (cfg["n_group"], cfg["topk_group"], cfg["n_shared_experts"]) == (
            n_group,
            topk_group,
            shared,
        )
    # Released values the presets keep.
    expected = {
        "deepseek-v3-routing": {"first_k_dense_replace": 3, "routed_scaling_factor": 2.5},
        "glm-4.5-air-routing": {
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 1.0,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
        },
        "qwen2-57b-a14b-routing": {"norm_topk_prob": False},
        "mixtral-8x7b-routing": {},
    }[preset]
    assert {k: cfg[k] for k in expected} == expected
    if preset == "qwen2-57b-a14b-routing":
        assert cfg["shared_expert_intermediate_size"] > 0
    # The layout at the real expert counts (a few layers only, to stay fast).
    first_moe = min(i for i in range(layers) if is_moe_layer(cfg, i))
    small = write_random_model(
        str(tmp_path), preset, {"num_hidden_layers": first_moe + 1}, check_routing=False
    )
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == _family_expected_shapes(small)


def test_preset_names() -> None:
    assert set(TINY_FAMILY_PRESETS) | set(ROUTING_PRESETS) | {
        "tiny",
        "qwen3-30b-a3b-routing",
        # the 2026 families' presets (tested in test_families_2026 / test_hf_qwen35)
        "tiny-minimax-m2", "tiny-gpt-oss", "tiny-qwen3.5-moe",
    } == set(PRESETS)


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("tiny-deepseek-v3", {"n_group": 3}),
        ("tiny-deepseek-v3", {"topk_group": 5}),
        ("tiny-deepseek-v3", {"first_k_dense_replace": 5}),
        ("tiny-deepseek-v3", {"topk_method": "greedy"}),
        ("tiny-deepseek-v3", {"num_key_value_heads": 2}),
        ("tiny-deepseek-v3", {"num_experts_per_tok": 9}),  # > 2 kept groups x 4 experts
        ("tiny-glm4-moe", {"num_experts_per_tok": 17}),
        ("tiny-glm4-moe", {"partial_rotary_factor": 0.125}),  # 2 of 16 dims: fine, 1 is odd
        ("tiny-qwen2-moe", {"mlp_only_layers": [4]}),
        ("tiny-mixtral", {"num_local_experts": 1}),
        ("tiny-mixtral", {"model_type": "qwen2_moe"}),
    ],
)
def test_family_bad_overrides(preset: str, overrides: dict) -> None:
    if overrides == {"partial_rotary_factor": 0.125}:
        build_config(preset, overrides)  # rotary dim 2
        overrides = {"partial_rotary_factor": 0.0625}  # rotary dim 1
    with pytest.raises(ValueError):
        build_config(preset, overrides)


@pytest.mark.parametrize(
    "preset, overrides, moe",
    [
        ("tiny-deepseek-v3", {"moe_layer_freq": 2}, {2}),
        ("tiny-deepseek-v3", {"q_lora_rank": None, "first_k_dense_replace": 3}, {3}),
        ("tiny-glm4-moe", {"use_qk_norm": True, "attention_bias": False}, {1, 2, 3}),
        ("tiny-qwen2-moe", {"tie_word_embeddings": True}, {0, 2, 3}),
    ],
)
def test_family_variants(tmp_path: Path, preset: str, overrides: dict, moe: set[int]) -> None:
    cfg = write_random_model(str(tmp_path), preset, overrides, check_routing=False)
    assert {i for i in range(4) if is_moe_layer(cfg, i)} == moe == _family_moe_layers(cfg)
    expected = _family_expected_shapes(cfg)
    if cfg["tie_word_embeddings"]:
        del expected["lm_head.weight"]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {k: tuple(t.shape) for k, t in tensors.items()} == expected


# The selection gap computed here from router logits, independently of the reference's
# (tools/reference_routing.py): the tests check the two agree.
def _consecutive_gaps(scores: np.ndarray, k: int, candidates: int) -> np.ndarray:
    """[T, E] scores (-inf outside the candidates) -> [T] min consecutive difference among the
    top min(k+1, candidates) (with k == candidates only the order is decided)."""
    m = min(k + 1, candidates)
    if m < 2:
        return np.full(scores.shape[0], np.inf)
    top = -np.sort(-scores, axis=-1)[:, :m]
    return np.min(top[:, :-1] - top[:, 1:], axis=-1)


def selection_gaps(
    router_logits: np.ndarray,
    rule: str,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    bias: dict[int, np.ndarray] | None = None,
) -> np.ndarray:
    """[T, L, E] float64 router logits (NaN rows: dense layers) -> [T, L] selection gaps.

    rule is the router rule (softmax_topk, topk_softmax, sigmoid_grouped); bias maps a layer
    to its e_score_correction_bias [E] (sigmoid_grouped; absent layers: zero bias).
    """
    t, n_layers, e = router_logits.shape
    out = np.full((t, n_layers), np.inf)
    for layer in range(n_layers):
        logits = router_logits[:, layer]
        if t == 0 or np.isnan(logits).all():
            continue
        if rule in ("softmax_topk", "topk_softmax"):
            out[:, layer] = _consecutive_gaps(logits, k, e)
            continue
        if rule != "sigmoid_grouped":
            raise ValueError(f"unknown router rule {rule!r}")
        c = 1.0 / (1.0 + np.exp(-logits)) + (bias or {}).get(layer, 0.0)
        gap = np.full(t, np.inf)
        candidates = e
        if n_group > 1:
            size = e // n_group
            grouped = c.reshape(t, n_group, size)
            group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [T, G]
            ordered = -np.sort(-group_scores, axis=-1)
            if topk_group < n_group:
                gap = ordered[:, topk_group - 1] - ordered[:, topk_group]
            # Kept groups: the topk_group best, ties to the lower group (stable sort).
            keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
            mask = np.zeros((t, n_group), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            c = np.where(np.repeat(mask, size, axis=-1), c, -np.inf)
            candidates = topk_group * size
        out[:, layer] = np.minimum(gap, _consecutive_gaps(c, k, candidates))
    return out


def test_selection_gaps() -> None:
    nan = np.full(4, np.nan)
    # softmax / topk_softmax: consecutive logit gaps among the top k+1; NaN rows are dense.
    logits = np.array([[[5.0, 1.0, 4.0, 3.5], nan]])  # [T=1, L=2, E=4]
    np.testing.assert_allclose(selection_gaps(logits, "softmax_topk", 2), [[0.5, np.inf]])
    np.testing.assert_allclose(selection_gaps(logits, "topk_softmax", 1), [[1.0, np.inf]])
    # k == E: only the order is decided (top k consecutive gaps).
    np.testing.assert_allclose(selection_gaps(logits[:, :1], "softmax_topk", 4), [[0.5]])
    # sigmoid_grouped: scores c = sigmoid(logit) + bias.
    c = np.array([0.9, 0.1, 0.8, 0.7, 0.5, 0.45, 0.2, 0.3])
    logit = np.log(c / (1 - c))[None, None, :]
    # One group: top 3 of c are 0.9, 0.8, 0.7 -> gaps 0.1, 0.1.
    np.testing.assert_allclose(selection_gaps(logit, "sigmoid_grouped", 2), [[0.1]], rtol=1e-9)
    # Four groups of 2: scores 1.0, 1.5, 0.95, 0.5; keep 2 -> groups 1 and 0 (gap 1.0 - 0.95);
    # candidates 0.9, 0.1, 0.8, 0.7 -> top-3 gaps 0.1, 0.1 -> 0.05 decides.
    np.testing.assert_allclose(
        selection_gaps(logit, "sigmoid_grouped", 2, n_group=4, topk_group=2), [[0.05]], rtol=1e-9
    )
    # The bias shifts the scores (and so the groups): expert 1 + 0.6 -> 0.7 ties expert 3.
    bias = {0: np.array([0.0, 0.6, 0, 0, 0, 0, 0, 0])}
    gap = selection_gaps(logit, "sigmoid_grouped", 3, n_group=4, topk_group=2, bias=bias)
    np.testing.assert_allclose(gap, [[0.0]], atol=1e-12)
    with pytest.raises(ValueError):
        selection_gaps(logit, "softmax_all", 2)


# --------------------------------------------------------------------------------------------
# Tokenizer and chat template
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_DIR / "tokenizer.json"))


def test_tokenizer_training_is_deterministic() -> None:
    trained = train_tokenizer(CORPUS_PATH)
    assert json.loads(trained.to_str()) == _read_json(BUNDLED_DIR / "tokenizer.json")


def test_corpus_is_varied_utf8() -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert 20_000 <= len(text.encode("utf-8")) <= 40_000
    assert any(ord(c) > 0x3000 for c in text)  # CJK
    assert any(ord(c) > 0xFFFF for c in text)  # emoji outside the BMP
    assert "def " in text and "{" in text


def test_tokenizer_round_trip(tokenizer: Tokenizer) -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    ids = tokenizer.encode(text).ids
    assert len(ids) < len(text.encode("utf-8")) / 1.5  # the merges compress
    assert tokenizer.decode(ids) == text
    for s in NON_ASCII + ["", " ", "a", "\n\n\n"]:
        assert tokenizer.decode(tokenizer.encode(s).ids) == s, repr(s)
    assert max(ids) < 509  # ordinary text never yields the special ids


def test_special_tokens_are_atomic(tokenizer: Tokenizer) -> None:
    s = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    enc = tokenizer.encode(s)
    specials = [tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    assert specials == [510, 511, 509]
    assert [i for i in enc.ids if i in specials] == specials
    assert tokenizer.decode(enc.ids, skip_special_tokens=False) == s
    assert tokenizer.decode(enc.ids, skip_special_tokens=True) == "user\nhi\n"


def _render(messages: list[dict], add_generation_prompt: bool) -> str:
    # The way transformers (and the engine) render chat templates.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = _read_json(BUNDLED_DIR / "tokenizer_config.json")["chat_template"]
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt
    )


def test_chat_template_renders_chatml() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi, café ☕?"},
        {"role": "assistant", "content": "Hello!"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}],
        },
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi, café ☕?<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nTwo parts<|im_end|>\n"
    )
    assert _render(messages, add_generation_prompt=False) == expected
    assert _render(messages, add_generation_prompt=True) == expected + "<|im_start|>assistant\n"
    assert _render([], add_generation_prompt=True) == "<|im_start|>assistant\n"
