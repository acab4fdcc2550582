"""Independent numpy float64 reference forward of Qwen3-MoE.

This module is the yardstick the engine is tested against, so it deliberately shares no code
with ``sgl_jax.srt``: it reads a Hugging Face checkpoint directory itself (``config.json`` plus
``*.safetensors``), converts every weight to float64 and implements the architecture directly
from its definition (HF transformers' ``modeling_qwen3_moe``):

    h = embed_tokens[ids]
    per layer:  h += o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))   on RMSNorm(h)
                h += mlp(RMSNorm(h))       mlp = routed experts (MoE layer) or dense SwiGLU
    logits = RMSNorm(h) @ lm_head^T        (embed_tokens^T when tie_word_embeddings)

Routing follows HF: softmax over all experts (here in float64), top-k by descending
probability with ties toward the lower expert id, optional renormalisation of the k weights.
Besides logits it records, per token and layer, the router logits, the chosen ids and weights,
and ``topk_gap`` (k-th minus (k+1)-th largest router logit): a float32 engine can only be
expected to reproduce the ids where that gap is clearly above float32 rounding noise.

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
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
from safetensors.numpy import load_file

__all__ = [
    "ReferenceModel",
    "ReferenceOutput",
    "apply_rope",
    "load_safetensors_f64",
    "rms_norm",
    "routed_experts_rows",
    "select_topk",
]


@dataclass
class ReferenceOutput:
    """Per-position outputs of one forward; T = number of positions, L = num_hidden_layers."""

    logits: np.ndarray  # [T, vocab] float64
    topk_ids: np.ndarray  # [T, L, k] int32; -1 on dense (router-less) layers
    topk_weights: np.ndarray  # [T, L, k] float64, after optional renormalisation; 0 on dense layers
    router_logits: np.ndarray  # [T, L, E] float64; nan on dense layers
    topk_gap: np.ndarray  # [T, L] float64; inf on dense layers and when k == E


# --------------------------------------------------------------------------------------------
# Checkpoint reading
# --------------------------------------------------------------------------------------------

# Raw safetensors dtypes the manual reader understands. BF16 is absent from
# safetensors.numpy (numpy has no bfloat16), and HF checkpoints are very often BF16.
_RAW_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 by shifting into the high half
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}


def _load_safetensors_raw(path: str) -> dict[str, np.ndarray]:
    """Read a safetensors file by its documented layout: u64 header length, JSON header, data."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype_str = info["dtype"]
        if dtype_str not in _RAW_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype_str}")
        start, end = info["data_offsets"]
        arr = np.frombuffer(data[start:end], dtype=_RAW_DTYPES[dtype_str])
        if dtype_str == "BF16":
            # bfloat16 is the top 16 bits of a float32: exact widening.
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.reshape(info["shape"])
    return out


def load_safetensors_f64(path: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as float64 (every supported dtype widens exactly)."""
    try:
        tensors = load_file(path)
    except (KeyError, TypeError):
        # safetensors.numpy fails on a dtype numpy lacks (BF16): KeyError in older releases,
        # TypeError ("data type 'bfloat16' not understood") in newer ones.
        tensors = _load_safetensors_raw(path)
    return {name: np.asarray(t, dtype=np.float64) for name, t in tensors.items()}


# --------------------------------------------------------------------------------------------
# Building blocks (module level so tests can probe them in isolation)
# --------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def apply_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Non-interleaved ("rotate_half") RoPE on x [T, heads, head_dim] at integer positions [T].

    Dimension i of the first half and i + head_dim/2 of the second half form one rotation pair
    with frequency theta^(-2i/head_dim).
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]  # broadcast over heads
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def select_topk(
    router_logits: np.ndarray, k: int, norm_topk_prob: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Router selection for [T, E] logits -> (ids [T, k] int32, weights [T, k], gap [T]).

    Order: descending softmax probability; a stable sort on -prob keeps equal probabilities in
    ascending expert id, i.e. ties go to the lower id (as torch.topk on CPU and the engine do).
    """
    num_experts = router_logits.shape[-1]
    probs = _softmax(router_logits, axis=-1)
    order = np.argsort(-probs, axis=-1, kind="stable")
    ids = order[:, :k]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    if k < num_experts:
        desc = -np.sort(-router_logits, axis=-1)
        gap = desc[:, k - 1] - desc[:, k]
    else:
        gap = np.full(router_logits.shape[0], np.inf)
    return ids.astype(np.int32), weights, gap


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass
class _Layer:
    """Weights of one decoder layer, float64, HF orientation ([out_features, in_features])."""

    input_norm: np.ndarray
    post_attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    q_norm: np.ndarray
    k_norm: np.ndarray
    is_moe: bool
    # MoE: router [E, H]; experts stacked gate/up [E, I, H], down [E, H, I].
    # Dense: gate/up [I, H], down [H, I]; router None.
    router: np.ndarray | None
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass
class _KVCache:
    """Per-layer K (after k_norm and RoPE) and V, [positions so far, kv_heads, head_dim]."""

    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.k else self.k[0].shape[0]


class ReferenceModel:
    """Float64 numpy Qwen3-MoE (Qwen3MoeForCausalLM) read from an HF checkpoint directory."""

    def __init__(self, path: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            self.config: dict = json.load(f)
        cfg = self.config
        self._check_supported(cfg)

        self.vocab_size: int = int(cfg["vocab_size"])
        self.hidden_size: int = int(cfg["hidden_size"])
        self.num_layers: int = int(cfg["num_hidden_layers"])
        self.num_heads: int = int(cfg["num_attention_heads"])
        self.num_kv_heads: int = int(cfg.get("num_key_value_heads") or self.num_heads)
        self.head_dim: int = int(cfg.get("head_dim") or self.hidden_size // self.num_heads)
        self.eps: float = float(cfg.get("rms_norm_eps", 1e-6))
        rope_params = cfg.get("rope_parameters") or {}
        self.rope_theta: float = float(cfg.get("rope_theta") or rope_params.get("rope_theta", 1e4))
        self.num_experts: int = int(cfg.get("num_experts") or 0)
        self.top_k: int = int(cfg.get("num_experts_per_tok") or 0)
        self.norm_topk_prob: bool = bool(cfg.get("norm_topk_prob", False))
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        w: dict[str, np.ndarray] = {}
        for file in files:
            w.update(load_safetensors_f64(file))

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
    def _check_supported(cfg: dict) -> None:
        # Better to refuse than to silently produce a wrong reference.
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in (None, "default"):
            raise NotImplementedError(f"reference supports default RoPE only, got {rope_type!r}")
        if cfg.get("use_sliding_window", False):
            raise NotImplementedError("reference does not implement sliding-window attention")

    def is_moe_layer(self, i: int) -> bool:
        """HF Qwen3-MoE rule for which decoder layers carry a router."""
        sparse_step = int(self.config.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(self.config.get("mlp_only_layers") or [])
        return i not in mlp_only and self.num_experts > 0 and (i + 1) % sparse_step == 0

    def _load_layer(self, w: dict[str, np.ndarray], i: int) -> _Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        is_moe = self.is_moe_layer(i)
        if is_moe:
            router = w[p + "mlp.gate.weight"]
            if p + "mlp.experts.gate_up_proj" in w:
                # Fused layout (transformers >= 5 in-memory naming): gate_up [E, 2I, H] with
                # the gate rows first, down [E, H, I].
                gate_up = w[p + "mlp.experts.gate_up_proj"]
                inter = gate_up.shape[1] // 2
                gate, up = gate_up[:, :inter], gate_up[:, inter:]
                down = w[p + "mlp.experts.down_proj"]
            else:
                e = p + "mlp.experts.{}.{}_proj.weight"
                gate = np.stack([w[e.format(j, "gate")] for j in range(self.num_experts)])
                up = np.stack([w[e.format(j, "up")] for j in range(self.num_experts)])
                down = np.stack([w[e.format(j, "down")] for j in range(self.num_experts)])
            if router.shape[0] != self.num_experts or gate.shape[0] != self.num_experts:
                raise ValueError(f"layer {i}: expert count does not match num_experts")
        else:
            router = None
            gate = w[p + "mlp.gate_proj.weight"]
            up = w[p + "mlp.up_proj.weight"]
            down = w[p + "mlp.down_proj.weight"]
        return _Layer(
            input_norm=w[p + "input_layernorm.weight"],
            post_attn_norm=w[p + "post_attention_layernorm.weight"],
            wq=w[a + "q_proj.weight"],
            wk=w[a + "k_proj.weight"],
            wv=w[a + "v_proj.weight"],
            wo=w[a + "o_proj.weight"],
            bq=w.get(a + "q_proj.bias"),
            bk=w.get(a + "k_proj.bias"),
            bv=w.get(a + "v_proj.bias"),
            bo=w.get(a + "o_proj.bias"),
            q_norm=w[a + "q_norm.weight"],
            k_norm=w[a + "k_norm.weight"],
            is_moe=is_moe,
            router=router,
            gate=gate,
            up=up,
            down=down,
        )

    # -- forward ---------------------------------------------------------------------------

    @staticmethod
    def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        y = x @ weight.T
        return y if bias is None else y + bias

    def _attention(
        self, layer: _Layer, x: np.ndarray, cache: _KVCache, li: int, start: int
    ) -> np.ndarray:
        """Causal GQA attention of new tokens x [n, H] at positions start.. over cache + new.

        Appends this layer's new K/V to the cache (layer li's cache holds `start` positions).
        """
        n, hd = x.shape[0], self.head_dim
        positions = np.arange(start, start + n)
        q = self._linear(x, layer.wq, layer.bq).reshape(n, self.num_heads, hd)
        k = self._linear(x, layer.wk, layer.bk).reshape(n, self.num_kv_heads, hd)
        v = self._linear(x, layer.wv, layer.bv).reshape(n, self.num_kv_heads, hd)
        q = apply_rope(rms_norm(q, layer.q_norm, self.eps), positions, self.rope_theta)
        k = apply_rope(rms_norm(k, layer.k_norm, self.eps), positions, self.rope_theta)
        if li < len(cache.k):
            assert cache.k[li].shape[0] == start
            cache.k[li] = np.concatenate([cache.k[li], k])
            cache.v[li] = np.concatenate([cache.v[li], v])
        else:
            cache.k.append(k)
            cache.v.append(v)
        keys, values = cache.k[li], cache.v[li]  # [S, kv_heads, hd], S = start + n

        group = self.num_heads // self.num_kv_heads
        # Query head h reads kv head h // group.
        keys = np.repeat(keys, group, axis=1)
        values = np.repeat(values, group, axis=1)
        scores = np.einsum("qhd,shd->hqs", q, keys) / np.sqrt(hd)
        key_pos = np.arange(keys.shape[0])
        scores = np.where(key_pos[None, None, :] > positions[None, :, None], -np.inf, scores)
        probs = _softmax(scores, axis=-1)
        out = np.einsum("hqs,shd->qhd", probs, values).reshape(n, self.num_heads * hd)
        return self._linear(out, layer.wo, layer.bo)

    @staticmethod
    def _swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        return (_silu(x @ gate.T) * (x @ up.T)) @ down.T

    def _moe(
        self, layer: _Layer, x: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        assert layer.router is not None
        router_logits = x @ layer.router.T  # [n, E]
        ids, weights, gap = select_topk(router_logits, self.top_k, self.norm_topk_prob)
        out = np.zeros_like(x)
        for e in np.unique(ids):
            # An expert appears at most once in a token's top-k, so rows are distinct.
            rows, slots = np.nonzero(ids == e)
            y = self._swiglu(x[rows], layer.gate[e], layer.up[e], layer.down[e])
            out[rows] += weights[rows, slots][:, None] * y
        return out, router_logits, ids, weights, gap

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

        # Read once: layer 0 extends the cache before later layers run.
        start = cache.length
        h = self.embed[input_ids]
        for li, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, self.eps)
            h = h + self._attention(layer, x, cache, li, start)
            x = rms_norm(h, layer.post_attn_norm, self.eps)
            if layer.is_moe:
                y, rl, ids, w, gap = self._moe(layer, x)
                router_logits[:, li] = rl
                topk_ids[:, li] = ids
                topk_weights[:, li] = w
                topk_gap[:, li] = gap
            else:
                y = self._swiglu(x, layer.gate, layer.up, layer.down)
            h = h + y
        h = rms_norm(h, self.final_norm, self.eps)
        logits = h @ self.lm_head.T
        return ReferenceOutput(logits, topk_ids, topk_weights, router_logits, topk_gap)

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
