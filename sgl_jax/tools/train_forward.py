"""A plain causal forward of the serving model's own modules, for training (``train_tiny``).

Serving runs the model over a paged KV cache (``models/common.py``); training needs the same
maths on dense ``[batch, seq]`` windows, differentiable, with the router's full probabilities
for a load-balancing loss. This module walks the very ``nnx`` modules the engine serves (the
embedding, norms, attention projections and q/k norms, ``apply_rotary``, the router module and
``ep_moe_forward`` with the ``dense`` expert backend, the final norm and LM head), so trained
parameters are the engine's parameters and nothing is re-implemented except the attention
kernel: a dense causal softmax attention stands in for the paged backends.

Only what the tiny Qwen3-MoE uses is supported (GQA without q/k/v biases, softmax top-k
routing, every layer MoE, untied head): :func:`check_trainable` says so early.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.moe.ep_moe import ep_moe_forward
from sgl_jax.srt.layers.moe.experts import get_moe_backend
from sgl_jax.srt.layers.rotary import apply_rotary
from sgl_jax.srt.models.common import GqaAttention, MoeForCausalLM, SparseMoeBlock

DENSE = get_moe_backend("dense")  # the reference expert compute (training needs no ragged)

def check_trainable(config: ModelConfig) -> None:
    """Raises unless the training forward covers this configuration."""
    problems = []
    if config.attention != "gqa" or config.qkv_bias:
        problems.append("attention must be GQA without q/k/v biases")
    if config.router != "softmax_topk":
        problems.append("the router must be softmax top-k")
    if not all(config.moe_layers) or config.num_shared_experts:
        problems.append("every layer must be MoE, without shared experts")
    if config.tie_word_embeddings or config.rope_scaling is not None:
        problems.append("the LM head must be untied and RoPE unscaled")
    if problems:
        raise ValueError(f"{config.architecture}: " + "; ".join(problems))


@dataclass
class ForwardOut:
    """What one training forward returns (N = batch * seq tokens, L layers, E experts)."""

    logits: jax.Array  # [batch, seq, vocab] float32
    router_probs: jax.Array  # [L, N, E] float32, softmax of the router logits
    topk_ids: jax.Array  # [L, N, k] int32, the experts each token was routed to


def causal_attention(attn: GqaAttention, x: jax.Array, positions: jax.Array,
                     batch: int, seq: int) -> jax.Array:
    """x [N, H] (N = batch * seq, row-major) -> [N, H]; each window attends causally to itself."""
    tokens = x.shape[0]
    q = (x @ attn.q_proj[...]).reshape(tokens, attn.num_heads, attn.head_dim)
    k = (x @ attn.k_proj[...]).reshape(tokens, attn.num_kv_heads, attn.head_dim)
    v = (x @ attn.v_proj[...]).reshape(tokens, attn.num_kv_heads, attn.head_dim)
    if attn.has_qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = apply_rotary(q, positions, attn.rope_theta, attn.rotary_dim)
    k = apply_rotary(k, positions, attn.rope_theta, attn.rotary_dim)
    # GQA: query head h reads KV head h // group (Hugging Face's repeat_kv order).
    group = attn.num_heads // attn.num_kv_heads
    q = q.reshape(batch, seq, attn.num_heads, attn.head_dim)
    k = jnp.repeat(k.reshape(batch, seq, attn.num_kv_heads, attn.head_dim), group, axis=2)
    v = jnp.repeat(v.reshape(batch, seq, attn.num_kv_heads, attn.head_dim), group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * attn.head_dim**-0.5
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(tokens, -1)
    return out @ attn.o_proj[...]


def moe(block: SparseMoeBlock, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The MoE block as the engine runs it (router module, ``ep_moe_forward``, dense backend)
    -> (output [N, H], router probabilities [N, E], top-k ids [N, k])."""
    probs = jax.nn.softmax(x.astype(jnp.float32) @ block.gate.weight[...], axis=-1)
    weights, ids = block.gate(x)
    out = ep_moe_forward(x, ids, weights, block.w_gate[...], block.w_up[...], block.w_down[...],
                         block.expert_order, backend=DENSE)
    return out, probs, ids


def _dropout(x: jax.Array, rate: float, key: jax.Array | None, index: int) -> jax.Array:
    if key is None or rate <= 0:
        return x
    keep = jax.random.bernoulli(jax.random.fold_in(key, index), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def forward(model: MoeForCausalLM, ids: jax.Array, dropout: float = 0.0,
            key: jax.Array | None = None) -> ForwardOut:
    """ids [batch, seq] int32, every window starting at position 0. With ``key``, residual
    dropout of rate ``dropout`` on the embedding and on every attention and MoE output
    (training only: the served model has none)."""
    batch, seq = ids.shape
    inner = model.model
    positions = jnp.tile(jnp.arange(seq, dtype=jnp.int32), batch)
    h = _dropout(jnp.take(inner.embed_tokens[...], ids.reshape(-1), axis=0), dropout, key, 0)
    all_probs, all_ids = [], []
    for i, layer in enumerate(inner.layers):
        attn = causal_attention(layer.self_attn, layer.input_layernorm(h), positions, batch, seq)
        h = h + _dropout(attn, dropout, key, 2 * i + 1)
        out, probs, topk = moe(getattr(layer, layer.ffn_name), layer.post_attention_layernorm(h))
        h = h + _dropout(out, dropout, key, 2 * i + 2)
        all_probs.append(probs)
        all_ids.append(topk)
    logits = (inner.norm(h) @ model.lm_head[...]).astype(jnp.float32)
    return ForwardOut(logits.reshape(batch, seq, -1), jnp.stack(all_probs), jnp.stack(all_ids))


def load_balance_loss(router_probs: jax.Array, topk_ids: jax.Array) -> jax.Array:
    """Switch-Transformer style auxiliary loss, averaged over layers: ``E * sum_e f_e * P_e``
    with ``f_e`` the share of (token, slot) assignments expert e received (not
    differentiable) and ``P_e`` its mean router probability. It is 1 when routing is uniform
    and grows as a few experts take the tokens, so its gradient pushes probability towards
    the under-used experts."""
    num_experts = router_probs.shape[-1]
    assigned = jax.nn.one_hot(topk_ids, num_experts, dtype=jnp.float32)  # [L, N, k, E]
    share = jnp.mean(assigned, axis=(1, 2))  # [L, E], each row sums to 1
    mean_prob = jnp.mean(router_probs, axis=1)  # [L, E]
    return jnp.mean(num_experts * jnp.sum(share * mean_prob, axis=-1))


def next_token_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ids[:, t + 1] from position t."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = ids[:, 1:, None]
    return -jnp.mean(jnp.take_along_axis(logp, target, axis=-1))
