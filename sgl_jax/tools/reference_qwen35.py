"""Float64 numpy reference forward of Qwen3.5-MoE (``Qwen3_5MoeForCausalLM`` and the released
``Qwen3_5MoeForConditionalGeneration``'s language model), written from the definition
(transformers 5.23's modeling code read for the facts); shares no code with ``sgl_jax.srt``.

    h = embed_tokens[ids]
    per layer:  h += mixer(norm(h))    Gated DeltaNet (reference_gated_delta) or gated attention,
                                       as config.layer_types says (else full_attention_interval)
                h += moe(norm(h))      softmax top-k renormalised + sigmoid-gated shared expert
    logits = norm(h) @ lm_head^T       every norm here computes rmsnorm(x) * (1 + w)

Gated attention: q_proj gives per head [query | gate]; q and k get a (1 + w) RMSNorm per head,
then rotate-half RoPE on their first head_dim * partial_rotary_factor dims; the attention output
(heads concatenated) is multiplied by sigmoid(gate) before o_proj. Experts are fused:
``gate_up_proj`` [E, 2I, H] (gate rows, then up rows), ``down_proj`` [E, H, I]; transformers 5.23's ``save_pretrained``
writes them per expert (``experts.E.gate_proj/up_proj/down_proj.weight``), also read.

Tensor names: ``model.language_model.*`` (released) or ``model.*`` (text-only), ``lm_head.*``;
``model.visual.*`` and ``mtp.*`` are not part of this forward and are listed in ``skipped``.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from sgl_jax.tools.reference_checkpoint import load_safetensors_f64
from sgl_jax.tools.reference_forward import ReferenceOutput
from sgl_jax.tools.reference_gated_delta import GatedDeltaWeights, gated_delta_layer, sigmoid, silu
from sgl_jax.tools.reference_layers import apply_rope, causal_attention, rms_norm
from sgl_jax.tools.reference_routing import softmax_topk

ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


def text_config(cfg: dict) -> dict:
    """The language model's fields: ``text_config`` over the top level, or the config itself."""
    if "text_config" in cfg:
        top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
        return {**top, **{k: v for k, v in cfg["text_config"].items() if v is not None}}
    return cfg


def layer_types(cfg: dict) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(cfg["num_hidden_layers"])]
    return list(types)


def norm1p(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return rms_norm(x, 1.0 + w, eps)


class Qwen35Reference:
    def __init__(self, path: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        arch = raw["architectures"][0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{arch} is not Qwen3.5-MoE")
        self.cfg = cfg = text_config(raw)
        tensors: dict[str, np.ndarray] = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            tensors.update(load_safetensors_f64(file))
        prefix = "model.language_model." if any(
            n.startswith("model.language_model.") for n in tensors) else "model."
        self.skipped = sorted(n for n in tensors if n.startswith(("model.visual.", "mtp.")))
        self.t = {n[len(prefix):]: a for n, a in tensors.items() if n.startswith(prefix)}
        self.lm_head = tensors.get("lm_head.weight", self.t["embed_tokens.weight"])
        self.types = layer_types(cfg)
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        fraction = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        self.rotary_dim = int(self.head_dim * fraction)
        self.theta = cfg.get("rope_theta", rope.get("rope_theta", 10_000.0))

    def _deltanet(self, i: int) -> GatedDeltaWeights:
        p, c = f"layers.{i}.linear_attn.", self.cfg
        return GatedDeltaWeights(
            **{n: self.t[p + n + ".weight"] for n in (
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj")},
            conv1d=self.t[p + "conv1d.weight"][:, 0, :], dt_bias=self.t[p + "dt_bias"],
            A_log=self.t[p + "A_log"], num_key_heads=c["linear_num_key_heads"],
            key_dim=c["linear_key_head_dim"], value_dim=c["linear_value_head_dim"],
            eps=self.eps)

    def _attention(self, i: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        p, c, hd, t = f"layers.{i}.self_attn.", self.cfg, self.head_dim, x.shape[0]
        heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        qg = (x @ self.t[p + "q_proj.weight"].T).reshape(t, heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, heads * hd)
        k = (x @ self.t[p + "k_proj.weight"].T).reshape(t, kv_heads, hd)
        v = (x @ self.t[p + "v_proj.weight"].T).reshape(t, kv_heads, hd)
        q = norm1p(q, self.t[p + "q_norm.weight"], self.eps)
        k = norm1p(k, self.t[p + "k_norm.weight"], self.eps)
        q = apply_rope(q, positions, self.theta, rotary_dim=self.rotary_dim)
        k = apply_rope(k, positions, self.theta, rotary_dim=self.rotary_dim)
        out = causal_attention(q, k, v, positions, hd ** -0.5).reshape(t, heads * hd)
        return (out * sigmoid(gate)) @ self.t[p + "o_proj.weight"].T

    def _experts(self, p: str) -> tuple[np.ndarray, np.ndarray]:
        """(gate_up [E, 2I, H], down [E, H, I]): fused as transformers holds them, or from the
        per-expert ``experts.E.{gate,up,down}_proj.weight`` its ``save_pretrained`` writes."""
        if p + "experts.gate_up_proj" in self.t:
            return self.t[p + "experts.gate_up_proj"], self.t[p + "experts.down_proj"]
        n = self.cfg["num_experts"]
        e = [f"{p}experts.{j}." for j in range(n)]
        gate_up = np.stack([np.concatenate([self.t[x + "gate_proj.weight"],
                                            self.t[x + "up_proj.weight"]]) for x in e])
        return gate_up, np.stack([self.t[x + "down_proj.weight"] for x in e])

    def _moe(self, i: int, x: np.ndarray):
        p, k = f"layers.{i}.mlp.", self.cfg["num_experts_per_tok"]
        logits = x @ self.t[p + "gate.weight"].T
        routed = softmax_topk(logits, k, norm_topk_prob=True)
        gate_up, down = self._experts(p)
        inter = down.shape[2]
        out = np.zeros_like(x)
        for tok in range(x.shape[0]):
            for e, wgt in zip(routed.ids[tok], routed.weights[tok], strict=True):
                gu = gate_up[e] @ x[tok]
                out[tok] += wgt * (down[e] @ (silu(gu[:inter]) * gu[inter:]))
        s = p + "shared_expert."
        if s + "gate_proj.weight" in self.t:
            shared = (silu(x @ self.t[s + "gate_proj.weight"].T) * (x @ self.t[s + "up_proj.weight"].T)
                      ) @ self.t[s + "down_proj.weight"].T
            out += sigmoid(x @ self.t[p + "shared_expert_gate.weight"].T) * shared
        return out, routed, logits

    def forward(self, ids: list[int]) -> ReferenceOutput:
        """The whole sequence from a fresh request (positions 0..T-1); the fields are
        reference_forward's (every layer has a router)."""
        h = self.t["embed_tokens.weight"][np.asarray(ids)]
        positions = np.arange(len(ids))
        routers, logit_rows = [], []
        for i, kind in enumerate(self.types):
            x = norm1p(h, self.t[f"layers.{i}.input_layernorm.weight"], self.eps)
            if kind == "linear_attention":
                h = h + gated_delta_layer(x, self._deltanet(i))[0]
            else:
                h = h + self._attention(i, x, positions)
            x = norm1p(h, self.t[f"layers.{i}.post_attention_layernorm.weight"], self.eps)
            moe, routed, router_logits = self._moe(i, x)
            h = h + moe
            routers.append(routed)
            logit_rows.append(router_logits)
        logits = norm1p(h, self.t["norm.weight"], self.eps) @ self.lm_head.T

        def stack(field: str) -> np.ndarray:
            return np.stack([getattr(r, field) for r in routers], axis=1)

        return ReferenceOutput(
            logits=logits, topk_ids=stack("ids"), topk_weights=stack("weights"),
            router_logits=np.stack(logit_rows, axis=1), topk_gap=stack("topk_gap"),
            selection_gap=stack("selection_gap"), hidden=h)
