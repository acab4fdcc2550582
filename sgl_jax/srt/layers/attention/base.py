"""The attention-backend interface, the per-step metadata and the paged KV-cache layout.

KV cache layout (shared by every backend, so the backend is a compute choice only): one array
per layer ``[num_pages, page_size, 2 * num_kv_heads, head_dim]`` with K and V interleaved on
the head axis (combined head ``2h`` is K of head ``h``, ``2h + 1`` its V). This is the layout
JAX's ragged paged attention kernel reads; it also keeps a head's K and V on the same device
when the head axis is split over the "tensor" mesh axis. A token's KV slot is
``page * page_size + offset``; page 0 is reserved for padding.

Multi-head latent attention (DeepSeek-V3) caches one latent row per token instead:
``[num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]`` (the normalised latent, then the
roped shared key part), written by ``write_latent`` and read by ``NativeAttention.attend_latent``
(the only backend that has it): every query head attends over the whole row as its key, and
the row's first ``v_dim`` dims are the value.

Per step, ``AttentionMetadata`` is built once (traced, inside the jitted step) from the batch
and the device-resident page table, and read by every layer.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import jax
import jax.numpy as jnp

from sgl_jax.srt.forward_batch_info import ForwardBatch

# Finite "minus infinity": a fully masked row then gives weights of exactly 0, never NaN.
MASKED = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    positions: jax.Array  # [T] absolute position of each token (0 for padding)
    token_to_req: jax.Array  # [T] batch row of each token (batch_size for padding)
    prefix_lens: jax.Array  # [B]
    extend_lens: jax.Array  # [B]
    extend_starts: jax.Array  # [B] index of each row's first token
    page_indices: jax.Array  # [B, max_pages] the pages of each row, in position order
    page_size: int = dataclasses.field(metadata={"static": True})
    is_decode: bool = dataclasses.field(metadata={"static": True})
    # A verify step (speculative decoding): every row brings at most T / B tokens (its last
    # token and its drafts), so one query block per row holds them all.
    is_verify: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def seq_lens(self) -> jax.Array:
        return self.prefix_lens + self.extend_lens

    @staticmethod
    def build(
        batch: ForwardBatch, token_to_req: jax.Array, positions: jax.Array,
        req_to_page: jax.Array, page_size: int,
    ) -> AttentionMetadata:
        """Traced once per step (``token_to_req`` and ``positions`` are the batch's, computed
        once). ``req_to_page`` must already hold this batch's pages."""
        return AttentionMetadata(
            positions=positions,
            token_to_req=token_to_req,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            extend_starts=batch.extend_starts,
            page_indices=req_to_page[batch.req_pool_indices],
            page_size=page_size,
            is_decode=batch.forward_mode.is_decode,
            is_verify=batch.forward_mode.is_verify,
        )


def kv_cache_shape(
    num_slots: int, page_size: int, cache_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """One layer's cache: ``cache_heads`` is ``ModelConfig.kv_cache_heads`` (2 x KV heads for
    GQA, K and V interleaved; 1 latent row for MLA)."""
    if num_slots % page_size:
        raise ValueError(f"{num_slots} KV slots are not whole pages of {page_size}")
    return (num_slots // page_size, page_size, cache_heads, head_dim)


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter new K/V rows ``[T, KVH, D]`` to their slots (padding tokens write slot 0).

    Indexed by (page, offset), not through a flattened view: a reshape of the donated cache
    makes XLA copy the whole cache on every step instead of updating it in place.
    """
    _, page_size, combined, head_dim = kv_cache.shape
    rows = jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, head_dim)
    return kv_cache.at[slots // page_size, slots % page_size].set(rows.astype(kv_cache.dtype))


def write_latent(kv_cache: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter new latent rows ``[T, D]`` (MLA) to their slots of a ``[P, ps, 1, D]`` cache
    (padding tokens write slot 0). Indexed by (page, offset), like ``write_kv``: the donated
    cache is updated in place."""
    page_size = kv_cache.shape[1]
    return kv_cache.at[slots // page_size, slots % page_size].set(
        rows[:, None, :].astype(kv_cache.dtype)
    )


def update_page_table(
    req_to_page: jax.Array, req_slots: jax.Array, positions: jax.Array,
    out_cache_loc: jax.Array, page_size: int,
) -> jax.Array:
    """Records the page of every new token in its request's row (traced, inside the step).

    All tokens of one page write the same value, so duplicate indices are harmless; padded
    tokens write page 0 at column 0 of the spare padding row.
    """
    return req_to_page.at[req_slots, positions // page_size].set(out_cache_loc // page_size)


class AttentionBackend(ABC):
    """Attention over the paged KV cache for one layer; K/V of the batch are already written."""

    name: str

    @abstractmethod
    def attend(
        self, q: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata, scale: float,
        sinks: jax.Array | None = None, window: int = 0,
    ) -> jax.Array:
        """q ``[T, H, D]`` -> ``[T, H, D]``: each token attends to positions ``<=`` its own of
        its request, read from ``kv_cache`` through ``meta.page_indices``.

        ``window`` > 0 (sliding-window layers, gpt-oss): only the last ``window`` positions,
        its own included (position p sees ``(p - window, p]``). ``sinks`` ``[H]`` (gpt-oss's
        attention sinks): one more logit per head joins each query's softmax and is dropped
        after it (it scales the output down by ``Z / (Z + exp(sink))``)."""
