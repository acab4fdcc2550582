"""The host side of the step's routing, for its two consumers.

The model's routing (every token's top-k experts in every layer) is an output of the step when a
consumer needs it (``layers/moe/routing.py``):

- the routed-experts capturer: rows in the host table's dtype, a fresh output of each step,
  their host copy started at dispatch when the batch asks for them (all of them when every
  request asked, else only the askers' rows, gathered on the device; under DP attention put in
  the scheduler's token order on the host), scattered into the host table at the tokens' KV
  slots when the step is processed;
- with ``--expert-distribution-recorder-mode``, the recorder: its device state (``stat``
  counts) is donated into the step, which also outputs the pass's counts or ids for
  ``per_pass`` / ``per_token`` (docs/expert_load.md).

No shape of the step depends on whether recording is on. On a follower node of a multi-node
job (``keeps_results`` False) neither consumer keeps anything: the results are rank 0's.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardBatch, ModelWorkerBatch
from sgl_jax.srt.layers.moe.expert_distribution import ExpertDistributionRecorder, create_recorder
from sgl_jax.srt.layers.moe.routed_experts_capturer import RoutedExpertsCapturer
from sgl_jax.srt.model_executor.step_program import StepOutput


class RoutingConsumers:
    def __init__(self, server_args: Any, model_config: ModelConfig, mesh: Mesh,
                 num_slots: int, keeps_results: bool, abstract: bool, replicated: Any,
                 one_hot_lookups: bool) -> None:
        self.mesh, self.keeps_results = mesh, keeps_results
        self.capturer = RoutedExpertsCapturer.create(
            enable=server_args.enable_return_routed_experts,
            model_config=model_config,
            # Shared experts (Qwen2-MoE, DeepSeek-V3, GLM-4.5) run as their own dense MLP,
            # not fused into the routed experts as extra ids: the capture sees k columns.
            num_fused_shared_experts=0,
            # An abstract runner never serves and a follower node reads no result: no host
            # rows (they can be gigabytes).
            num_tokens=num_slots if keeps_results and not abstract else 1,
            max_running_requests=int(server_args.max_running_requests),
            chunked_prefill_size=server_args.chunked_prefill_size,
            weights=server_args.enable_return_routed_expert_weights,
        )
        # Compiled for TPU: small-table lookups and counts by one-hot compares, not gathers or
        # scatters (ModelBackends.one_hot_lookups).
        self.recorder: ExpertDistributionRecorder | None = create_recorder(
            server_args, model_config, replicated, abstract, one_hot_lookups)

    @property
    def routing_spec(self) -> Any:
        """What the step's routing output must hold for both consumers."""
        spec = self.capturer.routing_spec
        return spec if self.recorder is None else spec | self.recorder.routing_spec

    def before_launch(self, mwb: ModelWorkerBatch) -> tuple[np.ndarray | None, bool | np.ndarray]:
        """(the tokens whose rows go to the host when only some requests asked, else None;
        which KV slots will hold known rows: every token's, none, or only the askers'),
        marked now unless a verify step with device inputs learns its slots when processed."""
        routed = mwb.routed_tokens()
        known: bool | np.ndarray = mwb.return_routed_experts
        if routed is not None:
            known = np.zeros(mwb.num_tokens, bool)
            known[routed] = True
        if self.keeps_results and mwb.verify_slots is None:
            self.capturer.on_forward_launch(mwb.out_cache_loc, known)
        return routed, known

    def after_launch(self, mwb: ModelWorkerBatch, batch: ForwardBatch, out: StepOutput,
                     routed: np.ndarray | None, known: bool | np.ndarray,
                     rids: list[str] | None) -> int:
        """Starts the host copy of the launched step's rows (the askers' only, in the
        scheduler's token order) and hands the recorder its pass; returns the bytes copied."""
        if mwb.verify_slots is not None:
            out.known_rows = known
        copied = 0
        if mwb.return_routed_experts:
            # DP attention: the step's rows are in its rank-by-rank token order.
            places = None if batch.dp_order is None else np.asarray(batch.dp_order.tokens)
            if routed is not None or places is not None:
                tokens = np.arange(mwb.num_tokens) if routed is None else routed
                with jax.set_mesh(self.mesh):  # every token asked: no gather, as without DP
                    out.routed_rows = self.capturer.select_rows(
                        out.routed_rows, tokens, places, gather=routed is not None)
            if self.keeps_results:  # overlaps the step and the next one
                copied = self.capturer.start_copy(out.routed_rows)
        if self.recorder is not None and self.keeps_results:
            self.recorder.on_launch(out.expert_pass, mwb.forward_mode, mwb.num_tokens,
                                    rids, mwb.prefix_lens, mwb.extend_lens)
        return copied

    def collect(self, out: StepOutput, out_cache_loc: np.ndarray, copy: bool) -> None:
        """A processed step: its routed-experts rows into the host table at the tokens' KV
        slots (``copy``: the step copied them), and the recorder's records of the steps
        launched up to this one (not the next one, in flight)."""
        if out.known_rows is not None:
            self.capturer.on_forward_launch(out_cache_loc, out.known_rows)
        self.capturer.on_forward_end(out.routed_rows, out_cache_loc, len(out_cache_loc), copy)
        if self.recorder is not None and out.expert_pass is not None:
            self.recorder.collect(through=out.expert_pass)
