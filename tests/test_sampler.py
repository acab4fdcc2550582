"""Device sampler: greedy, reproducibility, support of the truncations, distribution.

Tests share a few (batch, vocab, head_size) shapes so jit compiles stay at five. ``head_size``
is shrunk below the vocabulary so the full-sort path runs on a small vocabulary too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.layers.sampler import SamplingMetadata, sample
from sgl_jax.srt.sampling.sampling_params import SamplingParams

_sample = jax.jit(sample, static_argnames=("head_size", "vocab_chunks"))

VOCAB, HEAD = 256, 8  # most tests: rows need the head path, the sort path or neither
TPU_CHUNKS = 16  # the head's top-k as on TPU: 16 chunks of 16 ids (``vocab_chunks_for``)


def _run(logits: np.ndarray, meta: SamplingMetadata, head_size: int = 1024,
         vocab_chunks: int = 1) -> np.ndarray:
    return np.asarray(_sample(jnp.asarray(logits, jnp.float32), meta, head_size=head_size,
                              vocab_chunks=vocab_chunks))


def _meta(params, seeds, steps, padded_bs: int, vocab: int) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, seeds, steps, padded_bs, vocab)


def _reference_support(
    x: np.ndarray, p: SamplingParams, slack: float = 0.0
) -> set[int]:
    """Support of one row computed independently in float64 numpy; ``slack`` loosens the
    top-p and min-p thresholds so float32 rounding at a boundary cannot fail the check."""
    vocab = x.shape[0]
    order = np.argsort(-x.astype(np.float64), kind="stable")  # descending, ties -> lower id
    z = x.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    ps = probs[order]
    k = vocab if (p.top_k <= 0 or p.top_k >= vocab) else p.top_k
    exclusive = np.concatenate([[0.0], np.cumsum(ps)[:-1]])
    len_p = vocab if p.top_p >= 1.0 else int(np.sum(exclusive < p.top_p + slack))
    len_m = int(np.sum(ps >= (p.min_p - slack) * ps[0]))
    len_nz = int(np.sum(ps > 0.0))
    return {int(i) for i in order[: min(k, len_p, len_m, len_nz)]}


def test_greedy_is_argmax_with_ties_to_lower_id() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, VOCAB)).astype(np.float32)
    logits[3, [10, 40]] = 9.0  # tie for the max: the lower id wins
    logits[5, [7, 2]] = 9.0
    expected = logits.argmax(axis=1)
    assert expected[3] == 10 and expected[5] == 2

    # All-greedy batch (skips the sampling branch), with padding rows.
    greedy = [SamplingParams(temperature=0.0)] * 6
    meta = _meta(greedy, list(range(6)), [0] * 6, 8, VOCAB)
    np.testing.assert_array_equal(_run(logits, meta, HEAD)[:6], expected[:6])

    # Greedy rows inside a sampled batch take the argmax too (tiny temperatures included).
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-7)] * 3 + [
        SamplingParams(temperature=1.0, top_p=0.9)
    ] * 2
    meta = _meta(mixed, list(range(8)), [0] * 8, 8, VOCAB)
    np.testing.assert_array_equal(_run(logits, meta, HEAD)[:6], expected[:6])


def _requests(vocab: int) -> list[tuple[SamplingParams, np.ndarray, int]]:
    """One request per sampling path; rows are (params, logits row, seed)."""
    rng = np.random.default_rng(1)
    flat = rng.normal(size=vocab).astype(np.float32) * 0.5
    peaked = (rng.normal(size=vocab) * 4.0).astype(np.float32)
    return [
        (SamplingParams(temperature=0.0), flat, 0),
        (SamplingParams(), flat, 11),  # untruncated: id-order inverse CDF
        (SamplingParams(top_k=5), flat, 12),  # fits the head
        (SamplingParams(top_k=50), flat, 13),  # k > head: full sort
        (SamplingParams(top_p=0.9), flat, 14),  # wide top-p: full sort
        (SamplingParams(top_p=0.5), peaked, 15),
        (SamplingParams(temperature=0.7, min_p=0.2), peaked, 16),
        (SamplingParams(temperature=1.3, top_k=100, top_p=0.95), flat, 2**62 + 5),
    ]


def test_same_seed_and_step_give_same_token_in_any_row_or_batch() -> None:
    vocab, steps_per_req, head = VOCAB, 8, HEAD
    reqs = _requests(vocab)
    rows = [(p, x, seed, step) for p, x, seed in reqs for step in range(steps_per_req)]

    def run(batch_rows, padded_bs: int, vocab_chunks: int = 1) -> np.ndarray:
        logits = np.zeros((padded_bs, vocab), np.float32)
        logits[: len(batch_rows)] = np.stack([x for _, x, _, _ in batch_rows])
        meta = _meta(
            [p for p, *_ in batch_rows],
            [s for *_, s, _ in batch_rows],
            [t for *_, t in batch_rows],
            padded_bs,
            vocab,
        )
        return _run(logits, meta, head, vocab_chunks)[: len(batch_rows)]

    together = run(rows, 64)
    np.testing.assert_array_equal(run(rows, 64, TPU_CHUNKS), together)  # as on TPU
    reversed_padded = run(rows[::-1], 80)[::-1]
    np.testing.assert_array_equal(together, reversed_padded)
    # Each request alone: its rows no longer share a batch with rows that need the sort path.
    for i in range(len(reqs)):
        own = rows[i * steps_per_req : (i + 1) * steps_per_req]
        np.testing.assert_array_equal(
            run(own, steps_per_req), together[i * steps_per_req : (i + 1) * steps_per_req]
        )
    # Sanity: the sampled requests really vary across steps (the test is not vacuous).
    per_req = together.reshape(len(reqs), steps_per_req)
    assert len(set(per_req[1])) > 1 and len(set(per_req[4])) > 1


def test_steps_and_seeds_give_different_streams() -> None:
    vocab, n = VOCAB, 64
    logits = np.full((n, vocab), 1.0, np.float32)  # uniform distribution
    params = [SamplingParams()] * n

    def stream(seed: int) -> np.ndarray:
        return _run(logits, _meta(params, [seed] * n, list(range(n)), n, vocab), HEAD)

    a, b, c = stream(7), stream(8), stream(7 + 2**32)
    assert len(set(a.tolist())) > n // 2  # steps 0..63 are distinct draws
    assert np.mean(a != b) > 0.9
    assert np.mean(a != c) > 0.9  # the high word of a 64-bit seed matters
    np.testing.assert_array_equal(a, stream(7))


def test_truncations_never_pick_outside_support() -> None:
    rng = np.random.default_rng(2)
    vocab, batch = 64, 512
    logits = (rng.normal(size=(batch, vocab)) * rng.choice([0.3, 1.0, 3.0], size=(batch, 1)))
    logits = np.round(logits.astype(np.float32), 1)  # rounding creates ties
    logits[logits == 0.0] = 0.05
    logits[rng.random(size=logits.shape) < 0.1] = -np.inf  # never pickable
    logits[:, 0] = np.maximum(logits[:, 0], -5.0)  # keep every row finite somewhere
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.5, 1.0, 2.0])),
            top_k=int(rng.choice([-1, 1, 3, 10, 40])),
            top_p=float(rng.choice([1.0, 0.2, 0.6, 0.9])),
            min_p=float(rng.choice([0.0, 0.05, 0.3])),
        )
        for _ in range(batch)
    ]
    meta = _meta(params, rng.integers(0, 2**63, size=batch).tolist(), list(range(batch)), batch,
                 vocab)
    picks = _run(logits, meta, head_size=HEAD)
    # The head's top-k per vocabulary chunk (as on TPU) picks the very same tokens.
    np.testing.assert_array_equal(_run(logits, meta, HEAD, vocab_chunks=TPU_CHUNKS), picks)
    widths = []
    for i in range(batch):
        loose = _reference_support(logits[i], params[i], slack=1e-4)
        assert int(picks[i]) in loose, (i, params[i], picks[i], sorted(loose))
        widths.append(len(_reference_support(logits[i], params[i])))
    # Rows with supports wider than the head exist, so the sort path ran as well.
    assert max(widths) > HEAD and np.mean(picks != logits.argmax(axis=1)) > 0.2


def _chi_square(picks: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(picks, minlength=probs.shape[0])
    support = probs > 0
    assert observed[~support].sum() == 0
    expected = probs[support] * picks.shape[0]
    return float(np.sum((observed[support] - expected) ** 2 / expected))


def test_empirical_distribution_matches_softmax() -> None:
    vocab, n, head = 16, 8000, 2
    x = np.random.default_rng(3).permutation(np.linspace(-1.5, 1.5, vocab)).astype(np.float32)
    configs = [
        SamplingParams(),  # temperature 1, no truncation: id-order path
        SamplingParams(temperature=0.5, top_k=2),  # fits the head of 2
        SamplingParams(temperature=2.0, top_k=6),  # k > head: sort path
        SamplingParams(temperature=0.8, top_p=0.7, min_p=0.1),  # sort path
    ]
    params = [c for c in configs for _ in range(n)]
    logits = np.broadcast_to(x, (len(params), vocab))
    meta = _meta(params, [5] * len(params), list(range(len(params))), len(params), vocab)
    picks = _run(logits, meta, head_size=head).reshape(len(configs), n)
    for c, row in zip(configs, picks, strict=True):
        z = x.astype(np.float64) / c.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        keep = np.zeros(vocab, bool)
        keep[list(_reference_support(x, c))] = True
        probs = np.where(keep, probs, 0.0) / probs[keep].sum()
        # Degrees of freedom <= 15; 45 is beyond the 0.9999 quantile of chi2(15) (~42.6).
        assert _chi_square(row, probs) < 45.0, c


def test_from_params_padding_and_normalisation() -> None:
    vocab = 100
    params = [
        SamplingParams(temperature=1e-7, top_k=-1),
        SamplingParams(temperature=0.5, top_k=500, top_p=0.9, min_p=0.1),
        SamplingParams(top_k=7),
    ]
    meta = _meta(params, [1, 2**40 + 3, 2**64 - 1], [4, 5, 6], 5, vocab)
    np.testing.assert_array_equal(meta.temperatures, [0.0, 0.5, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(meta.top_ks, [vocab, vocab, 7, vocab, vocab])
    np.testing.assert_allclose(meta.top_ps, [1.0, 0.9, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(meta.min_ps, [0.0, 0.1, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(
        meta.seeds, [[0, 1], [2**8, 3], [2**32 - 1, 2**32 - 1], [0, 0], [0, 0]]
    )
    assert meta.seeds.dtype == np.uint32 and meta.steps.dtype == np.int32
    np.testing.assert_array_equal(meta.steps, [4, 5, 6, 0, 0])

    with pytest.raises(ValueError, match="equal lengths"):
        _meta(params, [1, 2], [0, 0, 0], 5, vocab)
    with pytest.raises(ValueError, match="padded batch"):
        _meta(params, [1, 2, 3], [0, 0, 0], 2, vocab)
    with pytest.raises(ValueError, match="seed"):
        _meta(params[:1], [2**64], [0], 1, vocab)


def test_chunked_top_k_and_cumsum_equal_the_whole_row_versions() -> None:
    """The head is a top-k per vocabulary chunk, then of the chunks' heads: the same values
    and ids as ``lax.top_k`` over the whole row, ties (many here) to the lower id; the
    chunked cumulative sum equals ``cumsum`` up to float rounding."""
    from sgl_jax.srt.layers.sampler import chunk_count, chunked_cumsum, chunked_top_k

    rng = np.random.default_rng(5)
    x = np.round(rng.normal(size=(6, VOCAB)), 1).astype(np.float32)  # ~60 distinct values
    x[2] = 0.5  # a row of one value: the k lowest ids
    assert chunk_count(VOCAB, TPU_CHUNKS, HEAD) == 16  # the test runs the chunked path
    assert chunk_count(VOCAB, TPU_CHUNKS, 32) == 8 and chunk_count(VOCAB, 5) == 4
    for k in (1, HEAD, VOCAB // 16, VOCAB // 4):
        vals, ids = jax.jit(chunked_top_k, static_argnums=(1, 2))(jnp.asarray(x), k, TPU_CHUNKS)
        want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(
        np.asarray(chunked_top_k(jnp.asarray(x), HEAD, TPU_CHUNKS)[1])[2], np.arange(HEAD))
    w = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(chunked_cumsum(jnp.asarray(w), TPU_CHUNKS)),
                               np.cumsum(w.astype(np.float64), axis=1), rtol=1e-5)
    # A width no chunk count divides (a prime): the whole-row versions.
    assert chunk_count(251, TPU_CHUNKS) == 1
    odd = jnp.asarray(x[:, :251])
    np.testing.assert_array_equal(np.asarray(chunked_top_k(odd, 4, TPU_CHUNKS)[1]),
                                  np.asarray(jax.lax.top_k(odd, 4)[1]))


def test_chunked_inverse_cdf_matches_the_whole_row_cumsum() -> None:
    """One chunk's cumulative sum per row: the same ids as the whole row's inverse CDF (up to
    a draw within float rounding of a cumulative sum: none here), never an ineligible id,
    and the same total weight up to rounding."""
    from sgl_jax.srt.layers.sampler import _inverse_cdf, chunked_inverse_cdf

    rng = np.random.default_rng(9)
    w = rng.random((64, VOCAB)).astype(np.float32) ** 4
    w[rng.random(w.shape) < 0.3] = 0.0  # ineligible ids
    w[3] = 0.0
    w[3, 17] = 1.0  # one eligible id
    w[5, VOCAB // 2:] = 0.0  # the back half ineligible
    u = rng.random(64).astype(np.float32)
    u[:4] = [0.0, 0.999999, 0.5, 1.0 - 2.0**-24]
    got, total = jax.jit(chunked_inverse_cdf, static_argnums=2)(jnp.asarray(w), jnp.asarray(u),
                                                               TPU_CHUNKS)
    cum = jnp.cumsum(jnp.asarray(w), axis=1)
    want = _inverse_cdf(cum, jnp.asarray(w) > 0, cum[:, -1], jnp.asarray(u))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (w[np.arange(64), np.asarray(got)] > 0).all() and int(got[3]) == 17
    np.testing.assert_allclose(np.asarray(total), w.astype(np.float64).sum(axis=1), rtol=1e-5)
