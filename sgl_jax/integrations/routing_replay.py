"""Routing-replay rows in the layouts JAX trainers take. numpy only: no tunix, MaxText or JAX.

The engine returns, per sample, ``[P + C - 1, num_hidden_layers, k]`` expert ids (docs/
routed_experts.md): one row per token it fed to the model, i.e. the P prompt tokens and the C
generated tokens but the last (it was sampled, never fed). Row ``i`` is token ``i``'s routing.
Layers without a router hold ``-1``.

A trainer sees a batch as prompts left-padded to ``prompt_width`` and completions right-padded
to ``completion_width``, concatenated: token ``i`` of a sample with a P-token prompt sits in
column ``prompt_width - P + i`` whether it is a prompt or a completion token.

- :func:`align_routed_experts` lays the rows out that way: int32 ``[B, prompt_width +
  completion_width, L, k]``, the layout tunix's routing replay carries (``tunix.rl.common.
  align_routed_experts``, after google/tunix#2046), with ``-1`` (``UNSET_ROUTED_EXPERT``, "no
  replay here, use the router") in every slot no row reaches: padding, the last generated
  token, prompt tokens cut off by a narrow window, completion tokens past ``completion_width``.
- :func:`to_maxtext_forced_routed_experts` keeps the MoE layers only: MaxText's
  ``forced_routed_experts`` is ``[B, T, num_moe_layers, k]`` (its decoder indexes it by MoE
  layer, not by layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# tunix's name and value for "no replay in this slot" (tunix.rl.common.UNSET_ROUTED_EXPERT).
UNSET_ROUTED_EXPERT = -1


def align_routed_experts(
    routed_experts: Sequence[np.ndarray],
    completion_lengths: Sequence[int],
    prompt_width: int,
    completion_width: int,
) -> np.ndarray:
    """Per-sample engine rows -> int32 ``[B, prompt_width + completion_width, L, k]``.

    ``routed_experts[b]`` is sample b's ``[P + C - 1, L, k]`` rows (any integer dtype; an
    unsigned dtype's maximum is the engine's no-router marker and becomes -1) and
    ``completion_lengths[b]`` its C, the number of generated tokens (the last one included).
    Prompt rows are right-aligned against the completion (a prompt wider than the window keeps
    its tail, as left padding truncates), completion rows left-aligned (a completion longer
    than the window keeps its head); every other slot, the last generated token's included,
    holds ``UNSET_ROUTED_EXPERT`` (-1). ValueError on inconsistent shapes or lengths."""
    if prompt_width < 0 or completion_width < 0:
        raise ValueError(f"widths must be >= 0, got prompt_width={prompt_width}, "
                         f"completion_width={completion_width}")
    rows_list = [_signed_rows(r) for r in routed_experts]
    lengths = [int(c) for c in completion_lengths]
    if len(rows_list) != len(lengths):
        raise ValueError(f"{len(rows_list)} routed-experts arrays but {len(lengths)} "
                         "completion lengths")
    if not rows_list:
        raise ValueError("no samples: the layer and top-k sizes are unknown")
    if rows_list[0].ndim != 3:
        raise ValueError(f"each sample's routed experts must be [tokens, layers, top_k], got "
                         f"{rows_list[0].shape}")
    layers_topk = rows_list[0].shape[1:]
    width = prompt_width + completion_width
    out = np.full((len(rows_list), width, *layers_topk), UNSET_ROUTED_EXPERT, np.int32)
    for b, (rows, completion) in enumerate(zip(rows_list, lengths, strict=True)):
        if rows.ndim != 3 or rows.shape[1:] != layers_topk:
            raise ValueError(f"sample {b}: rows {rows.shape} are not [n, {layers_topk[0]}, "
                             f"{layers_topk[1]}] like sample 0's")
        prompt = rows.shape[0] + 1 - completion  # rows = P + C - 1
        if completion < 0 or prompt < 1:
            raise ValueError(f"sample {b}: {rows.shape[0]} rows cannot be P + C - 1 with "
                             f"C = {completion} generated tokens and a non-empty prompt")
        # Token i sits in column prompt_width - P + i, prompt or completion alike; columns
        # left of 0 are the cut-off head of a long prompt, columns right of the window the
        # cut-off tail of a long completion.
        cols = prompt_width - prompt + np.arange(rows.shape[0])
        keep = (cols >= 0) & (cols < width)
        out[b, cols[keep]] = rows[keep]
    return out


def to_maxtext_forced_routed_experts(
    routed_experts: np.ndarray, moe_layers: Sequence[int] | Sequence[bool] | None = None
) -> np.ndarray:
    """``[B, T, num_hidden_layers, k]`` (e.g. from :func:`align_routed_experts`) -> int32
    ``[B, T, num_moe_layers, k]``, MaxText's ``forced_routed_experts``: the layers without a
    router dropped, ``-1`` kept (see docs/rl_rollouts.md for what MaxText does with it).

    ``moe_layers``: the MoE layers, as layer indices (``/get_model_info``'s ``moe_layers``,
    ``ModelConfig.moe_layer_ids``) or one bool per layer (``ModelConfig.moe_layers``). None:
    the layers holding an expert id anywhere in the batch (a layer without a router holds -1
    in every row; ValueError if no layer holds one). ValueError if a layer given as dense
    holds expert ids: its rows would be dropped."""
    routed = _signed_rows(routed_experts)
    if routed.ndim != 4:
        raise ValueError(f"routed_experts must be [batch, tokens, layers, top_k], got "
                         f"{routed.shape}")
    num_layers = routed.shape[2]
    has_ids = (routed >= 0).any(axis=(0, 1, 3))  # [L]
    if moe_layers is None:
        if not has_ids.any():
            raise ValueError("no expert id in routed_experts, so the MoE layers cannot be told "
                             "apart: pass moe_layers")
        keep = np.flatnonzero(has_ids)
    else:
        keep = _layer_ids(moe_layers, num_layers)
        dense_with_ids = np.flatnonzero(has_ids & ~np.isin(np.arange(num_layers), keep))
        if dense_with_ids.size:
            raise ValueError(f"layers {dense_with_ids.tolist()} hold expert ids but moe_layers "
                             "calls them dense")
    return np.ascontiguousarray(routed[:, :, keep, :])


def _layer_ids(moe_layers: Sequence[int] | Sequence[bool], num_layers: int) -> np.ndarray:
    items = list(moe_layers)
    if items and all(isinstance(x, bool | np.bool_) for x in items):
        if len(items) != num_layers:
            raise ValueError(f"moe_layers has {len(items)} flags for {num_layers} layers")
        return np.flatnonzero(np.asarray(items, bool))
    ids = np.asarray(items, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_layers or np.unique(ids).size != ids.size):
        raise ValueError(f"moe_layers {items} must be distinct layer indices in "
                         f"[0, {num_layers})")
    return np.sort(ids)


def _signed_rows(rows: np.ndarray) -> np.ndarray:
    """int32 ids with -1 for "no router": an unsigned dtype's maximum is that marker on the
    engine's narrow wire dtypes (``routed_experts_dtype``)."""
    rows = np.asarray(rows)
    if rows.dtype.kind not in "iu":
        raise ValueError(f"routed experts must be integers, got {rows.dtype}")
    if rows.dtype.kind == "u":
        return np.where(rows == np.iinfo(rows.dtype).max, UNSET_ROUTED_EXPERT,
                        rows.astype(np.int64)).astype(np.int32)
    return rows.astype(np.int32, copy=False)
