"""Routing replay on tunix's Qwen3-MoE: its forward with every MoE layer's top-k given.

``forced_forward(model, tokens, positions, attention_mask, forced)`` is tunix's Qwen3 forward
(its own embedder, attention, norms and LM head modules, called as its decoder layer calls them)
with each MoE layer's experts chosen by ``forced[:, :, layer]`` ``[B, T, k]`` instead of the
router's top-k:

- ids: the given ones; a ``(token, layer)`` row holding a negative id (``-1``: no replay
  there, e.g. padding or the last generated token) keeps the router's own top-k;
- weights: ``p = softmax(router logits)`` (float32, the router's own logits on the trainer's
  activations), ``w = p[ids] / sum(p[ids])``, as tunix's router renormalises its top-k. So the
  router still gets a gradient through the weights of the experts it is made to use (what
  MaxText's ``forced_routed_experts`` and the R3 paper do);
- experts: each token through its k experts only (``grouped_experts.grouped_swiglu``): one
  program per layer whatever the expert count, where tunix 0.1.7's CPU path writes a block per
  expert (its 48-layer, 128-expert model takes minutes to compile).

It also returns the ids every layer used, ``[B, T, L, k]`` (the forced ones, or the router's
where a row was unset): what a benchmark compares with the rollout's.

``ReplayQwen3`` is tunix's ``Qwen3`` whose ``__call__`` also takes ``forced_routed_experts=``
(the keyword tunix's ``compute_per_token_logps`` passes the rollout's routing under, to models
that take it, since google/tunix#2046); without it, it is tunix's forward unchanged.
``replayed_per_token_logps`` is tunix's per-token logprobs of completions under given routing.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.qwen3 import model as qwen3_lib
from tunix.rl import common

from sgl_jax.integrations.grouped_experts import grouped_swiglu


def replay_moe(moe: qwen3_lib.MoELayer, x: jax.Array, forced: jax.Array | None,
               method: str = "auto") -> tuple[jax.Array, jax.Array]:
    """One tunix MoE layer on x [B, T, D] with ids ``forced`` [B, T, k] (None or rows with a
    negative id: the router's own top-k) -> (output [B, T, D] in the layer's dtype, ids used
    [B, T, k] int32)."""
    k = moe.experts_per_tok
    probs = jax.nn.softmax(moe.router(x).astype(jnp.float32), axis=-1)  # [B, T, E]
    _, own = jax.lax.top_k(probs, k)
    ids = own
    if forced is not None:
        forced = forced.astype(jnp.int32)
        ids = jnp.where(jnp.any(forced < 0, axis=-1, keepdims=True), own, forced)
    picked = jnp.take_along_axis(probs, ids, axis=-1)
    weights = (picked / jnp.sum(picked, axis=-1, keepdims=True)).astype(moe.dtype)
    b, t, d = x.shape
    y = grouped_swiglu(
        x.reshape(b * t, d).astype(moe.dtype), ids.reshape(b * t, k), weights.reshape(b * t, k),
        moe.gate_proj.value.astype(moe.dtype), moe.up_proj.value.astype(moe.dtype),
        moe.down_proj.value.astype(moe.dtype), method=method)
    return y.reshape(b, t, d).astype(moe.dtype), ids


def _decoder_layer(layer: qwen3_lib.DecoderLayer, x: jax.Array, positions: jax.Array,
                   attention_mask: jax.Array | None, segment_ids: jax.Array | None,
                   forced: jax.Array | None, method: str) -> tuple[jax.Array, jax.Array]:
    # tunix's DecoderLayer.block with the MoE call replaced.
    _, attn = layer.attn(layer.input_layernorm(x), positions, None, attention_mask,
                         segment_ids=segment_ids)
    x = x + attn
    y, ids = replay_moe(layer.mlp, layer.post_attention_layernorm(x), forced, method)
    return x + y, ids


def forced_forward(
    model: qwen3_lib.Qwen3,
    input_tokens: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array | None,
    forced_routed_experts: jax.Array | None,
    segment_ids: jax.Array | None = None,
    method: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """tunix's Qwen3-MoE forward (no KV cache) under the routing ``forced_routed_experts``
    [B, T, num_layers, k] (None: the router's everywhere) -> (float32 logits [B, T, V], ids
    used [B, T, num_layers, k])."""
    cfg = model.config
    if cfg.num_experts is None:
        raise ValueError("routing replay needs a Qwen3-MoE model (num_experts is None)")
    if forced_routed_experts is not None:
        want = (*input_tokens.shape, cfg.num_layers, cfg.num_experts_per_tok)
        if tuple(forced_routed_experts.shape) != want:
            raise ValueError(f"forced_routed_experts {tuple(forced_routed_experts.shape)} must "
                             f"be [batch, tokens, num_layers, top_k] = {list(want)}")
    layer_fn = _decoder_layer
    remat = cfg.remat_config
    if remat in (qwen3_lib.RematConfig.DECODER, qwen3_lib.RematConfig.DECODER.value):
        layer_fn = nnx.remat(_decoder_layer, static_argnums=(6,))
    x = model.embedder.encode(input_tokens)
    used = []
    for i, layer in enumerate(model.layers):
        forced = None if forced_routed_experts is None else forced_routed_experts[:, :, i]
        x, ids = layer_fn(layer, x, positions, attention_mask, segment_ids, forced, method)
        used.append(ids)
    x = model.final_norm(x)
    logits = model.embedder.decode(x) if cfg.use_tied_embedding else model.lm_head(x)
    return logits.astype(jnp.float32), jnp.stack(used, axis=2)


class ReplayQwen3(qwen3_lib.Qwen3):
    """tunix's Qwen3(-MoE) with ``__call__(..., forced_routed_experts=)``: the same parameters
    (so tunix's loaders, optimizers and weight syncs see the same tree), the same forward when
    the keyword is absent or None; given ``[B, T, num_layers, k]`` ids, ``forced_forward``.
    Build one from a loaded model with ``ReplayQwen3.from_model(model)``."""

    # How the experts are computed under replay (grouped_experts.METHODS).
    expert_method: str = "auto"

    @classmethod
    def from_model(cls, model: qwen3_lib.Qwen3) -> ReplayQwen3:
        """A ReplayQwen3 holding ``model``'s parameter arrays (no copy; training one does not
        change the other)."""
        abstract = nnx.eval_shape(lambda: cls(model.config, rngs=nnx.Rngs(0)))
        nnx.update(abstract, nnx.state(model))
        return abstract

    def __call__(  # the signature of tunix's Qwen3.__call__, plus the replay keyword
        self,
        input_tokens: jax.Array,
        positions: jax.Array,
        cache: Any,
        attention_mask: jax.Array,
        output_hidden_states: bool = False,
        segment_ids: jax.Array | None = None,
        forced_routed_experts: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        if forced_routed_experts is None:
            return super().__call__(input_tokens, positions, cache, attention_mask,
                                    output_hidden_states, segment_ids)
        if cache is not None:
            raise ValueError("forced_routed_experts is for a training forward: cache must be None")
        if output_hidden_states:
            raise ValueError("output_hidden_states is not supported with forced_routed_experts")
        logits, _ = forced_forward(self, input_tokens, positions, attention_mask,
                                   jnp.asarray(forced_routed_experts), segment_ids,
                                   self.expert_method)
        return logits, None


def replayed_per_token_logps(
    model: qwen3_lib.Qwen3,
    prompt_tokens: jax.Array,
    completion_tokens: jax.Array,
    routed_experts: jax.Array | None,
    *,
    pad_id: int,
    eos_id: int,
    temperature: float = 1.0,
) -> jax.Array:
    """float32 [B, C]: tunix's per-token logprobs of the completions (``tunix.rl.common.
    compute_per_token_logps``: the same masks, positions and ``log_softmax(logits / T)``, no
    stop-gradient) with every MoE layer routed by ``routed_experts`` [B, P + C, num_layers, k]
    (``align_routed_experts``' layout; -1 rows: the router's own top-k; None: the router's
    everywhere, through the same program). Differentiable in the model's parameters, the
    routers' included (through the gate weights)."""
    if routed_experts is not None and not isinstance(routed_experts, jax.core.Tracer):
        routed_experts = jnp.asarray(routed_experts, jnp.int32)
        if int(routed_experts.max(initial=-1)) >= model.config.num_experts:
            raise ValueError(f"routed_experts holds ids >= num_experts "
                             f"({model.config.num_experts})")
    # As tunix's compute_per_token_logps: a pure function of (graphdef, state), so that it
    # composes with any transform around it and writes nothing back into the model.
    graphdef, state = nnx.split(model)
    return _replayed_logps(graphdef, state, jnp.asarray(prompt_tokens),
                           jnp.asarray(completion_tokens), routed_experts, pad_id=pad_id,
                           eos_id=eos_id, temperature=float(temperature))


@functools.partial(jax.jit, static_argnames=("pad_id", "eos_id", "temperature"))
def _replayed_logps(graphdef: nnx.GraphDef, state: nnx.State, prompt_tokens: jax.Array,
                    completion_tokens: jax.Array, routed_experts: jax.Array | None, *,
                    pad_id: int, eos_id: int, temperature: float) -> jax.Array:
    model = nnx.merge(graphdef, state)
    tokens, positions, attention_mask, segment_ids = common.process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id)
    method = getattr(model, "expert_method", "auto")
    logits, _ = forced_forward(model, tokens, positions, attention_mask, routed_experts,
                               segment_ids, method)
    width = completion_tokens.shape[1]
    logits = logits[:, -width - 1:-1, :]
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return common.selective_log_softmax(logits, tokens[:, -width:])
