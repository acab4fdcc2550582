"""Routing replay in tunix's Qwen3-MoE (``sgl_jax.integrations.tunix_qwen3``), on the bundled
checkpoint loaded by tunix's own loader.

The yardstick is independent of the code under test: the float64 numpy forward of the same
checkpoint file (``sgl_jax.tools.reference_forward``) with its MoE layers routed by given ids
(``sgl_jax.tools.reference_replay``, written from the definition of replay), and tunix's own
``compute_per_token_logps``. Skipped without tunix (its own CI stage installs it: .ci/run).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

pytest.importorskip("tunix", reason="needs the tunix extra: pip install 'sgl_jax[tunix]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl import common  # noqa: E402

from sgl_jax.integrations.routing_replay import align_routed_experts  # noqa: E402
from sgl_jax.integrations.tunix_qwen3 import (  # noqa: E402
    ReplayQwen3,
    replayed_per_token_logps,
)
from sgl_jax.integrations.tunix_qwen3_replay import forced_forward  # noqa: E402
from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH  # noqa: E402
from sgl_jax.srt.tokenizer import Tokenizer  # noqa: E402
from sgl_jax.tools.reference_replay import ForcedRoutingReference, log_softmax  # noqa: E402
from tests.tunix.tunix_utils import TEMPERATURE, load_actor  # noqa: E402

LAYERS, EXPERTS, TOP_K = 4, 16, 4
PROMPT_WIDTH, COMPLETION_WIDTH = 6, 7
# Two samples: one whose prompt is wider than the window (the window keeps its tail), one
# whose completion is shorter than the window.
PROMPTS = [[300, 12, 45, 7, 8, 9, 10, 11], [46, 77, 354]]
COMPLETIONS = [[260, 412, 271, 299, 13, 14, 15], [453, 11, 40]]
# (sample, token) rows left at -1: those tokens keep the router's own top-k.
UNSET = [(0, 7), (1, 1), (1, 4)]


@pytest.fixture(scope="module")
def model() -> ReplayQwen3:
    return ReplayQwen3.from_model(load_actor())


@pytest.fixture(scope="module")
def ids() -> tuple[int, int]:
    tok = Tokenizer.from_pretrained(BUNDLED_MODEL_PATH)
    return tok.pad_token_id, tok.eos_token_id


def rollout_rows(seed: int, unset: list[tuple[int, int]] = UNSET) -> list[np.ndarray]:
    """Engine-like rows, [P + C - 1, L, k] per sample: distinct random ids (not what the
    router would pick), the rows ``unset`` -1."""
    rng = np.random.default_rng(seed)
    rows = []
    for b, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        r = np.stack([[rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)]
                      for _ in range(len(p) + len(c) - 1)]).astype(np.int32)
        for sample, token in unset:
            if sample == b:
                r[token] = -1
        rows.append(r)
    return rows


def batch(pad: int, rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    prompts = np.array([[pad] * (PROMPT_WIDTH - len(p)) + p[-PROMPT_WIDTH:] for p in PROMPTS])
    completions = np.array([c + [pad] * (COMPLETION_WIDTH - len(c)) for c in COMPLETIONS])
    aligned = align_routed_experts(rows, [len(c) for c in COMPLETIONS], PROMPT_WIDTH,
                                   COMPLETION_WIDTH)
    return prompts, completions, aligned


def reference_logps(rows: list[np.ndarray]) -> list[tuple[np.ndarray, object]]:
    """Per sample: float64 logprobs of its completion tokens under its rows (the window's
    tokens only, as the trainer sees them), and the reference's output."""
    ref = ForcedRoutingReference(BUNDLED_MODEL_PATH)
    out = []
    for p, c, r in zip(PROMPTS, COMPLETIONS, rows, strict=True):
        p = p[-PROMPT_WIDTH:]
        r = r[-(len(p) + len(c) - 1):]  # the rows of the window's tokens
        forced = np.concatenate([r, np.full((1, LAYERS, TOP_K), -1)])  # the last token: none
        result = ref.forward_forced(p + c, forced)
        logp = log_softmax(result.logits, TEMPERATURE)
        out.append((np.array([logp[len(p) - 1 + j, t] for j, t in enumerate(c)]), result))
    return out


def test_replayed_logprobs_equal_a_float64_forced_routing_forward(model, ids):
    pad, eos = ids
    rows = rollout_rows(seed=1)
    prompts, completions, aligned = batch(pad, rows)
    got = np.asarray(replayed_per_token_logps(model, prompts, completions, aligned, pad_id=pad,
                                              eos_id=eos, temperature=TEMPERATURE))
    assert got.dtype == np.float32 and got.shape == completions.shape
    worst = 0.0
    for b, (want, result) in enumerate(reference_logps(rows)):
        n = len(COMPLETIONS[b])
        worst = max(worst, float(np.abs(got[b, :n] - want).max()))
        # The reference's fallback rows (-1) are its router's choice: decided by margins far
        # above float32 rounding, so the trainer's router must make the same choice.
        p = min(len(PROMPTS[b]), PROMPT_WIDTH)
        cut = len(PROMPTS[b]) - p
        for sample, token in UNSET:
            if sample == b and token >= cut:
                assert result.selection_gap[token - cut].min() > 1e-3
    print(f"largest |replayed float32 - float64 reference| logprob: {worst:.2e}")
    assert worst < 1e-4
    # Replay changes what the trainer computes: its own routing gives other logprobs.
    own = np.asarray(replayed_per_token_logps(model, prompts, completions, None, pad_id=pad,
                                              eos_id=eos, temperature=TEMPERATURE))
    assert np.abs(own - got)[completions != pad].max() > 0.1


def test_every_replayed_row_routes_through_its_experts_and_unset_rows_through_the_router(
        model, ids):
    pad, eos = ids
    rows = rollout_rows(seed=1)
    prompts, completions, aligned = batch(pad, rows)
    tokens, positions, mask, _ = common.process_ids(
        jnp.asarray(prompts), jnp.asarray(completions), pad, eos)
    _, used = forced_forward(model, tokens, positions, mask, jnp.asarray(aligned))
    used = np.asarray(used)
    replayed = aligned[..., 0] >= 0  # [B, T, L]
    np.testing.assert_array_equal(used[replayed], aligned[replayed])  # 100% of (token, layer)
    for b, (_, result) in enumerate(reference_logps(rows)):
        cut = len(PROMPTS[b]) - min(len(PROMPTS[b]), PROMPT_WIDTH)
        for sample, token in UNSET:
            if sample == b and token >= cut:
                col = PROMPT_WIDTH - (len(PROMPTS[b]) - cut) + (token - cut)
                np.testing.assert_array_equal(used[b, col], result.topk_ids[token - cut])


def test_without_replay_the_model_is_tunixs(model, ids):
    pad, eos = ids
    prompts, completions, _ = batch(pad, rollout_rows(seed=1))
    graphdef, state = nnx.split(model)
    stock = np.asarray(common.compute_per_token_logps(
        graphdef, state, jnp.asarray(prompts), jnp.asarray(completions), pad, eos,
        temperature=TEMPERATURE))  # ReplayQwen3 called without the keyword: tunix's forward
    unset = np.full((2, PROMPT_WIDTH + COMPLETION_WIDTH, LAYERS, TOP_K), -1)
    mask = completions != pad
    for routing in (None, unset):  # nothing to replay: the router's own top-k
        own = np.asarray(replayed_per_token_logps(model, prompts, completions, routing,
                                                  pad_id=pad, eos_id=eos,
                                                  temperature=TEMPERATURE))
        assert np.abs(own - stock)[mask].max() < 2e-5
    # tunix (since google/tunix#2046) forwards rollout routing to models whose __call__
    # takes this keyword.
    assert "forced_routed_experts" in inspect.signature(ReplayQwen3.__call__).parameters


def test_the_routers_gradient_is_finite_nonzero_and_matches_a_finite_difference(model, ids):
    pad, eos = ids
    # Every row replayed: no router decides anything, so the loss is smooth in the routers.
    prompts, completions, aligned = batch(pad, rollout_rows(seed=2, unset=[]))
    weights = jnp.asarray((completions != pad)
                          * np.random.default_rng(3).normal(size=completions.shape), jnp.float32)
    graphdef, routers, rest = nnx.split(model, nnx.PathContains("router"), ...)

    def loss(r):
        logps = replayed_per_token_logps(nnx.merge(graphdef, r, rest), prompts, completions,
                                         aligned, pad_id=pad, eos_id=eos,
                                         temperature=TEMPERATURE)
        return jnp.sum(logps * weights)

    grads = jax.grad(loss)(routers)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == LAYERS  # one router kernel per layer
    for g in leaves:
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 1e-4
    # Central difference along a random unit direction in all routers' kernels.
    rng = np.random.default_rng(4)
    direction = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), routers)
    norm = float(np.sqrt(sum(float(jnp.sum(d * d)) for d in jax.tree.leaves(direction))))
    direction = jax.tree.map(lambda d: d / norm, direction)
    eps = 1e-2
    numeric = (float(loss(jax.tree.map(lambda x, d: x + eps * d, routers, direction)))
               - float(loss(jax.tree.map(lambda x, d: x - eps * d, routers, direction)))
               ) / (2 * eps)
    analytic = float(sum(jnp.sum(g * d) for g, d in zip(leaves, jax.tree.leaves(direction),
                                                          strict=True)))
    print(f"routers' directional derivative: analytic {analytic:.6f}, central difference "
          f"{numeric:.6f} (eps {eps})")
    assert abs(analytic) > 1e-2
    # The float32 loss (~13) rounds at ~1e-6: that alone moves the quotient by a few 1e-4
    # at any eps here (measured: 3e-4 at eps 3e-2 to 5e-3); a wrong gradient is off by O(1).
    assert abs(numeric - analytic) <= 2e-3 * abs(analytic)
