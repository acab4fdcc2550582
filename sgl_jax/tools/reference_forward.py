"""Independent numpy float64 reference forward of the supported MoE families.

This module is the yardstick the engine is tested against, so it deliberately shares no code
with ``sgl_jax.srt``: it reads a Hugging Face checkpoint directory itself (``config.json`` plus
``*.safetensors``), converts every weight to float64 and implements each architecture directly
from its definition (HF transformers' modeling files), dispatching on ``architectures[0]``:

============================  ===========  ===============  ===================================
architecture                  family       router           attention / MLP extras
============================  ===========  ===============  ===================================
Qwen3MoeForCausalLM           qwen3_moe    softmax_topk     GQA, q_norm/k_norm
Qwen2MoeForCausalLM           qwen2_moe    softmax_topk     GQA, q/k/v bias; gated shared expert
MixtralForCausalLM            mixtral      topk_softmax     GQA; every layer MoE
DeepseekV3ForCausalLM         deepseek_v3  sigmoid_grouped  MLA (YaRN, rope_interleave); shared
Glm4MoeForCausalLM            glm4_moe     sigmoid_grouped  GQA, partial rotary, opt. bias/qk norm
MiniMaxM2ForCausalLM          minimax_m2   sigmoid_grouped  GQA, per-layer q/k norm, partial rotary
GptOssForCausalLM             gpt_oss      topk_softmax     GQA, q/k/v/o bias, sinks, sliding
                                                            window, YaRN; router bias; experts
                                                            with biases, clamped SwiGLU
============================  ===========  ===============  ===================================

MiniMax-M2's router is ``sigmoid_grouped`` with one group, renormalised, unscaled, its
correction bias held by the block (``block_sparse_moe.e_score_correction_bias``); gpt-oss's
is ``topk_softmax`` over logits that add the router's bias. gpt-oss experts are read from the
fused tensors (``gate_up_proj`` [E, H, 2I], gate in even columns, up in odd) or from MXFP4
blocks and scales, dequantised here from the format's definition.

    h = embed_tokens[ids]
    per layer:  h += o_proj(attn(...))         on RMSNorm(h)
                h += mlp(RMSNorm(h))           mlp = MoE (routed [+ shared]) or dense SwiGLU
    logits = RMSNorm(h) @ lm_head^T            (embed_tokens^T when tie_word_embeddings)

Router rules and the gaps are in :mod:`sgl_jax.tools.reference_routing`. Besides logits the
forward records, per token and layer, the router logits, the chosen ids (descending selection
score, ties to the lower id) and weights, ``topk_gap`` (k-th minus (k+1)-th selection score;
router logits for the softmax routers) and ``selection_gap`` (the smallest score difference
that decides the ids and their order, including the group boundary of grouped routers): a
float32 engine can only be expected to reproduce the ids where that gap is clearly above
float32 rounding noise. ``hidden`` is the last decoder layer's output before the final norm
(the features an EAGLE draft reads, see :mod:`sgl_jax.tools.reference_eagle`). ``load_layer`` /
``layer_forward`` run one decoder layer on its own (the MTP layer of
:mod:`sgl_jax.tools.reference_nextn`).

Usage::

    ref = ReferenceModel("path/to/checkpoint")
    out = ref.forward([1, 2, 3])
    new_ids = ref.greedy_generate([1, 2, 3], max_new_tokens=16, stop_token_ids=[0])
    rows = routed_experts_rows(ref, prompt_ids, output_ids)   # what the engine must return
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from sgl_jax.tools.reference_checkpoint import load_safetensors_f64
from sgl_jax.tools.reference_layers import (
    apply_rope,
    causal_attention,
    clamped_swiglu,
    default_inv_freq,
    dequantize_mxfp4,
    rms_norm,
    swiglu,
    yarn_get_mscale,
    yarn_inv_freq,
)
from sgl_jax.tools.reference_routing import (
    RouterResult,
    sigmoid_grouped,
    softmax_topk,
    topk_softmax,
)

__all__ = [
    "FAMILIES",
    "ReferenceModel",
    "ReferenceOutput",
    "apply_rope",
    "load_safetensors_f64",
    "rms_norm",
    "routed_experts_rows",
]

# architectures[0] -> family.
FAMILIES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "GptOssForCausalLM": "gpt_oss",
}


@dataclass
class ReferenceOutput:
    """Per-position outputs of one forward; T = number of positions, L = num_hidden_layers."""

    logits: np.ndarray  # [T, vocab] float64
    topk_ids: np.ndarray  # [T, L, k] int32; -1 on dense (router-less) layers
    topk_weights: np.ndarray  # [T, L, k] float64, the weights applied; 0 on dense layers
    router_logits: np.ndarray  # [T, L, E] float64; nan on dense layers
    topk_gap: np.ndarray  # [T, L] float64; inf on dense layers and when k == candidates
    selection_gap: np.ndarray  # [T, L] float64; inf on dense layers (see reference_routing)
    hidden: np.ndarray  # [T, H] float64, the last decoder layer's output before the final norm


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass
class _Mlp:
    """SwiGLU weights, HF orientation: gate/up [I, H], down [H, I]."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass
class _Moe:
    router: np.ndarray  # [E, H]
    correction_bias: np.ndarray | None  # [E] (sigmoid_grouped)
    gate: np.ndarray  # [E, I, H]
    up: np.ndarray  # [E, I, H]
    down: np.ndarray  # [E, H, I]
    shared: _Mlp | None
    shared_gate: np.ndarray | None  # [1, H] (qwen2_moe)
    router_bias: np.ndarray | None = None  # [E] (gpt_oss)
    expert_biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # gate/up [E, I], down [E, H]


@dataclass
class _Layer:
    input_norm: np.ndarray
    post_attn_norm: np.ndarray
    attn: dict[str, np.ndarray]  # HF self_attn.* names without the prefix (e.g. "q_proj.weight")
    mlp: _Mlp | None  # dense layer
    moe: _Moe | None  # MoE layer


@dataclass
class _KVCache:
    """Per-layer K (after norms and RoPE) and V, [positions so far, kv_heads, head_dim]."""

    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.k else self.k[0].shape[0]


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")

# transformers' DeepSeek-V3 builds q_a_layernorm / kv_a_layernorm without passing
# rms_norm_eps, so they use the RMSNorm default (DeepSeek's own inference code does too).
MLA_LORA_NORM_EPS = 1e-6

_SUPPORTED_DTYPES = "float32, float16, bfloat16 or float64 safetensors"


def _rope_params(cfg: dict) -> dict:
    """rope_scaling (HF configs up to transformers 4) merged with rope_parameters (5)."""
    return {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


class ReferenceModel:
    """Float64 numpy forward of an HF MoE checkpoint directory (families: see FAMILIES)."""

    def __init__(self, path: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            self.config: dict = json.load(f)
        self.path: str = path  # the checkpoint directory (reference_nextn reads its MTP layer)
        cfg = self.config
        archs = cfg.get("architectures") or ["Qwen3MoeForCausalLM"]
        if archs[0] not in FAMILIES:
            raise NotImplementedError(
                f"reference forward does not implement {archs[0]!r}; supported: {sorted(FAMILIES)}"
            )
        self.family: str = FAMILIES[archs[0]]
        fam = self.family
        self._check_supported(cfg, fam)

        self.vocab_size: int = int(cfg["vocab_size"])
        self.hidden_size: int = int(cfg["hidden_size"])
        self.num_layers: int = int(cfg["num_hidden_layers"])
        self.num_heads: int = int(cfg["num_attention_heads"])
        self.num_kv_heads: int = int(cfg.get("num_key_value_heads") or self.num_heads)
        self.head_dim: int = int(cfg.get("head_dim") or self.hidden_size // self.num_heads)
        self.eps: float = float(cfg.get("rms_norm_eps", 1e-6))
        if fam != "deepseek_v3" and self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

        experts_key = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}
        experts_key.update(glm4_moe="n_routed_experts", minimax_m2="num_local_experts",
                           gpt_oss="num_local_experts")
        self.num_experts: int = int(cfg.get(experts_key.get(fam, "num_experts")) or 0)
        self.top_k: int = int(cfg.get("num_experts_per_tok") or 0)
        grouped = fam in ("deepseek_v3", "glm4_moe")
        self.router_rule: str = (
            "sigmoid_grouped" if grouped or fam == "minimax_m2"
            else "topk_softmax" if fam in ("mixtral", "gpt_oss") else "softmax_topk"
        )
        self.norm_topk_prob: bool = bool(cfg.get("norm_topk_prob", grouped))
        if fam == "minimax_m2":
            self.norm_topk_prob = True  # transformers' MiniMax-M2 always renormalises
        # gpt-oss: which layers attend over a sliding window, and the clamped SwiGLU.
        self.layer_types: list[str] = list(cfg.get("layer_types") or [])
        if fam == "gpt_oss" and not self.layer_types:
            self.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(int(cfg["num_hidden_layers"]))]
        self.sliding_window: int | None = cfg.get("sliding_window")
        self.swiglu_limit = float(cfg.get("swiglu_limit", 7.0))
        self.swiglu_alpha = float(cfg.get("swiglu_alpha", 1.702))
        self.n_group: int = int(cfg.get("n_group") or 1) if grouped else 1
        self.topk_group: int = int(cfg.get("topk_group") or 1) if grouped else 1
        self.routed_scaling_factor: float = (
            float(cfg.get("routed_scaling_factor") or 1.0) if grouped else 1.0
        )

        # RoPE.
        rope = _rope_params(cfg)
        default_theta = {"mixtral": 1e6, "minimax_m2": 5e6, "gpt_oss": 1.5e5}.get(fam, 1e4)
        self.rope_theta: float = float(
            cfg.get("rope_theta") or rope.get("rope_theta") or default_theta
        )
        self.rope_interleave: bool = fam == "deepseek_v3" and bool(cfg.get("rope_interleave", True))
        if fam == "deepseek_v3":
            self.q_lora_rank: int | None = cfg.get("q_lora_rank")
            self.kv_lora_rank: int = int(cfg["kv_lora_rank"])
            self.qk_nope_head_dim: int = int(cfg["qk_nope_head_dim"])
            self.qk_rope_head_dim: int = int(cfg["qk_rope_head_dim"])
            self.v_head_dim: int = int(cfg["v_head_dim"])
            self.rotary_dim: int = self.qk_rope_head_dim
            qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            self.attn_scale: float = qk_head_dim**-0.5
        else:
            factor = 1.0
            if fam == "glm4_moe":
                factor = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                factor = 0.5 if factor is None else float(factor)
            if fam == "minimax_m2":
                factor = float(rope.get("partial_rotary_factor") or 1.0)
            self.rotary_dim = int(self.head_dim * factor)
            if fam == "minimax_m2" and cfg.get("rotary_dim"):
                self.rotary_dim = int(cfg["rotary_dim"])
            self.attn_scale = self.head_dim**-0.5
        if self._rope_type(cfg) == "yarn":
            max_pos = int(cfg.get("max_position_embeddings") or 0)
            self.inv_freq, self.rope_attention_factor, yarn_factor = yarn_inv_freq(
                self.rotary_dim, self.rope_theta, rope, max_pos
            )
            # transformers' DeepSeek-V3 attention: softmax scale times mscale(factor,
            # mscale_all_dim)^2 (when mscale_all_dim is set).
            if rope.get("mscale_all_dim"):
                mscale = yarn_get_mscale(yarn_factor, float(rope["mscale_all_dim"]))
                self.attn_scale *= mscale * mscale
        else:
            self.inv_freq = default_inv_freq(self.rotary_dim, self.rope_theta)
            self.rope_attention_factor = 1.0

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        w: dict[str, np.ndarray] = {}
        for file in files:
            for name, tensor in load_safetensors_f64(file).items():
                m = _LAYER_INDEX.match(name)
                if m and int(m.group(1)) >= self.num_layers:
                    continue  # multi-token-prediction layers (DeepSeek-V3, GLM-4.5): unused
                w[name] = tensor

        self.embed: np.ndarray = w["model.embed_tokens.weight"]
        self.final_norm: np.ndarray = w["model.norm.weight"]
        if cfg.get("tie_word_embeddings", False) or "lm_head.weight" not in w:
            if not cfg.get("tie_word_embeddings", False):
                raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
            self.lm_head: np.ndarray = self.embed
        else:
            self.lm_head = w["lm_head.weight"]
        self.layers: list[_Layer] = [self._load_layer(w, i) for i in range(self.num_layers)]

    # -- loading ---------------------------------------------------------------------------

    @staticmethod
    def _rope_type(cfg: dict) -> str:
        rope = _rope_params(cfg)
        return rope.get("rope_type") or rope.get("type") or "default"

    @classmethod
    def _check_supported(cls, cfg: dict, fam: str) -> None:
        # Better to refuse than to silently produce a wrong reference.
        quant = cfg.get("quantization_config")
        if quant and not (fam == "gpt_oss" and quant.get("quant_method") == "mxfp4"):
            method = cfg["quantization_config"].get("quant_method", "?")
            raise NotImplementedError(
                f"reference forward does not implement quantized checkpoints (quant_method="
                f"{method!r}); use unquantized {_SUPPORTED_DTYPES}"
            )
        rope_type = cls._rope_type(cfg)
        allowed = ("default", "yarn") if fam in ("deepseek_v3", "gpt_oss") else ("default",)
        if rope_type not in allowed:
            raise NotImplementedError(
                f"reference supports RoPE types {allowed} for {fam}, got {rope_type!r}"
            )
        if cfg.get("use_sliding_window", False) or (
            fam == "mixtral" and cfg.get("sliding_window") is not None
        ):
            raise NotImplementedError("reference does not implement sliding-window attention")
        if fam != "gpt_oss" and "sliding_attention" in (cfg.get("layer_types") or []):
            raise NotImplementedError("reference does not implement sliding-window attention")
        if fam == "minimax_m2" and cfg.get("qk_norm_type", "per_layer") != "per_layer":
            raise NotImplementedError("MiniMax-M2 reference implements qk_norm_type per_layer")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"reference implements silu only, got {cfg['hidden_act']!r}")
        if fam == "deepseek_v3":
            if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
                raise NotImplementedError("DeepSeek-V3 reference implements topk_method 'noaux_tc'")
            if cfg.get("scoring_func", "sigmoid") != "sigmoid":
                raise NotImplementedError("DeepSeek-V3 reference implements scoring_func 'sigmoid'")

    def is_moe_layer(self, i: int) -> bool:
        """Which decoder layers carry a router (per family, as HF builds them)."""
        cfg, fam = self.config, self.family
        if self.num_experts <= 0:
            return False
        if fam in ("mixtral", "minimax_m2", "gpt_oss"):
            return True
        if fam in ("deepseek_v3", "glm4_moe"):
            first_dense = int(cfg.get("first_k_dense_replace") or 0)
            freq = int(cfg.get("moe_layer_freq") or 1) if fam == "deepseek_v3" else 1
            return i >= first_dense and i % freq == 0
        sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        return i not in mlp_only and (i + 1) % sparse_step == 0

    def _experts(self, w: dict[str, np.ndarray], p: str) -> tuple[np.ndarray, ...]:
        """Stacked expert weights (gate [E, I, H], up [E, I, H], down [E, H, I]) under prefix p
        ("...mlp." or "...block_sparse_moe.")."""
        ne = self.num_experts
        if self.family == "gpt_oss":
            return self._gpt_oss_experts(w, p)
        if p + "experts.gate_up_proj" in w:
            # Fused layout (transformers >= 5 in-memory naming): gate_up [E, 2I, H] with the
            # gate rows first, down [E, H, I].
            gate_up = w[p + "experts.gate_up_proj"]
            inter = gate_up.shape[1] // 2
            return gate_up[:, :inter], gate_up[:, inter:], w[p + "experts.down_proj"]
        names = (
            ("w1", "w3", "w2")
            if self.family in ("mixtral", "minimax_m2")
            else ("gate_proj", "up_proj", "down_proj")
        )
        return tuple(np.stack([w[f"{p}experts.{e}.{n}.weight"] for e in range(ne)]) for n in names)

    @staticmethod
    def _gpt_oss_experts(w: dict[str, np.ndarray], p: str) -> tuple[np.ndarray, ...]:
        """gpt-oss's fused experts in HF orientation (gate/up [E, I, H], down [E, H, I]):
        ``gate_up_proj`` [E, H, 2I] holds gate in its even columns and up in its odd ones;
        MXFP4 checkpoints hold ``*_blocks`` / ``*_scales`` of the [E, out, in] matrices."""
        def weight(name: str) -> np.ndarray:  # [E, in, out] as transformers multiplies
            if p + f"experts.{name}_blocks" in w:
                out_in = dequantize_mxfp4(w[p + f"experts.{name}_blocks"],
                                          w[p + f"experts.{name}_scales"])
                return out_in.transpose(0, 2, 1)
            return w[p + f"experts.{name}"]

        gate_up, down = weight("gate_up_proj"), weight("down_proj")
        return (gate_up[:, :, 0::2].transpose(0, 2, 1), gate_up[:, :, 1::2].transpose(0, 2, 1),
                down.transpose(0, 2, 1))

    def load_layer(self, w: dict[str, np.ndarray], i: int, moe: bool | None = None) -> _Layer:
        """Decoder layer i from HF tensors ``w`` (``model.layers.{i}.*``, float64), a MoE layer
        when ``moe`` (default: this model's rule for layer i). For layers the model itself does
        not load, e.g. the MTP layers past num_hidden_layers (reference_nextn)."""
        return self._load_layer(w, i, moe)

    def layer_forward(
        self, layer: _Layer, h: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None, RouterResult | None]:
        """One decoder layer on its own over h [n, H] at positions 0..n-1 (causal, a fresh
        K/V cache): (output [n, H], router logits [n, E] or None, routing or None on a dense
        layer). The same operations as a layer of ``forward``."""
        x = rms_norm(h, layer.input_norm, self.eps)
        h = h + self._attention(layer, x, _KVCache(), 0, 0)
        x = rms_norm(h, layer.post_attn_norm, self.eps)
        if layer.moe is None:
            assert layer.mlp is not None
            return h + swiglu(x, layer.mlp.gate, layer.mlp.up, layer.mlp.down), None, None
        y, router_logits, r = self._moe(layer.moe, x)
        return h + y, router_logits, r

    def _load_layer(
        self, w: dict[str, np.ndarray], i: int, moe_layer: bool | None = None
    ) -> _Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn = {n[len(a) :]: t for n, t in w.items() if n.startswith(a)}
        self._check_attention_weights(attn, i)
        mlp = moe = None
        if self.is_moe_layer(i) if moe_layer is None else moe_layer:
            mp = p + "mlp."
            if self.family in ("mixtral", "minimax_m2") and p + "block_sparse_moe.gate.weight" in w:
                mp = p + "block_sparse_moe."
            gate, up, down = self._experts(w, mp)
            router_name = mp + ("router." if self.family == "gpt_oss" else "gate.")
            router = w[router_name + "weight"]
            if router.shape[0] != self.num_experts or gate.shape[0] != self.num_experts:
                raise ValueError(f"layer {i}: expert count does not match the config")
            shared = shared_gate = None
            if self.family == "qwen2_moe":
                s = mp + "shared_expert."
                shared = _Mlp(
                    w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"]
                )
                shared_gate = w[mp + "shared_expert_gate.weight"]
            elif self.family in ("deepseek_v3", "glm4_moe") and self.config.get("n_shared_experts"):
                s = mp + "shared_experts."
                shared = _Mlp(
                    w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"]
                )
            bias = w.get(mp + "gate.e_score_correction_bias")
            if self.family == "minimax_m2":
                bias = w[mp + "e_score_correction_bias"]  # on the block, not the gate
            moe = _Moe(router, bias, gate, up, down, shared, shared_gate)
            if self.family == "gpt_oss":
                gub = w[mp + "experts.gate_up_proj_bias"]
                moe.router_bias = w[router_name + "bias"]
                moe.expert_biases = (gub[:, 0::2], gub[:, 1::2], w[mp + "experts.down_proj_bias"])
        else:
            mp = p + "mlp."
            mlp = _Mlp(
                w[mp + "gate_proj.weight"], w[mp + "up_proj.weight"], w[mp + "down_proj.weight"]
            )
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            post_attn_norm=w[p + "post_attention_layernorm.weight"],
            attn=attn,
            mlp=mlp,
            moe=moe,
        )

    def _check_attention_weights(self, attn: dict[str, np.ndarray], i: int) -> None:
        """Refuse a checkpoint whose attention tensors do not match what the config implies."""
        fam, cfg = self.family, self.config
        if fam == "deepseek_v3":
            need = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight"]
            need += ["o_proj.weight"]
            if self.q_lora_rank is None:
                need += ["q_proj.weight"]
            else:
                need += ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
        else:
            need = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
            if fam in ("qwen3_moe", "minimax_m2") or (fam == "glm4_moe" and cfg.get("use_qk_norm")):
                need += ["q_norm.weight", "k_norm.weight"]
            if fam == "gpt_oss":
                need += ["sinks"]
                if cfg.get("attention_bias", True):
                    need += [f"{n}_proj.bias" for n in "qkvo"]
            if (fam == "qwen2_moe" and cfg.get("qkv_bias", True)) or (
                fam == "glm4_moe" and cfg.get("attention_bias")
            ):
                need += ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        missing = [n for n in need if n not in attn]
        if missing:
            raise KeyError(f"layer {i}: missing self_attn tensors {missing}")

    # -- forward ---------------------------------------------------------------------------

    @staticmethod
    def _linear(x: np.ndarray, attn: dict[str, np.ndarray], name: str) -> np.ndarray:
        y = x @ attn[name + ".weight"].T
        bias = attn.get(name + ".bias")
        return y if bias is None else y + bias

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return apply_rope(
            x,
            positions,
            inv_freq=self.inv_freq,
            interleave=self.rope_interleave,
            attention_factor=self.rope_attention_factor,
        )

    @property
    def _use_qk_norm(self) -> bool:
        return self.family == "qwen3_moe" or (
            self.family == "glm4_moe" and bool(self.config.get("use_qk_norm"))
        )

    def _qkv_gqa(self, attn: dict[str, np.ndarray], x: np.ndarray, positions: np.ndarray):
        """GQA q [n, H, d], k and v [n, Hkv, d]: projections (+bias), q/k norm, partial RoPE."""
        n, hd = x.shape[0], self.head_dim
        q, k = self._linear(x, attn, "q_proj"), self._linear(x, attn, "k_proj")
        if self.family == "minimax_m2":  # per_layer: one norm over all heads, then split
            q = rms_norm(q, attn["q_norm.weight"], self.eps)
            k = rms_norm(k, attn["k_norm.weight"], self.eps)
        q = q.reshape(n, self.num_heads, hd)
        k = k.reshape(n, self.num_kv_heads, hd)
        v = self._linear(x, attn, "v_proj").reshape(n, self.num_kv_heads, hd)
        if self._use_qk_norm and self.family != "minimax_m2":
            q = rms_norm(q, attn["q_norm.weight"], self.eps)
            k = rms_norm(k, attn["k_norm.weight"], self.eps)
        return self._rope(q, positions), self._rope(k, positions), v

    def _qkv_mla(self, attn: dict[str, np.ndarray], x: np.ndarray, positions: np.ndarray):
        """MLA in its plain per-head form: q [n, H, nope+rope], k [n, H, nope+rope], v [n, H, v].

        The k RoPE part is one vector per token shared by all heads.
        """
        n, nh, nope, rdim = x.shape[0], self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = self._linear(x, attn, "q_proj")
        else:
            qa = rms_norm(
                self._linear(x, attn, "q_a_proj"), attn["q_a_layernorm.weight"], MLA_LORA_NORM_EPS
            )
            q = self._linear(qa, attn, "q_b_proj")
        q = q.reshape(n, nh, nope + rdim)
        ckv = self._linear(x, attn, "kv_a_proj_with_mqa")
        c, k_rope = ckv[:, : self.kv_lora_rank], ckv[:, self.kv_lora_rank :]
        c = rms_norm(c, attn["kv_a_layernorm.weight"], MLA_LORA_NORM_EPS)
        kv = self._linear(c, attn, "kv_b_proj").reshape(n, nh, nope + self.v_head_dim)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_rope = self._rope(q[..., nope:], positions)
        k_rope = self._rope(k_rope[:, None, :], positions)
        q = np.concatenate([q[..., :nope], q_rope], axis=-1)
        k = np.concatenate([k_nope, np.broadcast_to(k_rope, (n, nh, rdim))], axis=-1)
        return q, k, v

    def _attention(
        self, layer: _Layer, x: np.ndarray, cache: _KVCache, li: int, start: int
    ) -> np.ndarray:
        """Causal attention of new tokens x [n, H] at positions start.. over cache + new.

        Appends this layer's new K/V to the cache (layer li's cache holds `start` positions).
        """
        n = x.shape[0]
        positions = np.arange(start, start + n)
        qkv = self._qkv_mla if self.family == "deepseek_v3" else self._qkv_gqa
        q, k, v = qkv(layer.attn, x, positions)
        if li < len(cache.k):
            assert cache.k[li].shape[0] == start
            cache.k[li] = np.concatenate([cache.k[li], k])
            cache.v[li] = np.concatenate([cache.v[li], v])
        else:
            cache.k.append(k)
            cache.v.append(v)
        window = None
        if self.layer_types and self.layer_types[li] == "sliding_attention":
            window = self.sliding_window
        out = causal_attention(q, cache.k[li], cache.v[li], positions, self.attn_scale,
                               sliding_window=window, sinks=layer.attn.get("sinks"))
        return self._linear(out.reshape(n, -1), layer.attn, "o_proj")

    def route(self, router_logits: np.ndarray, correction_bias: np.ndarray | None) -> RouterResult:
        """This model's router rule on float64 logits [T, E]."""
        if self.router_rule == "softmax_topk":
            return softmax_topk(router_logits, self.top_k, self.norm_topk_prob)
        if self.router_rule == "topk_softmax":
            return topk_softmax(router_logits, self.top_k)
        return sigmoid_grouped(
            router_logits,
            correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )

    def _moe(self, moe: _Moe, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, RouterResult]:
        router_logits = x @ moe.router.T  # [n, E]
        if moe.router_bias is not None:
            router_logits = router_logits + moe.router_bias
        r = self.route(router_logits, moe.correction_bias)
        out = np.zeros_like(x)
        for e in np.unique(r.ids):
            # An expert appears at most once in a token's top-k, so rows are distinct.
            rows, slots = np.nonzero(r.ids == e)
            if moe.expert_biases is not None:
                gb, ub, db = (b[e] for b in moe.expert_biases)
                y = clamped_swiglu(x[rows], moe.gate[e], moe.up[e], moe.down[e], gb, ub, db,
                                   self.swiglu_limit, self.swiglu_alpha)
            else:
                y = swiglu(x[rows], moe.gate[e], moe.up[e], moe.down[e])
            out[rows] += r.weights[rows, slots][:, None] * y
        if moe.shared is not None:
            s = swiglu(x, moe.shared.gate, moe.shared.up, moe.shared.down)
            if moe.shared_gate is not None:
                s = s / (1.0 + np.exp(-(x @ moe.shared_gate.T)))  # sigmoid gate [n, 1]
            out = out + s
        return out, router_logits, r

    def _run(self, input_ids: np.ndarray, cache: _KVCache) -> ReferenceOutput:
        """Forward the new tokens input_ids, at positions following what cache holds."""
        n, num_layers, k, num_e = len(input_ids), self.num_layers, self.top_k, self.num_experts
        if n == 0:
            raise ValueError("empty input")
        if np.any(input_ids < 0) or np.any(input_ids >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        topk_ids = np.full((n, num_layers, k), -1, dtype=np.int32)
        topk_weights = np.zeros((n, num_layers, k), dtype=np.float64)
        router_logits = np.full((n, num_layers, num_e), np.nan, dtype=np.float64)
        topk_gap = np.full((n, num_layers), np.inf, dtype=np.float64)
        selection_gap = np.full((n, num_layers), np.inf, dtype=np.float64)

        # Read once: layer 0 extends the cache before later layers run.
        start = cache.length
        h = self.embed[input_ids]
        for li, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, self.eps)
            h = h + self._attention(layer, x, cache, li, start)
            x = rms_norm(h, layer.post_attn_norm, self.eps)
            if layer.moe is not None:
                y, rl, r = self._moe(layer.moe, x)
                router_logits[:, li] = rl
                topk_ids[:, li] = r.ids
                topk_weights[:, li] = r.weights
                topk_gap[:, li] = r.topk_gap
                selection_gap[:, li] = r.selection_gap
            else:
                assert layer.mlp is not None
                y = swiglu(x, layer.mlp.gate, layer.mlp.up, layer.mlp.down)
            h = h + y
        hidden = h  # the features an EAGLE draft reads (reference_eagle)
        logits = rms_norm(h, self.final_norm, self.eps) @ self.lm_head.T
        return ReferenceOutput(
            logits=logits,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            router_logits=router_logits,
            topk_gap=topk_gap,
            selection_gap=selection_gap,
            hidden=hidden,
        )

    def forward(self, input_ids: Sequence[int], chunk_size: int | None = None) -> ReferenceOutput:
        """Outputs for every position of one sequence (positions 0..T-1, causal attention).

        chunk_size feeds the sequence through the K/V cache that many tokens at a time (like
        chunked prefill / decode); the result equals the one-shot forward up to float64
        rounding, which the tests check.
        """
        ids = np.asarray(list(input_ids), dtype=np.int64)
        if chunk_size is None or chunk_size >= len(ids):
            return self._run(ids, _KVCache())
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        cache = _KVCache()
        parts = [self._run(ids[s : s + chunk_size], cache) for s in range(0, len(ids), chunk_size)]
        return ReferenceOutput(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in (fl.name for fl in fields(ReferenceOutput))
            )
        )

    def greedy_generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
    ) -> list[int]:
        """Greedy (argmax, ties to the lower token id) continuation; generated ids only.

        A stop token is included in the result and ends generation. Uses the K/V cache: one
        prefill, then one single-token step per generated token.
        """
        stops = set(int(t) for t in stop_token_ids)
        out: list[int] = []
        if max_new_tokens <= 0:
            return out
        cache = _KVCache()
        logits = self._run(np.asarray(list(input_ids), dtype=np.int64), cache).logits[-1]
        while True:
            token = int(np.argmax(logits))  # np.argmax returns the first maximum
            out.append(token)
            if token in stops or len(out) >= max_new_tokens:
                return out
            logits = self._run(np.asarray([token], dtype=np.int64), cache).logits[-1]


def routed_experts_rows(
    ref: ReferenceModel,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    start_len: int = 0,
) -> np.ndarray:
    """The routed-experts rows the engine must return for a finished request.

    seq_len - 1 rows ([seq_len - 1, num_hidden_layers, k] int32): one per prompt token and one
    per generated token except the last, which was never fed to the model. start_len mirrors
    the request's routed_experts_start_len (rows [start_len, seq_len - 1)).
    """
    seq = list(prompt_ids) + list(output_ids)
    if len(seq) <= 1:
        rows = np.zeros((0, ref.num_layers, ref.top_k), dtype=np.int32)
    else:
        rows = ref.forward(seq[:-1]).topk_ids
    return rows[start_len:]
