"""FLOPs and bytes from the config alone: the active parameters per token, the ideal FLOPs
of a bucket, the KV cache per token, the attention kernel's work (which XLA cannot see),
the MoE dispatch's interconnect bytes and the static size XLA counts a grouped matmul at."""

from __future__ import annotations

import math
from typing import Any

from sgl_jax.tools.aot.buckets import Bucket


def attention_params(cfg: Any) -> int:
    """Per-token parameters of one layer's attention projections (biases, norms: negligible).

    GQA: q, k, v and o. MLA: q_a_proj + q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_b_proj
    and o_proj. kv_b_proj is counted whole: with absorbed weights its two halves are the
    per-head matmuls ``q_nope @ W_UK`` and ``o_latent @ W_UV``, run once per token, so
    ``2 * kv_lora * heads * (qk_nope + v_head)`` FLOPs per token, as a projection would."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.attention != "mla":
        d = cfg.head_dim
        # attn_output_gate (Qwen3.5): q_proj gives [query | gate] per head, twice the rows.
        q = heads * d * (2 if cfg.attn_output_gate else 1)
        return h * (q + 2 * cfg.num_key_value_heads * d) + heads * d * h
    q_out = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q = h * q_out if cfg.q_lora_rank is None else h * cfg.q_lora_rank + cfg.q_lora_rank * q_out
    kv_a = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    kv_b = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv_a + kv_b + heads * cfg.v_head_dim * h


def linear_attention_params(cfg: Any) -> int:
    """Per-token parameters of one Gated DeltaNet layer (Qwen3.5): in_proj_qkv (``hidden *
    conv_dim``), in_proj_z (``hidden * Hv * dv``), in_proj_b and in_proj_a (``hidden * Hv``
    each), the depthwise causal conv (``conv_dim * K``: ``2 * K`` FLOPs per channel and token)
    and out_proj (``Hv * dv * hidden``)."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    value = hv * cfg.linear_value_head_dim
    conv = cfg.linear_conv_dim
    return h * conv + h * value + 2 * h * hv + conv * cfg.linear_conv_kernel_dim + value * h


def linear_layer_count(cfg: Any) -> int:
    return sum(cfg.linear_layers)


def full_attention_layers(cfg: Any) -> int:
    """Layers with a KV cache and a paged attention call (all but the linear ones)."""
    return cfg.num_hidden_layers - linear_layer_count(cfg)


def recurrence_flops_per_token(cfg: Any) -> int:
    """FLOPs of one token's gated delta rule in one linear layer, per the recurrent form:
    per value head ``2 * dk * dv`` each for the readout ``S^T k``, the rank-1 update
    ``k (beta (v - S^T k))^T`` and the output ``S^T q`` (the decay ``g * S``, ``dk * dv``
    multiplies, and the chunked form's extra work at prefill are not counted: the ideal is
    the recurrence itself)."""
    if not cfg.linear_layers:
        return 0
    return 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim


def linear_state_bytes_per_request(cfg: Any, itemsize: int) -> int:
    """Bytes one request's states take in all linear layers: the float32 recurrent state
    ``Hv * dk * dv * 4`` and the conv state ``conv_dim * (K - 1)`` (model dtype) per layer.
    A decode step reads and writes them once: twice this (``state_bytes_per_decode_step``)."""
    if not cfg.linear_layers:
        return 0
    recurrent = (cfg.linear_num_value_heads * cfg.linear_key_head_dim
                 * cfg.linear_value_head_dim * 4)
    conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * itemsize
    return linear_layer_count(cfg) * (recurrent + conv)


def moe_params(cfg: Any) -> int:
    """Per-token parameters of one MoE layer: router, top-k routed experts, shared experts
    (``3 * hidden * shared width``) and Qwen2-MoE's shared-expert gate (``hidden``)."""
    h = cfg.hidden_size
    routed = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    shared = 3 * h * cfg.shared_expert_intermediate_size if cfg.num_shared_experts else 0
    gate = h if cfg.num_shared_experts and cfg.shared_expert_gated else 0
    return h * cfg.num_experts + routed + shared + gate


def active_params_per_token(cfg: Any) -> tuple[int, int]:
    """(per-token parameters of all decoder layers, LM head parameters)."""
    attn, moe = attention_params(cfg), moe_params(cfg)
    linear = linear_attention_params(cfg) if cfg.linear_layers else 0
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    kinds = cfg.linear_layers or (False,) * cfg.num_hidden_layers
    layers = sum((linear if is_linear else attn) + (moe if is_moe else dense)
                 for is_moe, is_linear in zip(cfg.moe_layers, kinds, strict=True))
    return layers, cfg.hidden_size * cfg.vocab_size


def attention_flops_per_pair(cfg: Any) -> int:
    """FLOPs of one (query, key) pair of one head. GQA: ``4 * head_dim`` (scores and values).
    MLA as the engine computes it, in latent space: ``2 * (kv_lora + qk_rope)`` for the score
    over the cached row and ``2 * kv_lora`` for the value (the latent part of the row)."""
    if cfg.attention == "mla":
        return 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * cfg.kv_lora_rank
    return 4 * cfg.head_dim


def ideal_attention_flops(cfg: Any, b: Bucket) -> int:
    """Exact causal attention over the context in the full-attention layers, plus the gated
    delta rule's recurrence in the linear ones."""
    full = (cfg.num_attention_heads * attention_flops_per_pair(cfg) * b.q_kv_pairs
            * full_attention_layers(cfg))
    return full + recurrence_flops_per_token(cfg) * b.tokens * linear_layer_count(cfg)


def ideal_flops(cfg: Any, b: Bucket) -> int:
    layers, head = active_params_per_token(cfg)
    return 2 * layers * b.tokens + 2 * head * b.sampled + ideal_attention_flops(cfg, b)


def kv_bytes_per_token_per_device(cfg: Any, tp: int, itemsize: int) -> float:
    """KV cache bytes of one token (all full-attention layers; linear layers keep no KV) on
    one device: split over tp by head for GQA; MLA's latent row (``kv_lora + qk_rope`` values
    per layer) is replicated, whatever tp."""
    per_token = full_attention_layers(cfg) * cfg.kv_cache_heads * cfg.kv_cache_head_dim * itemsize
    return per_token / tp if cfg.kv_cache_sharded else float(per_token)


def kernel_cost_per_call(cfg: Any, b: Bucket, tp: int, itemsize: int) -> tuple[float, float]:
    """Per device (FLOPs, bytes) of one layer's attention over the cache, added analytically
    to XLA's count: the Pallas kernel's (GQA; XLA counts a custom call as 0) or the native
    backend's block loop (XLA counts a loop body once). FLOPs: ``heads / tp`` heads times
    ``attention_flops_per_pair`` per causal (query, key) pair; bytes: one read of each
    sequence's cached K/V (MLA: its latent rows, replicated over tp: every device of a rank
    reads them all), the queries and the outputs. A device attends for its attention rank's
    requests only: all of them without DP, the busiest rank's ``ceil(requests / dp)`` with it
    (the per-device figure of the roofline; ``Bucket.rank_load`` scales it to the sum)."""
    heads = cfg.num_attention_heads / tp
    requests = b.rank_requests
    flops = heads * attention_flops_per_pair(cfg) * b.pairs_per_request * requests
    cache_heads = cfg.kv_cache_heads / tp if cfg.kv_cache_sharded else cfg.kv_cache_heads
    kv = requests * b.context_len * cache_heads * cfg.kv_cache_head_dim * itemsize
    if cfg.attention == "mla":
        q_dim, out_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    else:
        q_dim = out_dim = cfg.head_dim
    q_out = requests * b.q_len * heads * (q_dim + out_dim) * itemsize
    return flops, kv + q_out


def dispatch_bytes_per_moe_layer(tokens: int, hidden: int, top_k: int, itemsize: int,
                                 tp: int, ep: int, dp: int,
                                 dispatch: str = "all_gather") -> float:
    """Bytes one device sends (= receives) over the interconnect for one MoE layer's token
    dispatch, from the formula (ring collectives; ``tokens``: the compiled tokens of the
    step, all ranks; ``itemsize``: the activation dtype's).

    Without DP: ep_moe's ``psum`` of the ``[T, H]`` partial outputs over all ``n = ep * tp``
    devices, ``2 * T * H * itemsize * (n - 1) / n`` (XLA:TPU reduces them in the activation
    dtype, as the compiled HLO shows). With DP (ranks = rows of "expert", ``f = (ep - 1) /
    ep``), the all-gather dispatch: the all-gather over "expert" of x (``T * H * itemsize *
    f``) and of the top-k ids and weights (``T * k * 8 * f``), the reduce-scatter of the
    partial outputs (in the activation dtype) back to their ranks (``T * H * itemsize * f``),
    and the all-reduce over "tensor" of each rank's ``T / ep`` rows (``2 * T / ep * H *
    itemsize * (tp - 1) / tp``). The ragged all-to-all dispatch sends each of a rank's
    ``T / ep * k`` assignments once (on average a fraction ``f`` leaves the device): its token
    row, local expert row and weight (``H * itemsize + 8``), and gets its float32 weighted
    result back (``H * 4``), then the same "tensor" all-reduce."""
    if dp == 1:
        n = ep * tp
        return 2 * tokens * hidden * itemsize * (n - 1) / n
    f = (ep - 1) / ep
    tensor = 2 * tokens / ep * hidden * itemsize * (tp - 1) / tp
    if dispatch == "ragged_all_to_all":
        assignments = tokens / ep * top_k
        return assignments * f * (hidden * itemsize + 8 + hidden * 4) + tensor
    gather = tokens * hidden * itemsize * f + tokens * top_k * 8 * f
    scatter = tokens * hidden * itemsize * f
    return gather + scatter + tensor


def shard_bytes(x: Any) -> int:
    """Bytes of one device's shard of an abstract (sharded ShapeDtypeStruct) array."""
    import numpy as np

    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    return math.prod(shape) * np.dtype(x.dtype).itemsize


def grouped_matmul_excess_flops(cfg: Any, b: Bucket, moe_backend: str, tp: int, ep: int,
                                dtype_name: str) -> float:
    """FLOPs XLA counts in the expert matmuls beyond the real work, summed over devices
    (``ragged_static_excess_flops``; 0 unless the ragged or gmm backend runs with ep > 1)."""
    # XLA counts a grouped matmul at its static size, though each device's groups hold only
    # its own experts' share of the rows (the rest sort past the last group, where the kernel
    # has no work): ragged's holds all T*k assignments on every device of the "expert" axis,
    # gmm's one pass window (gmm.pass_rows: 1.25 times the device's share).
    excess = 0.0
    if moe_backend in ("ragged", "gmm") and ep > 1:
        top_k = cfg.num_experts_per_tok
        per_assignment = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        # A device's matmuls see every compiled token's k assignments (with DP: all ranks'
        # tokens, gathered; idle ranks' padding included), its experts' slice.
        rows = b.compiled_tokens * top_k
        if moe_backend == "gmm":
            import jax
            import jax.numpy as jnp

            from sgl_jax.srt.layers.moe import gmm

            # The pass window, padded to its row tile, as the kernels' estimates count it.
            rows = gmm.pass_rows(rows, ep, gmm.CAPACITY_FACTOR)
            inter = cfg.moe_intermediate_size // tp
            experts = cfg.num_physical_experts // ep
            dtype = jnp.dtype(dtype_name)
            w_gate = jax.ShapeDtypeStruct((experts, cfg.hidden_size, inter), dtype)
            w_down = jax.ShapeDtypeStruct((experts, inter, cfg.hidden_size), dtype)
            rows = gmm.pad_rows(rows, gmm.row_tile(rows, w_gate, w_down))
        excess = per_assignment * sum(cfg.moe_layers) * (ep * rows - b.tokens * top_k)
    return excess
