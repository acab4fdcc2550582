"""Independent numpy float64 forward of an EAGLE draft head (the yardstick for the engine).

Like :mod:`sgl_jax.tools.reference_forward` it shares no code with ``sgl_jax.srt``. The draft
(``SglJaxEagleDraft``, written by ``train_eagle``) is one Qwen3 decoder layer with a dense
SwiGLU MLP in front of which ``fc`` fuses a token embedding with a feature; it borrows the
target's ``embed_tokens`` and ``lm_head`` (not stored in the draft):

    draft position p (p = 0, 1, ...):
        e_p = target.embed[x_{p+1}]
        f_p = the target's last decoder layer output at position p (before its final norm)
        z_p = fc(concat([e_p, f_p]))                        fc.weight [H, 2H]
        g_p = decoder_layer(z_p)                            causal over draft positions 0..p
        logits_p = rms_norm(g_p, norm.weight) @ target.lm_head^T      predicts x_{p+2}

Chain drafting: with real features up to position p, d1 = argmax logits_p; position p + 1
takes e = embed[d1] and f = g_p (the draft's own feature), giving d2; and so on.

Usage::

    target = ReferenceModel(target_path)
    draft = EagleReference(draft_path, target)
    hidden = target.forward(tokens).hidden
    drafts = draft.chain(tokens, hidden, num_steps=3)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load_file

from sgl_jax.tools.reference_forward import ReferenceModel
from sgl_jax.tools.reference_layers import apply_rope, causal_attention, rms_norm, swiglu

__all__ = ["ARCHITECTURE", "EagleFeatures", "EagleReference", "accept_length", "tensor_shapes"]

ARCHITECTURE = "SglJaxEagleDraft"


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the draft checkpoint and its shape (linear weights [out, in])."""
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    return {
        "fc.weight": (h, 2 * h),
        "layers.0.input_layernorm.weight": (h,),
        a + "q_proj.weight": (nq * d, h),
        a + "k_proj.weight": (nkv * d, h),
        a + "v_proj.weight": (nkv * d, h),
        a + "o_proj.weight": (h, nq * d),
        a + "q_norm.weight": (d,),
        a + "k_norm.weight": (d,),
        "layers.0.post_attention_layernorm.weight": (h,),
        m + "gate_proj.weight": (i, h),
        m + "up_proj.weight": (i, h),
        m + "down_proj.weight": (h, i),
        "norm.weight": (h,),
    }


@dataclass
class EagleFeatures:
    """One draft forward over positions 0..n-1."""

    g: np.ndarray  # [n, H] float64, the decoder layer's output (before the draft's norm)
    logits: np.ndarray  # [n, vocab] float64; row p is the draft's distribution of x_{p+2}


class EagleReference:
    """Float64 forward of the draft checkpoint at ``path`` on top of ``target``."""

    def __init__(self, path: str, target: ReferenceModel) -> None:
        with open(os.path.join(path, "config.json")) as f:
            self.config: dict = json.load(f)
        cfg = self.config
        if (cfg.get("architectures") or [None])[0] != ARCHITECTURE:
            raise ValueError(f"{path}: not an {ARCHITECTURE} checkpoint")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError("the draft's MLP is SwiGLU (hidden_act silu)")
        for key in ("hidden_size", "vocab_size"):
            if int(cfg[key]) != int(target.config[key]):
                raise ValueError(f"draft {key} {cfg[key]} != target's {target.config[key]}")
        self.target = target
        self.hidden_size = int(cfg["hidden_size"])
        self.num_heads = int(cfg["num_attention_heads"])
        self.num_kv_heads = int(cfg["num_key_value_heads"])
        self.head_dim = int(cfg["head_dim"])
        self.eps = float(cfg["rms_norm_eps"])
        self.rope_theta = float(cfg["rope_theta"])
        tensors = load_file(os.path.join(path, "model.safetensors"))
        want = tensor_shapes(cfg)
        if set(tensors) != set(want):
            raise KeyError(f"draft tensors differ: missing {sorted(set(want) - set(tensors))}, "
                           f"unexpected {sorted(set(tensors) - set(want))}")
        for name, shape in want.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{name}: shape {tensors[name].shape}, expected {shape}")
        self.w = {name: np.asarray(t, dtype=np.float64) for name, t in tensors.items()}

    # -- forward ---------------------------------------------------------------------------

    def _layer(self, z: np.ndarray) -> np.ndarray:
        """The Qwen3 decoder layer over draft positions 0..n-1 (z [n, H]) -> g [n, H]."""
        w, a = self.w, "layers.0.self_attn."
        n, d = z.shape[0], self.head_dim
        positions = np.arange(n)
        x = rms_norm(z, w["layers.0.input_layernorm.weight"], self.eps)
        q = (x @ w[a + "q_proj.weight"].T).reshape(n, self.num_heads, d)
        k = (x @ w[a + "k_proj.weight"].T).reshape(n, self.num_kv_heads, d)
        v = (x @ w[a + "v_proj.weight"].T).reshape(n, self.num_kv_heads, d)
        q = apply_rope(rms_norm(q, w[a + "q_norm.weight"], self.eps), positions, self.rope_theta)
        k = apply_rope(rms_norm(k, w[a + "k_norm.weight"], self.eps), positions, self.rope_theta)
        attn = causal_attention(q, k, v, positions, d**-0.5).reshape(n, -1)
        h = z + attn @ w[a + "o_proj.weight"].T
        x = rms_norm(h, w["layers.0.post_attention_layernorm.weight"], self.eps)
        m = "layers.0.mlp."
        return h + swiglu(x, w[m + "gate_proj.weight"], w[m + "up_proj.weight"],
                          w[m + "down_proj.weight"])

    def forward(self, next_tokens: Sequence[int], features: np.ndarray) -> EagleFeatures:
        """The draft at positions 0..n-1 from ``next_tokens`` [n] (x_{p+1} of each position
        p) and ``features`` [n, H] (f_p: the target's hidden states, or the draft's own g)."""
        ids = np.asarray(list(next_tokens), dtype=np.int64)
        features = np.asarray(features, dtype=np.float64)
        if features.shape != (len(ids), self.hidden_size):
            raise ValueError(f"features {features.shape} for {len(ids)} tokens")
        e = self.target.embed[ids]
        z = np.concatenate([e, features], axis=-1) @ self.w["fc.weight"].T
        g = self._layer(z)
        logits = rms_norm(g, self.w["norm.weight"], self.eps) @ self.target.lm_head.T
        return EagleFeatures(g, logits)

    @staticmethod
    def _real_features(tokens: Sequence[int], hidden: np.ndarray) -> np.ndarray:
        """Rows 0..T-2 of the target's hidden states of ``tokens`` (T tokens): ``hidden`` may
        hold T - 1 rows (the target ran on all but the newest token, as after a verify) or T
        (the target ran on all of them; the last row is not used)."""
        n = len(tokens) - 1
        if n < 1:
            raise ValueError("need at least two tokens")
        if hidden.shape[0] not in (n, n + 1):
            raise ValueError(f"hidden has {hidden.shape[0]} rows for {len(tokens)} tokens")
        return np.asarray(hidden[:n], dtype=np.float64)

    def features(self, tokens: Sequence[int], hidden: np.ndarray) -> EagleFeatures:
        """Teacher-forced draft over a sequence: positions p = 0..T-2 with e_p = embed[x_{p+1}]
        and the target's f_p. ``hidden``: [T-1 or T, H] (see ``_real_features``). Row p of the
        logits is the draft's distribution of tokens[p + 2] (the last row: of the token after
        the sequence)."""
        return self.forward(list(tokens)[1:], self._real_features(tokens, hidden))

    def chain(self, tokens: Sequence[int], hidden: np.ndarray, num_steps: int) -> list[int]:
        """Greedy chain of ``num_steps`` drafts following ``tokens`` (argmax, ties to the lower
        id): the first from the real features, each next one from the previous draft token and
        the draft's own feature g. Recomputes the whole draft each step (no cache: plain)."""
        next_tokens = list(tokens)[1:]
        feats = list(self._real_features(tokens, hidden))
        drafts: list[int] = []
        for _ in range(num_steps):
            out = self.forward(next_tokens, np.stack(feats))
            token = int(np.argmax(out.logits[-1]))
            drafts.append(token)
            next_tokens.append(token)
            feats.append(out.g[-1])
        return drafts


def accept_length(draft: EagleReference, prompt: Sequence[int], continuation: Sequence[int],
                  num_steps: int) -> tuple[int, int]:
    """Simulated greedy speculation over a known target continuation: (emitted tokens,
    verify steps). The first continuation token comes from the prefill; then each verify step
    checks a ``num_steps`` chain drafted after the accepted tokens (with the true target
    hidden states) and emits its accepted prefix plus one target token. The mean accepted
    length is emitted / steps (1 = no draft ever accepted)."""
    seq = list(prompt) + list(continuation)
    hidden = draft.target.forward(seq).hidden  # causal: a prefix's rows equal these
    m = len(prompt)  # seq[:m + 1] is known (the prefill produced seq[m])
    emitted = steps = 0
    while m + 1 < len(seq):
        drafts = draft.chain(seq[: m + 1], hidden[:m], num_steps)
        truth = seq[m + 1: m + 1 + num_steps]
        accepted = 0
        while accepted < len(truth) and drafts[accepted] == truth[accepted]:
            accepted += 1
        # The verify step emits the accepted drafts and the target's token after them (past
        # the end of the known continuation there is nothing left to emit).
        gained = min(accepted + 1, len(seq) - 1 - m)
        emitted += gained
        steps += 1
        m += gained
    return emitted, steps
