"""The jitted step: the model forward, sampling, the routing's consumers and, with EAGLE /
NEXTN, the draft chain, as one function of (parameters, device state, batch).

``StepProgram`` holds what the step is specialised on and never changes after start-up (the
model's graph, the backends, the capturer and the recorder, the page geometry). Its
``_step_impl`` runs only while JAX traces it, once per padded shape: ``num_compiles`` counts
those traces. The device state (KV cache, page table, next inputs, the recorder's state) goes in
donated and comes out replaced, so it is updated in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sgl_jax.srt.forward_batch_info import ForwardBatch
from sgl_jax.srt.layers.attention import AttentionMetadata, update_page_table
from sgl_jax.srt.layers.linear_attention.verify import commit
from sgl_jax.srt.layers.logprobs import LogprobOutput, logprob_outputs
from sgl_jax.srt.layers.moe.expert_distribution import ExpertDistributionRecorder
from sgl_jax.srt.layers.moe.routed_experts_capturer import RoutedExpertsCapturer
from sgl_jax.srt.layers.sampler import apply_vocab_mask, sample, vocab_chunks_for
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.speculative import device_inputs
from sgl_jax.srt.speculative.eagle import accepted_counts, draft_step


@dataclass
class StepOutput:
    next_token_ids: jax.Array  # [B_pad] int32
    logits: jax.Array  # [B_pad, vocab] float32
    # The capturer's rows (a ``Routing``: ids [T_pad, layers, k] in the host table's dtype,
    # no router = its maximum, with routing weights when captured), when enabled; in a batch
    # where only some requests asked, or under DP attention (rows in the rank-by-rank token
    # order), a ``GatheredRows`` (what is copied to the host, and where each token's row is).
    routed_rows: Any
    logprobs: LogprobOutput | None = None  # when some request asked
    # --expert-distribution-recorder-mode per_pass / per_token: this pass's counts or ids.
    expert_pass: Any = None
    # EAGLE: every row's next draft tokens [B_pad, num_steps] (extend and verify steps).
    drafts: jax.Array | None = None
    # A verify step with device inputs: which of its slots' rows will be known (as
    # ``RoutedExpertsCapturer.on_forward_launch`` takes it), marked when it is processed.
    known_rows: bool | np.ndarray | None = None


@dataclass(eq=False)  # hashed by identity: jax.jit keys its cache on the bound method
class StepProgram:
    graphdef: Any  # the target model's (nnx.split)
    param_treedef: Any  # the step takes the parameters as a flat list of leaves
    backends: ModelBackends
    capturer: RoutedExpertsCapturer
    recorder: ExpertDistributionRecorder | None
    mesh: Mesh
    platform: str
    deterministic: bool  # batch-invariant mode: sampled rows and input-logprob rows apart
    page_size: int
    no_req_slot: int  # the padding rows' request slot
    tie_word_embeddings: bool
    # EAGLE / NEXTN: the draft's chain length (0: no draft), graph and parameter structure.
    draft_steps: int = 0
    draft_graphdef: Any = None
    draft_treedef: Any = None
    num_compiles: int = 0  # traces so far: one per compiled shape

    # Named as when it was a ModelRunner method, so the compiled module is still
    # ``jit__step_impl`` in HLO dumps, profiles and AOT reports.
    def _step_impl(
        self, param_leaves: list, kv_caches: list, req_to_page: jax.Array,
        next_inputs: jax.Array, expert_state: Any, batch: ForwardBatch,
        draft_leaves: list | None = None,
    ) -> tuple:
        self.num_compiles += 1  # runs only while tracing: one count per compiled shape
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, param_leaves))
        if batch.verify_slots is not None:  # EAGLE / NEXTN: inputs, positions and slots
            batch = device_inputs.resolve(batch, next_inputs)
        token_to_req, positions = batch.token_to_req, batch.positions
        req_slot = jnp.take(batch.req_pool_indices, token_to_req, mode="fill",
                            fill_value=self.no_req_slot)
        input_ids = jnp.where(batch.input_ids < 0, next_inputs[req_slot, device_inputs.TOKEN],
                              batch.input_ids)
        batch = dataclasses.replace(batch, input_ids=input_ids)
        req_to_page = update_page_table(
            req_to_page, req_slot, positions, batch.out_cache_loc, self.page_size
        )
        meta = AttentionMetadata.build(batch, token_to_req, positions, req_to_page, self.page_size)
        draft_kv = None
        if self.draft_steps:  # EAGLE: the draft's KV layer is the cache's last
            kv_caches, draft_kv = kv_caches[:-1], kv_caches[-1]
        drafting = self.draft_steps > 0 and not batch.forward_mode.is_decode
        if drafting:
            logits, kv_caches, routing, hidden = model(batch, meta, kv_caches, self.backends,
                                                       return_hidden=True)
        else:
            logits, kv_caches, routing = model(batch, meta, kv_caches, self.backends)
        real_tokens = token_to_req < batch.batch_size
        order = batch.dp_order
        # The routing's consumers (None when nothing asked for it: no op in the step). The
        # routed-experts rows stay in the step's token order: under DP attention the host puts
        # them in the scheduler's (``select_rows``); XLA:TPU counts the row gather of
        # [T, layers, k] at about 70 MB per MoE layer of the 235B at 8,192 tokens.
        routed_rows = self.capturer.step_rows(routing)
        expert_pass = None
        if self.recorder is not None:  # real tokens only: padded ones have no batch row
            # Counts are the same in any token order: only per-token records are put in the
            # scheduler's (DP attention: a row gather).
            ids = (routing.ids, real_tokens)
            if order is not None and self.recorder.mode == "per_token":
                ids = jax.tree.map(lambda x: x[order.tokens], ids)
            expert_state, expert_pass = self.recorder.record_step(expert_state, *ids)
        rows = batch.sampled_rows
        sampled_logits = logits[:rows]  # then, with logprobs, the input-logprob rows
        if batch.sampling.vocab_mask is not None:  # constrained decoding
            # Sampling and the sampled rows' logprobs see the masked logits (SGLang's order).
            sampled_logits = apply_vocab_mask(sampled_logits, batch.sampling.vocab_mask)
            logits = jnp.concatenate([sampled_logits, logits[rows:]])
        next_ids = sample(sampled_logits, batch.sampling,
                          vocab_chunks=vocab_chunks_for(self.platform))
        if not batch.forward_mode.is_verify:  # a verify step's: written with its drafts
            # Rows that only end a prompt chunk also write here; no step reads a slot's last
            # token before the step that samples the request's real next token has written it.
            next_inputs = next_inputs.at[batch.req_pool_indices, device_inputs.TOKEN].set(
                next_ids[: batch.batch_size])
        logprobs = None
        if batch.logprobs is not None:
            logprobs = self._logprobs(logits, batch, next_ids)
        if order is not None:
            next_ids, sampled_logits = next_ids[order.rows], sampled_logits[order.rows]
        drafts = None
        accepted = (accepted_counts(batch, token_to_req, next_ids)
                    if batch.forward_mode.is_verify else None)
        if accepted is not None:  # linear-attention layers: their states after the accepted
            # tokens only, written now that the step knows them (linear_attention/verify.py)
            kv_caches = [commit(entry, accepted) for entry in kv_caches]
        if drafting:
            draft = nnx.merge(self.draft_graphdef,
                              jax.tree.unflatten(self.draft_treedef, draft_leaves))
            embed = model.model.embed_tokens[...]
            head = embed.T if self.tie_word_embeddings else model.lm_head[...]
            if draft.reads_normed_hidden:  # Qwen3.5's MTP layer
                hidden = model.model.norm(hidden)
            drafts, draft_kv, req_to_page = draft_step(
                draft, embed, head, batch, meta, hidden, next_ids, draft_kv, req_to_page,
                self.backends, self.draft_steps, self.page_size, self.no_req_slot, accepted)
            next_inputs = device_inputs.record(next_inputs, batch, next_ids, drafts, accepted)
        if draft_kv is not None:
            kv_caches = [*kv_caches, draft_kv]
        # What the host reads is replicated: on a multi-host job every node holds all of it
        # (rank 0 reads its own copy; no gather per step).
        replicated = NamedSharding(self.mesh, PartitionSpec())
        next_ids, routed_rows, logprobs, expert_pass, drafts = jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(x, replicated),
            (next_ids, routed_rows, logprobs, expert_pass, drafts))
        return (next_ids, sampled_logits, kv_caches, req_to_page, next_inputs, routed_rows,
                logprobs, expert_state, expert_pass, drafts)

    def _logprobs(self, logits: jax.Array, batch: ForwardBatch,
                  next_ids: jax.Array) -> LogprobOutput:
        """The logprobs of the sampled rows (in the step's row order) and of the extra
        input-logprob rows after them; under DP attention the sampled rows are put in the
        scheduler's order, the extra rows stay as they are."""
        lp, rows = batch.logprobs, batch.sampled_rows
        temps = jnp.concatenate([batch.sampling.temperatures, lp.extra_temperatures])
        targets = jnp.concatenate([next_ids, lp.extra_targets])
        if self.deterministic and logits.shape[0] > rows:
            # Sampled rows and input-logprob rows apart: each part has a fixed shape.
            parts = [logprob_outputs(logits[sl], temps[sl], targets[sl], lp.token_ids[sl])
                     for sl in (slice(0, rows), slice(rows, None))]
            logprobs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *parts)
        else:
            logprobs = logprob_outputs(logits, temps, targets, lp.token_ids)
        order = batch.dp_order
        if order is not None:  # the sampled rows in the scheduler's order, then the extra
            logprobs = jax.tree.map(
                lambda x: jnp.concatenate([x[:rows][order.rows], x[rows:]]), logprobs)
        return logprobs
