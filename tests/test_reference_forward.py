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
