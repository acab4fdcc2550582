"""Qwen3.5-MoE's Gated DeltaNet (linear attention) mixer over the engine's per-request states.

The layer's math is ``layers/linear_attention/gated_delta.py`` (pure functions of the params,
the tokens and the two states); this module holds the weights under their Hugging Face names
and moves the states between the step and the layer's state tables:

* ``conv`` (q ``[S + 1, Hk dk, K - 1]``, k likewise, v ``[S + 1, Hv dv, K - 1]``; model dtype)
  and ``recurrent`` ``[S + 1, Hv, dk, dv]`` (float32), one row per request slot
  (``batch.req_pool_indices``, the slot a request holds for exactly as long as its
  ``req.state_slot``), row ``S`` the padding rows' scratch row;
  they ride in the step's donated ``kv_caches`` list in place of a KV array (the runner builds
  them: ``model_executor/linear_state.py``).
* An extend row whose ``prefix_lens`` is 0 starts a request: its states are zeros whatever its
  slot's row holds (a slot's previous owner). Prefix reuse is off for these models, so a row
  with a prefix is exactly a later chunk of the same request (chunked prefill), which
  continues from the states the previous chunk wrote.
* A speculative verify step (NGRAM, NEXTN) runs the one-token recurrence over each row's
  positions and leaves the tables to the step, which writes the states after the accepted
  tokens once it has sampled (``layers/linear_attention/verify.py``).

Weights are kept in the checkpoint's orientation (``[out, in]``; ``conv1d`` as ``[C, 1, K]``):
the pure functions take them so, and loads and updates copy them as is.

Under ``--tp-size`` the layer splits by head over "tensor", as attention does: a device holds
Hk / tp key heads and the Hv / tp value heads that read them (value head h reads key head
h // (Hv / Hk), so contiguous blocks line up), their rows of every input projection and of the
conv, their slices of the states, and their columns of ``out_proj`` (whose partial sums GSPMD
all-reduces, as after ``o_proj``). ``in_proj_qkv`` and ``conv1d`` (rows ``[q | k | v]``) are
read as their three parts (``model_loader/qwen35_names.py``) so that each part splits whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.attention import AttentionMetadata
from sgl_jax.srt.layers.linear_attention import gated_delta
from sgl_jax.srt.layers.linear_attention.packed import prefill_packed
from sgl_jax.srt.layers.linear_attention.verify import PendingStates, verify_forward
from sgl_jax.srt.models.common import param

# Tokens per chunk of the chunked delta rule in a prefill (a multiple of 8; the within-chunk
# solve is C x C per head).
PREFILL_CHUNK = 64

# (conv parts (q, k, v) [S + 1, C_part, K - 1], recurrent [S + 1, Hv, dk, dv])
LinearState = tuple[gated_delta.Parts, jax.Array]


def _hf(name: str, shape: tuple[int, ...], dtype: jnp.dtype, heads_axis: int | None = 0
        ) -> nnx.Param:
    """A parameter read as is (not transposed) from ``linear_attn.<name>``, split by head over
    "tensor" on ``heads_axis`` (None: replicated)."""
    sharding = tuple("tensor" if i == heads_axis else None for i in range(len(shape)))
    return param(shape, dtype, sharding, (name, False))


def linear_dims(config: ModelConfig) -> gated_delta.GatedDeltaDims:
    """The config's Gated DeltaNet dimensions."""
    return gated_delta.GatedDeltaDims(
        config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
        config.linear_value_head_dim, config.rms_norm_eps)


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        hidden, kernel = config.hidden_size, config.linear_conv_kernel_dim
        hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
        self.dims = linear_dims(config)
        for part, width in zip("qkv", gated_delta.part_widths(self.dims), strict=True):
            setattr(self, f"in_proj_{part}", _hf(f"in_proj_{part}.weight", (width, hidden), dtype))
            setattr(self, f"conv1d_{part}", _hf(f"conv1d_{part}.weight", (width, 1, kernel), dtype))
        self.in_proj_z = _hf("in_proj_z.weight", (hv * dv, hidden), dtype)
        self.in_proj_b = _hf("in_proj_b.weight", (hv, hidden), dtype)
        self.in_proj_a = _hf("in_proj_a.weight", (hv, hidden), dtype)
        self.dt_bias = _hf("dt_bias", (hv,), dtype)
        self.A_log = _hf("A_log", (hv,), dtype)
        self.norm = _hf("norm.weight", (dv,), dtype, None)  # the gated output norm: w itself
        self.out_proj = _hf("out_proj.weight", (hidden, hv * dv), dtype, 1)

    def params(self) -> gated_delta.GatedDeltaParams:
        return gated_delta.GatedDeltaParams(
            in_proj_qkv=tuple(getattr(self, f"in_proj_{part}")[...] for part in "qkv"),
            in_proj_z=self.in_proj_z[...], in_proj_b=self.in_proj_b[...],
            in_proj_a=self.in_proj_a[...],
            conv1d=tuple(getattr(self, f"conv1d_{part}")[...][:, 0, :] for part in "qkv"),
            dt_bias=self.dt_bias[...], A_log=self.A_log[...], norm=self.norm[...],
            out_proj=self.out_proj[...])

    def __call__(self, x: jax.Array, slots: jax.Array, meta: AttentionMetadata,
                 state: LinearState, verify_width: int = 0,
                 ) -> tuple[jax.Array, LinearState | PendingStates]:
        """x ``[T, hidden]`` (normed) -> (``[T, hidden]``, the updated state tables).
        ``slots`` ``[B]``: each batch row's state row (padding rows: the scratch row).
        ``verify_width`` (a speculative verify step: its most tokens per row): the states are
        returned pending, written by the step once it knows the accepted drafts
        (``layers/linear_attention/verify.py``)."""
        if verify_width:
            return verify_forward(self.params(), self.dims, x, meta.extend_starts,
                                  meta.extend_lens, slots, state, verify_width)
        conv_tables, rec_table = state
        conv, rec = tuple(t[slots] for t in conv_tables), rec_table[slots]
        p = self.params()
        if meta.is_decode:  # one token per row, tokens in row order
            if x.shape[0] != slots.shape[0]:
                raise ValueError(f"a decode step has one token per row: {x.shape[0]} tokens, "
                                 f"{slots.shape[0]} rows")
            y, conv, rec = gated_delta.decode(p, self.dims, x, conv, rec)
        else:
            fresh = meta.prefix_lens == 0  # a request's first chunk: start from zeros
            conv = tuple(jnp.where(fresh[:, None, None], jnp.zeros_like(c), c) for c in conv)
            rec = jnp.where(fresh[:, None, None, None], jnp.zeros_like(rec), rec)
            # Each row's tokens packed into whole chunks: at most T / C + B chunks a step
            # (gated_delta.prefill_ragged would pad every row to the bucket's T tokens).
            y, conv, rec = prefill_packed(p, self.dims, x, meta.extend_starts,
                                          meta.extend_lens, conv, rec, chunk=PREFILL_CHUNK)
        conv_tables = tuple(t.at[slots].set(c.astype(t.dtype))
                            for t, c in zip(conv_tables, conv, strict=True))
        rec_table = rec_table.at[slots].set(rec.astype(rec_table.dtype))
        return y, (conv_tables, rec_table)
