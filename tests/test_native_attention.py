"""The native attention's short-extend program: a few new tokens per row over long cached
contexts (a turn appended to a cached conversation, the last token of a cached prompt) take
one small query block per row instead of a whole padded block, as cheap as a decode step. Both
programs (short, and the general one when some row brings more tokens) equal a float64 softmax
over each token's own request, for grouped-query and latent attention."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.layers.attention.native import SHORT_EXTEND, NativeAttention
from tests.test_mla import Pages, make_meta, reference_latent, request_slots

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 16, 4


def reference_gqa(q, cache, pages, rows, scale) -> np.ndarray:
    """Per token and head: softmax over its request's keys at positions <= its own (float64),
    query head h reading KV head h // (HEADS / KV_HEADS)."""
    flat = np.asarray(cache, np.float64).reshape(-1, 2 * KV_HEADS, HEAD_DIM)
    group = HEADS // KV_HEADS
    out, t = [], 0
    for req, pre, ext in rows:
        kv = flat[request_slots(pages, req, pre + ext)]  # [L, 2 KVH, D]
        keys, values = kv[:, 0::2], kv[:, 1::2]
        for i in range(ext):
            n = pre + i + 1
            per_head = []
            for h in range(HEADS):
                s = keys[:n, h // group] @ q[t, h] * scale
                p = np.exp(s - s.max())
                per_head.append((p / p.sum()) @ values[:n, h // group])
            out.append(per_head)
            t += 1
    return np.asarray(out)


# (request, cached prefix, new tokens): every row <= SHORT_EXTEND new tokens (the short
# program), or one row above it (the general program), with an empty padding row either way.
SHORT = [(0, 300, 1), (1, 41, SHORT_EXTEND), (2, 129, 3)]
GENERAL = [(0, 300, 1), (1, 41, SHORT_EXTEND + 1), (2, 129, 3)]


@pytest.mark.parametrize("rows", [SHORT, GENERAL], ids=["short", "general"])
@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "latent"])
def test_short_and_general_extends_match_the_softmax(rows, latent: bool) -> None:
    rng = np.random.default_rng(rows[1][2] + 100 * latent)
    num_tokens, num_rows = 64, 4  # 16 tokens a row: a general query block of 16 > 8
    num_pages = 600 // PAGE
    pages = Pages(num_pages, PAGE, rng)
    for req, pre, ext in rows:
        pages.slots(req, 0, pre + ext)  # cached prefix and the new tokens' slots
    meta, _ = make_meta(pages, rows, num_tokens, num_rows, is_decode=False)
    real = sum(ext for _, _, ext in rows)
    scale = 0.25
    attention = NativeAttention(kv_block=16)
    if latent:
        dk, v_dim = 12, 8
        cache = rng.standard_normal((num_pages, PAGE, 1, dk)).astype(np.float32)
        q = rng.standard_normal((num_tokens, HEADS, dk)).astype(np.float32)
        want = reference_latent(q, cache, pages, rows, scale, v_dim)
        got = attention.attend_latent(jnp.asarray(q), jnp.asarray(cache), meta, scale, v_dim)
    else:
        cache = rng.standard_normal((num_pages, PAGE, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
        q = rng.standard_normal((num_tokens, HEADS, HEAD_DIM)).astype(np.float32)
        want = reference_gqa(q, cache, pages, rows, scale)
        got = attention.attend(jnp.asarray(q), jnp.asarray(cache), meta, scale)
    np.testing.assert_allclose(np.asarray(got)[:real], want, rtol=2e-5, atol=2e-5)
