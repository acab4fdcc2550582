"""SamplingMetadata: the per-row sampling parameters of a padded batch (a pytree of arrays).

Built on the host from each request's parameters and read by the sampler inside the jitted
step; it lives apart from the sampler so that the batch description (``forward_batch_info``)
does not import layer code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import jax
import numpy as np

from sgl_jax.srt.sampling.sampling_params import SAMPLING_EPS


class _HasSamplingFields(Protocol):
    temperature: float
    top_p: float
    top_k: int
    min_p: float


@jax.tree_util.register_dataclass
@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of a (padded) batch; every field has leading dim B."""

    temperatures: jax.Array  # [B] float32; < SAMPLING_EPS => greedy row
    top_ps: jax.Array  # [B] float32 in (0, 1]
    top_ks: jax.Array  # [B] int32; values <= 0 or >= V mean "no top-k truncation"
    min_ps: jax.Array  # [B] float32 in [0, 1]
    # [B, 2] uint32: the 64-bit seed as (high word, low word), the threefry key data that
    # ``jax.random.key(seed)`` gives with jax_enable_x64 (without x64 JAX keeps only the low
    # word); both words so 63-bit user seeds do not collide modulo 2**32.
    seeds: jax.Array
    steps: jax.Array  # [B] int32: output index of the token being sampled
    # Constrained decoding: [B, ceil(V / 32)] int32, bit i % 32 of word i // 32 set when id i
    # is allowed (llguidance's layout); None (another compiled variant) when no row of the
    # batch has a grammar.
    vocab_mask: jax.Array | None = None

    @staticmethod
    def from_params(
        params: Sequence[_HasSamplingFields],
        seeds: Sequence[int],
        steps: Sequence[int],
        padded_bs: int,
        vocab_size: int,
        vocab_mask: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """Host-side (numpy) construction; rows ``len(params):padded_bs`` are greedy padding.

        ``seeds`` are integers in [0, 2**64) (the host derives one for requests without a
        seed); ``steps`` are the per-request output indices of the token being sampled.
        ``vocab_mask``: the requests' packed masks (rows of padding allow every id).
        """
        n = len(params)
        if not (len(seeds) == len(steps) == n):
            raise ValueError(
                f"params, seeds and steps must have equal lengths, got {n}, {len(seeds)}, "
                f"{len(steps)}"
            )
        if n > padded_bs:
            raise ValueError(f"{n} requests do not fit a padded batch of {padded_bs}")
        temperatures = np.zeros(padded_bs, np.float32)
        top_ps = np.ones(padded_bs, np.float32)
        top_ks = np.full(padded_bs, vocab_size, np.int32)
        min_ps = np.zeros(padded_bs, np.float32)
        seed_words = np.zeros((padded_bs, 2), np.uint32)
        step_arr = np.zeros(padded_bs, np.int32)
        for i, p in enumerate(params):
            greedy = p.temperature < SAMPLING_EPS
            temperatures[i] = 0.0 if greedy else p.temperature
            top_ps[i] = p.top_p
            top_ks[i] = vocab_size if (p.top_k <= 0 or p.top_k >= vocab_size) else p.top_k
            min_ps[i] = p.min_p
            seed = int(seeds[i])
            if not (0 <= seed < 2**64):
                raise ValueError(f"seed must be in [0, 2**64), got {seed}")
            seed_words[i] = (seed >> 32, seed & 0xFFFFFFFF)
            step_arr[i] = steps[i]
        mask = None
        if vocab_mask is not None:
            if vocab_mask.shape[0] != n:
                raise ValueError(f"vocab_mask has {vocab_mask.shape[0]} rows for {n} requests")
            mask = np.full((padded_bs, vocab_mask.shape[1]), -1, np.int32)
            mask[:n] = vocab_mask
        return SamplingMetadata(
            vocab_mask=mask,
            temperatures=temperatures,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            seeds=seed_words,
            steps=step_arr,
        )
