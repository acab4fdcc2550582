"""A request's routed experts on their way out: the payload of its output record (built by the
scheduler, passed through by the detokenizer), and the one place that turns it into
``meta_info`` keys. The Engine and ``/generate`` return those keys in ``meta_info``; the OpenAI
routes return them in ``choices[i].meta_info`` (and alone in a stream's earlier chunks).

JAX-free, like the codec it uses (the detokenizer process never imports JAX).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from sgl_jax.srt.routed_experts_codec import (
    dtype_name,
    encode_routed_expert_weights,
    encode_routed_experts,
)

# Every meta_info key of this payload holds it (routed_experts*, routed_expert_weights*, and
# their prompt_ forms).
_KEY_MARK = "routed_expert"


class RoutedExpertsOut(NamedTuple):
    """Rows ``[start, start + n)`` of one request: ``ids`` ``[n, layers, k]`` in the request's
    wire dtype (``routed_experts_dtype``) and, when it asked for them, the same rows' routing
    weights in their wire float dtype. The arrays' dtypes and shapes describe them; they
    travel out of band between processes and are base64-encoded once, in ``meta_info``.

    A named tuple, like the record that holds it: a batch packs a column of these and
    unpacks it with ``zip``, without a call per payload."""

    ids: np.ndarray
    start: int  # the position of the first row (meta_info "routed_experts_start")
    weights: np.ndarray | None = None

    @staticmethod
    def pack_column(items: Sequence[RoutedExpertsOut | None]) -> PackedColumn | None:
        """A batch's column of these, or of their values (None for a request that carries
        none), as plain columns, which pickle without a hook per object (their arrays still
        out of band): the positions that carry one (None: all do) and their ids, starts and
        weights. None when no request carries any."""
        payloads = list(filter(None, items))
        if not payloads:
            return None
        positions = None if len(payloads) == len(items) else \
            [i for i, item in enumerate(items) if item is not None]
        return (positions, *zip(*payloads, strict=True))

    @classmethod
    def unpack_column(cls, packed: PackedColumn | None, n: int) -> list[RoutedExpertsOut | None]:
        """The column of ``n`` requests that ``pack_column`` packed."""
        if packed is None:
            return [None] * n
        positions, ids, starts, weights = packed
        payloads = list(map(_new_routed, zip(ids, starts, weights, strict=True)))
        if positions is None:
            return payloads
        column: list[RoutedExpertsOut | None] = [None] * n
        for i, payload in zip(positions, payloads, strict=True):
            column[i] = payload
        return column

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def ids_nbytes(self) -> int:
        return self.ids.nbytes

    @property
    def weights_nbytes(self) -> int:
        return 0 if self.weights is None else self.weights.nbytes

    def rows(self, begin: int, end: int | None = None) -> RoutedExpertsOut:
        """Rows ``[begin, end)`` of these (indices into ``ids``)."""
        weights = None if self.weights is None else self.weights[begin:end]
        return RoutedExpertsOut(self.ids[begin:end], self.start + begin, weights)

    def meta_info(self, split_at: int | None = None, raw: bool = False) -> dict[str, Any]:
        """The ``meta_info`` keys: ``routed_experts`` (base64, or with ``raw`` the array
        itself), ``routed_experts_start``, ``routed_experts_dtype`` and
        ``routed_experts_shape`` ``[rows, layers, k]``; the routing weights likewise
        (``routed_expert_weights``, ``_dtype``, ``_shape``) when present. With
        ``routed_experts_split`` (``split_at``: the prompt length) the rows of positions before
        ``split_at`` take the same keys prefixed ``prompt_``."""
        if split_at is None:
            return self._keys("", raw)
        cut = min(max(split_at - self.start, 0), self.num_rows)
        meta = self.rows(0, cut)._keys("prompt_", raw) if cut else {}
        meta.update(self.rows(cut)._keys("", raw))
        return meta

    def _keys(self, prefix: str, raw: bool) -> dict[str, Any]:
        shape = list(self.ids.shape)
        name = dtype_name(self.ids.dtype)
        meta: dict[str, Any] = {
            f"{prefix}routed_experts": self.ids if raw else encode_routed_experts(self.ids, name),
            f"{prefix}routed_experts_start": self.start,
            f"{prefix}routed_experts_dtype": name,
            f"{prefix}routed_experts_shape": shape,
        }
        if self.weights is not None:
            weights_name = dtype_name(self.weights.dtype)
            meta.update({
                f"{prefix}routed_expert_weights": self.weights if raw
                    else encode_routed_expert_weights(self.weights, weights_name),
                f"{prefix}routed_expert_weights_dtype": weights_name,
                f"{prefix}routed_expert_weights_shape": shape,
            })
        return meta


# One from a tuple of its values, without the Python-level call of ``RoutedExpertsOut(...)``.
_new_routed = functools.partial(tuple.__new__, RoutedExpertsOut)
# A packed column: (positions or None, ids, starts, weights), see ``pack_column``.
PackedColumn = tuple[list[int] | None, Sequence[np.ndarray], Sequence[int],
                     Sequence[np.ndarray | None]]


def routed_experts_keys(meta: dict[str, Any]) -> dict[str, Any]:
    """The routed-experts keys of a ``meta_info`` (what a stream's earlier chunks carry)."""
    return {k: v for k, v in meta.items() if _KEY_MARK in k}
