"""EAGLE: a one-layer draft head on the target's hidden states, run inside the target's step.

The draft checkpoint (Hugging Face layout, ``architectures: ["SglJaxEagleDraft"]``; the bundled
model's is ``assets/tiny-qwen3-moe-eagle``, trained by ``tools/train_eagle.py``) holds ``fc``
``[H, 2H]``, one decoder layer of the target's attention shape with a dense SwiGLU MLP, and a
final ``norm``; the embedding and the LM head are the target's (so they follow its weight
updates). Draft position p fuses the target's token at p + 1 with the target's last hidden
state at p (before its final norm): ``z_p = fc([embed(x_{p+1}), f_p])``; the layer's output
``g_p`` gives the draft's logits for x_{p+2} (``norm(g_p) @ lm_head``) and stands in for
``f_{p+1}`` at the next draft step.

In a step (``draft_step``, traced into the target's jitted step):

1. **Draft extend** over the step's tokens, laid out like the target's (same positions, slots
   and pages; the draft's KV is one more layer of the paged cache, at the same slots). In a
   verify step a token's next token is the target's sampled one (for the accepted positions
   that is the sequence's); in an extend step it is the next input token, and at a row's last
   token the sampled one (or, at a prompt chunk's end, the next prompt token the host gives).
2. Per row the last kept position: in a verify step the last accepted one (the acceptance
   rule of ``verify.py``, evaluated here too), in an extend step the row's last token. Its
   ``g`` gives the first draft token.
3. **Chain**: ``num_steps - 1`` single-token draft steps at the following positions, each
   writing its KV to the row's scratch slots (``ForwardBatch.draft_scratch``, positions after
   the step's tokens, allocated by the host and freed after the step) and reading the
   row's draft KV as the paged attention reads any cache.

Draft KV written at rejected positions or in scratch slots is never read as real: every
position the next step keeps is written again by that step's draft extend. A prefix-cache hit
reuses the draft KV its first owner wrote; at the cached prefix's last position that KV fused
the first owner's next token, which may differ: a weaker draft there, never a wrong output
(the target verifies every token).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardBatch, ForwardMode
from sgl_jax.srt.layers.attention import AttentionMetadata
from sgl_jax.srt.layers.attention.base import update_page_table
from sgl_jax.srt.layers.norm import RMSNorm
from sgl_jax.srt.model_loader.loader import SafetensorsCheckpoint, read_params
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.models.common import DecoderLayer, GqaAttention, param

ARCHITECTURE = "SglJaxEagleDraft"
# The draft's attention must have the target's shape: its KV is one more layer of the cache.
_SAME_AS_TARGET = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "vocab_size")


def draft_config(draft_path: str, target: ModelConfig) -> ModelConfig:
    """The draft layer's config: the target's attention, the draft's MLP, norms and RoPE.
    ValueError, saying what differs, for a checkpoint that is not a draft for ``target``."""
    path = os.path.join(draft_path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"speculative_draft_model_path={draft_path!r} has no config.json")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"{draft_path}: architectures {cfg.get('architectures')} is not an "
                         f"EAGLE draft of this engine ([{ARCHITECTURE!r}], see docs/speculative.md)")
    if target.attention != "gqa":
        raise ValueError(f"EAGLE drafts need a GQA target; {target.architecture} uses "
                         f"{target.attention} attention")
    for name in _SAME_AS_TARGET:
        if cfg.get(name) != getattr(target, name):
            raise ValueError(f"{draft_path}: {name}={cfg.get(name)} but the target's is "
                             f"{getattr(target, name)}; the draft must share the target's "
                             "attention shape and vocabulary")
    return dataclasses.replace(
        target, model_path=draft_path, num_hidden_layers=1, moe_layers=(False,),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", target.rms_norm_eps)),
        rope_theta=float(cfg.get("rope_theta", target.rope_theta)),
        # The draft layer is a plain Qwen3 layer whatever the target's attention extras
        # (MiniMax-M2's per-layer qk-norm and partial rotary, gpt-oss's biases, sinks and
        # sliding windows): its checkpoint has none of their tensors.
        qk_norm=True, qkv_bias=False, qk_norm_per_layer=False, o_proj_bias=False,
        attention_sinks=False, sliding_window=0, sliding_layers=(), rotary_dim=0,
    )


class EagleDraft(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        hidden = config.hidden_size
        self.fc = param((2 * hidden, hidden), dtype, (None, None))
        self.layers = nnx.List([DecoderLayer(config, 0, dtype, GqaAttention)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)

    def output_norm(self, g: jax.Array) -> jax.Array:
        return self.norm(g)

    # The step gives it the target's hidden states before the final norm.
    reads_normed_hidden = False

    def chain_features(self, g: jax.Array) -> jax.Array:
        return g  # a chained step's feature: the layer's output itself

    def __call__(self, embedded: jax.Array, features: jax.Array, batch: ForwardBatch,
                 meta: AttentionMetadata, kv: jax.Array, backends: ModelBackends,
                 ) -> tuple[jax.Array, jax.Array]:
        """``g`` ``[T, H]`` (before the norm) for tokens ``embedded`` + ``features``, and the
        draft's KV layer with their K/V written at ``batch.out_cache_loc``."""
        z = jnp.concatenate([embedded, features.astype(embedded.dtype)], axis=-1) @ self.fc[...]
        g, kv, _ = self.layers[0](z, batch, meta, kv, backends)
        return g, kv


def load_draft(config: ModelConfig, mesh: Mesh, dtype: jnp.dtype) -> EagleDraft:
    from sgl_jax.srt.layers.moe.placement import ExpertPlacement

    abstract = nnx.eval_shape(lambda: EagleDraft(config, dtype))
    graphdef, state = nnx.split(abstract)
    placement = ExpertPlacement.contiguous(config.num_experts, mesh.shape["expert"])
    pure = read_params(config, state, mesh, placement, SafetensorsCheckpoint(config.model_path))
    for path, var in nnx.to_flat_state(state):
        var.set_value(pure[path])
    return nnx.merge(graphdef, state)


def accepted_counts(batch: ForwardBatch, token_to_req: jax.Array,
                    next_ids: jax.Array) -> jax.Array:
    """[B] drafts each row of a verify step accepted (``verify.accepted_tokens``' rule): the
    leading run of its tokens whose next input is the token the target sampled there."""
    t = batch.num_tokens
    rows = batch.batch_size
    row = jnp.minimum(token_to_req, rows - 1)
    rel = jnp.arange(t, dtype=jnp.int32) - batch.extend_starts[row]
    following = jnp.concatenate([batch.input_ids[1:], jnp.zeros((1,), jnp.int32)])
    last = rel >= batch.extend_lens[row] - 1
    stop = last | (following != next_ids) | (token_to_req >= rows)
    first_stop = jax.ops.segment_min(jnp.where(stop, rel, t), token_to_req,
                                     num_segments=rows + 1)[:rows]
    return jnp.minimum(first_stop, jnp.maximum(batch.extend_lens - 1, 0))


def draft_step(
    draft: nnx.Module, embed: jax.Array, head: jax.Array, batch: ForwardBatch,
    meta: AttentionMetadata, hidden: jax.Array, next_ids: jax.Array, kv: jax.Array,
    req_to_page: jax.Array, backends: ModelBackends, num_steps: int, page_size: int,
    no_req_slot: int, accepted: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The next drafts ``[B, num_steps]`` of every row, the draft's KV layer and the page
    table (with the scratch positions' pages). ``draft``: an ``EagleDraft`` or a NEXTN
    ``MtpDraft`` / ``Qwen35MtpDraft`` (the same interface); ``embed`` / ``head``: the
    target's; ``hidden``: the features the draft reads (``reads_normed_hidden``). ``accepted``: a
    verify step's ``accepted_counts`` (the runner's, which also records them; None in an
    extend step)."""
    token_to_req, positions = meta.token_to_req, meta.positions
    rows = batch.batch_size
    starts, lens = batch.extend_starts, batch.extend_lens
    real_row = lens > 0
    if batch.forward_mode.is_verify:
        following = next_ids  # [T]: the target's token after each position
        assert accepted is not None, "a verify step's accepted counts"
        kept = starts + accepted
    else:
        last = jnp.maximum(starts + lens - 1, 0)
        following = jnp.concatenate([batch.input_ids[1:], jnp.zeros((1,), jnp.int32)])
        # A row's last token: the sampled one, or the next prompt token at a chunk's end.
        at_end = jnp.where(batch.draft_next_ids >= 0, batch.draft_next_ids, next_ids[:rows])
        following = following.at[jnp.where(real_row, last, batch.num_tokens)].set(
            at_end, mode="drop")
        kept = last
    following = jnp.where(token_to_req < rows, following, 0)
    g, kv = draft(jnp.take(embed, following, axis=0), hidden, batch, meta, kv, backends)

    def propose(g_rows: jax.Array) -> jax.Array:
        logits = draft.output_norm(g_rows) @ head
        return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)

    feature = jnp.take(g, kept, axis=0)  # [B, H]
    drafts = [propose(feature)]
    position = jnp.take(positions, kept, axis=0)  # [B] the kept token's position
    req_slot = jnp.where(real_row, batch.req_pool_indices, no_req_slot)
    scratch = batch.draft_scratch  # [B, num_steps - 1] slots after the step's tokens
    if num_steps > 1:
        first_scratch = batch.prefix_lens + lens  # the position of scratch slot 0
        offsets = jnp.arange(num_steps - 1, dtype=jnp.int32)
        req_to_page = update_page_table(
            req_to_page, jnp.repeat(req_slot, num_steps - 1),
            (first_scratch[:, None] + offsets).reshape(-1), scratch.reshape(-1), page_size)
    for _ in range(num_steps - 1):
        position = position + 1
        page = req_to_page[req_slot, position // page_size]
        slots = jnp.where(real_row, page * page_size + position % page_size, 0)
        chain = ForwardBatch(
            input_ids=drafts[-1], out_cache_loc=slots, req_pool_indices=req_slot,
            prefix_lens=jnp.where(real_row, position, 0),
            extend_lens=real_row.astype(jnp.int32), sampling=batch.sampling,
            forward_mode=ForwardMode.DECODE)
        chain_meta = AttentionMetadata.build(chain, chain.token_to_req, chain.positions,
                                             req_to_page, page_size)
        feature, kv = draft(jnp.take(embed, drafts[-1], axis=0), draft.chain_features(feature),
                            chain, chain_meta, kv, backends)
        drafts.append(propose(feature))
    return jnp.stack(drafts, axis=1), kv, req_to_page
