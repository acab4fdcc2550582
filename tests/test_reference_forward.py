"""Tests of the float64 numpy reference forward (sgl_jax.tools.reference_forward).

Every test writes its own small random Qwen3-MoE checkpoint (HF layout, real safetensors
files) under tmp_path, so nothing here depends on the bundled model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sgl_jax.tools.reference_forward import (
    ReferenceModel,
    apply_rope,
    rms_norm,
    routed_experts_rows,
)
from sgl_jax.tools.reference_routing import sigmoid_grouped, softmax_topk, topk_softmax

BASE_CONFIG: dict = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # deliberately != hidden_size / num_attention_heads
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
}

Weights = dict[str, np.ndarray]


def _is_moe(cfg: dict, i: int) -> bool:
    return (
        i not in cfg["mlp_only_layers"]
        and cfg["num_experts"] > 0
        and (i + 1) % cfg["decoder_sparse_step"] == 0
    )


def random_weights(cfg: dict, seed: int = 0) -> Weights:
    rng = np.random.default_rng(seed)
    hidden, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv, ne = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"]

    def mat(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w: Weights = {
        "model.embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], hidden)).astype(
            np.float32
        ),
        "model.norm.weight": norm(hidden),
    }
    # Drawn even when tied, so a seed gives the same other weights either way.
    lm_head = mat(cfg["vocab_size"], hidden)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lm_head
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = mat(nh * hd, hidden)
        w[p + "self_attn.k_proj.weight"] = mat(nkv * hd, hidden)
        w[p + "self_attn.v_proj.weight"] = mat(nkv * hd, hidden)
        w[p + "self_attn.o_proj.weight"] = mat(hidden, nh * hd)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
        w[p + "self_attn.k_norm.weight"] = norm(hd)
        if _is_moe(cfg, i):
            inter = cfg["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = 3.0 * mat(ne, hidden)
            for e in range(ne):
                w[p + f"mlp.experts.{e}.gate_proj.weight"] = mat(inter, hidden)
                w[p + f"mlp.experts.{e}.up_proj.weight"] = mat(inter, hidden)
                w[p + f"mlp.experts.{e}.down_proj.weight"] = mat(hidden, inter)
        else:
            inter = cfg["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = mat(inter, hidden)
            w[p + "mlp.up_proj.weight"] = mat(inter, hidden)
            w[p + "mlp.down_proj.weight"] = mat(hidden, inter)
    return w


def write_checkpoint(
    path: Path,
    cfg_overrides: dict | None = None,
    mutate: Callable[[dict, Weights], None] | None = None,
    seed: int = 0,
) -> tuple[Path, dict, Weights]:
    cfg = {**BASE_CONFIG, **(cfg_overrides or {})}
    w = random_weights(cfg, seed)
    if mutate is not None:
        mutate(cfg, w)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    # Two shards: the reader must merge every *.safetensors file in the directory.
    names = sorted(w)
    half = len(names) // 2
    save_file({n: w[n] for n in names[:half]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({n: w[n] for n in names[half:]}, str(path / "model-00002-of-00002.safetensors"))
    return path, cfg, w


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[ReferenceModel, dict, Weights]:
    def tie_router_rows(cfg: dict, w: Weights) -> None:
        # Layer 0's router: experts 2 and 5 share one row, all others are zero. Per token,
        # either their common logit is > 0 (top-2 must be [2, 5]) or < 0 (the six zero logits
        # tie and top-2 must be [0, 1]): ties are exercised on both sides deterministically.
        g = w["model.layers.0.mlp.gate.weight"]
        g[[0, 1, 3, 4, 6, 7]] = 0.0
        g[5] = g[2]

    path, cfg, w = write_checkpoint(tmp_path_factory.mktemp("base"), mutate=tie_router_rows)
    return ReferenceModel(str(path)), cfg, w


PROMPT = [3, 17, 42, 5, 9, 60, 1, 33, 20, 11, 7, 48]


def test_shapes_and_dense_layers(base: tuple[ReferenceModel, dict, Weights]) -> None:
    ref, cfg, _ = base
    out = ref.forward(PROMPT)
    t, num_layers, k, ne = len(PROMPT), cfg["num_hidden_layers"], 2, cfg["num_experts"]
    assert out.logits.shape == (t, cfg["vocab_size"]) and out.logits.dtype == np.float64
    assert out.topk_ids.shape == (t, num_layers, k) and out.topk_ids.dtype == np.int32
    assert out.topk_weights.shape == (t, num_layers, k) and out.topk_weights.dtype == np.float64
    assert out.router_logits.shape == (t, num_layers, ne)
    assert out.topk_gap.shape == (t, num_layers)
    # Layer 1 is in mlp_only_layers: no router.
    assert np.all(out.topk_ids[:, 1] == -1)
    assert np.all(out.topk_weights[:, 1] == 0)
    assert np.all(np.isnan(out.router_logits[:, 1]))
    assert np.all(np.isinf(out.topk_gap[:, 1]))
    for li in (0, 2):
        assert np.all((out.topk_ids[:, li] >= 0) & (out.topk_ids[:, li] < ne))
        assert np.all(np.isfinite(out.router_logits[:, li]))
        np.testing.assert_allclose(out.topk_weights[:, li].sum(-1), 1.0, rtol=1e-12)
    assert np.all(np.isfinite(out.logits))
    assert ref.config == cfg


def test_decoder_sparse_step(tmp_path: Path) -> None:
    path, cfg, _ = write_checkpoint(
        tmp_path, {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": []}
    )
    out = ReferenceModel(str(path)).forward(PROMPT[:4])
    # (i + 1) % 2 == 0 -> layers 1 and 3 are MoE, 0 and 2 dense.
    assert np.all(out.topk_ids[:, [0, 2]] == -1)
    assert np.all(out.topk_ids[:, [1, 3]] >= 0)


def test_topk_order_and_ties(base: tuple[ReferenceModel, dict, Weights]) -> None:
    ref, cfg, _ = base
    out = ref.forward(PROMPT)
    k = cfg["num_experts_per_tok"]
    for t in range(len(PROMPT)):
        for li in (0, 2):
            logits = out.router_logits[t, li]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            # Brute force: sort by (descending prob, ascending id).
            expected = sorted(range(cfg["num_experts"]), key=lambda e: (-probs[e], e))[:k]
            assert out.topk_ids[t, li].tolist() == expected
            desc = np.sort(logits)[::-1]
            assert out.topk_gap[t, li] == desc[k - 1] - desc[k]
            np.testing.assert_allclose(
                out.topk_weights[t, li], probs[expected] / probs[expected].sum(), rtol=1e-12
            )
    # Layer 0 (see the fixture): two exactly tied groups.
    shared = out.router_logits[:, 0, 2]
    np.testing.assert_array_equal(out.router_logits[:, 0, 5], shared)
    expected0 = np.where(shared[:, None] > 0, [2, 5], [0, 1])
    np.testing.assert_array_equal(out.topk_ids[:, 0], expected0)
    np.testing.assert_array_equal(out.topk_weights[:, 0], 0.5)
    assert (shared > 0).any() and (shared < 0).any()  # both branches hit with this seed


def test_all_tied_router_picks_lowest_ids(tmp_path: Path) -> None:
    def zero_router(cfg: dict, w: Weights) -> None:
        w["model.layers.2.mlp.gate.weight"][:] = 0.0

    path, cfg, _ = write_checkpoint(tmp_path, mutate=zero_router)
    out = ReferenceModel(str(path)).forward(PROMPT[:5])
    assert np.all(out.topk_ids[:, 2] == np.arange(cfg["num_experts_per_tok"]))
    assert np.all(out.topk_gap[:, 2] == 0.0)
    np.testing.assert_allclose(out.topk_weights[:, 2], 0.5, rtol=1e-15)


def test_gap_infinite_when_k_equals_num_experts(tmp_path: Path) -> None:
    path, _, _ = write_checkpoint(tmp_path, {"num_experts": 2, "num_experts_per_tok": 2})
    out = ReferenceModel(str(path)).forward(PROMPT[:3])
    assert np.all(np.isinf(out.topk_gap))
    assert np.all(np.sort(out.topk_ids[:, [0, 2]], axis=-1) == [0, 1])


def test_norm_topk_prob(tmp_path: Path) -> None:
    p_true, _, _ = write_checkpoint(tmp_path / "t", {"norm_topk_prob": True})
    p_false, _, _ = write_checkpoint(tmp_path / "f", {"norm_topk_prob": False})
    out_t = ReferenceModel(str(p_true)).forward(PROMPT)
    out_f = ReferenceModel(str(p_false)).forward(PROMPT)
    # Layer 0's router input does not depend on the flag; its selection is identical.
    np.testing.assert_array_equal(out_t.router_logits[:, 0], out_f.router_logits[:, 0])
    np.testing.assert_array_equal(out_t.topk_ids[:, 0], out_f.topk_ids[:, 0])
    w_f = out_f.topk_weights[:, 0]
    np.testing.assert_allclose(out_t.topk_weights[:, 0], w_f / w_f.sum(-1, keepdims=True))
    for li in (0, 2):
        rl = out_f.router_logits[:, li]
        probs = np.exp(rl - rl.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        picked = np.take_along_axis(probs, out_f.topk_ids[:, li].astype(np.int64), -1)
        np.testing.assert_allclose(out_f.topk_weights[:, li], picked, rtol=1e-12)
        assert np.all(out_f.topk_weights[:, li].sum(-1) < 1.0)
    # The flag changes the MoE output, hence the logits.
    assert not np.allclose(out_t.logits, out_f.logits)


def test_causality(base: tuple[ReferenceModel, dict, Weights]) -> None:
    ref, _, _ = base
    full = ref.forward(PROMPT)
    prefix = ref.forward(PROMPT[:5])
    np.testing.assert_allclose(prefix.logits, full.logits[:5], rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(prefix.topk_ids, full.topk_ids[:5])
    np.testing.assert_allclose(prefix.router_logits, full.router_logits[:5], rtol=1e-10, atol=1e-12)
    # ...and appending tokens does change later positions' view of the past.
    other = ref.forward(PROMPT[:5] + [0, 0])
    np.testing.assert_allclose(other.logits[:5], full.logits[:5], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 3, 5])
def test_kv_cached_chunks_equal_full(
    base: tuple[ReferenceModel, dict, Weights], chunk_size: int
) -> None:
    ref, _, _ = base
    full = ref.forward(PROMPT)
    chunked = ref.forward(PROMPT, chunk_size=chunk_size)
    np.testing.assert_allclose(chunked.logits, full.logits, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(chunked.topk_ids, full.topk_ids)
    np.testing.assert_allclose(chunked.topk_weights, full.topk_weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(chunked.router_logits, full.router_logits, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(chunked.topk_gap, full.topk_gap, rtol=1e-8, atol=1e-12)


def test_greedy_generate_matches_full_forward(base: tuple[ReferenceModel, dict, Weights]) -> None:
    ref, _, _ = base
    prompt = PROMPT[:4]
    gen = ref.greedy_generate(prompt, max_new_tokens=12)
    assert len(gen) == 12
    seq = list(prompt)
    for token in gen:
        assert int(np.argmax(ref.forward(seq).logits[-1])) == token
        seq.append(token)
    assert ref.greedy_generate(prompt, max_new_tokens=0) == []


def test_greedy_generate_stop_token(base: tuple[ReferenceModel, dict, Weights]) -> None:
    ref, _, _ = base
    gen = ref.greedy_generate(PROMPT[:4], max_new_tokens=12)
    stop = gen[2]
    first = gen.index(stop)
    assert ref.greedy_generate(PROMPT[:4], 12, stop_token_ids=[stop]) == gen[: first + 1]


def test_routed_experts_rows(base: tuple[ReferenceModel, dict, Weights]) -> None:
    ref, _, _ = base
    prompt = PROMPT[:5]
    output = ref.greedy_generate(prompt, max_new_tokens=4)
    rows = routed_experts_rows(ref, prompt, output)
    assert rows.shape == (len(prompt) + len(output) - 1, 3, 2)
    np.testing.assert_array_equal(rows, ref.forward(prompt + output[:-1]).topk_ids)
    np.testing.assert_array_equal(routed_experts_rows(ref, prompt, output, start_len=2), rows[2:])
    assert routed_experts_rows(ref, [7], []).shape == (0, 3, 2)


def test_tie_word_embeddings(tmp_path: Path) -> None:
    tied_path, _, w = write_checkpoint(tmp_path / "tied", {"tie_word_embeddings": True})
    assert "lm_head.weight" not in w

    def copy_embed(cfg: dict, w: Weights) -> None:
        w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()

    # Same seed -> same weights; an untied model whose lm_head is a copy of the embedding.
    untied_path, _, _ = write_checkpoint(tmp_path / "untied", mutate=copy_embed)
    tied = ReferenceModel(str(tied_path)).forward(PROMPT)
    untied = ReferenceModel(str(untied_path)).forward(PROMPT)
    np.testing.assert_array_equal(tied.logits, untied.logits)
    different = write_checkpoint(tmp_path / "plain")[0]
    assert not np.allclose(ReferenceModel(str(different)).forward(PROMPT).logits, tied.logits)


def test_single_token_by_hand(base: tuple[ReferenceModel, dict, Weights]) -> None:
    """One token: attention over one key is just o_proj(v); the rest written out directly."""
    ref, cfg, w = base
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    eps, group = cfg["rms_norm_eps"], cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    token = 42

    def norm(x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x**2).mean() + eps) * w64[name]

    def silu(x: np.ndarray) -> np.ndarray:
        return x / (1 + np.exp(-x))

    h = w64["model.embed_tokens.weight"][token]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, p + "input_layernorm.weight")
        v = (w64[p + "self_attn.v_proj.weight"] @ x).reshape(cfg["num_key_value_heads"], -1)
        h = h + w64[p + "self_attn.o_proj.weight"] @ np.repeat(v, group, axis=0).reshape(-1)
        x = norm(h, p + "post_attention_layernorm.weight")
        if i == 1:
            m = p + "mlp."
            y = w64[m + "down_proj.weight"] @ (
                silu(w64[m + "gate_proj.weight"] @ x) * (w64[m + "up_proj.weight"] @ x)
            )
        else:
            logits = w64[p + "mlp.gate.weight"] @ x
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            top = sorted(range(cfg["num_experts"]), key=lambda e: (-probs[e], e))[:2]
            y = np.zeros_like(h)
            for e in top:
                m = p + f"mlp.experts.{e}."
                expert = w64[m + "down_proj.weight"] @ (
                    silu(w64[m + "gate_proj.weight"] @ x) * (w64[m + "up_proj.weight"] @ x)
                )
                y += probs[e] / probs[top].sum() * expert
        h = h + y
    expected = w64["lm_head.weight"] @ norm(h, "model.norm.weight")
    np.testing.assert_allclose(ref.forward([token]).logits[0], expected, rtol=1e-10, atol=1e-12)


def test_rope_properties() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 16))
    k = rng.standard_normal((1, 2, 16))
    # Position 0 is the identity; rotations preserve the norm.
    np.testing.assert_allclose(apply_rope(q, np.array([0]), 1e4), q, rtol=0, atol=0)
    np.testing.assert_allclose(
        np.linalg.norm(apply_rope(q, np.array([7]), 1e4)), np.linalg.norm(q), rtol=1e-12
    )

    def score(pq: int, pk: int) -> np.ndarray:
        rq = apply_rope(q, np.array([pq]), 1e4)
        rk = apply_rope(k, np.array([pk]), 1e4)
        return np.sum(rq * rk, axis=-1)

    # q.k after RoPE depends only on the relative position.
    np.testing.assert_allclose(score(9, 4), score(105, 100), rtol=1e-9)
    assert not np.allclose(score(9, 4), score(9, 5))
    # Non-interleaved: dims i and i + head_dim/2 rotate together with frequency theta^(-2i/d).
    x = np.zeros((1, 1, 16))
    x[0, 0, 1] = 1.0
    r = apply_rope(x, np.array([3]), 1e4)[0, 0]
    ang = 3 * 1e4 ** (-2 / 16)
    np.testing.assert_allclose(r[[1, 9]], [np.cos(ang), np.sin(ang)], rtol=1e-12)
    assert np.count_nonzero(r) == 2


def test_rms_norm() -> None:
    x = np.array([[3.0, 4.0]])
    np.testing.assert_allclose(
        rms_norm(x, np.array([1.0, 2.0]), 0.0), [[3 / 12.5**0.5, 8 / 12.5**0.5]]
    )


def _write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors.numpy cannot write BF16; write the documented layout by hand."""
    header: dict = {}
    blobs: list[bytes] = []
    offset = 0
    for name, arr in tensors.items():
        bits = (np.ascontiguousarray(arr, dtype="<f4").view("<u4") >> 16).astype("<u2")
        blob = bits.tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def test_bf16_and_fused_checkpoints_load(tmp_path: Path) -> None:
    cfg = dict(BASE_CONFIG)
    w = random_weights(cfg)
    # Truncate to bf16-representable values so the float32 file holds the same numbers.
    w = {n: (a.view(np.uint32) & 0xFFFF0000).view(np.float32) for n, a in w.items()}
    for sub in ("f32", "bf16", "fused"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(tmp_path / "f32" / "model.safetensors"))
    _write_bf16_safetensors(tmp_path / "bf16" / "model.safetensors", w)

    fused = dict(w)
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts."
        e = range(cfg["num_experts"])
        gate = np.stack([fused.pop(p + f"{j}.gate_proj.weight") for j in e])
        up = np.stack([fused.pop(p + f"{j}.up_proj.weight") for j in e])
        fused[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        fused[p + "down_proj"] = np.stack([fused.pop(p + f"{j}.down_proj.weight") for j in e])
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))

    outs = [ReferenceModel(str(tmp_path / s)).forward(PROMPT) for s in ("f32", "bf16", "fused")]
    for other in outs[1:]:
        np.testing.assert_array_equal(other.logits, outs[0].logits)
        np.testing.assert_array_equal(other.topk_ids, outs[0].topk_ids)


def test_rejects_bad_input(base: tuple[ReferenceModel, dict, Weights]) -> None:
    ref, cfg, _ = base
    with pytest.raises(ValueError):
        ref.forward([cfg["vocab_size"]])
    with pytest.raises(ValueError):
        ref.forward([])


def test_reference_is_independent_of_engine() -> None:
    """The reference must share no code with the engine it judges: its modules
    (sgl_jax/tools/reference_*.py) import nothing from sgl_jax but each other."""
    import ast

    import sgl_jax.tools.reference_forward as module

    files = sorted(Path(module.__file__).parent.glob("reference_*.py"))
    assert {f.name for f in files} >= {
        "reference_checkpoint.py",
        "reference_forward.py",
        "reference_layers.py",
        "reference_routing.py",
    }
    for file in files:
        tree = ast.parse(file.read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        own = [m for m in imported if m.startswith("sgl_jax")]
        assert all(m.startswith("sgl_jax.tools.reference_") for m in own), (file, own)


# --------------------------------------------------------------------------------------------
# Other families: Qwen2-MoE, Mixtral, DeepSeek-V3 (MLA), GLM-4.5 MoE
# --------------------------------------------------------------------------------------------

_SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
}

FAMILY_CONFIGS: dict[str, dict] = {
    "qwen2_moe": {
        **_SMALL,
        "architectures": ["Qwen2MoeForCausalLM"],
        "num_key_value_heads": 2,  # head_dim = 32 / 4 = 8
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 24,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "rope_theta": 10000.0,
    },
    "mixtral": {
        **_SMALL,
        "architectures": ["MixtralForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
        "sliding_window": None,
    },
    "deepseek_v3": {
        **_SMALL,
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "q_lora_rank": 16,
        "kv_lora_rank": 12,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.8,
            "mscale_all_dim": 1.0,
        },
    },
    "glm4_moe": {
        **_SMALL,
        "architectures": ["Glm4MoeForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.0,
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
    },
}


def _family_of(cfg: dict) -> str:
    return {
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "MixtralForCausalLM": "mixtral",
        "DeepseekV3ForCausalLM": "deepseek_v3",
        "Glm4MoeForCausalLM": "glm4_moe",
    }[cfg["architectures"][0]]


def _family_is_moe(cfg: dict, i: int) -> bool:
    fam = _family_of(cfg)
    if fam == "mixtral":
        return True
    if fam in ("deepseek_v3", "glm4_moe"):
        return i >= cfg["first_k_dense_replace"] and i % cfg.get("moe_layer_freq", 1) == 0
    return i not in cfg["mlp_only_layers"] and (i + 1) % cfg["decoder_sparse_step"] == 0


def family_weights(cfg: dict, seed: int = 0) -> Weights:
    """Random float32 weights under HF names for one of FAMILY_CONFIGS' families."""
    rng = np.random.default_rng(seed)
    fam = _family_of(cfg)
    hidden, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hidden // nh

    def mat(out_f: int, in_f: int, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def vec(n: int, center: float = 1.0) -> np.ndarray:
        return (center + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w: Weights = {
        "model.embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], hidden)).astype(
            np.float32
        ),
        "model.norm.weight": vec(hidden),
        "lm_head.weight": mat(cfg["vocab_size"], hidden),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = vec(hidden)
        w[p + "post_attention_layernorm.weight"] = vec(hidden)
        if fam == "deepseek_v3":
            nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            if cfg["q_lora_rank"] is None:
                w[a + "q_proj.weight"] = mat(nh * (nope + rope), hidden)
            else:
                w[a + "q_a_proj.weight"] = mat(cfg["q_lora_rank"], hidden)
                w[a + "q_a_layernorm.weight"] = vec(cfg["q_lora_rank"])
                w[a + "q_b_proj.weight"] = mat(nh * (nope + rope), cfg["q_lora_rank"])
            w[a + "kv_a_proj_with_mqa.weight"] = mat(cfg["kv_lora_rank"] + rope, hidden)
            w[a + "kv_a_layernorm.weight"] = vec(cfg["kv_lora_rank"])
            w[a + "kv_b_proj.weight"] = mat(nh * (nope + vd), cfg["kv_lora_rank"])
            w[a + "o_proj.weight"] = mat(hidden, nh * vd)
        else:
            w[a + "q_proj.weight"] = mat(nh * hd, hidden)
            w[a + "k_proj.weight"] = mat(nkv * hd, hidden)
            w[a + "v_proj.weight"] = mat(nkv * hd, hidden)
            w[a + "o_proj.weight"] = mat(hidden, nh * hd)
            if fam == "qwen2_moe" or (fam == "glm4_moe" and cfg["attention_bias"]):
                w[a + "q_proj.bias"] = vec(nh * hd, 0.0)
                w[a + "k_proj.bias"] = vec(nkv * hd, 0.0)
                w[a + "v_proj.bias"] = vec(nkv * hd, 0.0)
            if fam == "glm4_moe" and cfg["use_qk_norm"]:
                w[a + "q_norm.weight"] = vec(hd)
                w[a + "k_norm.weight"] = vec(hd)
        if not _family_is_moe(cfg, i):
            inter = cfg["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = mat(inter, hidden)
            w[p + "mlp.up_proj.weight"] = mat(inter, hidden)
            w[p + "mlp.down_proj.weight"] = mat(hidden, inter)
            continue
        if fam == "mixtral":
            ne, inter = cfg["num_local_experts"], cfg["intermediate_size"]
            m = p + "block_sparse_moe."
            w[m + "gate.weight"] = mat(ne, hidden, 3.0)
            for e in range(ne):
                w[m + f"experts.{e}.w1.weight"] = mat(inter, hidden)
                w[m + f"experts.{e}.w3.weight"] = mat(inter, hidden)
                w[m + f"experts.{e}.w2.weight"] = mat(hidden, inter)
            continue
        ne = cfg["num_experts"] if fam == "qwen2_moe" else cfg["n_routed_experts"]
        inter = cfg["moe_intermediate_size"]
        m = p + "mlp."
        w[m + "gate.weight"] = mat(ne, hidden, 3.0)
        for e in range(ne):
            w[m + f"experts.{e}.gate_proj.weight"] = mat(inter, hidden)
            w[m + f"experts.{e}.up_proj.weight"] = mat(inter, hidden)
            w[m + f"experts.{e}.down_proj.weight"] = mat(hidden, inter)
        if fam == "qwen2_moe":
            si = cfg["shared_expert_intermediate_size"]
            s = m + "shared_expert."
            w[m + "shared_expert_gate.weight"] = mat(1, hidden)
        else:
            si = inter * cfg["n_shared_experts"]
            s = m + "shared_experts."
            w[m + "gate.e_score_correction_bias"] = (0.05 * rng.standard_normal(ne)).astype(
                np.float32
            )
        w[s + "gate_proj.weight"] = mat(si, hidden)
        w[s + "up_proj.weight"] = mat(si, hidden)
        w[s + "down_proj.weight"] = mat(hidden, si)
    return w


def write_family(
    path: Path, family: str, overrides: dict | None = None, seed: int = 0
) -> tuple[Path, dict, Weights]:
    cfg = {**FAMILY_CONFIGS[family], **(overrides or {})}
    w = family_weights(cfg, seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(path / "model.safetensors"))
    return path, cfg, w


FAMILY_VARIANTS = {
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe_norm_sparse2": (
        "qwen2_moe",
        {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": []},
    ),
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_no_q_lora": (
        "deepseek_v3",
        {
            "q_lora_rank": None,
            "rope_scaling": None,
            "rope_interleave": False,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "deepseek_v3_freq2": ("deepseek_v3", {"num_hidden_layers": 4, "moe_layer_freq": 2}),
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe_plain": (
        "glm4_moe",
        {"attention_bias": False, "use_qk_norm": False, "n_group": 1, "topk_group": 1},
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILY_VARIANTS))
def family_model(request, tmp_path_factory) -> tuple[ReferenceModel, dict, Weights]:
    family, overrides = FAMILY_VARIANTS[request.param]
    path, cfg, w = write_family(tmp_path_factory.mktemp(request.param), family, overrides)
    return ReferenceModel(str(path)), cfg, w


def test_family_shapes_dense_layers_and_gaps(family_model) -> None:
    ref, cfg, _ = family_model
    out = ref.forward(PROMPT)
    t, num_layers, k = len(PROMPT), cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    assert ref.family == _family_of(cfg)
    assert (ref.num_layers, ref.top_k, ref.vocab_size) == (num_layers, k, cfg["vocab_size"])
    assert out.logits.shape == (t, cfg["vocab_size"]) and np.all(np.isfinite(out.logits))
    assert out.topk_ids.shape == (t, num_layers, k) and out.topk_ids.dtype == np.int32
    assert out.router_logits.shape == (t, num_layers, ref.num_experts)
    assert out.selection_gap.shape == (t, num_layers) and out.selection_gap.dtype == np.float64
    moe = [i for i in range(num_layers) if _family_is_moe(cfg, i)]
    dense = [i for i in range(num_layers) if i not in moe]
    assert moe and [ref.is_moe_layer(i) for i in range(num_layers)] == [
        i in moe for i in range(num_layers)
    ]
    assert np.all(out.topk_ids[:, dense] == -1) and np.all(out.topk_weights[:, dense] == 0)
    assert np.all(np.isnan(out.router_logits[:, dense]))
    assert np.all(np.isinf(out.selection_gap[:, dense])) and np.all(
        np.isinf(out.topk_gap[:, dense])
    )
    assert np.all((out.topk_ids[:, moe] >= 0) & (out.topk_ids[:, moe] < ref.num_experts))
    assert np.all(np.isfinite(out.selection_gap[:, moe])) and np.all(out.selection_gap[:, moe] > 0)
    assert np.all(out.selection_gap[:, moe] <= out.topk_gap[:, moe])
    for li in moe:  # each layer's ids follow from its router logits by the family's rule
        bias = None
        if ref.router_rule == "sigmoid_grouped":
            bias = ref.layers[li].moe.correction_bias
        r = ref.route(out.router_logits[:, li], bias)
        np.testing.assert_array_equal(r.ids, out.topk_ids[:, li])


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_family_chunked_equals_full(family_model, chunk_size: int) -> None:
    ref, _, _ = family_model
    full = ref.forward(PROMPT)
    chunked = ref.forward(PROMPT, chunk_size=chunk_size)
    np.testing.assert_allclose(chunked.logits, full.logits, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(chunked.topk_ids, full.topk_ids)
    np.testing.assert_allclose(chunked.topk_weights, full.topk_weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(chunked.selection_gap, full.selection_gap, rtol=1e-7, atol=1e-12)
    prefix = ref.forward(PROMPT[:5])
    np.testing.assert_allclose(prefix.logits, full.logits[:5], rtol=1e-10, atol=1e-12)


def test_family_greedy_generate(family_model) -> None:
    ref, cfg, _ = family_model
    gen = ref.greedy_generate(PROMPT[:3], max_new_tokens=5)
    seq = PROMPT[:3]
    for token in gen:
        assert int(np.argmax(ref.forward(seq).logits[-1])) == token
        seq = seq + [token]
    rows = routed_experts_rows(ref, PROMPT[:3], gen)
    assert rows.shape == (3 + len(gen) - 1, cfg["num_hidden_layers"], cfg["num_experts_per_tok"])


# -- routers on hand-made logits --------------------------------------------------------------


def _logit(p: np.ndarray) -> np.ndarray:
    """Inverse sigmoid: router logits whose sigmoid scores are p."""
    return np.log(p / (1.0 - p))


def test_sigmoid_grouped_group_limiting_excludes_a_better_expert() -> None:
    # 8 experts, 4 groups of 2, keep 2 groups, k = 2. Expert 0 has the best single score
    # (0.95) but its group (0.95 + 0.05 = 1.0) loses to groups 1 (0.8+0.7) and 3 (0.6+0.55).
    s = np.array([[0.95, 0.05, 0.8, 0.7, 0.3, 0.3, 0.6, 0.55]])
    r = sigmoid_grouped(_logit(s), None, 2, 4, 2, norm_topk_prob=False, routed_scaling_factor=1.0)
    assert r.ids.tolist() == [[2, 3]]
    np.testing.assert_allclose(r.weights, [[0.8, 0.7]], rtol=1e-12)
    # Group scores desc: 1.5 (g1), 1.15 (g3), 1.0 (g0), 0.6 (g2): group gap 0.15; consecutive
    # choice scores among the kept 0.8, 0.7, 0.6: 0.1 -> selection gap 0.1; topk_gap 0.1.
    np.testing.assert_allclose(r.selection_gap, [0.1], rtol=1e-9)
    np.testing.assert_allclose(r.topk_gap, [0.1], rtol=1e-9)
    # Without group limiting (one group) expert 0 wins.
    r1 = sigmoid_grouped(_logit(s), None, 2, 1, 1, norm_topk_prob=False, routed_scaling_factor=1.0)
    assert r1.ids.tolist() == [[0, 2]]
    # The group gap decides when it is the smallest difference.
    s2 = np.array([[0.9, 0.1, 0.5, 0.49, 0.2, 0.1, 0.6, 0.3]])  # groups 1.0, 0.99, 0.3, 0.9
    r2 = sigmoid_grouped(_logit(s2), None, 2, 4, 2, norm_topk_prob=False, routed_scaling_factor=1.0)
    assert r2.ids.tolist() == [[0, 2]]
    np.testing.assert_allclose(r2.selection_gap, [0.01], rtol=1e-8)  # 1.0 - 0.99 (and 0.9-0.5 > )


def test_sigmoid_grouped_bias_weights_renorm_and_scaling() -> None:
    s = np.array([[0.6, 0.5, 0.4, 0.3]])
    bias = np.array([0.0, 0.0, 0.25, 0.0])  # choice scores 0.6, 0.5, 0.65, 0.3
    r = sigmoid_grouped(_logit(s), bias, 2, 1, 1, norm_topk_prob=True, routed_scaling_factor=2.5)
    assert r.ids.tolist() == [[2, 0]]  # descending choice score (with bias)
    # Weights from the scores WITHOUT bias, renormalised, then scaled.
    np.testing.assert_allclose(r.weights, [[2.5 * 0.4 / 1.0, 2.5 * 0.6 / 1.0]], rtol=1e-12)
    np.testing.assert_allclose(r.topk_gap, [0.1], rtol=1e-9)  # 0.6 - 0.5
    np.testing.assert_allclose(r.selection_gap, [0.05], rtol=1e-9)  # 0.65 - 0.6
    r = sigmoid_grouped(_logit(s), bias, 2, 1, 1, norm_topk_prob=False, routed_scaling_factor=2.5)
    np.testing.assert_allclose(r.weights, [[2.5 * 0.4, 2.5 * 0.6]], rtol=1e-12)


def test_sigmoid_grouped_ties() -> None:
    # All equal: groups tie (lower groups kept), experts tie (lower ids first).
    r = sigmoid_grouped(np.zeros((1, 8)), None, 3, 4, 2, True, 1.0)
    assert r.ids.tolist() == [[0, 1, 2]]
    assert r.selection_gap.tolist() == [0.0] and r.topk_gap.tolist() == [0.0]
    # Groups 1 and 2 tie for the second place: group 1 is kept, so expert 3 is eligible, 5 not.
    s = np.array([[0.9, 0.8, 0.3, 0.4, 0.5, 0.2, 0.1, 0.1]])  # groups 1.7, 0.7, 0.7, 0.2
    r = sigmoid_grouped(_logit(s), None, 3, 4, 2, False, 1.0)
    assert r.ids.tolist() == [[0, 1, 3]]
    assert r.selection_gap.tolist() == pytest.approx([0.0], abs=1e-15)
    # k equal to the candidates (2 kept groups of 2): topk_gap inf, the order still decided.
    r = sigmoid_grouped(_logit(s), None, 4, 4, 2, False, 1.0)
    assert r.ids.tolist() == [[0, 1, 3, 2]] and np.isinf(r.topk_gap[0])


def test_softmax_routers_on_hand_made_logits() -> None:
    logits = np.array([[1.0, 3.0, 2.0, 3.0, -1.0]])
    r = softmax_topk(logits, 3, norm_topk_prob=False)
    assert r.ids.tolist() == [[1, 3, 2]]  # the 3.0 tie goes to the lower id
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(r.weights[0], p[[1, 3, 2]], rtol=1e-12)
    assert r.selection_gap.tolist() == [0.0] and r.topk_gap.tolist() == [1.0]
    rn = softmax_topk(logits, 3, norm_topk_prob=True)
    np.testing.assert_allclose(rn.weights[0], p[[1, 3, 2]] / p[[1, 3, 2]].sum(), rtol=1e-12)
    # Mixtral: softmax over the selected logits == softmax over all, renormalised.
    m = topk_softmax(np.array([[0.5, 2.0, -1.0, 1.0]]), 2)
    assert m.ids.tolist() == [[1, 3]]
    np.testing.assert_allclose(m.weights[0], [1 / (1 + np.exp(-1.0)), 1 / (1 + np.exp(1.0))])
    np.testing.assert_allclose(m.selection_gap, [0.5])
    np.testing.assert_allclose(m.topk_gap, [0.5])
    # Selection gap: min consecutive difference among the top k+1 logits.
    g = softmax_topk(np.array([[5.0, 4.0, 3.9, 1.0, 0.0]]), 2, False)
    np.testing.assert_allclose(g.selection_gap, [0.1], rtol=1e-9)
    np.testing.assert_allclose(g.topk_gap, [0.1], rtol=1e-9)
    g = softmax_topk(np.array([[5.0, 4.99, 3.0, 1.0]]), 2, False)
    np.testing.assert_allclose(g.selection_gap, [0.01], rtol=1e-8)  # order of the two chosen
    np.testing.assert_allclose(g.topk_gap, [1.99], rtol=1e-12)


# -- by-hand forwards -------------------------------------------------------------------------


def _hand_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * weight


def _hand_swiglu(
    x: np.ndarray, w64: Weights, prefix: str, names=("gate_proj", "up_proj", "down_proj")
) -> np.ndarray:
    g, u, d = (w64[f"{prefix}{n}.weight"] for n in names)
    a = g @ x
    return d @ (a / (1 + np.exp(-a)) * (u @ x))


def _hand_moe(cfg: dict, w64: Weights, p: str, x: np.ndarray) -> np.ndarray:
    """One token's MoE output, each family's rule written out with Python sorts."""
    fam = _family_of(cfg)
    k = cfg["num_experts_per_tok"]
    if fam == "mixtral":
        m = p + "block_sparse_moe."
        logits = w64[m + "gate.weight"] @ x
        top = sorted(range(len(logits)), key=lambda e: (-logits[e], e))[:k]
        z = np.exp(logits[top] - logits[top].max())
        weights = z / z.sum()
        return sum(
            wt * _hand_swiglu(x, w64, m + f"experts.{e}.", ("w1", "w3", "w2"))
            for wt, e in zip(weights, top, strict=True)
        )
    m = p + "mlp."
    logits = w64[m + "gate.weight"] @ x
    ne = len(logits)
    if fam == "qwen2_moe":
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = sorted(range(ne), key=lambda e: (-probs[e], e))[:k]
        weights = probs[top] / (probs[top].sum() if cfg["norm_topk_prob"] else 1.0)
        gate = 1 / (1 + np.exp(-(w64[m + "shared_expert_gate.weight"] @ x)[0]))
        shared = gate * _hand_swiglu(x, w64, m + "shared_expert.")
    else:
        s = 1 / (1 + np.exp(-logits))
        c = s + w64[m + "gate.e_score_correction_bias"]
        size = ne // cfg["n_group"]
        gscore = [sum(sorted(c[g * size : (g + 1) * size])[-2:]) for g in range(cfg["n_group"])]
        kept = sorted(range(cfg["n_group"]), key=lambda g: (-gscore[g], g))[: cfg["topk_group"]]
        cand = [e for e in range(ne) if e // size in kept]
        top = sorted(cand, key=lambda e: (-c[e], e))[:k]
        weights = s[top]
        if cfg["norm_topk_prob"]:
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * cfg["routed_scaling_factor"]
        shared = _hand_swiglu(x, w64, m + "shared_experts.")
    routed = sum(
        wt * _hand_swiglu(x, w64, m + f"experts.{e}.") for wt, e in zip(weights, top, strict=True)
    )
    return routed + shared


@pytest.mark.parametrize("variant", ["qwen2_moe", "qwen2_moe_norm_sparse2", "mixtral", "glm4_moe"])
def test_gqa_family_single_token_by_hand(variant: str, tmp_path: Path) -> None:
    """One token: attention over one key is o_proj(v) (v bias included): RoPE and q/k drop out,
    the MoE (shared experts, gates, every rule) is written out directly."""
    family, overrides = FAMILY_VARIANTS[variant]
    path, cfg, w = write_family(tmp_path, family, overrides)
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    eps, token = cfg["rms_norm_eps"], 42
    group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    h = w64["model.embed_tokens.weight"][token]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        x = _hand_norm(h, w64[p + "input_layernorm.weight"], eps)
        v = w64[a + "v_proj.weight"] @ x + w64.get(a + "v_proj.bias", 0.0)
        v = np.repeat(v.reshape(cfg["num_key_value_heads"], -1), group, axis=0).reshape(-1)
        h = h + w64[a + "o_proj.weight"] @ v
        x = _hand_norm(h, w64[p + "post_attention_layernorm.weight"], eps)
        if _family_is_moe(cfg, i):
            h = h + _hand_moe(cfg, w64, p, x)
        else:
            h = h + _hand_swiglu(x, w64, p + "mlp.")
    expected = w64["lm_head.weight"] @ _hand_norm(h, w64["model.norm.weight"], eps)
    got = ReferenceModel(str(path)).forward([token]).logits[0]
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def _rotate_pairs(x: np.ndarray, pos: int, pairs: list[tuple[int, int]], inv_freq, factor=1.0):
    """Rotate (x[a], x[b]) by pos * inv_freq[j] as a complex number, j-th pair; scale by factor."""
    y = x.copy()
    for j, (a, b) in enumerate(pairs):
        z = complex(x[a], x[b]) * np.exp(1j * pos * inv_freq[j]) * factor
        y[a], y[b] = z.real, z.imag
    return y


def _hand_attention_layer(cfg: dict, w64: Weights, i: int, xs: np.ndarray) -> np.ndarray:
    """Attention of layer i over all positions of xs [T, H], per head and position in loops.

    GLM: RoPE pairs (j, j + rot/2) over the first rot = head_dim * partial_rotary_factor dims.
    DeepSeek MLA: per-head keys from the latent; RoPE on the shared k_rope and on q_rope, pairs
    (2j, 2j+1) when rope_interleave, YaRN frequencies and scales from the config.
    """
    fam = _family_of(cfg)
    a = f"model.layers.{i}.self_attn."
    eps, nh, theta = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["rope_theta"]
    t_len = xs.shape[0]
    if fam == "glm4_moe":
        hd, nkv = cfg["head_dim"], cfg["num_key_value_heads"]
        rot = int(hd * cfg["partial_rotary_factor"])
        inv_freq = [theta ** (-2 * j / rot) for j in range(rot // 2)]
        pairs = [(j, j + rot // 2) for j in range(rot // 2)]

        def proj(name: str, n: int) -> np.ndarray:
            y = xs @ w64[a + name + ".weight"].T + w64.get(a + name + ".bias", 0.0)
            return y.reshape(t_len, n, hd)

        q, k, v = proj("q_proj", nh), proj("k_proj", nkv), proj("v_proj", nkv)
        if cfg["use_qk_norm"]:
            q = _hand_norm(q, w64[a + "q_norm.weight"], eps)
            k = _hand_norm(k, w64[a + "k_norm.weight"], eps)
        heads = []
        for head in range(nh):
            kv_head = head // (nh // nkv)
            o = np.zeros((t_len, hd))
            for t in range(t_len):
                qt = _rotate_pairs(q[t, head], t, pairs, inv_freq)
                sc = [
                    qt @ _rotate_pairs(k[s, kv_head], s, pairs, inv_freq) / np.sqrt(hd)
                    for s in range(t + 1)
                ]
                pr = np.exp(np.array(sc) - max(sc))
                o[t] = (pr / pr.sum()) @ v[: t + 1, kv_head]
            heads.append(o)
        return np.concatenate(heads, axis=-1) @ w64[a + "o_proj.weight"].T
    # DeepSeek-V3 MLA.
    nope, rd, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r = cfg["kv_lora_rank"]
    scale, cos_factor = (nope + rd) ** -0.5, 1.0
    inv_freq = [theta ** (-2 * j / rd) for j in range(rd // 2)]
    ys = cfg.get("rope_scaling")
    if ys:
        f, orig = ys["factor"], ys["original_max_position_embeddings"]

        def mscale(m: float) -> float:
            return 0.1 * m * np.log(f) + 1.0

        lo = max(
            np.floor(rd * np.log(orig / (ys["beta_fast"] * 2 * np.pi)) / (2 * np.log(theta))), 0
        )
        hi = min(
            np.ceil(rd * np.log(orig / (ys["beta_slow"] * 2 * np.pi)) / (2 * np.log(theta))), rd - 1
        )
        ramp = [min(max((j - lo) / (hi - lo), 0.0), 1.0) for j in range(rd // 2)]
        inv_freq = [fr * (1 - rm) + fr / f * rm for fr, rm in zip(inv_freq, ramp, strict=True)]
        cos_factor = mscale(ys["mscale"]) / mscale(ys["mscale_all_dim"])
        scale *= mscale(ys["mscale_all_dim"]) ** 2
    if cfg.get("rope_interleave", True):
        pairs = [(2 * j, 2 * j + 1) for j in range(rd // 2)]
    else:
        pairs = [(j, j + rd // 2) for j in range(rd // 2)]
    if cfg["q_lora_rank"] is None:
        q = xs @ w64[a + "q_proj.weight"].T
    else:
        qa = _hand_norm(xs @ w64[a + "q_a_proj.weight"].T, w64[a + "q_a_layernorm.weight"], 1e-6)
        q = qa @ w64[a + "q_b_proj.weight"].T
    q = q.reshape(t_len, nh, nope + rd)
    ckv = xs @ w64[a + "kv_a_proj_with_mqa.weight"].T
    c = _hand_norm(ckv[:, :r], w64[a + "kv_a_layernorm.weight"], 1e-6)
    kv = (c @ w64[a + "kv_b_proj.weight"].T).reshape(t_len, nh, nope + vd)
    k_rope = [_rotate_pairs(ckv[s, r:], s, pairs, inv_freq, cos_factor) for s in range(t_len)]
    heads = []
    for head in range(nh):
        o = np.zeros((t_len, vd))
        for t in range(t_len):
            q_rope = _rotate_pairs(q[t, head, nope:], t, pairs, inv_freq, cos_factor)
            sc = [
                (q[t, head, :nope] @ kv[s, head, :nope] + q_rope @ k_rope[s]) * scale
                for s in range(t + 1)
            ]
            pr = np.exp(np.array(sc) - max(sc))
            o[t] = (pr / pr.sum()) @ kv[: t + 1, head, nope:]
        heads.append(o)
    return np.concatenate(heads, axis=-1) @ w64[a + "o_proj.weight"].T


@pytest.mark.parametrize(
    "variant", ["deepseek_v3", "deepseek_v3_no_q_lora", "glm4_moe", "glm4_moe_plain"]
)
def test_attention_by_hand_mla_and_partial_rotary(variant: str, tmp_path: Path) -> None:
    """Two-layer models (layer 0 dense, layer 1 MoE) over 7 tokens, written out with loops:
    MLA with and without q LoRA, YaRN and interleaved pairs; GLM partial rotary."""
    family, overrides = FAMILY_VARIANTS[variant]
    path, cfg, w = write_family(tmp_path, family, {**overrides, "num_hidden_layers": 2})
    w64 = {n: a.astype(np.float64) for n, a in w.items()}
    eps, ids = cfg["rms_norm_eps"], [3, 17, 42, 5, 9, 60, 30]
    h = w64["model.embed_tokens.weight"][ids]
    for i in range(2):
        p = f"model.layers.{i}."
        x = _hand_norm(h, w64[p + "input_layernorm.weight"], eps)
        h = h + _hand_attention_layer(cfg, w64, i, x)
        x = _hand_norm(h, w64[p + "post_attention_layernorm.weight"], eps)
        if _family_is_moe(cfg, i):
            h = h + np.stack([_hand_moe(cfg, w64, p, xt) for xt in x])
        else:
            h = h + np.stack([_hand_swiglu(xt, w64, p + "mlp.") for xt in x])
    expected = _hand_norm(h, w64["model.norm.weight"], eps) @ w64["lm_head.weight"].T
    got = ReferenceModel(str(path)).forward(ids).logits
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-10)


def test_partial_rotary_leaves_the_rest() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 16))
    y = apply_rope(x, np.array([5, 9]), 1e4, rotary_dim=8)
    np.testing.assert_array_equal(y[..., 8:], x[..., 8:])
    np.testing.assert_allclose(y[..., :8], apply_rope(x[..., :8], np.array([5, 9]), 1e4))
    # Interleaved pairs = de-interleave, then rotate_half.
    perm = np.r_[0:8:2, 1:8:2]
    np.testing.assert_allclose(
        apply_rope(x[..., :8], np.array([5, 9]), 1e4, interleave=True),
        apply_rope(x[..., perm], np.array([5, 9]), 1e4),
        rtol=1e-14,
    )


# -- loading rules ----------------------------------------------------------------------------


def test_mtp_layers_are_ignored(tmp_path: Path) -> None:
    path, cfg, w = write_family(tmp_path / "plain", "deepseek_v3")
    base = ReferenceModel(str(path)).forward(PROMPT[:6])
    n = cfg["num_hidden_layers"]
    extra = {
        k.replace("model.layers.1.", f"model.layers.{n}."): v
        for k, v in w.items()
        if "layers.1." in k
    }
    extra[f"model.layers.{n}.eh_proj.weight"] = np.ones((4, 4), np.float32)
    save_file(extra, str(path / "model-mtp.safetensors"))
    out = ReferenceModel(str(path)).forward(PROMPT[:6])
    np.testing.assert_array_equal(out.logits, base.logits)
    np.testing.assert_array_equal(out.topk_ids, base.topk_ids)


@pytest.mark.parametrize(
    "family, overrides, match",
    [
        ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "bfloat16"),
        ("mixtral", {"sliding_window": 4096}, "sliding"),
        ("qwen2_moe", {"use_sliding_window": True}, "sliding"),
        ("qwen2_moe", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE"),
        ("glm4_moe", {"rope_scaling": {"type": "yarn", "factor": 2.0}}, "RoPE"),
        ("deepseek_v3", {"topk_method": "greedy"}, "noaux_tc"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "sigmoid"),
        ("qwen2_moe", {"model_type": "llama"}, "LlamaForCausalLM"),
    ],
)
def test_refuses_what_it_does_not_implement(
    tmp_path: Path, family: str, overrides: dict, match: str
) -> None:
    path, cfg, _ = write_family(tmp_path, family, overrides)
    if cfg.get("model_type") == "llama":
        (path / "config.json").write_text(json.dumps({**cfg, "architectures": [match]}))
    with pytest.raises(NotImplementedError, match=match):
        ReferenceModel(str(path))
