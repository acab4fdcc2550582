"""JAX's Pallas TPU kernel for ragged paged attention (what a TPU runs).

The kernel takes the batch as it is: queries back to back (``cu_q_lens``), each sequence's
total length (``kv_lens`` = prefix + new tokens, whose K/V were written to the cache first)
and its pages (``page_indices``), and reads the cache in the combined K/V layout of
``base.py``. It needs ``head_dim`` to be a multiple of 128.

Under tensor parallelism the heads are split over the "tensor" mesh axis; the kernel is a
custom call that XLA cannot partition, so it runs inside ``shard_map`` on each device's heads.
On CPU it runs in Pallas' TPU interpret mode (slow; for tests only).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.layers.attention.base import AttentionBackend, AttentionMetadata

TENSOR_AXIS = "tensor"
HEAD_DIM_MULTIPLE = 128
NO_SINKS = ("--attention-backend pallas has no attention sinks (JAX's ragged paged attention "
            "kernel has no sink logit and returns no softmax denominator to add one to); use "
            "--attention-backend native")


def check_pallas_shapes(head_dim: int) -> None:
    if head_dim % HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"--attention-backend pallas needs head_dim to be a multiple of "
            f"{HEAD_DIM_MULTIPLE} (JAX's ragged paged attention kernel); this model has "
            f"head_dim={head_dim}. Use --attention-backend native."
        )


class PallasAttention(AttentionBackend):
    name = "pallas"

    def __init__(self, interpret: bool = False, vmem_limit: int | None = None) -> None:
        """``vmem_limit``: the scoped VMEM (bytes) the kernel may use on a TPU (None: XLA's
        default, 16 MiB on v5e and v5p). The scores of one block grow with the query heads
        of the KV-head group it holds and with its KV positions; at the default XLA:TPU
        refused to compile the 235B's prefill at tp 1 and 2 on v5p (64 and 32 heads a
        block) and the 30B's decode over a 32k context in pages of 64 on v5e (8 heads, 8,192
        positions a block). The chip's limit (``vmem_rows.chip_vmem_limit``) is asked for
        always: a rule by heads missed the last case (docs/performance.md)."""
        self.interpret = interpret
        self.vmem_limit = vmem_limit
        if interpret:
            from sgl_jax.srt.layers.attention.pallas_interpret import enable_tpu_interpret_mode

            enable_tpu_interpret_mode()

    def attend(
        self, q: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata, scale: float,
        sinks: jax.Array | None = None, window: int = 0,
    ) -> jax.Array:
        """``window``: the kernel's own ``sliding_window`` (the same rule: a query sees its
        last ``window`` keys). ``sinks``: not in JAX's kernel (it returns no softmax
        denominator to rescale by): refused; the model names its family first
        (``models/common.GqaAttention``)."""
        if sinks is not None:
            raise ValueError(NO_SINKS)
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention,
        )

        kv_lens = meta.seq_lens.astype(jnp.int32)
        cu_q_lens = jnp.concatenate(
            [jnp.zeros(1, jnp.int32), jnp.cumsum(meta.extend_lens).astype(jnp.int32)]
        )
        # Padded rows (no new tokens) come last: they are not sequences for the kernel.
        num_seqs = jnp.sum(meta.extend_lens > 0).astype(jnp.int32).reshape(1)
        page_indices = meta.page_indices.astype(jnp.int32)
        kernel = partial(ragged_paged_attention, sm_scale=scale, sliding_window=window or None,
                         **self._block_sizes(meta))

        mesh = jax.sharding.get_abstract_mesh()
        # Inside DP attention's per-rank shard_map the axes are already manual: the kernel
        # then sees the rank's heads as they are.
        if (not mesh.empty and mesh.shape.get(TENSOR_AXIS, 1) > 1
                and TENSOR_AXIS not in mesh.manual_axes):
            kernel = jax.shard_map(
                kernel,
                mesh=mesh,
                in_specs=(P(None, TENSOR_AXIS, None), P(None, None, TENSOR_AXIS, None),
                          P(), P(), P(), P()),
                out_specs=P(None, TENSOR_AXIS, None),
                check_vma=False,
            )
        return kernel(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)

    def _block_sizes(self, meta: AttentionMetadata) -> dict[str, int]:
        """On a TPU the kernel picks tuned block sizes for its chip (and gets the chip's
        scoped VMEM limit); the interpreter has no chip, so it gets fixed ones (128 positions
        of KV per block, 16 queries)."""
        if not self.interpret:
            return {} if self.vmem_limit is None else {"vmem_limit_bytes": self.vmem_limit}
        pages_per_seq = meta.page_indices.shape[1]
        return {
            "num_kv_pages_per_block": max(1, min(pages_per_seq, 128 // meta.page_size)),
            "num_queries_per_block": 16,
        }
