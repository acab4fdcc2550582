"""Multi-head latent attention (DeepSeek-V3): the native backend's ``attend_latent`` against a
direct softmax over the gathered latent rows, and ``MlaAttention``'s absorbed forward over the
latent cache against a plain per-head float64 computation from the same weights."""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.attention import (
    AttentionMetadata,
    NativeAttention,
    create_attention_backend,
    write_latent,
)
from sgl_jax.srt.models.deepseek_v3 import MlaAttention


# -- a paged batch, built by hand -------------------------------------------------------------
class Pages:
    """Slots of requests in a paged cache of ``num_pages`` pages (page 0 reserved), each
    request's pages scattered (not consecutive) so a wrong page-table lookup shows."""

    def __init__(self, num_pages: int, page_size: int, rng: np.random.Generator) -> None:
        self.page_size = page_size
        self.free = [int(p) for p in rng.permutation(np.arange(1, num_pages))]
        self.pages: dict[int, list[int]] = {}

    def slots(self, req: int, start: int, count: int) -> list[int]:
        pages = self.pages.setdefault(req, [])
        out = []
        for pos in range(start, start + count):
            if pos // self.page_size >= len(pages):
                pages.append(self.free.pop())
            out.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
        return out


def make_meta(
    pages: Pages, rows: list[tuple[int, int, int]], num_tokens: int, num_rows: int,
    is_decode: bool,
) -> tuple[AttentionMetadata, np.ndarray]:
    """rows: (request, prefix_len, extend_len); padded up to ``num_tokens`` tokens and
    ``num_rows`` rows. Returns the metadata and each token's slot (padding: slot 0)."""
    ps = pages.page_size
    prefix = np.zeros(num_rows, np.int32)
    extend = np.zeros(num_rows, np.int32)
    token_to_req = np.full(num_tokens, num_rows, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)
    t = 0
    for r, (req, pre, ext) in enumerate(rows):
        prefix[r], extend[r] = pre, ext
        slots[t : t + ext] = pages.slots(req, pre, ext)
        token_to_req[t : t + ext] = r
        positions[t : t + ext] = np.arange(pre, pre + ext)
        t += ext
    max_pages = 1 + max(len(p) for p in pages.pages.values())
    page_indices = np.zeros((num_rows, max_pages), np.int32)
    for r, (req, _, _) in enumerate(rows):
        page_indices[r, : len(pages.pages[req])] = pages.pages[req]
    meta = AttentionMetadata(
        positions=jnp.asarray(positions), token_to_req=jnp.asarray(token_to_req),
        prefix_lens=jnp.asarray(prefix), extend_lens=jnp.asarray(extend),
        extend_starts=jnp.asarray(np.cumsum(extend) - extend), page_indices=jnp.asarray(page_indices),
        page_size=ps, is_decode=is_decode,
    )
    return meta, slots


def request_slots(pages: Pages, req: int, length: int) -> np.ndarray:
    ps = pages.page_size
    return np.array([pages.pages[req][p // ps] * ps + p % ps for p in range(length)])


# -- (a) attend_latent ------------------------------------------------------------------------
def reference_latent(q, cache, pages, rows, scale, v_dim) -> np.ndarray:
    """Per token: softmax over its request's rows at positions <= its own (float64)."""
    flat = np.asarray(cache, np.float64).reshape(-1, cache.shape[-1])
    out = []
    t = 0
    for req, pre, ext in rows:
        keys = flat[request_slots(pages, req, pre + ext)]  # [L, Dk]
        for i in range(ext):
            pos = pre + i
            s = np.einsum("hd,ld->hl", q[t], keys[: pos + 1]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out.append(p @ keys[: pos + 1, :v_dim])
            t += 1
    return np.stack(out)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("decode", [False, True])
def test_attend_latent_matches_direct_softmax(page_size, decode):
    rng = np.random.default_rng(page_size + 10 * decode)
    heads, dk, v_dim = 3, 12, 8
    num_pages = 64 // page_size + 8
    pages = Pages(num_pages, page_size, rng)
    if decode:  # decode rows over cached prefixes (one shorter than a KV block)
        rows = [(0, 13, 1), (1, 2, 1), (2, 30, 1)]
        num_tokens, num_rows = 4, 4
    else:  # a prefix + extend row, a fresh prompt, a one-token (decode-like) row
        rows = [(0, 9, 7), (1, 0, 11), (2, 21, 1)]
        num_tokens, num_rows = 24, 4
    for req, pre, _ in rows:
        pages.slots(req, 0, pre)  # the cached prefix
    meta, slots = make_meta(pages, rows, num_tokens, num_rows, decode)
    cache = jnp.asarray(rng.standard_normal((num_pages, page_size, 1, dk)).astype(np.float32))
    real = sum(ext for _, _, ext in rows)
    new_rows = rng.standard_normal((num_tokens, dk)).astype(np.float32)
    cache = write_latent(cache, jnp.asarray(new_rows), jnp.asarray(slots))
    np.testing.assert_array_equal(  # written where the slots say, nowhere else
        np.asarray(cache).reshape(-1, dk)[slots[:real]], new_rows[:real]
    )
    q = rng.standard_normal((num_tokens, heads, dk)).astype(np.float32)
    scale = 0.3
    want = reference_latent(q, np.asarray(cache), pages, rows, scale, v_dim)
    for kv_block in (4, 128):
        got = NativeAttention(kv_block).attend_latent(jnp.asarray(q), cache, meta, scale, v_dim)
        assert got.shape == (num_tokens, heads, v_dim)
        np.testing.assert_allclose(np.asarray(got)[:real], want, rtol=2e-5, atol=2e-5)


def test_pallas_refuses_latent_attention():
    with pytest.raises(ValueError, match="no multi-head latent attention.*native"):
        create_attention_backend("pallas", "cpu", 128, 16, latent=True)


# -- (b) MlaAttention: absorbed forward vs plain per-head MLA ----------------------------------
def deepseek_config(q_lora_rank: int | None, yarn: bool) -> ModelConfig:
    hf = {
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "first_k_dense_replace": 0, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "q_lora_rank": q_lora_rank, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 6, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "rope_interleave": True,
    }
    if yarn:
        hf["rope_scaling"] = {
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
        }
    return ModelConfig.from_dict(hf, "/nonexistent")


def ref_inv_freq(dim: int, theta: float, scaling: dict | None) -> tuple[np.ndarray, float]:
    """transformers' default / YaRN inverse frequencies and cos-sin factor, float64."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(scaling["beta_fast"])), 0)
    high = min(math.ceil(corr(scaling["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, get_mscale(factor, scaling["mscale"]) / get_mscale(factor, scaling["mscale_all_dim"])


def ref_rope_interleaved(x: np.ndarray, positions: np.ndarray, inv: np.ndarray, attn: float):
    """HF DeepSeek-V3: de-interleave the (even, odd) pairs, then rotate_half."""
    d = x.shape[-1]
    x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    freqs = positions[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * attn, np.sin(emb) * attn
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (d,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def ref_rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def reference_mla(w: dict, x: np.ndarray, hf: dict, cfg: ModelConfig) -> np.ndarray:
    """One request's full sequence [L, hidden], causal, per-head K/V (no absorption)."""
    heads, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    kvl, vd = cfg.kv_lora_rank, cfg.v_head_dim
    length = x.shape[0]
    if cfg.q_lora_rank is None:
        q = x @ w["q_proj"].T
    else:
        q = ref_rms(x @ w["q_a_proj"].T, w["q_a_layernorm"]) @ w["q_b_proj"].T
    q = q.reshape(length, heads, nope + rope)
    ckv = x @ w["kv_a_proj_with_mqa"].T
    c = ref_rms(ckv[:, :kvl], w["kv_a_layernorm"])
    kv = (c @ w["kv_b_proj"].T).reshape(length, heads, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    inv, attn = ref_inv_freq(rope, cfg.rope_theta, hf)
    pos = np.arange(length, dtype=np.float64)
    q_rope = ref_rope_interleaved(q[..., nope:], pos, inv, attn)
    k_rope = ref_rope_interleaved(ckv[:, None, kvl:], pos, inv, attn)
    k = np.concatenate([k_nope, np.broadcast_to(k_rope, (length, heads, rope))], axis=-1)
    qq = np.concatenate([q[..., :nope], q_rope], axis=-1)
    scale = (nope + rope) ** -0.5
    if hf is not None:
        m = 0.1 * hf["mscale_all_dim"] * math.log(hf["factor"]) + 1.0
        scale *= m * m
    s = np.einsum("qhd,khd->hqk", qq, k) * scale
    s = np.where(np.tril(np.ones((length, length), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hqk,khv->qhv", p, v).reshape(length, heads * vd)
    return o @ w["o_proj"].T


@pytest.mark.parametrize("q_lora_rank", [12, None])
@pytest.mark.parametrize("yarn", [False, True])
def test_mla_absorbed_matches_per_head(q_lora_rank, yarn):
    cfg = deepseek_config(q_lora_rank, yarn)
    assert cfg.attention == "mla" and cfg.kv_cache_heads == 1
    assert cfg.kv_cache_head_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    rng = np.random.default_rng(3 + (q_lora_rank or 0) + 100 * yarn)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    nope, rope, kvl, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    shapes = {  # HF layouts [out, in]
        "kv_a_proj_with_mqa": (kvl + rope, hidden), "kv_a_layernorm": (kvl,),
        "kv_b_proj": (heads * (nope + vd), kvl), "o_proj": (hidden, heads * vd),
    }
    if q_lora_rank is None:
        shapes["q_proj"] = (heads * (nope + rope), hidden)
    else:
        shapes.update(q_a_proj=(q_lora_rank, hidden), q_a_layernorm=(q_lora_rank,),
                      q_b_proj=(heads * (nope + rope), q_lora_rank))
    w = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            w[name] = rng.standard_normal(shape) / math.sqrt(shape[1])
    attn = MlaAttention(cfg, jnp.float32)
    for name, value in w.items():
        target = getattr(attn, name)
        if len(value.shape) == 1:
            target.weight.set_value(jnp.asarray(value, jnp.float32))
        else:
            target.set_value(jnp.asarray(value.T, jnp.float32))

    # Two steps over a page size of 4: prompts, then a mixed batch (chunk on a cached prefix,
    # a decode-like row, a fresh prompt) reading the first step's latent rows.
    page_size = 4
    pages = Pages(24, page_size, rng)
    lengths = {0: 14, 1: 4, 2: 5}
    xs = {r: rng.standard_normal((n, hidden)) for r, n in lengths.items()}
    steps = [[(0, 0, 9), (1, 0, 3)], [(0, 9, 5), (1, 3, 1), (2, 0, 5)]]
    backends = SimpleNamespace(attention=NativeAttention(kv_block=4), dp_attention=False)
    cache = jnp.zeros((24, page_size, 1, kvl + rope), jnp.float32)
    got = {r: [] for r in lengths}
    for rows in steps:
        num_tokens = sum(e for _, _, e in rows) + 2  # two padding tokens
        meta, slots = make_meta(pages, rows, num_tokens, len(rows) + 1, False)
        x = np.zeros((num_tokens, hidden), np.float32)
        t = 0
        for req, pre, ext in rows:
            x[t : t + ext] = xs[req][pre : pre + ext]
            t += ext
        out, cache = attn(jnp.asarray(x), SimpleNamespace(out_cache_loc=jnp.asarray(slots)), meta,
                          cache, backends)
        assert out.shape == (num_tokens, hidden)
        t = 0
        for req, _, ext in rows:
            got[req].append(np.asarray(out)[t : t + ext])
            t += ext
    # The cache holds only the latent rows: normalised c and the roped k_rope.
    hf_yarn = None
    if yarn:
        hf_yarn = {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                   "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
    inv, att = ref_inv_freq(rope, cfg.rope_theta, hf_yarn)
    x0 = xs[0]
    ckv = x0 @ w["kv_a_proj_with_mqa"].T
    cached = np.asarray(cache).reshape(-1, kvl + rope)[request_slots(pages, 0, lengths[0])]
    np.testing.assert_allclose(cached[:, :kvl], ref_rms(ckv[:, :kvl], w["kv_a_layernorm"]),
                               rtol=1e-4, atol=1e-5)
    k_rope = ref_rope_interleaved(ckv[:, kvl:], np.arange(lengths[0], dtype=np.float64), inv, att)
    # (the cache keeps HF's interleaved order; the reference de-interleaves)
    deint = np.concatenate([cached[:, kvl:][:, 0::2], cached[:, kvl:][:, 1::2]], axis=-1)
    np.testing.assert_allclose(deint, k_rope, rtol=1e-4, atol=1e-5)
    for req in lengths:
        want = reference_mla(w, xs[req], hf_yarn, cfg)
        np.testing.assert_allclose(np.concatenate(got[req]), want, rtol=1e-4, atol=2e-5,
                                   err_msg=f"request {req}")


def test_mla_params_and_sharding():
    """HF-named parameters, heads split over "tensor", down projections replicated."""
    from flax import nnx

    attn = nnx.eval_shape(lambda: MlaAttention(deepseek_config(12, False), jnp.float32))
    specs = {
        ".".join(map(str, path)): (var.get_value().shape, var.get_metadata().get("out_sharding"))
        for path, var in nnx.to_flat_state(nnx.state(attn, nnx.Param))
    }
    assert specs == {
        "q_a_proj": ((32, 12), (None, None)),
        "q_a_layernorm.weight": ((12,), (None,)),
        "q_b_proj": ((12, 64), (None, "tensor")),
        "kv_a_proj_with_mqa": ((32, 24), (None, None)),
        "kv_a_layernorm.weight": ((16,), (None,)),
        "kv_b_proj": ((16, 56), (None, "tensor")),
        "o_proj": ((24, 32), ("tensor", None)),
    }
