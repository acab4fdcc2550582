"""The random-checkpoint tool, its tokenizer, and the bundled tiny Qwen3-MoE checkpoint.

Everything is checked on real files: checkpoints are written to tmp_path and read back with
safetensors, the tokenizer with the `tokenizers` library, the chat template with jinja2.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2.sandbox
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from sgl_jax.tools.make_random_model import (
    BUNDLED_DIR,
    build_config,
    main,
    measure,
    order_gaps,
    parse_set,
    sample_prompts,
    write_random_model,
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
# The bundled checkpoint
# --------------------------------------------------------------------------------------------


def test_bundled_checkpoint_layout() -> None:
    for name in CHECKPOINT_FILES:
        assert (BUNDLED_DIR / name).is_file(), name
    cfg = _read_json(BUNDLED_DIR / "config.json")
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

    path = BUNDLED_DIR / "model.safetensors"
    assert 1.5e6 < path.stat().st_size < 3e6
    assert _safetensors_header(path)["__metadata__"] == {"format": "pt"}
    tensors = load_file(str(path))
    assert {k: tuple(t.shape) for k, t in tensors.items()} == _expected_shapes(cfg)
    assert all(t.dtype == np.float32 for t in tensors.values())
    # Norm weights carry noise around 1 so that a kernel ignoring them is caught.
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert 0.01 < float(np.std(norm)) < 0.3 and abs(float(np.mean(norm)) - 1) < 0.1


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


def test_tool_reproduces_bundled_checkpoint(tmp_path: Path) -> None:
    """The asset is exactly what the tool writes for preset tiny, seed 0 (router search incl.)."""
    cfg = write_random_model(str(tmp_path), "tiny", seed=0)
    assert cfg == _read_json(BUNDLED_DIR / "config.json")
    for name in CHECKPOINT_FILES:
        assert (tmp_path / name).read_bytes() == (BUNDLED_DIR / name).read_bytes(), name


def test_bundled_routing_margin_and_logits() -> None:
    """The documented guarantee: on the sample prompts, top-(k+1) router logits differ by >= 1e-3."""
    tok = Tokenizer.from_file(str(BUNDLED_DIR / "tokenizer.json"))
    prompts = sample_prompts(tok)
    assert prompts[0] == tok.encode(CORPUS_PATH.read_text(encoding="utf-8")).ids[:200]
    assert 400 <= sum(len(p) for p in prompts) <= 1000
    m = measure(str(BUNDLED_DIR), prompts)
    assert m.order_gap.min() >= 1e-3
    assert m.topk_gap.min() >= m.order_gap.min()
    # Non-degenerate next-token distributions for sampling tests.
    assert 1.5 < m.logits_std < 6.0


def test_bundled_routing_is_spread_over_experts() -> None:
    ref = ReferenceModel(str(BUNDLED_DIR))
    tok = Tokenizer.from_file(str(BUNDLED_DIR / "tokenizer.json"))
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
