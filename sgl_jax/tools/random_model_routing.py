"""Routing margins of a checkpoint on sample prompts (used by make_random_model's search).

The *selection gap* of a token in a MoE layer is the smallest margin that decides its top-k ids
and their order (the M11 spec's definition): the smallest of (a) the consecutive differences
among the top k+1 selection scores restricted to the kept groups (softmax routers: the
logits, softmax being monotone; sigmoid routers: the bias-corrected scores
``c = sigmoid(logit) + e_score_correction_bias``) and (b) when n_group > 1, the difference
between the topk_group-th and (topk_group+1)-th largest group scores (a group's score is the
sum of its 2 largest c). With k equal to the number of candidates (a) covers the top k
(their order); inf on dense layers and where no pair of scores decides anything.

The float64 reference reports it per token and layer as ``selection_gap``; with a reference
that predates that field, :func:`selection_gaps` computes it here from the router logits.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from sgl_jax.tools.random_model_families import family_of
from sgl_jax.tools.train_tokenizer import CORPUS_PATH, IM_END, IM_START


@dataclass
class Measurement:
    """Routing margins of one checkpoint on the sample prompts (P prompts, L layers).

    Gap arrays are per (prompt, layer) minima over the prompt's tokens; inf on dense layers.
    """

    prompt_lengths: list[int]
    topk_gap: np.ndarray  # [P, L] the reference's topk_gap (k-th minus (k+1)-th)
    order_gap: np.ndarray  # [P, L] min consecutive difference among the top k+1 router logits
    logits_std: float
    # [P, L] the selection gap (module docstring): what the router search uses
    selection_gap: np.ndarray | None = None


def sample_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of the prompts the routing margin is measured on (several hundred tokens).

    The first is the first 200 tokens of corpus.txt; then a ChatML conversation; then slices
    of the corpus's code and non-ASCII passages.
    """
    text = CORPUS_PATH.read_text(encoding="utf-8")
    ids = tokenizer.encode(text).ids
    chat = (
        f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
        f"{IM_START}user\nWhat does the lighthouse keeper record each morning?{IM_END}\n"
        f"{IM_START}assistant\n"
    )
    prompts = [ids[:200], tokenizer.encode(chat).ids]
    for marker in ("def summarise", "In Kyoto"):
        start = text.find(marker)
        piece = text[start:] if start >= 0 else text
        prompts.append(tokenizer.encode(piece).ids[:128])
    return prompts


def order_gaps(router_logits: np.ndarray, k: int) -> np.ndarray:
    """[..., E] router logits -> [...] min difference of consecutive logits among the top k+1.

    Where it is clearly above float32 rounding noise, both the top-k set and its order are
    unambiguous. NaN rows (dense layers) give inf.
    """
    m = min(k + 1, router_logits.shape[-1])
    if m < 2:
        return np.full(router_logits.shape[:-1], np.inf)
    top = -np.sort(-router_logits, axis=-1)[..., :m]
    gaps = np.min(top[..., :-1] - top[..., 1:], axis=-1)
    return np.where(np.isnan(gaps), np.inf, gaps)


def _consecutive_gaps(scores: np.ndarray, k: int, candidates: int) -> np.ndarray:
    """[T, E] scores (-inf outside the candidates) -> [T] min consecutive difference among the
    top min(k+1, candidates) (with k == candidates only the order is decided)."""
    m = min(k + 1, candidates)
    if m < 2:
        return np.full(scores.shape[0], np.inf)
    top = -np.sort(-scores, axis=-1)[:, :m]
    return np.min(top[:, :-1] - top[:, 1:], axis=-1)


def selection_gaps(
    router_logits: np.ndarray,
    rule: str,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    bias: dict[int, np.ndarray] | None = None,
) -> np.ndarray:
    """[T, L, E] float64 router logits (NaN rows: dense layers) -> [T, L] selection gaps.

    rule is the router rule (softmax_topk, topk_softmax, sigmoid_grouped); bias maps a layer
    to its e_score_correction_bias [E] (sigmoid_grouped; absent layers: zero bias).
    """
    t, n_layers, e = router_logits.shape
    out = np.full((t, n_layers), np.inf)
    for layer in range(n_layers):
        logits = router_logits[:, layer]
        if t == 0 or np.isnan(logits).all():
            continue
        if rule in ("softmax_topk", "topk_softmax"):
            out[:, layer] = _consecutive_gaps(logits, k, e)
            continue
        if rule != "sigmoid_grouped":
            raise ValueError(f"unknown router rule {rule!r}")
        c = 1.0 / (1.0 + np.exp(-logits)) + (bias or {}).get(layer, 0.0)
        gap = np.full(t, np.inf)
        candidates = e
        if n_group > 1:
            size = e // n_group
            grouped = c.reshape(t, n_group, size)
            group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [T, G]
            ordered = -np.sort(-group_scores, axis=-1)
            if topk_group < n_group:
                gap = ordered[:, topk_group - 1] - ordered[:, topk_group]
            # Kept groups: the topk_group best, ties to the lower group (stable sort).
            keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
            mask = np.zeros((t, n_group), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            c = np.where(np.repeat(mask, size, axis=-1), c, -np.inf)
            candidates = topk_group * size
        out[:, layer] = np.minimum(gap, _consecutive_gaps(c, k, candidates))
    return out


def _read_tensors(path: Path, names: set[str]) -> dict[str, np.ndarray]:
    """Only the named tensors of a safetensors file, as float64 (F32, F16 or BF16)."""
    dtypes = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for name in names & set(header):
            info = header[name]
            start, end = info["data_offsets"]
            f.seek(8 + n + start)
            arr = np.frombuffer(f.read(end - start), dtype=dtypes[info["dtype"]])
            if info["dtype"] == "BF16":
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            out[name] = arr.astype(np.float64).reshape(info["shape"])
    return out


def _fallback_selection_gaps(
    config: dict[str, Any], router_logits: np.ndarray, biases: dict[int, np.ndarray]
) -> np.ndarray:
    fam = family_of(config)
    return selection_gaps(
        router_logits,
        fam.router_rule,
        config["num_experts_per_tok"],
        int(config.get("n_group", 1) or 1),
        int(config.get("topk_group", 1) or 1),
        biases,
    )


def measure(path: str, prompts: list[list[int]]) -> Measurement:
    """Run the float64 reference on each prompt and collect the routing margins."""
    from sgl_jax.tools.reference_forward import ReferenceModel

    ckpt = Path(path)
    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    k = config["num_experts_per_tok"]
    ref = ReferenceModel(path)
    biases: dict[int, np.ndarray] | None = None
    topk, order, selection, stds = [], [], [], []
    for ids in prompts:
        out = ref.forward(ids)
        sel = getattr(out, "selection_gap", None)
        if sel is None:  # a reference without the field: compute it from the router logits
            if biases is None:
                names = {
                    f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                    for i in range(config["num_hidden_layers"])
                }
                found = {}
                for f in sorted(ckpt.glob("*.safetensors")):
                    found.update(_read_tensors(f, names))
                biases = {int(n.split(".")[2]): b for n, b in found.items()}
            sel = _fallback_selection_gaps(config, out.router_logits, biases)
        topk.append(np.min(out.topk_gap, axis=0))
        order.append(np.min(order_gaps(out.router_logits, k), axis=0))
        selection.append(np.min(sel, axis=0))
        stds.append(float(np.std(out.logits)))
    return Measurement(
        prompt_lengths=[len(p) for p in prompts],
        topk_gap=np.stack(topk),
        order_gap=np.stack(order),
        logits_std=float(np.mean(stds)),
        selection_gap=np.stack(selection),
    )
