"""Float64 numpy reference of Qwen3.5-MoE's MTP layer (``mtp.*``) as a greedy draft, written
from the released model's serving code (vLLM's ``qwen3_5_mtp`` / ``qwen3_next_mtp`` read for
the facts); shares no code with ``sgl_jax.srt``.

    f_p = norm(h_p)                      the target's hidden state after its final norm
    z_p = fc([pre_fc_norm_embedding(embed[x_{p+1}]), pre_fc_norm_hidden(f_p)])
    g_p = layer(z_p)                     one gated-attention MoE decoder layer (mtp.layers.0)
    n_p = mtp.norm(g_p);  logits_p = n_p @ lm_head^T   (predicts x_{p+2})

every norm computing rmsnorm(x) * (1 + w). A chained draft step takes ``n_p`` as its feature.
The interface is :class:`~sgl_jax.tools.reference_eagle.EagleReference`'s (``chain``, and
``accept_length`` over it), with ``g`` holding ``n_p``.
"""

from __future__ import annotations

import copy
import glob
import os
from collections.abc import Sequence

import numpy as np

from sgl_jax.tools.reference_checkpoint import load_safetensors_f64
from sgl_jax.tools.reference_eagle import EagleFeatures, EagleReference
from sgl_jax.tools.reference_qwen35 import Qwen35Reference, norm1p


class Qwen35MtpReference(EagleReference):
    def __init__(self, target: Qwen35Reference, path: str) -> None:
        # No super().__init__: the draft's tensors are the target checkpoint's mtp.*.
        self.target = target
        self.eps = target.eps
        mtp: dict[str, np.ndarray] = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            mtp.update({n[len("mtp."):]: t for n, t in load_safetensors_f64(file).items()
                        if n.startswith("mtp.")})
        if "fc.weight" not in mtp:
            raise ValueError(f"{path}: no MTP tensors (mtp.*)")
        self.w = mtp
        self.hidden_size = mtp["fc.weight"].shape[0]
        # The MTP layer is a Qwen3.5 decoder layer 0 of gated attention: the target's layer
        # code over the mtp tensors.
        self.layer = copy.copy(target)
        self.layer.t = mtp

    def forward(self, next_tokens: Sequence[int], features: np.ndarray) -> EagleFeatures:
        """Draft positions 0..n-1 from ``next_tokens`` [n] (x_{p+1}) and ``features`` [n, H]
        (the target's normed hidden states, or the draft's own ``n_p``)."""
        ids = np.asarray(list(next_tokens), dtype=np.int64)
        w, eps = self.w, self.eps
        e = norm1p(self.target.t["embed_tokens.weight"][ids], w["pre_fc_norm_embedding.weight"],
                   eps)
        f = norm1p(np.asarray(features, np.float64), w["pre_fc_norm_hidden.weight"], eps)
        z = np.concatenate([e, f], axis=-1) @ w["fc.weight"].T
        positions = np.arange(len(ids))
        h = z + self.layer._attention(0, norm1p(z, w["layers.0.input_layernorm.weight"], eps),
                                      positions)
        moe, _, _ = self.layer._moe(0, norm1p(h, w["layers.0.post_attention_layernorm.weight"],
                                              eps))
        normed = norm1p(h + moe, w["norm.weight"], eps)
        return EagleFeatures(normed, normed @ self.target.lm_head.T)

    def _real_features(self, tokens: Sequence[int], hidden: np.ndarray) -> np.ndarray:
        rows = EagleReference._real_features(tokens, hidden)
        return norm1p(rows, self.target.t["norm.weight"], self.eps)
