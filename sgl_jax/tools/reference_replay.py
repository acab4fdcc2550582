"""Float64 forced-routing forward: the yardstick of routing replay in a trainer.

:class:`ForcedRoutingReference` is :class:`~sgl_jax.tools.reference_forward.ReferenceModel` (the
independent float64 numpy forward of a Hugging Face checkpoint) whose MoE layers use given
expert ids instead of their router's top-k, written from the definition of routing replay
(R3, arXiv:2510.11370; MaxText's ``forced_routed_experts``):

- ids: ``forced[t, layer]``; a row holding a negative id (-1: nothing to replay) keeps the
  router's own top-k;
- weights: the router's own rule evaluated at those ids, i.e. for the softmax routers
  (Qwen-MoE, Mixtral) ``p = softmax(router logits)``, ``w = p[ids]``, divided by their sum
  when the model renormalises (``norm_topk_prob``; Mixtral's softmax over the selected logits
  is the same quotient);
- everything else (attention, norms, expert MLPs, shared experts) exactly as the reference.

Like the reference, it shares no code with ``sgl_jax.srt`` or ``sgl_jax.integrations``.

Usage::

    ref = ForcedRoutingReference("path/to/checkpoint")
    out = ref.forward_forced(token_ids, forced)   # forced [T, num_hidden_layers, k] int
    out.logits, out.topk_ids                       # ids used per token and layer
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sgl_jax.tools.reference_forward import ReferenceModel, ReferenceOutput
from sgl_jax.tools.reference_routing import RouterResult

__all__ = ["ForcedRoutingReference", "log_softmax"]


class ForcedRoutingReference(ReferenceModel):
    """The float64 reference forward with per-token, per-layer expert ids given."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        if self.router_rule not in ("softmax_topk", "topk_softmax"):
            raise NotImplementedError(
                f"forced routing is written for the softmax routers, not {self.router_rule}")
        self._forced: np.ndarray | None = None
        self._layer: int | None = None
        self._layer_of: dict[int, int] = {}

    def forward_forced(self, input_ids: Sequence[int], forced: np.ndarray) -> ReferenceOutput:
        """One sequence's outputs (positions 0..T-1) with ``forced`` [T, num_hidden_layers, k]
        ids (dense layers' entries are ignored). ``topk_ids`` / ``topk_weights`` of the output
        are the ids and weights used; ``topk_gap`` / ``selection_gap`` those of the router's
        own choice (how safely a -1 row's fallback is decided)."""
        forced = np.asarray(forced)
        want = (len(input_ids), self.num_layers, self.top_k)
        if forced.shape != want:
            raise ValueError(f"forced {forced.shape} must be [tokens, layers, k] = {want}")
        self._layer_of = {id(layer.moe): i for i, layer in enumerate(self.layers)
                          if layer.moe is not None}
        self._forced = forced.astype(np.int64)
        try:
            return self.forward(input_ids)
        finally:
            self._forced, self._layer = None, None

    def _moe(self, moe: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, RouterResult]:
        # The parent runs one MoE layer; which one decides the forced rows ``route`` uses.
        self._layer = self._layer_of.get(id(moe))
        return super()._moe(moe, x)

    def route(self, router_logits: np.ndarray, correction_bias: np.ndarray | None) -> RouterResult:
        own = super().route(router_logits, correction_bias)
        if self._forced is None or self._layer is None:
            return own
        rows = self._forced[:, self._layer]  # [T, k]
        unset = np.any(rows < 0, axis=-1, keepdims=True)
        if np.any(rows >= self.num_experts):
            raise ValueError(f"forced ids must be below num_experts={self.num_experts}")
        ids = np.where(unset, own.ids, rows)
        for t, row in enumerate(ids):
            if len(set(row.tolist())) != len(row):
                raise ValueError(f"token {t}, layer {self._layer}: repeated expert ids {row}")
        z = np.exp(router_logits - router_logits.max(axis=-1, keepdims=True))
        probs = z / z.sum(axis=-1, keepdims=True)
        weights = np.take_along_axis(probs, ids, axis=-1)
        if self.norm_topk_prob or self.router_rule == "topk_softmax":
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return RouterResult(ids.astype(np.int32), weights, own.topk_gap, own.selection_gap)


def log_softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float64 ``log_softmax(logits / temperature)`` over the last axis."""
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
