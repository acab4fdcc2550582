"""Independent numpy float64 forward of a checkpoint's MTP layer as a NEXTN draft.

DeepSeek-V3 and GLM-4.5 ship a multi-token-prediction (MTP) layer after their L decoder layers
(L = num_hidden_layers), under ``model.layers.{L}.``: ``enorm``, ``hnorm`` and
``shared_head.norm`` (RMSNorm weights [H]), ``eh_proj`` [H, 2H], copies of the embedding
(``embed_tokens``) and LM head (``shared_head.head``), and a full decoder layer of the family
(MLA for DeepSeek-V3, GQA for GLM-4.5; always a MoE layer with the family's router). NEXTN
speculative decoding drafts with it exactly as EAGLE drafts with its head
(:mod:`sgl_jax.tools.reference_eagle`, whose ``features`` / ``chain`` / ``accept_length``
this module reuses), with the MTP layer's own fusion and norms:

    draft position p (p = 0, 1, ...):
        e_p = target.embed[x_{p+1}]
        f_p = the target's last decoder layer output at position p (before its final norm)
        z_p = concat([enorm(e_p), hnorm(f_p)]) @ eh_proj^T          enorm'd embedding first
        g_p = decoder_layer(z_p)              causal over draft positions 0..p, RoPE at p
        logits_p = shared_head.norm(g_p) @ target.lm_head^T           predicts x_{p+2}

Chain drafting: d1 = argmax logits_p; position p + 1 takes e = embed[d1] and f = g_p (the
layer's own output), giving d2; and so on. The decoder layer is ``ReferenceModel``'s own
(``load_layer`` / ``layer_forward``), so it shares no code with ``sgl_jax.srt``; its routing is
computed but not returned (a draft's routing is never a routed-experts row).

Usage::

    target = ReferenceModel(path)           # a checkpoint with num_nextn_predict_layers >= 1
    draft = NextnReference(target)
    hidden = target.forward(tokens).hidden
    drafts = draft.chain(tokens, hidden, num_steps=3)
    emitted, steps = accept_length(draft, prompt, continuation, num_steps=3)
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

import numpy as np

from sgl_jax.tools.reference_checkpoint import load_safetensors_f64
from sgl_jax.tools.reference_eagle import EagleFeatures, EagleReference, accept_length
from sgl_jax.tools.reference_forward import ReferenceModel
from sgl_jax.tools.reference_layers import rms_norm
from sgl_jax.tools.reference_routing import RouterResult

__all__ = ["NEXTN_FAMILIES", "NextnFeatures", "NextnReference", "accept_length", "mtp_tensors"]

# Families whose checkpoints carry MTP layers (ReferenceModel.family).
NEXTN_FAMILIES = ("deepseek_v3", "glm4_moe")

# One draft forward over positions 0..n-1: g [n, H] (the MTP decoder layer's output, before
# shared_head.norm) and logits [n, vocab] (row p: the draft's distribution of x_{p+2}).
NextnFeatures = EagleFeatures


def mtp_tensors(path: str, layer: int) -> dict[str, np.ndarray]:
    """Every tensor under ``model.layers.{layer}.`` of the checkpoint at ``path``, float64."""
    prefix = f"model.layers.{layer}."
    out: dict[str, np.ndarray] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update({n: t for n, t in load_safetensors_f64(file).items() if n.startswith(prefix)})
    return out


class NextnReference(EagleReference):
    """Float64 forward of ``target``'s first MTP layer (index L) as a draft.

    Only ``forward`` differs from :class:`EagleReference`: ``features(tokens, hidden)``,
    ``chain(tokens, hidden, num_steps)`` and ``accept_length(draft, ...)`` are the same
    functions (greedy, ties to the lower id; a chain recomputes the draft from position 0
    each step, no cache)."""

    def __init__(self, target: ReferenceModel) -> None:
        # No super().__init__: there is no separate draft checkpoint to read.
        cfg = target.config
        if target.family not in NEXTN_FAMILIES:
            raise NotImplementedError(f"{target.family} checkpoints have no MTP layers")
        if int(cfg.get("num_nextn_predict_layers") or 0) < 1:
            raise ValueError(f"{target.path}: num_nextn_predict_layers is 0 (no MTP layer)")
        self.target = target
        self.config = cfg
        self.hidden_size = target.hidden_size
        self.eps = target.eps
        self.layer_index = target.num_layers  # MTP layer 0 follows the decoder layers
        p = f"model.layers.{self.layer_index}."
        w = mtp_tensors(target.path, self.layer_index)
        h, v = target.hidden_size, target.vocab_size
        want = {
            "enorm.weight": (h,),
            "hnorm.weight": (h,),
            "eh_proj.weight": (h, 2 * h),
            "shared_head.norm.weight": (h,),
            "shared_head.head.weight": (v, h),
            "embed_tokens.weight": (v, h),
        }
        for name, shape in want.items():
            if p + name not in w:
                raise KeyError(f"{target.path}: MTP tensor {p + name} missing")
            if tuple(w[p + name].shape) != shape:
                raise ValueError(f"{p + name}: shape {w[p + name].shape}, expected {shape}")
        self.enorm = w[p + "enorm.weight"]
        self.hnorm = w[p + "hnorm.weight"]
        self.eh_proj = w[p + "eh_proj.weight"]  # [H, 2H]
        self.head_norm = w[p + "shared_head.norm.weight"]
        # The shared head and embedding are the target's (the draft reads those); the MTP
        # layer's copies stay available to check that they are copies.
        self.head_copy = w[p + "shared_head.head.weight"]
        self.embed_copy = w[p + "embed_tokens.weight"]
        self.layer = target.load_layer(w, self.layer_index, moe=True)

    def _run(
        self, next_tokens: Sequence[int], features: np.ndarray
    ) -> tuple[NextnFeatures, RouterResult]:
        """(NextnFeatures, the MTP layer's RouterResult) at positions 0..n-1."""
        ids = np.asarray(list(next_tokens), dtype=np.int64)
        features = np.asarray(features, dtype=np.float64)
        if features.shape != (len(ids), self.hidden_size):
            raise ValueError(f"features {features.shape} for {len(ids)} tokens")
        e = rms_norm(self.target.embed[ids], self.enorm, self.eps)
        f = rms_norm(features, self.hnorm, self.eps)
        z = np.concatenate([e, f], axis=-1) @ self.eh_proj.T
        g, _, routing = self.target.layer_forward(self.layer, z)
        assert routing is not None  # the MTP layer is a MoE layer
        logits = rms_norm(g, self.head_norm, self.eps) @ self.target.lm_head.T
        return NextnFeatures(g, logits), routing

    def forward(self, next_tokens: Sequence[int], features: np.ndarray) -> NextnFeatures:
        """The draft at positions 0..n-1 from ``next_tokens`` [n] (x_{p+1} of each position
        p) and ``features`` [n, H] (f_p: the target's hidden states, or the layer's own g).
        The MTP layer's routing is computed but not returned (see ``routing``)."""
        return self._run(next_tokens, features)[0]

    def routing(self, tokens: Sequence[int], hidden: np.ndarray) -> RouterResult:
        """The MTP layer's routing of the teacher-forced draft over ``tokens`` (as
        ``features``): make_random_model's router search reads its ``selection_gap``; it is
        never a routed-experts row."""
        return self._run(list(tokens)[1:], self._real_features(tokens, hidden))[1]
