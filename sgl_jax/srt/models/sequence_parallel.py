"""Sequence parallelism of the residual stream over the "tensor" mesh axis.

With tensor parallelism alone every device of the "tensor" axis holds the whole ``[T, H]``
residual stream: the attention output projection and the MoE block end in an all-reduce of
their partial sums, and every device then runs the same RMSNorms, residual adds and router
on all ``T`` tokens. At a prefill those elementwise passes over ``[T, H]`` are a large part
of the step's memory traffic (compile-only v6e, Qwen3-30B-A3B tp 4, 8,192 tokens: about a
fifth of the bytes). Split by token over "tensor" between the blocks, each device runs them
on ``T / tp`` tokens; the all-reduce becomes a reduce-scatter (the partial sums are
constrained to the split layout, which XLA's partitioner lowers as a reduce-scatter) and the
projections' inputs are all-gathered where the next block needs every token. The bytes
moved over the links are the same (an all-reduce is a reduce-scatter and an all-gather).

Decode steps keep the replicated layout: with a few tokens a step is bound by collective
latency, and two collectives per block cost more than one (``sequence_parallel_tokens``:
the smallest step split, in tokens per device before the split). With DP attention the
tokens are split over "expert" (the ranks) already and each rank's are replicated over its
"tensor" devices; split, each device holds ``1 / tp`` of its rank's tokens (over "expert" x
"tensor"), gathered within the rank for attention (which runs per rank), and the MoE
block's sums reduce-scattered over "expert" and then over "tensor"
(``ep_moe.ep_moe_forward``). Not with the all-to-all dispatch, which moves each rank's
replicated tokens.

The split changes where each token's arithmetic runs and the collective that adds the
partial sums: a reduce-scatter may add them in another order than an all-reduce, and
the MoE block's are added in the activation dtype (as XLA:TPU adds the replicated layout's;
on CPU the all-reduce adds float32). With a bfloat16 model the hidden states may differ in
the last bits of bfloat16, as between two tensor-parallel sizes.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.layers.moe.ep_moe import EXPERT_AXIS, TENSOR_AXIS
from sgl_jax.srt.models.backends import ModelBackends


def splits(backends: ModelBackends, tokens: int) -> bool:
    """Whether a step of ``tokens`` tokens runs with its residual stream split by token over
    the "tensor" axis of the mesh in context (every device an equal share; with DP
    attention, of its rank's ``tokens / ranks``, which the threshold is compared with)."""
    mesh = jax.sharding.get_abstract_mesh()
    # Not in deterministic mode: which device adds a token's partial sums, in which order,
    # depends on the token's place in the batch. Not with the all-to-all dispatch (module
    # docstring).
    if (mesh.empty or TENSOR_AXIS not in mesh.axis_names or backends.batch_invariant
            or backends.moe_all_to_all is not None):
        return False
    tp = mesh.shape[TENSOR_AXIS]
    ranks = mesh.shape[EXPERT_AXIS] if backends.dp_attention else 1
    return (tp > 1 and tokens % (tp * ranks) == 0
            and 0 < backends.sequence_parallel_tokens <= tokens // ranks)


def gather_tokens(x: jax.Array, dp_attention: bool = False) -> jax.Array:
    """x ``[T, ...]`` laid out whole on every device (with DP attention: every device of a
    rank holding the rank's tokens): a block's input all-gathered before its projections
    (left to itself, XLA's partitioner may all-gather the weights instead and multiply the
    token-split input by them whole)."""
    return jax.lax.with_sharding_constraint(x, P(EXPERT_AXIS) if dp_attention else P())


def split_tokens(x: jax.Array, dp_attention: bool = False) -> jax.Array:
    """x ``[T, ...]`` laid out split by token over "tensor" (with DP attention: over
    "expert" x "tensor", each rank's tokens split over its devices); a partial sum
    arriving here is reduce-scattered."""
    return jax.lax.with_sharding_constraint(
        x, P((EXPERT_AXIS, TENSOR_AXIS)) if dp_attention else P(TENSOR_AXIS))
