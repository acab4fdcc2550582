"""ModelRunner: owns the model, the KV cache and the memory pools; runs one jitted step.

A step is the model forward plus sampling, jitted once per (mode, padded tokens, padded rows)
(``step_program.py``; the buckets and the padded batch: ``step_plan.py``). The KV cache, the
device page table and the next-inputs buffer (each request slot's last sampled token; with
EAGLE / NEXTN also its position and drafts, speculative/device_inputs.py) are donated into the
step and replaced by its outputs, so they are updated in place (sizes: ``kv_memory.py``). The
model's routing is an output of the step when a consumer needs it: the routed-experts capturer
and the expert distribution recorder (``routing_consumers.py``). Every trace of the step is
counted in ``num_compiles``: after precompilation, serving inside the buckets must leave it
flat.

The device page table ``req_to_page[req_slot, page_column]`` is device-resident: the step
records the page of every token it computes, and the host sends a request's page row only
once, when the request starts on a cached prefix (``prefix_page_rows``). So what the host
sends per step grows with the batch's tokens and rows, never with batch x context.

``abstract=True`` builds the same runner with no weights and no memory (parameters, KV cache
and buffers are ``jax.ShapeDtypeStruct`` sharded over a mesh of the given ``devices``): it
lowers the very step the engine serves for ahead-of-time compilation (``lower_bucket``), e.g.
on compile-only TPU devices (``tools/aot_report``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.distributed import (
    check_mesh,
    check_parallel_layout,
    make_mesh,
    maybe_initialize_distributed,
    select_devices,
)
from sgl_jax.srt.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    ModelWorkerBatch,
    make_padding_batch,
    shape_key,
)
from sgl_jax.srt.layers.attention import create_attention_backend
from sgl_jax.srt.layers.moe.dispatch import ragged_collective
from sgl_jax.srt.layers.moe.expert_distribution import ExpertDistributionRecorder
from sgl_jax.srt.layers.moe.experts import create_moe_backend
from sgl_jax.srt.layers.moe.placement import ExpertPlacement
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool
from sgl_jax.srt.model_executor import linear_state
from sgl_jax.srt.model_executor.eplb_manager import EplbManager
from sgl_jax.srt.model_executor.kv_memory import (
    KvLayout,
    MemoryPools,
    device_zeros,
    kv_bytes_per_token,
    nbytes,
    resolve_max_total_tokens,
)
from sgl_jax.srt.model_executor.memory_occupation import MemoryOccupation
from sgl_jax.srt.model_executor.routing_consumers import RoutingConsumers
from sgl_jax.srt.model_executor.step_plan import (
    StepPlan,
    StepShapes,
    pad_batch,
    prefix_page_rows,
    round_up,
)
from sgl_jax.srt.model_executor.step_program import StepOutput, StepProgram
from sgl_jax.srt.model_loader.loader import abstract_model, load_model
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.server_args_checks import check_for_linear_attention
from sgl_jax.srt.speculative import device_inputs
from sgl_jax.srt.speculative.eagle import EagleDraft, draft_config, load_draft
from sgl_jax.srt.speculative.nextn import draft_class as mtp_draft_class
from sgl_jax.srt.speculative.nextn import load_mtp, mtp_config

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, platform: str) -> jnp.dtype:
    """``auto``: bfloat16 on accelerators, float32 on CPU (where routing must match a float32
    reference bit for bit)."""
    if name == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


class ModelRunner:
    def __init__(
        self, server_args: ServerArgs, model_config: ModelConfig,
        devices: Sequence[Any] | None = None, abstract: bool = False,
        mesh: Mesh | None = None,
    ) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.abstract = abstract
        # A follower node of a multi-node job dispatches the steps rank 0 sends and reads no
        # result (docs/parallelism.md, "Several hosts").
        self.keeps_results = server_args.node_rank == 0
        if mesh is not None:  # the caller's (Engine(mesh=...), single-process mode)
            devices = list(mesh.devices.flat)
        elif devices is None:
            # Before the first use of the backend: afterwards JAX only sees this host's devices.
            maybe_initialize_distributed(
                server_args.dist_init_addr, server_args.nnodes, server_args.node_rank
            )
            devices = select_devices(jax.devices(), server_args.device_indexes)
        check_for_linear_attention(server_args, model_config.linear_layers, model_config.family)
        check_parallel_layout(model_config, server_args.tp_size, server_args.ep_size, len(devices))
        self.mesh = (check_mesh(mesh, server_args.tp_size, server_args.ep_size) if mesh is not None
                     else make_mesh(devices, server_args.tp_size, server_args.ep_size))
        self.platform = devices[0].platform
        self.dtype = resolve_dtype(server_args.dtype, self.platform)
        # Chosen (and checked) once, before loading; bundled with the routing outputs in
        # self.backends. Batch-invariant mode (docs/determinism.md): one padded shape per mode
        # (the buckets, server_args), the dense MoE (ragged groups depend on the other
        # tokens), attention without the shortcut that depends on the batch-mates' positions,
        # and the sampled rows' logits apart from the input-logprob rows.
        self.deterministic = server_args.enable_deterministic_inference
        attention = create_attention_backend(
            server_args.attention_backend, self.platform, model_config.head_dim,
            server_args.attention_block_size, latent=model_config.attention == "mla",
            batch_invariant=self.deterministic, device_kind=devices[0].device_kind,
        )
        moe_backend = create_moe_backend(server_args.moe_backend, self.platform,
                                         batch_invariant=self.deterministic,
                                         device_kind=devices[0].device_kind)
        # Where the experts live: static (contiguous, or --ep-expert-mapping), or EPLB's
        # dynamic placement with P = E + R physical experts (eplb_manager.py).
        ep_size = self.mesh.shape["expert"]
        self.eplb: EplbManager | None = None
        if server_args.enable_eplb:
            model_config = dataclasses.replace(
                model_config, eplb=True, num_redundant_experts=server_args.ep_num_redundant_experts)
            self.model_config = model_config
            self.eplb = EplbManager(
                model_config, self.mesh, server_args.eplb_algorithm, server_args.nnodes,
                server_args.eplb_rebalance_num_iterations, server_args.init_expert_location)
        elif server_args.ep_expert_mapping:
            self._static_placement = ExpertPlacement.parse(server_args.ep_expert_mapping)
        else:
            self._static_placement = ExpertPlacement.contiguous(model_config.num_experts, ep_size)
        self.max_running_requests = int(server_args.max_running_requests)
        self.context_len = model_config.context_len
        self.page_size = server_args.page_size
        # Host rows of req_to_token hold every position of the longest request, in whole pages;
        # with EAGLE / NEXTN also the draft chain's scratch positions past its last token.
        scratch = (server_args.speculative_num_steps - 1
                   if server_args.speculative_algorithm in ("EAGLE", "NEXTN") else 0)
        self.page_width = round_up(self.context_len + scratch, self.page_size)
        # Speculative decoding: tokens a request brings to a verify step at most (its last
        # token and its drafts); 0 without speculation (no verify shapes).
        self.verify_tokens = server_args.speculative_num_draft_tokens or 0
        self.dp_size = server_args.dp_size
        self.shapes = StepShapes(server_args.bs_paddings(), server_args.token_paddings(),
                                 self.max_running_requests, self.dp_size, self.verify_tokens)

        t0 = time.perf_counter()
        build = abstract_model if abstract else load_model
        # Not kept: the step takes the parameters as arguments, and a weight update replaces
        # them (a reference here would keep the old weights alive).
        model = build(model_config, self.mesh, self.dtype, self.expert_placement)
        self.graphdef, params = nnx.split(model)
        # EAGLE / NEXTN: the draft head, its KV one more layer of the cache (the last), its
        # parameters an argument of the step beside the target's (not part of weight updates).
        self.draft_steps = 0
        self.draft_graphdef = self.draft_treedef = None
        self.draft_leaves: list | None = None
        if (draft := self._build_draft()) is not None:
            self.draft_graphdef, draft_params = nnx.split(draft)
            self.draft_leaves, self.draft_treedef = jax.tree.flatten(draft_params)
            self.draft_steps = int(server_args.speculative_num_steps)
        # The step takes the parameters as a flat list of arrays: flattening an nnx.State of
        # Variables on every call costs more host time than a decode step of a small model.
        self.param_leaves, self.param_treedef = jax.tree.flatten(params)
        self.load_seconds = time.perf_counter() - t0

        # Linear-attention layers (Qwen3.5-MoE) have state tables instead of KV pages.
        hybrid = any(model_config.linear_layers)
        kv_layers = ((linear_state.kv_layers(model_config) if hybrid
                      else model_config.num_hidden_layers) + (1 if self.draft_steps else 0))
        self.max_total_tokens = resolve_max_total_tokens(
            server_args.max_total_tokens, self.max_running_requests, self.context_len,
            self.page_size, kv_bytes_per_token(model_config, self.dtype, kv_layers))
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.page_width)
        layout = KvLayout.split(self.max_total_tokens, self.dp_size, self.page_size)
        self.kv_allocators = layout.allocators()
        self.token_to_kv_pool_allocator = self.kv_allocators[0]
        # The slot each rank's padded tokens write (slot 0 without DP attention).
        self.padding_slots = [a.padding_slot for a in self.kv_allocators]
        self.kv_caches = (
            linear_state.hybrid_caches(layout, model_config, self.dtype, self.mesh, abstract,
                                       self.max_running_requests + 1)
            # NEXTN's MTP layer (full attention): its KV is the cache's last entry.
            + layout.kv_caches(model_config, 1 if self.draft_steps else 0, self.dtype,
                               self.mesh, abstract) if hybrid
            else layout.kv_caches(model_config, kv_layers, self.dtype, self.mesh, abstract))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        # Request slot max_running_requests is the padding rows' spare row, in both tables.
        self.no_req_slot = self.max_running_requests
        self.req_to_page = device_zeros(
            (self.max_running_requests + 1, self.page_width // self.page_size), jnp.int32,
            replicated, abstract,
        )
        # Column 0: each slot's last sampled token (a decode step's input, read on the device:
        # it may still be in flight); EAGLE / NEXTN add its position and the drafts.
        self.next_inputs = device_zeros(
            (self.max_running_requests + 1,
             device_inputs.next_inputs_width(self.draft_steps) if self.draft_steps else 1),
            jnp.int32, replicated, abstract,
        )
        self.verify_slot_width = (device_inputs.slot_width(self.verify_tokens, self.draft_steps)
                                  if self.draft_steps else 0)
        self._set_page_row = jax.jit(
            lambda table, row, pages: table.at[row].set(pages), donate_argnums=0
        )

        # The step's routing, read by the routed-experts capturer and, with
        # --expert-distribution-recorder-mode, the recorder (routing_consumers.py). Both are
        # also attributes of their own here: the scheduler, control ops and tests reach them.
        one_hot_lookups = self.platform == "tpu"
        consumers = RoutingConsumers(server_args, model_config, self.mesh, layout.num_slots,
                                     self.keeps_results, abstract, replicated, one_hot_lookups)
        self.routing_consumers = consumers
        self.capturer, self.expert_recorder = consumers.capturer, consumers.recorder
        if self.eplb is not None and not abstract:
            self.expert_recorder.start()  # EPLB rebalances from these counts
        self.backends = ModelBackends(attention=attention, moe=moe_backend,
                                      routing=consumers.routing_spec,
                                      batch_invariant=self.deterministic,
                                      dp_attention=self.dp_size > 1,
                                      sequence_parallel_tokens=(
                                          server_args.sequence_parallel_min_tokens),
                                      one_hot_lookups=one_hot_lookups,
                                      verify_width=self.verify_tokens,
                                      moe_all_to_all=(
                                          ragged_collective(self.platform)
                                          if server_args.moe_dispatch == "ragged_all_to_all"
                                          else None))

        self.last_step_host_bytes = 0
        self.last_step_copy_bytes = 0  # routed rows (and weights) copied device-to-host
        self.compile_seconds: dict[tuple[int, ...], float] = {}
        self.program = StepProgram(
            self.graphdef, self.param_treedef, self.backends, self.capturer,
            self.expert_recorder, self.mesh, self.platform, self.deterministic, self.page_size,
            self.no_req_slot, model_config.tie_word_embeddings, self.draft_steps,
            self.draft_graphdef, self.draft_treedef)
        # Donated: the KV cache, the page table, the next inputs and the recorder's state.
        self._step = jax.jit(self.program._step_impl, donate_argnums=(1, 2, 3, 4))

    @property
    def model(self) -> nnx.Module:
        """The model on the current parameters, merged on demand (not kept: a weight update
        replaces the parameters, and a kept module would hold the old ones alive)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, self.param_leaves))

    @property
    def num_compiles(self) -> int:
        """Traces of the step so far: after precompilation, serving inside the buckets must
        leave it flat."""
        return self.program.num_compiles

    def _build_draft(self) -> nnx.Module | None:
        """EAGLE's draft head or NEXTN's MTP layer (abstract: shapes only), else None."""
        args, algorithm = self.server_args, self.server_args.speculative_algorithm
        if algorithm == "EAGLE":
            dcfg = draft_config(args.speculative_draft_model_path, self.model_config)
            return (nnx.eval_shape(lambda: EagleDraft(dcfg, self.dtype)) if self.abstract
                    else load_draft(dcfg, self.mesh, self.dtype))
        if algorithm == "NEXTN":
            dcfg = mtp_config(self.model_config)
            cls = mtp_draft_class(self.model_config)
            return (nnx.eval_shape(lambda: cls(dcfg, self.dtype)) if self.abstract
                    else load_mtp(dcfg, self.model_config, self.mesh, self.dtype))
        return None

    def memory_report(self) -> dict[str, int]:
        return {
            "parameters": sum(nbytes(x) for x in self.param_leaves),
            "kv_cache": sum(nbytes(kv) for kv in jax.tree.leaves(self.kv_caches)),
            "page_table": nbytes(self.req_to_page),
            **self.capturer.memory_report(),
        }

    # -- memory occupation (release_memory_occupation: memory_occupation.py) --------------------
    @functools.cached_property
    def _memory(self) -> MemoryOccupation:
        return MemoryOccupation()

    def release_memory(self, tags: Sequence[str]) -> None:
        """Frees the device arrays of ``tags``: "kv_cache" (contents dropped), "weights"
        (kept in host memory). No step may run until they are resumed."""
        if "kv_cache" in tags:
            # (A list of arrays, or with linear layers of arrays and state-table pairs.)
            leaves, self._kv_treedef = jax.tree.flatten(self.kv_caches)
            self.kv_caches = self._memory.release("kv_cache", leaves, keep=False)
        if "weights" in tags:
            self.param_leaves = self._memory.release("weights", self.param_leaves, keep=True)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Puts them back with the same shapes, dtypes and shardings (no step recompiles):
        the weights as they were, the KV cache zeroed."""
        if "weights" in tags:
            self.param_leaves = self._memory.resume("weights")
        if "kv_cache" in tags:
            self.kv_caches = jax.tree.unflatten(self._kv_treedef,
                                                self._memory.resume("kv_cache"))

    def released_memory(self) -> frozenset[str]:
        return self._memory.released()

    # -- the scheduler's side ---------------------------------------------------------------------
    def memory_pools(self) -> MemoryPools:
        """The host memory the scheduler hands out (the runner's steps read what it records)."""
        return MemoryPools(self.req_to_token_pool, self.kv_allocators, self.capturer.host_cache)

    def collect_routing(self, out: StepOutput, out_cache_loc: np.ndarray, copy: bool) -> None:
        """The host side of a processed step's routing, for both consumers
        (``RoutingConsumers.collect``)."""
        self.routing_consumers.collect(out, out_cache_loc, copy)

    def recorder(self) -> ExpertDistributionRecorder | None:
        """The expert distribution recorder, None when it is off: control operations start,
        stop, dump and read it (managers/control.py)."""
        return self.expert_recorder

    # -- expert placement --------------------------------------------------------------------------
    @property
    def expert_placement(self) -> ExpertPlacement:
        """Where every MoE layer's experts are now (EPLB's changes with each rebalance)."""
        return self.eplb.placement if self.eplb is not None else self._static_placement

    def rebalance_experts(self, load: np.ndarray | None = None) -> dict[str, Any]:
        """EPLB: a new placement from ``load`` ``[moe_layers, E]`` (default: the recorder's
        ``stat`` counts), applied on the device without recompiling the step
        (``eplb_manager.py``). Returns the per-layer imbalance before and after."""
        if self.eplb is None:
            raise ValueError("rebalance_experts needs --enable-eplb")
        if load is None:
            load, _ = self.expert_recorder.stat_counts()
        self.param_leaves, result = self.eplb.rebalance(load, self.param_leaves,
                                                        self.param_treedef)
        return result

    # -- the jitted step (step_program.py) --------------------------------------------------------
    def _step_args(self, batch: Any) -> tuple:
        state = None if self.expert_recorder is None else self.expert_recorder.state
        return (self.param_leaves, self.kv_caches, self.req_to_page, self.next_inputs, state,
                batch, self.draft_leaves)

    def forward(self, batch: ForwardBatch) -> StepOutput:
        """Dispatches one step (asynchronously: the outputs are futures until read)."""
        before = self.num_compiles
        t0 = time.perf_counter()
        with jax.set_mesh(self.mesh):  # the model's shard_map regions run on this mesh
            (next_ids, logits, self.kv_caches, self.req_to_page, self.next_inputs,
             rows, logprobs, expert_state, expert_pass, drafts) = self._step(
                *self._step_args(batch))
        if self.expert_recorder is not None:
            self.expert_recorder.state = expert_state
        if self.num_compiles != before:
            next_ids.block_until_ready()
            key = shape_key(batch)
            self.compile_seconds[key] = time.perf_counter() - t0
            logger.debug("compiled %s in %.2fs", key, self.compile_seconds[key])
        if logprobs is not None:
            for leaf in jax.tree.leaves(logprobs):
                leaf.copy_to_host_async()  # small ([B + P] x 20); read when processed
        if drafts is not None:
            drafts.copy_to_host_async()  # [B, steps]: read with the tokens, no second wait
        return StepOutput(next_ids, logits, rows, logprobs, expert_pass, drafts)

    def padding_batch(self, mode: ForwardMode, num_tokens: int, batch_size: int) -> ForwardBatch:
        """An all-padding batch of a bucket (with DP attention: per rank; the batch holds
        ``dp_size`` times as many tokens and rows)."""
        return make_padding_batch(
            mode, num_tokens * self.dp_size, batch_size * self.dp_size,
            self.model_config.vocab_size, self.no_req_slot,
            padding_slots=self.padding_slots, draft_steps=self.draft_steps,
            verify_slot_width=self.verify_slot_width,
        )

    def lower_bucket(self, mode: ForwardMode, num_tokens: int, batch_size: int) -> Any:
        """``jax.stages.Lowered`` of the step for one bucket (abstract or not; nothing runs);
        with DP attention ``num_tokens`` / ``batch_size`` are each rank's."""
        batch = self.padding_batch(mode, num_tokens, batch_size)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), batch
        )
        with jax.set_mesh(self.mesh):
            return self._step.lower(*self._step_args(batch))

    # -- batches --------------------------------------------------------------------------------
    def run_worker_batch(
        self, mwb: ModelWorkerBatch, rids: list[str] | None = None,
    ) -> tuple[ForwardBatch, StepOutput]:
        """Pads ``mwb`` to its bucket and dispatches it; returns the padded batch and output.
        ``rids``: the requests' ids, for the per_token expert distribution recorder."""
        return self.launch_step(self.plan_step(mwb, self.prefix_page_rows(mwb)), rids)

    def prefix_page_rows(self, mwb: ModelWorkerBatch) -> list[tuple[int, np.ndarray]]:
        """The page rows the device page table needs before ``mwb`` (step_plan.py). The
        scheduler's side of a step: on a multi-node job they travel to the followers with the
        batch."""
        return prefix_page_rows(self.req_to_token_pool, mwb, self.page_size)

    def plan_step(
        self, mwb: ModelWorkerBatch, prefix_pages: list[tuple[int, np.ndarray]],
    ) -> StepPlan:
        """The host inputs of one step: ``mwb`` padded to its bucket, plus the page rows."""
        batch = pad_batch(mwb, self.shapes, self.model_config.vocab_size, self.no_req_slot,
                          self.padding_slots, self.draft_steps)
        return StepPlan(mwb, batch, prefix_pages)

    def launch_step(
        self, plan: StepPlan, rids: list[str] | None = None,
    ) -> tuple[ForwardBatch, StepOutput]:
        """Dispatches a planned step. On a follower node (``node_rank > 0``) only what runs on
        the devices happens: the host-side bookkeeping of results is rank 0's."""
        mwb, batch = plan.mwb, plan.batch
        routed, known = self.routing_consumers.before_launch(mwb)
        with jax.set_mesh(self.mesh):
            for idx, pages in plan.prefix_pages:
                self.req_to_page = self._set_page_row(self.req_to_page, np.int32(idx), pages)
        # What this step copied from host to device (numpy leaves plus page rows sent).
        self.last_step_host_bytes = sum(p.nbytes for _, p in plan.prefix_pages) + sum(
            x.nbytes for x in jax.tree.leaves(batch))
        out = self.forward(batch)
        self.last_step_copy_bytes = self.routing_consumers.after_launch(
            mwb, batch, out, routed, known, rids)
        # EPLB: every node counts passes and rebalances from its copy of the replicated counts.
        if self.eplb is not None and self.eplb.after_pass():
            self.rebalance_experts()
        return batch, out

    # -- padding buckets (step_plan.py) --------------------------------------------------------
    def padded_decode_bs(self, bs: int) -> int:
        return self.shapes.padded_decode_bs(bs)

    def padded_extend_tokens(self, num_tokens: int) -> int:
        return self.shapes.padded_extend_tokens(num_tokens)

    def extend_rows(self, padded_tokens: int) -> int:
        return self.shapes.extend_rows(padded_tokens)

    def precompile(self) -> None:
        shapes = self.shapes.all()
        t0 = time.perf_counter()
        for mode, tokens, rows in tqdm(shapes, desc="Precompiling", unit="shape"):
            self.forward(self.padding_batch(mode, tokens, rows)).next_token_ids.block_until_ready()
        with jax.set_mesh(self.mesh):  # the one shape of the prefix page-row update
            self.req_to_page = self._set_page_row(
                self.req_to_page, np.int32(self.no_req_slot),
                np.zeros(self.req_to_page.shape[1], np.int32),
            )
        logger.info(
            "Precompiled %d shapes in %.1fs (decode bs %s; extend tokens %s%s)",
            len(shapes), time.perf_counter() - t0, self.shapes.bs_paddings,
            self.shapes.token_paddings,
            f"; per DP attention rank, {self.dp_size} ranks" if self.dp_size > 1 else "",
        )

