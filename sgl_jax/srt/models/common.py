"""The decoder every supported MoE family is built from, configured by ``ModelConfig``.

Parameter paths mirror the Hugging Face names (``model.layers.3.self_attn.q_proj``), with
differences the loader resolves (``model_loader/loader.py``): linear weights are stored
``[in, out]`` (the forward is ``x @ w``); the experts of a layer are stacked into ``w_gate`` /
``w_up`` ``[E, H, I]`` and ``w_down`` ``[E, I, H]``; a parameter whose HF name does not follow
from its path says so in its ``hf`` metadata ``(name relative to its parent, transposed)``.
Every parameter carries a partition spec over the mesh axes ``expert`` and ``tensor``; with a
1-device mesh they are all trivially replicated.

What differs between families is data, not code paths: the router rule
(``layers/moe/router.py``), shared experts (gated or not), biases and norms of the attention
projections, partial rotary, which layers are dense, and the attention module itself (GQA
here; multi-head latent attention in ``deepseek_v3.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardBatch
from sgl_jax.srt.layers import norm_rope, token_matmul
from sgl_jax.srt.layers.attention import AttentionMetadata, write_kv
from sgl_jax.srt.layers.attention.data_parallel import (
    DATA_AXIS,
    rank_local_attention,
    take_rank_rows,
)
from sgl_jax.srt.layers.moe.ep_moe import (
    TENSOR_AXIS,
    W_DOWN_SPEC,
    W_GATE_UP_SPEC,
    ExpertLocation,
    ep_moe_forward,
)
from sgl_jax.srt.layers.moe.experts import MoEBackend
from sgl_jax.srt.layers.moe.router import create_router
from sgl_jax.srt.layers.moe.routing import LayerRouting, stack_routing
from sgl_jax.srt.layers.norm import RMSNorm
from sgl_jax.srt.layers.rotary import apply_rotary, rotation_table
from sgl_jax.srt.models import sequence_parallel
from sgl_jax.srt.models.backends import ModelBackends

KVCache = list[jax.Array]  # per layer: [pages, page_size, kv_cache_heads, kv_cache_head_dim]


def param(
    shape: tuple[int, ...], dtype: jnp.dtype, sharding: tuple[str | None, ...],
    hf: tuple[str, bool] | None = None, **metadata: object,
) -> nnx.Param:
    """A parameter (placeholder values: the model is built under ``nnx.eval_shape`` and the
    loader fills it). ``hf``: its Hugging Face name relative to the parent module and whether
    it is stored transposed, when the path alone does not say (``model_loader.hf_sources``);
    ``metadata``: more for the loader (gpt-oss's fused experts: ``fused``)."""
    extra = dict(metadata) if hf is None else {"hf": hf, **metadata}
    return nnx.Param(jnp.zeros(shape, dtype=dtype), out_sharding=sharding, eager_sharding=False,
                     **extra)


class DenseMLP(nnx.Module):
    """SwiGLU MLP: the dense layers, and the shared experts of a MoE layer."""

    def __init__(self, hidden: int, intermediate: int, dtype: jnp.dtype) -> None:
        self.gate_proj = param((hidden, intermediate), dtype, (None, "tensor"))
        self.up_proj = param((hidden, intermediate), dtype, (None, "tensor"))
        self.down_proj = param((intermediate, hidden), dtype, ("tensor", None))

    def __call__(self, x: jax.Array) -> jax.Array:
        act = jax.nn.silu(x @ self.gate_proj[...]) * (x @ self.up_proj[...])
        return act @ self.down_proj[...]


class GqaAttention(nnx.Module):
    """Grouped-query attention over the paged KV cache, with the families' options: biases on
    q/k/v (Qwen2-MoE, GLM-4.5; gpt-oss on o_proj too), RMSNorm of each q/k head (Qwen3-MoE,
    GLM-4.5 with use_qk_norm) or of all heads' q and k at once (MiniMax-M2's per-layer
    qk-norm), partial rotary (GLM-4.5, MiniMax-M2), YaRN (gpt-oss), attention sinks and
    sliding windows on some layers (gpt-oss)."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, layer_id: int = 0) -> None:
        hidden, heads, kv_heads, head_dim = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope_theta, self.rotary_dim = config.rope_theta, config.rope_dim
        self.yarn = config.rope_scaling
        self.family = config.family
        self.window = config.layer_window(layer_id)
        self.q_proj = param((hidden, heads * head_dim), dtype, (None, "tensor"))
        self.k_proj = param((hidden, kv_heads * head_dim), dtype, (None, "tensor"))
        self.v_proj = param((hidden, kv_heads * head_dim), dtype, (None, "tensor"))
        self.o_proj = param((heads * head_dim, hidden), dtype, ("tensor", None))
        self.has_bias = config.qkv_bias
        if self.has_bias:
            self.q_proj_bias = param((heads * head_dim,), dtype, ("tensor",), ("q_proj.bias", False))
            self.k_proj_bias = param((kv_heads * head_dim,), dtype, ("tensor",), ("k_proj.bias", False))
            self.v_proj_bias = param((kv_heads * head_dim,), dtype, ("tensor",), ("v_proj.bias", False))
        self.has_o_bias = config.o_proj_bias
        if self.has_o_bias:
            self.o_proj_bias = param((hidden,), dtype, (None,), ("o_proj.bias", False))
        self.has_sinks = config.attention_sinks
        if self.has_sinks:  # one logit per query head, split with the heads
            self.sinks = param((heads,), dtype, ("tensor",), ("sinks", False))
        # DP attention: a rank's query heads split over "tensor" only with its KV heads.
        self.kv_heads_split = config.kv_cache_sharded
        self.has_qk_norm = config.qk_norm and not config.qk_norm_per_layer
        if self.has_qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype)
        # MiniMax-M2: one RMSNorm over all heads' q (k) before they are split into heads
        # (under tensor parallelism its mean is a sum over the devices' heads: GSPMD's).
        self.layer_qk_norm = config.qk_norm and config.qk_norm_per_layer
        if self.layer_qk_norm:
            self.q_norm = RMSNorm(heads * head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(kv_heads * head_dim, config.rms_norm_eps, dtype)

    def _projections(self, x: jax.Array, positions: jax.Array, backends: ModelBackends
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q ``[T, heads, D]`` and k ``[T, kv_heads, D]`` normed and rotated, v ``[T,
        kv_heads * D]``. In order of preference:

        1. On the Pallas path in a prefill-sized step, without biases, where the norm/rotary
           kernel covers q and k: one call of the token matmul kernel for all three, x read
           once (``layers/token_matmul.py``), which also norms and rotates q and k (they are
           never written unrotated). Compile-only it beats the fused XLA matmul: the 30B's
           prefill on v6e, 78.0 -> 76.0 GB per device.
        2. Where x is wider in tokens than a device's fused columns, one XLA matmul with the
           biases added in it (:meth:`_fused_qkv`; on the Pallas path q and k normed and
           rotated by the norm/rotary kernel reading their columns in place).
        3. The token matmul kernel's three products alone (x read once), then the biases,
           norms and rotation.
        4. Three XLA dots (decode; the native backend, as in deterministic mode)."""
        names = ("q_proj", "k_proj", "v_proj")
        weights = tuple(getattr(self, name)[...] for name in names)
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.has_qk_norm else (None, None)
        interpret = getattr(backends.attention, "interpret", False)
        pallas = backends.attention.name == "pallas"
        # (Every device holding whole KV heads, the norm/rotary kernel covers q if it covers k.)
        in_kernel = self._rotates_in_kernel(backends, self.num_kv_heads)
        if pallas and in_kernel and not self.has_bias:  # (never with a layer qk-norm)
            done = token_matmul.column_parallel(
                x, weights, interpret, backends.dp_attention, (*self._qk_parts(), None),
                rotation_table(positions, self.rope_theta, self.head_dim),
                None if q_norm is None else q_norm.eps)  # k_norm's too: both rms_norm_eps
            if done is not None:
                q, k, v = done
                return q, k.reshape(k.shape[0], self.num_kv_heads, self.head_dim), v
        fused = self._fused_qkv(x, backends)
        if fused is not None:  # (its bias added)
            if in_kernel:
                return (*self._rotate_fused(fused, positions, backends),
                        self._qkv_part(fused, 2))
            q, k, v = (self._qkv_part(fused, part) for part in range(3))
        else:
            done = (token_matmul.column_parallel(x, weights, interpret, backends.dp_attention)
                    if pallas else None)
            q, k, v = done if done is not None else (x @ w for w in weights)
            if self.has_bias:
                q, k, v = (y + getattr(self, f"{name}_bias")[...]
                           for y, name in zip((q, k, v), names, strict=True))
        if self.layer_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._norm_and_rotate(q, q_norm, self.num_heads, positions, backends, query=True)
        k = self._norm_and_rotate(k, k_norm, self.num_kv_heads, positions, backends)
        return q, k, v

    def _fused_qkv(self, x: jax.Array, backends: ModelBackends) -> jax.Array | None:
        """q, k and v as one matmul, ``[T, tp * W]``: device i's columns ``[i * W, (i + 1) *
        W)`` hold its q, k and v heads side by side (:meth:`_qkv_part`); None where three
        matmuls cost less.

        Each matmul of its own reads x ``[T, H]`` whole; the fused one reads it once but
        first writes each device's q, k and v weight columns next to each other (a copy of
        its share of the weights every step). So it is used when x is wider in tokens than
        the device's fused columns (a prefill; never at decode; with DP attention, a rank's
        tokens), with every device holding a whole number of KV heads (the weights'
        "tensor" blocks then line up)."""
        mesh = jax.sharding.get_abstract_mesh()
        tp = 1 if mesh.empty else mesh.shape.get(TENSOR_AXIS, 1)
        local = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim // tp
        ranks = mesh.shape.get(DATA_AXIS, 1) if backends.dp_attention else 1
        if tp == 1 or self.num_kv_heads % tp or x.shape[0] // ranks <= local:
            return None
        names = ("q_proj", "k_proj", "v_proj")
        # [H, tp, width / tp] per weight: device i's columns are block i of dimension 1.
        blocks = [getattr(self, n)[...].reshape(x.shape[1], tp, -1) for n in names]
        fused = jax.lax.with_sharding_constraint(jnp.concatenate(blocks, axis=2),
                                                 P(None, TENSOR_AXIS, None))
        # XLA's dot (the token matmul kernel on these concatenated weights counted 0.5 GB
        # more on the 30B's prefill, compile-only v6e; its three weights unconcatenated,
        # rotating q and k, it is preferred where it applies: :meth:`_projections`).
        y = jnp.einsum("th,hsd->tsd", x, fused)
        if self.has_bias:
            y = y + jnp.concatenate([getattr(self, f"{n}_bias")[...].reshape(tp, -1)
                                     for n in names], axis=1)
        return y.reshape(x.shape[0], -1)

    def _qkv_part(self, fused: jax.Array, part: int) -> jax.Array:
        """q (0), k (1) or v (2) ``[T, heads * D]`` out of :meth:`_fused_qkv`'s array."""
        mesh = jax.sharding.get_abstract_mesh()
        tp = mesh.shape[TENSOR_AXIS]
        widths = [h * self.head_dim // tp
                  for h in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]
        start = sum(widths[:part])
        blocks = fused.reshape(fused.shape[0], tp, -1)[:, :, start:start + widths[part]]
        return blocks.reshape(fused.shape[0], -1)

    def _rotates_in_kernel(self, backends: ModelBackends, heads: int) -> bool:
        """Whether ``heads`` heads are normed and rotated by ``layers/norm_rope.py``'s kernel
        (the Pallas attention backend, a layout the kernel covers)."""
        if self.layer_qk_norm or self.yarn is not None:  # the kernel norms heads, no YaRN
            return False
        mesh = jax.sharding.get_abstract_mesh()
        tp = 1 if mesh.empty else mesh.shape.get(TENSOR_AXIS, 1)
        return backends.attention.name == "pallas" and norm_rope.supported(
            self.head_dim, self.rotary_dim, False, heads, tp)

    def _norm_and_rotate(self, y: jax.Array, norm: RMSNorm | None, heads: int,
                         positions: jax.Array, backends: ModelBackends,
                         query: bool = False) -> jax.Array:
        """[T, heads * D] projection -> [T, heads, D]: each head's RMSNorm (Qwen3, GLM-4.5)
        and the rotary embedding; on TPU (the Pallas attention backend) in one kernel
        (``layers/norm_rope.py``) where it covers the layout, which writes q (``query``)
        as ``[T, heads, D]`` itself (the attention kernel's layout; k stays ``[T, heads *
        D]`` for the cache write, which stacks it with v)."""
        attention = backends.attention
        if self._rotates_in_kernel(backends, heads):
            y = norm_rope.norm_rope(
                y, None if norm is None else norm.weight[...], positions, self.rope_theta,
                heads, None if norm is None else norm.eps,
                getattr(attention, "interpret", False), tokens_split=backends.dp_attention,
                heads_axis=query)
            return y.reshape(y.shape[0], heads, self.head_dim)
        y = y.reshape(y.shape[0], heads, self.head_dim)
        if norm is not None:
            y = norm(y)
        return apply_rotary(y, positions, self.rope_theta, self.rotary_dim, yarn=self.yarn)

    def _qk_parts(self, k_column_block: int = 0) -> tuple[norm_rope.Part, norm_rope.Part]:
        """q and k as the norm/rotary arithmetic takes them (their RMSNorm weights, if any):
        q with a heads axis (the attention kernel's layout), k in column block
        ``k_column_block`` of a fused array (:meth:`_rotate_fused`)."""
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.has_qk_norm else (None, None)
        return (norm_rope.Part(self.num_heads, None if q_norm is None else q_norm.weight[...],
                               0, heads_axis=True),
                norm_rope.Part(self.num_kv_heads, None if k_norm is None else k_norm.weight[...],
                               k_column_block))

    def _rotate_fused(self, fused: jax.Array, positions: jax.Array,
                      backends: ModelBackends) -> tuple[jax.Array, jax.Array]:
        """q ``[T, heads, D]`` and k ``[T, kv_heads, D]`` normed and rotated by one kernel
        reading their columns of :meth:`_fused_qkv`'s array in place (k's block follows q's:
        ``heads / kv_heads`` blocks of its width), the rotation table read once."""
        q_norm = self.q_norm if self.has_qk_norm else None
        q, k = norm_rope.norm_rope_parts(
            fused, self._qk_parts(self.num_heads // self.num_kv_heads), positions,
            self.rope_theta, self.head_dim,
            None if q_norm is None else q_norm.eps,  # k_norm's too: both rms_norm_eps
            getattr(backends.attention, "interpret", False), tokens_split=backends.dp_attention)
        return q, k.reshape(k.shape[0], self.num_kv_heads, self.head_dim)

    def __call__(
        self, x: jax.Array, batch: ForwardBatch, meta: AttentionMetadata, kv: jax.Array,
        backends: ModelBackends,
    ) -> tuple[jax.Array, jax.Array]:
        if self.has_sinks and backends.attention.name != "native":
            raise ValueError(f"{self.family}: attention sinks run on --attention-backend "
                             f"native only ({backends.attention.name} has none)")
        q, k, v = self._projections(x, meta.positions, backends)
        v = v.reshape(x.shape[0], self.num_kv_heads, self.head_dim)
        scale = self.head_dim**-0.5
        window = self.window

        def write_and_attend(q: jax.Array | tuple[jax.Array, jax.Array],
                             new: tuple[jax.Array, jax.Array], kv: jax.Array,
                             slots: jax.Array, meta: AttentionMetadata
                             ) -> tuple[jax.Array, jax.Array]:
            # Write first, then read everything (prefix and new tokens) from the written
            # cache: the reads depend on the scatter, so XLA updates the donated cache in place.
            kv = write_kv(kv, *new, slots)
            sinks = None
            if isinstance(q, tuple):  # the sinks ride with the queries: (q, [T, heads])
                q, sinks = q[0], q[1][0]
            return backends.attention.attend(q, kv, meta, scale, sinks, window), kv

        query: jax.Array | tuple[jax.Array, jax.Array] = q
        if self.has_sinks:
            # Broadcast over the tokens, they split like q (by head over "tensor", by token
            # over DP attention's ranks), so a rank's heads get their own sinks.
            query = (q, jnp.broadcast_to(self.sinks[...], q.shape[:2]))
        if backends.dp_attention:
            out, kv = rank_local_attention(
                write_and_attend, query, (k, v), kv, batch.out_cache_loc, meta,
                heads_split=self.kv_heads_split, cache_heads_split=self.kv_heads_split)
        else:
            out, kv = write_and_attend(query, (k, v), kv, batch.out_cache_loc, meta)
        out = out.reshape(x.shape[0], -1) @ self.o_proj[...]
        if self.has_o_bias:
            out = out + self.o_proj_bias[...]
        return out, kv


class SparseMoeBlock(nnx.Module):
    """Router, routed experts (``ep_moe_forward`` with the M8 backends) and shared experts.

    Experts are stacked in the layer's physical order (``layers/moe/placement.py``): a static
    placement is recorded as ``expert_order`` (row i holds logical expert ``expert_order[i]``;
    the loader sets the order it stacked them in; default: identity, contiguous).

    With EPLB (``config.eplb``) there are ``P = E + R`` physical rows, row p holding logical
    expert ``physical_to_logical[p]``, and the placement is data: ``replicas [E, R + 1]``
    (physical rows of each logical expert) and ``num_replicas [E]``.
    """

    def __init__(self, config: ModelConfig, layer_id: int, dtype: jnp.dtype,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 router_name: str = "gate") -> None:
        hidden, experts, inter = (
            config.hidden_size, config.num_physical_experts, config.moe_intermediate_size,
        )
        self.layer_id = layer_id
        self.router_name = router_name  # HF attribute of the router (gpt-oss: "router")
        setattr(self, router_name, create_router(config))
        gate_name, up_name, down_name = expert_names
        self.w_gate = param((experts, hidden, inter), dtype, W_GATE_UP_SPEC, (gate_name, True))
        self.w_up = param((experts, hidden, inter), dtype, W_GATE_UP_SPEC, (up_name, True))
        self.w_down = param((experts, inter, hidden), dtype, W_DOWN_SPEC, (down_name, True))
        self.expert_order: tuple[int, ...] = tuple(range(experts))
        # EPLB: the placement is data (ep_moe.ExpertLocation), set by the loader and swapped by
        # a rebalance; the compiled step does not depend on it. Off: nothing is added.
        self.eplb = config.eplb
        if self.eplb:
            max_replicas = config.num_redundant_experts + 1
            self.replicas = ExpertLocation(jnp.zeros((config.num_experts, max_replicas),
                                                     jnp.int32), out_sharding=(),
                                          eager_sharding=False)
            self.num_replicas = ExpertLocation(jnp.ones((config.num_experts,), jnp.int32),
                                               out_sharding=(), eager_sharding=False)
        # Shared experts: every token's, never routed and never in the returned rows.
        # Qwen2-MoE has one ("shared_expert") scaled by a sigmoid gate; DeepSeek-V3 and
        # GLM-4.5 add theirs ("shared_experts", n of them as one MLP of n times the width).
        self.shared_name = None
        if config.num_shared_experts:
            self.shared_name = "shared_expert" if config.shared_expert_gated else "shared_experts"
            setattr(self, self.shared_name,
                    DenseMLP(hidden, config.shared_expert_intermediate_size, dtype))
        self.gated_shared = config.shared_expert_gated and self.shared_name is not None
        if self.gated_shared:
            self.shared_expert_gate = param((hidden, 1), dtype, (None, None))

    def __call__(self, x: jax.Array, backends: ModelBackends,
                 sequence_split: bool = False) -> tuple[jax.Array, LayerRouting]:
        """The block's output and its router choice (logical ids, before any device-expert
        mapping is applied, and their weights). ``sequence_split``: x is split by token over
        "tensor" (with DP attention, over "expert" x "tensor": ``sequence_parallel``), and so
        is the output."""
        topk_weights, topk_ids = getattr(self, self.router_name)(x)
        dp = backends.dp_attention
        if sequence_split:  # the router on the split tokens (else XLA runs it on all of them)
            topk_weights, topk_ids = (sequence_parallel.split_tokens(a, dp)
                                      for a in (topk_weights, topk_ids))
        out = ep_moe_forward(  # x split by token: gathered inside (``sequence_split``)
            self.expert_input(x), topk_ids, topk_weights, self.w_gate[...], self.w_up[...],
            self.w_down[...], self.expert_order, backend=self.expert_backend(backends),
            location=(self.replicas[...], self.num_replicas[...]) if self.eplb else None,
            tokens_split=backends.dp_attention, all_to_all=backends.moe_all_to_all,
            sequence_split=sequence_split, one_hot_lookups=backends.one_hot_lookups,
        )
        out = self.expert_output(out, topk_ids, topk_weights)
        if self.shared_name is not None:
            if sequence_split:
                x = sequence_parallel.gather_tokens(x, dp)
            shared = getattr(self, self.shared_name)(x)
            if self.gated_shared:
                shared = jax.nn.sigmoid(x @ self.shared_expert_gate[...]) * shared
            out = out + shared
        return out, (topk_ids, topk_weights)

    # What a family's experts add around the shared expert compute (gpt-oss: models/gpt_oss.py).
    def expert_input(self, x: jax.Array) -> jax.Array:
        return x

    def expert_backend(self, backends: ModelBackends) -> MoEBackend:
        return backends.moe

    def expert_output(self, out: jax.Array, topk_ids: jax.Array,
                      topk_weights: jax.Array) -> jax.Array:
        return out


class DecoderLayer(nnx.Module):
    # The MoE block's attribute (and HF name): Mixtral calls it "block_sparse_moe".
    def __init__(self, config: ModelConfig, layer_id: int, dtype: jnp.dtype,
                 attention_cls: type[nnx.Module], moe_name: str = "mlp",
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 moe_cls: type[SparseMoeBlock] = SparseMoeBlock,
                 router_name: str = "gate") -> None:
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = attention_cls(config, dtype, layer_id=layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.ffn_name = moe_name if config.moe_layers[layer_id] else "mlp"
        if config.moe_layers[layer_id]:
            ffn = moe_cls(config, layer_id, dtype, expert_names, router_name)
        else:
            ffn = DenseMLP(config.hidden_size, config.intermediate_size, dtype)
        setattr(self, self.ffn_name, ffn)
        self.is_moe = config.moe_layers[layer_id]

    def __call__(
        self, h: jax.Array, batch: ForwardBatch, meta: AttentionMetadata, kv: jax.Array,
        backends: ModelBackends,
    ) -> tuple[jax.Array, jax.Array, LayerRouting]:
        """The new hidden state, the layer's cache and its router choice (None: dense)."""
        split = sequence_parallel.splits(backends, h.shape[0])
        if split:  # h split by token; each block's input gathered, its output reduce-scattered
            dp = backends.dp_attention
            h = sequence_parallel.split_tokens(h, dp)
            gather = functools.partial(sequence_parallel.gather_tokens, dp_attention=dp)
            scatter = functools.partial(sequence_parallel.split_tokens, dp_attention=dp)
        else:
            gather = scatter = lambda a: a
        attn_out, kv = self.self_attn(gather(self.input_layernorm(h)), batch, meta, kv,
                                      backends)
        h = h + scatter(attn_out)
        x = self.post_attention_layernorm(h)
        ffn = getattr(self, self.ffn_name)
        routing = None
        if self.is_moe:  # the router runs on the split tokens, the experts on all of them
            out, routing = ffn(x, backends, split)
        else:
            out = ffn(gather(x))
        return h + scatter(out), kv, routing


class MoeModel(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, attention_cls: type[nnx.Module],
                 moe_name: str, expert_names: tuple[str, str, str],
                 moe_cls: type[SparseMoeBlock] = SparseMoeBlock,
                 router_name: str = "gate") -> None:
        self.embed_tokens = param((config.vocab_size, config.hidden_size), dtype, (None, None))
        self.layers = nnx.List([
            DecoderLayer(config, i, dtype, attention_cls, moe_name, expert_names, moe_cls,
                         router_name)
            for i in range(config.num_hidden_layers)
        ])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def __call__(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_caches: KVCache,
        backends: ModelBackends,
    ) -> tuple[jax.Array, KVCache, list[LayerRouting]]:
        """Hidden states, new caches, and each layer's router choice (None: dense)."""
        if backends.dp_attention:  # each attention rank holds its own tokens' hidden states
            ids = jax.lax.with_sharding_constraint(batch.input_ids, P(DATA_AXIS))
            h = jax.lax.with_sharding_constraint(
                jnp.take(self.embed_tokens[...], ids, axis=0), P(DATA_AXIS, None))
        else:
            h = jnp.take(self.embed_tokens[...], batch.input_ids, axis=0)
        return run_layers(self.layers, h, batch, meta, kv_caches, backends)


def run_layers(layers: Any, h: jax.Array, batch: ForwardBatch, meta: AttentionMetadata,
               caches: list, backends: ModelBackends) -> tuple[jax.Array, list, list]:
    """The decoder layers in order, each with its own cache entry (a KV array, or a
    linear-attention layer's states): the hidden states, the new caches, each layer's
    routing."""
    new_caches, layer_routing = [], []
    for layer, cache in zip(layers, caches, strict=True):
        h, cache, routing = layer(h, batch, meta, cache, backends)
        new_caches.append(cache)
        layer_routing.append(routing)
    return h, new_caches, layer_routing


class MoeForCausalLM(nnx.Module):
    """A family is this class with its attention module and HF names (see the subclasses)."""

    attention_cls: type[nnx.Module] = GqaAttention
    moe_name = "mlp"  # HF attribute of a layer's MoE block
    expert_names = ("gate_proj", "up_proj", "down_proj")  # HF names of an expert's projections
    moe_cls: type[SparseMoeBlock] = SparseMoeBlock  # the MoE block (gpt-oss: its own)
    router_name = "gate"  # HF attribute of the MoE block's router

    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        self.config = config
        self.model = MoeModel(config, dtype, self.attention_cls, self.moe_name, self.expert_names,
                              self.moe_cls, self.router_name)
        if not config.tie_word_embeddings:
            self.lm_head = param((config.hidden_size, config.vocab_size), dtype, (None, "tensor"))

    def __call__(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_caches: KVCache,
        backends: ModelBackends, return_hidden: bool = False,
    ) -> tuple:
        """Returns float32 logits ``[len(batch.logits_indices), vocab]`` (each row's last new
        token, then any input-logprob tokens), the new caches and the step's routing (what
        ``backends.routing`` asks for; None when nothing is); with ``return_hidden`` also
        every token's last hidden state ``[T, H]`` before the final norm (EAGLE's input)."""
        h, kv_caches, layer_routing = self.model(batch, meta, kv_caches, backends)
        head = self.model.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        indices = batch.logits_indices
        rows = batch.sampled_rows
        if backends.dp_attention:
            # Each rank its own sampled rows (then any input-logprob rows, gathered whole).
            picked = [take_rank_rows(h, indices[:rows], batch.dp_size)]
            if indices.shape[0] > rows:
                picked.append(jnp.take(h, indices[rows:], axis=0))
            logits = jnp.concatenate([self.model.norm(x) @ head for x in picked])
        elif backends.batch_invariant and indices.shape[0] > rows:
            # The sampled rows keep their shapes (norm and LM head) whether or not a batch-mate
            # asked for input logprobs (the extra rows): kernels depend on the row count.
            parts = [self.model.norm(jnp.take(h, ix, axis=0)) @ head
                     for ix in (indices[:rows], indices[rows:])]
            logits = jnp.concatenate(parts)
        else:
            logits = self.model.norm(jnp.take(h, indices, axis=0)) @ head
        logits = logits.astype(jnp.float32)
        routing = None
        if backends.routing.ids:  # nothing asked: no op added
            # Stacked once, after the logits (the order of the ops the step had when the
            # layers captured into the capturer: the same program, the same float results).
            top_k = self.config.num_experts_per_tok
            routing = stack_routing(layer_routing, top_k, backends.routing)
        return (logits, kv_caches, routing, h) if return_hidden else (logits, kv_caches, routing)
