"""Float64 router rules of the reference forward (see sgl_jax.tools.reference_forward).

Part of the independent yardstick: shares no code with ``sgl_jax.srt``. Every router takes
float64 router logits [T, E] and returns a :class:`RouterResult`:

- ``ids`` [T, k] int32: LOGICAL expert ids in DESCENDING order of the rule's selection score,
  ties to the LOWER id (stable sorts on the negated score);
- ``weights`` [T, k] float64: the weights the experts' outputs are multiplied by;
- ``topk_gap`` [T]: k-th minus (k+1)-th selection score (for the softmax routers: router
  logits) among the candidate experts; inf when k equals the number of candidates;
- ``selection_gap`` [T]: the smallest score difference that decides the ids AND their order:
  min of (a) consecutive differences among the top min(k+1, candidates) selection scores
  (logits for the softmax routers; softmax is monotone) restricted to the kept groups, and
  (b) for grouped routers with dropped groups, the topk_group-th minus (topk_group+1)-th
  largest group score. inf only when no pair of scores decides anything (a single candidate
  and no group step).

Rules (ids/weights):

- ``softmax_topk`` (Qwen2-MoE, Qwen3-MoE): p = softmax(logits); ids = top-k of p; weights =
  p[ids], divided by their sum when norm_topk_prob.
- ``topk_softmax`` (Mixtral): ids = top-k of logits; weights = softmax over the k selected
  logits.
- ``sigmoid_grouped`` (DeepSeek-V3, GLM-4.5 MoE, "noaux_tc"): s = sigmoid(logits); c = s +
  e_score_correction_bias; experts form n_group contiguous groups; group score = sum of the
  2 largest c of the group; the topk_group best groups are kept (ties to the lower group),
  the other experts get score -inf; ids = top-k of c; weights = s[ids] (no bias), divided by
  (sum + 1e-20) when norm_topk_prob, then times routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "RouterResult",
    "sigmoid_grouped",
    "softmax_topk",
    "topk_softmax",
]


@dataclass
class RouterResult:
    ids: np.ndarray  # [T, k] int32
    weights: np.ndarray  # [T, k] float64
    topk_gap: np.ndarray  # [T] float64
    selection_gap: np.ndarray  # [T] float64


def _order_desc(scores: np.ndarray) -> np.ndarray:
    """Indices sorting each row by descending score, equal scores in ascending index."""
    return np.argsort(-scores, axis=-1, kind="stable")


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return z / np.sum(z, axis=-1, keepdims=True)


def _gaps(scores: np.ndarray, k: int, num_candidates: int) -> tuple[np.ndarray, np.ndarray]:
    """(topk_gap, consecutive-difference part of selection_gap) of [T, E] selection scores.

    Non-candidates must hold -inf (they sort last); num_candidates counts the others.
    """
    desc = -np.sort(-scores, axis=-1)[:, : min(k + 1, num_candidates)]
    if k < num_candidates:
        topk_gap = desc[:, k - 1] - desc[:, k]
    else:
        topk_gap = np.full(scores.shape[0], np.inf)
    if desc.shape[1] >= 2:
        consecutive = np.min(desc[:, :-1] - desc[:, 1:], axis=-1)
    else:
        consecutive = np.full(scores.shape[0], np.inf)
    return topk_gap, consecutive


def _check_k(k: int, num_experts: int) -> None:
    if not 1 <= k <= num_experts:
        raise ValueError(f"num_experts_per_tok={k} must be in [1, {num_experts}]")


def softmax_topk(logits: np.ndarray, k: int, norm_topk_prob: bool) -> RouterResult:
    """Qwen-MoE rule: top-k of softmax(logits), optionally renormalised."""
    _check_k(k, logits.shape[-1])
    probs = _softmax(logits)
    ids = _order_desc(probs)[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    topk_gap, selection_gap = _gaps(logits, k, logits.shape[-1])
    return RouterResult(ids.astype(np.int32), weights, topk_gap, selection_gap)


def topk_softmax(logits: np.ndarray, k: int) -> RouterResult:
    """Mixtral rule: top-k of the logits, softmax over the k selected logits."""
    _check_k(k, logits.shape[-1])
    ids = _order_desc(logits)[:, :k]
    weights = _softmax(np.take_along_axis(logits, ids, axis=-1))
    topk_gap, selection_gap = _gaps(logits, k, logits.shape[-1])
    return RouterResult(ids.astype(np.int32), weights, topk_gap, selection_gap)


def sigmoid_grouped(
    logits: np.ndarray,
    correction_bias: np.ndarray | None,
    k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> RouterResult:
    """DeepSeek-V3 "noaux_tc" rule (also GLM-4.5 MoE); see the module docstring."""
    num_tokens, num_experts = logits.shape
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_routed_experts={num_experts} is not a multiple of n_group={n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    group_size = num_experts // n_group
    num_candidates = topk_group * group_size if n_group > 1 else num_experts
    _check_k(k, num_candidates)

    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores if correction_bias is None else scores + correction_bias
    group_gap = np.full(num_tokens, np.inf)
    if n_group > 1:
        grouped = choice.reshape(num_tokens, n_group, group_size)
        top2 = -np.sort(-grouped, axis=-1)[..., : min(2, group_size)]
        group_scores = np.sum(top2, axis=-1)  # [T, n_group]
        kept_groups = _order_desc(group_scores)[:, :topk_group]
        keep = np.zeros((num_tokens, n_group), dtype=bool)
        np.put_along_axis(keep, kept_groups, True, axis=-1)
        choice = np.where(np.repeat(keep, group_size, axis=-1), choice, -np.inf)
        if topk_group < n_group:
            desc = -np.sort(-group_scores, axis=-1)
            group_gap = desc[:, topk_group - 1] - desc[:, topk_group]

    ids = _order_desc(choice)[:, :k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (np.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * routed_scaling_factor
    topk_gap, consecutive = _gaps(choice, k, num_candidates)
    return RouterResult(ids.astype(np.int32), weights, topk_gap, np.minimum(consecutive, group_gap))
