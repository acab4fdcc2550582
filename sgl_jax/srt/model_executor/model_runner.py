"""ModelRunner: owns the model, the KV cache and the memory pools; runs one jitted step.

A step is the model forward plus sampling, jitted once per (mode, padded tokens, padded rows).
The KV cache, the device page table and the next-inputs buffer (each request slot's last sampled
token; with EAGLE / NEXTN also its position and drafts, speculative/device_inputs.py) are
donated into the step and replaced by its outputs, so they are updated in place. The model's
routing (every token's top-k experts in every layer) is an output of the step when a consumer
needs it (``layers/moe/routing.py``), read by two consumers: the routed-experts capturer (rows
in the host table's dtype, a fresh output of each step, their host copy started at dispatch when
the batch asks for them: all of them when every request asked, else only the askers' rows,
gathered on the device; under DP attention put in the scheduler's token order on the host)
and, with ``--expert-distribution-recorder-mode``, the recorder (its
device state, ``stat`` counts, is donated too, and the step also outputs the pass's counts or
ids for ``per_pass`` / ``per_token``; docs/expert_load.md); no shape depends on whether
recording is on. Every trace of the step is counted in ``num_compiles``: after precompilation,
serving inside the buckets must leave it flat.

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

import bisect
import dataclasses
import functools
import hashlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
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
    maybe_initialize_distributed,
    select_devices,
)
from sgl_jax.srt.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    ModelWorkerBatch,
    build_dp_forward_batch,
    build_forward_batch,
    dp_rank_sizes,
    make_padding_batch,
    shape_key,
)
from sgl_jax.srt.layers.attention import (
    AttentionMetadata,
    create_attention_backend,
    kv_cache_shape,
    update_page_table,
)
from sgl_jax.srt.layers.logprobs import LogprobOutput, logprob_outputs
from sgl_jax.srt.layers.moe.dispatch import ragged_collective
from sgl_jax.srt.layers.moe.ep_moe import EXPERT_AXIS
from sgl_jax.srt.layers.moe.expert_distribution import ExpertDistributionRecorder, create_recorder
from sgl_jax.srt.layers.moe.experts import create_moe_backend
from sgl_jax.srt.layers.moe.placement import ExpertPlacement
from sgl_jax.srt.layers.moe.routed_experts_capturer import RoutedExpertsCapturer
from sgl_jax.srt.layers.sampler import sample, vocab_chunks_for
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache
from sgl_jax.srt.model_executor.eplb_manager import EplbManager
from sgl_jax.srt.model_executor.memory_occupation import MemoryOccupation
from sgl_jax.srt.model_loader.loader import abstract_model, load_model
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.speculative import device_inputs
from sgl_jax.srt.speculative.eagle import (
    EagleDraft,
    accepted_counts,
    draft_config,
    draft_step,
    load_draft,
)
from sgl_jax.srt.speculative.nextn import MtpDraft, load_mtp, mtp_config

logger = logging.getLogger(__name__)

DEFAULT_KV_BUDGET_BYTES = 1 << 30


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


@dataclass(frozen=True)
class MemoryPools:
    """The host memory a scheduler manages: request slots, KV slots and the routed-experts
    rows of those slots (None when capture is off)."""

    req_to_token: ReqToTokenPool
    # One per data-parallel attention rank (one in all without DP attention): rank r's hands
    # out pages of rank r's shard of the KV cache only.
    kv_allocators: tuple[TokenToKVPoolAllocator, ...]
    routed_rows: RoutedExpertsHostCache | None

    @property
    def kv_allocator(self) -> TokenToKVPoolAllocator:
        """The allocator of a runner without DP attention."""
        if len(self.kv_allocators) != 1:
            raise ValueError("DP attention has one KV allocator per rank: use kv_allocators")
        return self.kv_allocators[0]


@dataclass
class StepPlan:
    """One step's host inputs: what every node of a multi-node job dispatches identically."""

    mwb: ModelWorkerBatch
    batch: ForwardBatch  # ``mwb`` padded to its bucket
    prefix_pages: list[tuple[int, np.ndarray]]  # (request slot, page row) to send first

    def digest(self) -> str:
        """A hash of everything the devices receive, to check that nodes dispatch alike."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(self.batch.forward_mode).encode())
        for x in jax.tree.leaves(self.batch) + [a for row in self.prefix_pages for a in row]:
            x = np.asarray(x)
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        return h.hexdigest()


def make_mesh(devices: Sequence[Any], tp_size: int, ep_size: int) -> Mesh:
    """The ``("expert", "tensor")`` mesh on the first ``tp_size * ep_size`` devices, the
    "tensor" axis over neighbouring devices. On a multi-host job the mesh must hold every
    device (each host runs its share of every step) and "tensor" must stay within a host
    (its all-reduces run in every attention and MoE block: they want the fastest links)."""
    need = tp_size * ep_size
    if need > len(devices):
        raise ValueError(
            f"tp_size={tp_size} x ep_size={ep_size} needs {need} devices; {len(devices)} "
            f"available ({devices[0].platform})"
        )
    hosts = {d.process_index for d in devices}
    if len(hosts) > 1:
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
        per_host = len(devices) // len(hosts)
        if need != len(devices):
            raise ValueError(
                f"a {len(hosts)}-host job needs tp_size x ep_size = every device "
                f"({len(devices)}: {per_host} per host); got tp_size={tp_size} x "
                f"ep_size={ep_size} = {need}")
        if per_host % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide the {per_host} devices of each host: tensor "
                f"parallelism stays within a host (span hosts with ep_size)")
    # Host by host: a row of the grid ("tensor") never straddles two hosts.
    grid = np.array(list(devices)[:need]).reshape(ep_size, tp_size)
    return Mesh(grid, ("expert", "tensor"))


def resolve_dtype(name: str, platform: str) -> jnp.dtype:
    """``auto``: bfloat16 on accelerators, float32 on CPU (where routing must match a float32
    reference bit for bit)."""
    if name == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _nbytes(x: Any) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


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
        self.bs_paddings = server_args.bs_paddings()
        self.token_paddings = server_args.token_paddings()
        # Speculative decoding: tokens a request brings to a verify step at most (its last
        # token and its drafts); 0 without speculation (no verify shapes).
        self.verify_tokens = server_args.speculative_num_draft_tokens or 0

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
        algorithm = server_args.speculative_algorithm
        if algorithm in ("EAGLE", "NEXTN"):
            if algorithm == "EAGLE":
                dcfg = draft_config(server_args.speculative_draft_model_path, model_config)
                draft = (nnx.eval_shape(lambda: EagleDraft(dcfg, self.dtype)) if abstract
                         else load_draft(dcfg, self.mesh, self.dtype))
            else:
                dcfg = mtp_config(model_config)
                draft = (nnx.eval_shape(lambda: MtpDraft(dcfg, self.dtype)) if abstract
                         else load_mtp(dcfg, model_config, self.mesh, self.dtype))
            self.draft_graphdef, draft_params = nnx.split(draft)
            self.draft_leaves, self.draft_treedef = jax.tree.flatten(draft_params)
            self.draft_steps = int(server_args.speculative_num_steps)
        # The step takes the parameters as a flat list of arrays: flattening an nnx.State of
        # Variables on every call costs more host time than a decode step of a small model.
        self.param_leaves, self.param_treedef = jax.tree.flatten(params)
        self.load_seconds = time.perf_counter() - t0

        self.max_total_tokens = self._resolve_max_total_tokens()
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.page_width)
        # DP attention: the KV cache's pages are split over the ranks ("data" = "expert"
        # axis), each rank with its own allocator over its own contiguous range of pages.
        self.dp_size = server_args.dp_size
        rank_tokens = round_up(-(-self.max_total_tokens // self.dp_size), self.page_size)
        rank_pages = rank_tokens // self.page_size + 1  # + the rank's padding page
        self.kv_allocators = tuple(
            TokenToKVPoolAllocator(rank_tokens, page_size=self.page_size,
                                   first_page=r * rank_pages)
            for r in range(self.dp_size)
        )
        self.token_to_kv_pool_allocator = self.kv_allocators[0]
        # The slot each rank's padded tokens write (slot 0 without DP attention).
        self.padding_slots = [a.padding_slot for a in self.kv_allocators]
        num_slots = self.dp_size * rank_pages * self.page_size
        replicated = NamedSharding(self.mesh, PartitionSpec())
        cfg = model_config
        head_axis = "tensor" if cfg.kv_cache_sharded else None
        page_axis = EXPERT_AXIS if self.dp_size > 1 else None  # DP: each rank's own pages
        self.kv_caches = [
            self._device_zeros(
                kv_cache_shape(num_slots, self.page_size, cfg.kv_cache_heads, cfg.kv_cache_head_dim),
                self.dtype,
                NamedSharding(self.mesh, PartitionSpec(page_axis, None, head_axis, None)),
            )
            for _ in range(cfg.num_hidden_layers + (1 if self.draft_steps else 0))
        ]
        # Request slot max_running_requests is the padding rows' spare row, in both tables.
        self.no_req_slot = self.max_running_requests
        self.req_to_page = self._device_zeros(
            (self.max_running_requests + 1, self.page_width // self.page_size), jnp.int32,
            replicated,
        )
        # Column 0: each slot's last sampled token (a decode step's input, read on the device:
        # it may still be in flight); EAGLE / NEXTN add its position and the drafts.
        self.next_inputs = self._device_zeros(
            (self.max_running_requests + 1,
             device_inputs.next_inputs_width(self.draft_steps) if self.draft_steps else 1),
            jnp.int32, replicated,
        )
        self.verify_slot_width = (device_inputs.slot_width(self.verify_tokens, self.draft_steps)
                                  if self.draft_steps else 0)
        self._set_page_row = jax.jit(
            lambda table, row, pages: table.at[row].set(pages), donate_argnums=0
        )

        self.capturer = RoutedExpertsCapturer.create(
            enable=server_args.enable_return_routed_experts,
            model_config=model_config,
            # Shared experts (Qwen2-MoE, DeepSeek-V3, GLM-4.5) run as their own dense MLP,
            # not fused into the routed experts as extra ids: the capture sees k columns.
            num_fused_shared_experts=0,
            # An abstract runner never serves and a follower node reads no result: no host
            # rows (they can be gigabytes).
            num_tokens=num_slots if self.keeps_results and not abstract else 1,
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=server_args.chunked_prefill_size,
            weights=server_args.enable_return_routed_expert_weights,
        )
        # --expert-distribution-recorder-mode: the second consumer of the step's routing.
        # Compiled for TPU: small-table lookups and counts by one-hot compares, not gathers or
        # scatters (ModelBackends.one_hot_lookups).
        one_hot_lookups = self.platform == "tpu"
        self.expert_recorder = create_recorder(server_args, model_config, replicated, abstract,
                                               one_hot_lookups)
        if self.eplb is not None and not abstract:
            self.expert_recorder.start()  # EPLB rebalances from these counts
        routing = self.capturer.routing_spec
        if self.expert_recorder is not None:
            routing = routing | self.expert_recorder.routing_spec
        self.backends = ModelBackends(attention=attention, moe=moe_backend, routing=routing,
                                      batch_invariant=self.deterministic,
                                      dp_attention=self.dp_size > 1,
                                      sequence_parallel_tokens=(
                                          server_args.sequence_parallel_min_tokens),
                                      one_hot_lookups=one_hot_lookups,
                                      moe_all_to_all=(
                                          ragged_collective(self.platform)
                                          if server_args.moe_dispatch == "ragged_all_to_all"
                                          else None))

        self.num_compiles = 0
        self.last_step_host_bytes = 0
        self.last_step_copy_bytes = 0  # routed rows (and weights) copied device-to-host
        self.compile_seconds: dict[tuple[int, ...], float] = {}
        self._step = jax.jit(
            partial(self._step_impl, self.graphdef, self.param_treedef),
            donate_argnums=(1, 2, 3, 4),
        )

    @property
    def model(self) -> nnx.Module:
        """The model on the current parameters, merged on demand (not kept: a weight update
        replaces the parameters, and a kept module would hold the old ones alive)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, self.param_leaves))

    # -- set-up ---------------------------------------------------------------------------------
    def _device_zeros(self, shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> Any:
        if self.abstract:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

    def kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        itemsize = jnp.dtype(self.dtype).itemsize
        layers = cfg.num_hidden_layers + (1 if self.draft_steps else 0)
        return layers * cfg.kv_cache_heads * cfg.kv_cache_head_dim * itemsize

    def _resolve_max_total_tokens(self) -> int:
        if self.server_args.max_total_tokens is not None:
            tokens = int(self.server_args.max_total_tokens)
        else:
            wanted = self.max_running_requests * 2048
            budget = DEFAULT_KV_BUDGET_BYTES // self.kv_bytes_per_token()
            tokens = max(self.context_len, min(wanted, budget))
        return round_up(tokens, self.page_size)

    def memory_report(self) -> dict[str, int]:
        return {
            "parameters": sum(_nbytes(x) for x in self.param_leaves),
            "kv_cache": sum(_nbytes(kv) for kv in self.kv_caches),
            "page_table": _nbytes(self.req_to_page),
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
            self.kv_caches = self._memory.release("kv_cache", self.kv_caches, keep=False)
        if "weights" in tags:
            self.param_leaves = self._memory.release("weights", self.param_leaves, keep=True)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Puts them back with the same shapes, dtypes and shardings (no step recompiles):
        the weights as they were, the KV cache zeroed."""
        if "weights" in tags:
            self.param_leaves = self._memory.resume("weights")
        if "kv_cache" in tags:
            self.kv_caches = self._memory.resume("kv_cache")

    def released_memory(self) -> frozenset[str]:
        return self._memory.released()

    # -- the scheduler's side ---------------------------------------------------------------------
    def memory_pools(self) -> MemoryPools:
        """The host memory the scheduler hands out (the runner's steps read what it records)."""
        return MemoryPools(self.req_to_token_pool, self.kv_allocators, self.capturer.host_cache)

    def collect_routing(self, out: StepOutput, out_cache_loc: np.ndarray, copy: bool) -> None:
        """The host side of a processed step's routing, for both consumers: its routed-experts
        rows into the host table at the tokens' KV slots (``copy``: the step copied them),
        and the recorder's records of the steps launched up to this one (not the next one,
        in flight)."""
        if out.known_rows is not None:
            self.capturer.on_forward_launch(out_cache_loc, out.known_rows)
        self.capturer.on_forward_end(out.routed_rows, out_cache_loc, len(out_cache_loc), copy)
        if self.expert_recorder is not None and out.expert_pass is not None:
            self.expert_recorder.collect(through=out.expert_pass)

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

    # -- the jitted step ------------------------------------------------------------------------
    def _step_impl(
        self, graphdef: Any, param_treedef: Any, param_leaves: list, kv_caches: list,
        req_to_page: jax.Array, next_inputs: jax.Array, expert_state: Any, batch: ForwardBatch,
        draft_leaves: list | None = None,
    ) -> tuple:
        self.num_compiles += 1  # runs only while tracing: one count per compiled shape
        model = nnx.merge(graphdef, jax.tree.unflatten(param_treedef, param_leaves))
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
        if self.expert_recorder is not None:  # real tokens only: padded ones have no batch row
            # Counts are the same in any token order: only per-token records are put in the
            # scheduler's (DP attention: a row gather).
            ids = (routing.ids, real_tokens)
            if order is not None and self.expert_recorder.mode == "per_token":
                ids = jax.tree.map(lambda x: x[order.tokens], ids)
            expert_state, expert_pass = self.expert_recorder.record_step(expert_state, *ids)
        rows = batch.sampled_rows
        sampled_logits = logits[:rows]  # then, with logprobs, the input-logprob rows
        next_ids = sample(sampled_logits, batch.sampling,
                          vocab_chunks=vocab_chunks_for(self.platform))
        if not batch.forward_mode.is_verify:  # a verify step's: written with its drafts
            # Rows that only end a prompt chunk also write here; no step reads a slot's last
            # token before the step that samples the request's real next token has written it.
            next_inputs = next_inputs.at[batch.req_pool_indices, device_inputs.TOKEN].set(
                next_ids[: batch.batch_size])
        logprobs = None
        if batch.logprobs is not None:
            lp = batch.logprobs
            temps = jnp.concatenate([batch.sampling.temperatures, lp.extra_temperatures])
            targets = jnp.concatenate([next_ids, lp.extra_targets])
            if self.deterministic and logits.shape[0] > rows:
                # Sampled rows and input-logprob rows apart: each part has a fixed shape.
                parts = [logprob_outputs(logits[sl], temps[sl], targets[sl], lp.token_ids[sl])
                         for sl in (slice(0, rows), slice(rows, None))]
                logprobs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *parts)
            else:
                logprobs = logprob_outputs(logits, temps, targets, lp.token_ids)
            if order is not None:  # the sampled rows in the scheduler's order, then the extra
                logprobs = jax.tree.map(
                    lambda x: jnp.concatenate([x[:rows][order.rows], x[rows:]]), logprobs)
        if order is not None:
            next_ids, sampled_logits = next_ids[order.rows], sampled_logits[order.rows]
        drafts = None
        if drafting:
            draft = nnx.merge(self.draft_graphdef,
                              jax.tree.unflatten(self.draft_treedef, draft_leaves))
            embed = model.model.embed_tokens[...]
            head = embed.T if self.model_config.tie_word_embeddings else model.lm_head[...]
            accepted = (accepted_counts(batch, token_to_req, next_ids)
                        if batch.forward_mode.is_verify else None)
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
        """The page row of each request that starts on a cached prefix the device page table
        does not hold yet (once per admission; the step records every other page), read from
        the host pool, which learns what the device will hold. The scheduler's side of a step:
        on a multi-node job the rows travel to the followers with the batch."""
        rows = []
        pool = self.req_to_token_pool
        for idx, prefix, extend in zip(
            mwb.req_pool_indices, mwb.prefix_lens, mwb.extend_lens, strict=True
        ):
            if pool.device_len[idx] < prefix:
                # A fresh array: on CPU the device may read it in place after we return.
                pages = pool.req_to_token[idx, :: self.page_size] // self.page_size
                rows.append((int(idx), pages.astype(np.int32)))
            pool.device_len[idx] = prefix + extend
        return rows

    def plan_step(
        self, mwb: ModelWorkerBatch, prefix_pages: list[tuple[int, np.ndarray]],
    ) -> StepPlan:
        """The host inputs of one step: ``mwb`` padded to its bucket, plus the page rows."""
        dp = self.dp_size > 1
        if self.draft_steps and not mwb.forward_mode.is_decode and mwb.draft_scratch is None:
            raise ValueError("EAGLE / NEXTN: extend and verify batches need draft_scratch (the chain's "
                             f"{self.draft_steps - 1} slots per row) and draft_next_ids")
        if dp and mwb.dp_ranks is None:
            raise ValueError("DP attention: the batch must give each row's rank (dp_ranks)")
        # DP attention: every rank is padded to the bucket of the busiest one.
        num_tokens, num_rows = (dp_rank_sizes(mwb, self.dp_size) if dp
                                else (mwb.num_tokens, mwb.batch_size))
        if mwb.forward_mode.is_decode:
            rows = self.padded_decode_bs(num_rows)
            tokens = rows
        elif mwb.forward_mode.is_verify:  # up to verify_tokens per request
            rows = self.padded_decode_bs(num_rows)
            tokens = rows * self.verify_tokens
        else:
            tokens = self.padded_extend_tokens(num_tokens)
            rows = self.extend_rows(tokens)
        vocab = self.model_config.vocab_size
        if dp:
            batch = build_dp_forward_batch(mwb, tokens, rows, vocab, self.no_req_slot,
                                           self.padding_slots)
        else:
            batch = build_forward_batch(mwb, tokens, rows, vocab, self.no_req_slot)
        return StepPlan(mwb, batch, prefix_pages)

    def launch_step(
        self, plan: StepPlan, rids: list[str] | None = None,
    ) -> tuple[ForwardBatch, StepOutput]:
        """Dispatches a planned step. On a follower node (``node_rank > 0``) only what runs on
        the devices happens: the host-side bookkeeping of results is rank 0's."""
        mwb, batch = plan.mwb, plan.batch
        routed = mwb.routed_tokens()  # only some requests asked: their tokens, else None
        # Which KV slots will hold known rows: every token's, none, or only the askers'.
        known: bool | np.ndarray = mwb.return_routed_experts
        if routed is not None:
            known = np.zeros(mwb.num_tokens, bool)
            known[routed] = True
        # A verify step with device inputs learns its slots when processed: marked then.
        if self.keeps_results and mwb.verify_slots is None:
            self.capturer.on_forward_launch(mwb.out_cache_loc, known)
        with jax.set_mesh(self.mesh):
            for idx, pages in plan.prefix_pages:
                self.req_to_page = self._set_page_row(self.req_to_page, np.int32(idx), pages)
        # What this step copied from host to device (numpy leaves plus page rows sent).
        self.last_step_host_bytes = sum(p.nbytes for _, p in plan.prefix_pages) + sum(
            x.nbytes for x in jax.tree.leaves(batch))
        out = self.forward(batch)
        if mwb.verify_slots is not None:
            out.known_rows = known
        self.last_step_copy_bytes = 0
        if mwb.return_routed_experts:
            # DP attention: the step's rows are in its rank-by-rank token order.
            places = None if batch.dp_order is None else np.asarray(batch.dp_order.tokens)
            if routed is not None or places is not None:
                tokens = np.arange(mwb.num_tokens) if routed is None else routed
                with jax.set_mesh(self.mesh):  # every token asked: no gather, as without DP
                    out.routed_rows = self.capturer.select_rows(
                        out.routed_rows, tokens, places, gather=routed is not None)
            if self.keeps_results:  # overlaps the step and the next one
                self.last_step_copy_bytes = self.capturer.start_copy(out.routed_rows)
        if self.expert_recorder is not None and self.keeps_results:
            self.expert_recorder.on_launch(out.expert_pass, mwb.forward_mode, mwb.num_tokens,
                                           rids, mwb.prefix_lens, mwb.extend_lens)
        # EPLB: every node counts passes and rebalances from its copy of the replicated counts.
        if self.eplb is not None and self.eplb.after_pass():
            self.rebalance_experts()
        return batch, out

    # -- padding buckets ------------------------------------------------------------------------
    def padded_decode_bs(self, bs: int) -> int:
        return _bucket(self.bs_paddings, bs)

    def padded_extend_tokens(self, num_tokens: int) -> int:
        return _bucket(self.token_paddings, num_tokens)

    def extend_rows(self, padded_tokens: int) -> int:
        """Rows of an extend batch of ``padded_tokens``: one per request, each >= 1 token
        (with DP attention, of one rank: its share of the running requests)."""
        return min(padded_tokens, -(-self.max_running_requests // self.dp_size))

    def precompile(self) -> None:
        # With speculation every decode step is a verify step.
        shapes = [(ForwardMode.TARGET_VERIFY, bs * self.verify_tokens, bs) if self.verify_tokens
                  else (ForwardMode.DECODE, bs, bs) for bs in self.bs_paddings]
        shapes += [(ForwardMode.EXTEND, t, self.extend_rows(t)) for t in self.token_paddings]
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
            len(shapes), time.perf_counter() - t0, self.bs_paddings, self.token_paddings,
            f"; per DP attention rank, {self.dp_size} ranks" if self.dp_size > 1 else "",
        )


def _bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket >= n; past the largest, a multiple of 64 (compiled on demand)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else round_up(n, 64)
