"""Log-probabilities inside the jitted step: only reductions of ``[B, V]`` leave the device.

The distribution is the one sampling draws from before truncation: ``log_softmax(logits / T)``
in float32, with T the row's temperature (1 for greedy rows, so greedy requests get the model's
raw distribution). Top-k / top-p / min-p do not change it. This is SGLang's default (its
logprobs are taken after the temperature, before the truncating filters).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sgl_jax.srt.sampling.sampling_params import (
    MAX_TOP_LOGPROBS,
    SAMPLING_EPS,
)


@jax.tree_util.register_dataclass
@dataclass
class LogprobOutput:
    """Per row: the logprob of ``targets`` ([R]), the top ``MAX_TOP_LOGPROBS`` (values and
    ids, most probable first, ties to the lower id) and the logprobs of the asked ids."""

    target: jax.Array  # [R] float32
    top_values: jax.Array  # [R, MAX_TOP_LOGPROBS] float32
    top_ids: jax.Array  # [R, MAX_TOP_LOGPROBS] int32
    token_ids: jax.Array  # [R, MAX_TOKEN_IDS_LOGPROB] float32 (0 where no id was asked)


def log_softmax_rows(logits: jax.Array, temperatures: jax.Array) -> jax.Array:
    """``[R, V]`` float32 log-probabilities of ``logits / T`` (T = 1 for greedy rows)."""
    temps = jnp.where(temperatures < SAMPLING_EPS, 1.0, temperatures).astype(jnp.float32)
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temps[:, None], axis=-1)


def logprob_outputs(
    logits: jax.Array, temperatures: jax.Array, targets: jax.Array, token_ids: jax.Array
) -> LogprobOutput:
    """``targets`` [R] (negative: none, logprob 0), ``token_ids`` [R, MAX_TOKEN_IDS_LOGPROB]
    (negative: unused)."""
    logprobs = log_softmax_rows(logits, temperatures)
    # -0.0 -> 0.0 so equal values order by id (lax.top_k puts +0 before -0).
    ranked = jnp.where(logprobs == 0.0, 0.0, logprobs)
    top_values, top_ids = jax.lax.top_k(ranked, min(MAX_TOP_LOGPROBS, logits.shape[-1]))

    def pick(ids: jax.Array) -> jax.Array:
        got = jnp.take_along_axis(logprobs, jnp.maximum(ids, 0), axis=1)
        return jnp.where(ids >= 0, got, 0.0)

    return LogprobOutput(
        target=pick(targets[:, None])[:, 0],
        top_values=top_values,
        top_ids=top_ids.astype(jnp.int32),
        token_ids=pick(token_ids),
    )
