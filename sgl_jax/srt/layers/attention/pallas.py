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

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.layers.attention.base import AttentionBackend, AttentionMetadata

TENSOR_AXIS = "tensor"
HEAD_DIM_MULTIPLE = 128
# The most query heads a block of the kernel may hold for XLA:TPU's default scoped VMEM
# (16 MiB on v5p) to fit it. The kernel's blocks take the query heads of a whole group of KV
# heads; their scores grow with them. 16 compile on every chip measured (the 235B at tp 4
# on v5p); 32 (its tp 2) and 64 (tp 1) do not on v5p, so such blocks ask for the chip's
# limit (``vmem_rows.chip_vmem_limit``). Not every block asks: a larger scoped limit moves
# XLA's own use of VMEM around the kernel (the 30B's prefill at tp 4 on v6e counted 2.8 GB
# more with 100 MiB asked for; docs/performance.md).
DEFAULT_VMEM_HEADS = 16


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
        """``vmem_limit``: the scoped VMEM (bytes) the kernel asks for on a TPU when its
        blocks hold more than ``DEFAULT_VMEM_HEADS`` query heads (None: XLA's default
        always)."""
        self.interpret = interpret
        self.vmem_limit = vmem_limit
        if interpret:
            from sgl_jax.srt.layers.attention.pallas_interpret import enable_tpu_interpret_mode

            enable_tpu_interpret_mode()

    def attend(
        self, q: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata, scale: float
    ) -> jax.Array:
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

        def kernel(q: jax.Array, kv_cache: jax.Array, *meta_arrays: jax.Array) -> jax.Array:
            # Under shard_map the shapes are the device's: its heads size the blocks.
            return ragged_paged_attention(q, kv_cache, *meta_arrays, sm_scale=scale,
                                          **self._block_sizes(meta, q, kv_cache))

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

    def _block_sizes(self, meta: AttentionMetadata, q: jax.Array,
                     kv_cache: jax.Array) -> dict[str, int]:
        """On a TPU the kernel picks tuned block sizes for its chip, and gets the chip's
        scoped VMEM limit when its blocks hold many heads; the interpreter has no chip, so it
        gets fixed ones (128 positions of KV per block, 16 queries)."""
        if not self.interpret:
            # The kernel's own rule for the heads one block holds.
            from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
                get_min_heads_per_blk,
            )

            heads, _ = get_min_heads_per_blk(q.shape[1], kv_cache.shape[2], q.dtype,
                                             kv_cache.dtype)
            if self.vmem_limit is None or heads <= DEFAULT_VMEM_HEADS:
                return {}
            return {"vmem_limit_bytes": self.vmem_limit}
        pages_per_seq = meta.page_indices.shape[1]
        return {
            "num_kv_pages_per_block": max(1, min(pages_per_seq, 128 // meta.page_size)),
            "num_queries_per_block": 16,
        }
