"""Routing margins of a checkpoint on sample prompts (used by make_random_model's search).

The *selection gap* of a token in a MoE layer is the smallest margin that decides its top-k ids
and their order (the M11 spec's definition): the smallest of (a) the consecutive differences
among the top k+1 selection scores restricted to the kept groups (softmax routers: the
logits, softmax being monotone; sigmoid routers: the bias-corrected scores
``c = sigmoid(logit) + e_score_correction_bias``) and (b) when n_group > 1, the difference
between the topk_group-th and (topk_group+1)-th largest group scores (a group's score is the
sum of its 2 largest c). With k equal to the number of candidates (a) covers the top k
(their order); inf on dense layers and where no pair of scores decides anything.

The float64 reference reports it per token and layer as ``selection_gap``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

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


def measure(path: str, prompts: list[list[int]]) -> Measurement:
    """Run the float64 reference on each prompt and collect the routing margins."""
    from sgl_jax.tools.reference_forward import ReferenceModel
    from sgl_jax.tools.reference_qwen35 import ARCHITECTURES as QWEN35
    from sgl_jax.tools.reference_qwen35 import Qwen35Reference

    ckpt = Path(path)
    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    k = config["num_experts_per_tok"]
    qwen35 = (config.get("architectures") or [""])[0] in QWEN35
    ref = Qwen35Reference(path) if qwen35 else ReferenceModel(path)
    topk, order, selection, stds = [], [], [], []
    for ids in prompts:
        out = ref.forward(ids)
        sel = out.selection_gap
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
