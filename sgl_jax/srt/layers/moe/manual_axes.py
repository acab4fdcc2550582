"""Varying mesh axes of arrays inside ``shard_map`` (``check_vma``), for the Pallas calls of
the gmm backend.

A ``pallas_call`` builds its output type without the manual mesh axes its operands vary over,
which ``shard_map``'s default ``check_vma=True`` refuses. The gmm backend traces its kernels
with the check off and then marks each output varying over every axis an operand varies over
(what the type would have said: the output depends on them), as a ``while_loop`` carry must
be marked to keep one type across iterations.
"""

from __future__ import annotations

import jax


def varying_axes(*arrays: jax.Array) -> frozenset[str]:
    """The manual mesh axes (inside ``shard_map``) any of ``arrays`` varies over."""
    axes: frozenset[str] = frozenset()
    for a in arrays:
        manual = jax.typeof(a).manual_axis_type
        if manual is not None:
            axes |= manual.varying
    return axes


def mark_varying(out: jax.Array, *operands: jax.Array) -> jax.Array:
    """``out`` marked varying over every manual mesh axis any of ``operands`` varies over."""
    missing = varying_axes(*operands) - varying_axes(out)
    return jax.lax.pcast(out, tuple(sorted(missing)), to="varying") if missing else out
