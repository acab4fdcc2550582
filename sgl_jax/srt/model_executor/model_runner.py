"""ModelRunner: owns the model, the KV cache and the memory pools; runs one jitted step.

A step is the model forward plus sampling, jitted once per (mode, padded tokens, padded rows).
The KV cache and the routed-experts device buffer are donated into the step and replaced by
its outputs, so they are updated in place. Every trace of the step is counted in
``num_compiles``: after precompilation, serving inside the buckets must leave it flat.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
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
from sgl_jax.srt.distributed import check_parallel_layout, maybe_initialize_distributed
from sgl_jax.srt.layers.moe.ep_moe import ExpertMapping
from sgl_jax.srt.layers.moe.routed_experts_capturer import (
    RoutedExpertsCapturer,
    get_global_experts_capturer,
    set_global_experts_capturer,
)
from sgl_jax.srt.layers.sampler import sample
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.model_executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    ModelWorkerBatch,
    build_forward_batch,
    make_padding_batch,
    shape_key,
)
from sgl_jax.srt.model_loader.loader import load_model
from sgl_jax.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_KV_BUDGET_BYTES = 1 << 30


@dataclass
class StepOutput:
    next_token_ids: jax.Array  # [B_pad] int32
    logits: jax.Array  # [B_pad, vocab] float32
    routed_rows: jax.Array | None  # [T_pad, layers, k] int32, when the capturer is enabled


def make_mesh(tp_size: int, ep_size: int) -> Mesh:
    devices = jax.devices()
    need = tp_size * ep_size
    if need > len(devices):
        raise ValueError(
            f"tp_size={tp_size} x ep_size={ep_size} needs {need} devices; {len(devices)} "
            f"available ({devices[0].platform})"
        )
    grid = np.array(devices[:need]).reshape(ep_size, tp_size)
    return Mesh(grid, ("expert", "tensor"))


def resolve_dtype(name: str) -> jnp.dtype:
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.dtype = resolve_dtype(server_args.dtype)
        # Before the first use of the backend: afterwards JAX only sees this host's devices.
        maybe_initialize_distributed(
            server_args.dist_init_addr, server_args.nnodes, server_args.node_rank
        )
        check_parallel_layout(
            model_config, server_args.tp_size, server_args.ep_size, jax.device_count()
        )
        self.mesh = make_mesh(server_args.tp_size, server_args.ep_size)
        mapping = server_args.ep_expert_mapping
        self.expert_mapping = ExpertMapping.parse(mapping) if mapping else None
        self.max_running_requests = int(server_args.max_running_requests)
        self.context_len = model_config.context_len
        # Page-table rows are as wide as the longest request, in whole attention blocks.
        self.page_width = round_up(self.context_len, server_args.attention_block_size)
        self.bs_paddings = server_args.bs_paddings()
        self.token_paddings = server_args.token_paddings()

        t0 = time.perf_counter()
        self.model = load_model(model_config, self.mesh, self.dtype, self.expert_mapping)
        self.graphdef, params = nnx.split(self.model)
        # The step takes the parameters as a flat list of arrays: flattening an nnx.State of
        # Variables on every call costs more host time than a decode step of a small model.
        self.param_leaves, self.param_treedef = jax.tree.flatten(params)
        self.load_seconds = time.perf_counter() - t0

        self.max_total_tokens = self._resolve_max_total_tokens()
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.page_width)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(self.max_total_tokens)
        self.kv_caches = self._allocate_kv_cache(self.token_to_kv_pool_allocator.num_slots)
        # The token each request slot sampled last (row max_running_requests: padding rows).
        self.no_req_slot = self.max_running_requests
        self.last_tokens = jax.device_put(
            np.zeros(self.max_running_requests + 1, np.int32),
            NamedSharding(self.mesh, PartitionSpec()),
        )

        capturer = RoutedExpertsCapturer.create(
            enable=server_args.enable_return_routed_experts,
            model_config=model_config,
            num_fused_shared_experts=0,
            num_tokens=self.token_to_kv_pool_allocator.num_slots,
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=server_args.chunked_prefill_size,
        )
        set_global_experts_capturer(capturer)
        self.capturer = capturer
        if capturer.device_cache() is not None:
            # Committed to the mesh like the step's own outputs, so that the first call and
            # later calls see the same placement and share one compiled program.
            replicated = NamedSharding(self.mesh, PartitionSpec())
            capturer.set_device_cache(jax.device_put(capturer.device_cache(), replicated))
        self._check_capture_capacity()

        self.num_compiles = 0
        self.compile_seconds: dict[tuple[int, int, int], float] = {}
        self._step = jax.jit(
            partial(self._step_impl, self.graphdef, self.param_treedef), donate_argnums=(1, 2, 3)
        )

    # -- set-up ---------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        itemsize = jnp.dtype(self.dtype).itemsize
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize

    def _resolve_max_total_tokens(self) -> int:
        if self.server_args.max_total_tokens is not None:
            return int(self.server_args.max_total_tokens)
        wanted = self.max_running_requests * 2048
        budget = DEFAULT_KV_BUDGET_BYTES // self.kv_bytes_per_token()
        return max(self.context_len, min(wanted, budget))

    def _allocate_kv_cache(self, num_slots: int) -> list[tuple[jax.Array, jax.Array]]:
        cfg = self.model_config
        shape = (num_slots, cfg.num_key_value_heads, cfg.head_dim)
        sharding = NamedSharding(self.mesh, PartitionSpec(None, "tensor", None))
        make = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=sharding)
        return [(make(), make()) for _ in range(cfg.num_hidden_layers)]

    def _check_capture_capacity(self) -> None:
        limit = self.capturer.max_tokens()
        if limit is None:
            return
        largest = max(max(self.token_paddings), max(self.bs_paddings))
        if largest > limit:
            raise ValueError(
                f"a padded batch of {largest} tokens would not fit the routed-experts device "
                f"buffer of max(chunked_prefill_size, max_running_requests) = {limit} rows; "
                f"keep precompile_token_paddings and precompile_bs_paddings <= {limit}"
            )

    def memory_report(self) -> dict[str, int]:
        params = sum(x.nbytes for x in self.param_leaves)
        kv = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        return {"parameters": params, "kv_cache": kv, **self.capturer.memory_report()}

    # -- the jitted step ------------------------------------------------------------------------
    def _step_impl(
        self, graphdef: Any, param_treedef: Any, param_leaves: list, kv_caches: list,
        last_tokens: jax.Array, routed_cache: Any, batch: ForwardBatch,
    ) -> tuple:
        self.num_compiles += 1  # runs only while tracing: one count per compiled shape
        model = nnx.merge(graphdef, jax.tree.unflatten(param_treedef, param_leaves))
        req_slot = jnp.take(batch.req_pool_indices, batch.token_to_req, mode="fill",
                            fill_value=self.no_req_slot)
        input_ids = jnp.where(batch.input_ids < 0, last_tokens[req_slot], batch.input_ids)
        batch = dataclasses.replace(batch, input_ids=input_ids)
        capturer = get_global_experts_capturer()
        capturer.begin_forward(routed_cache)
        logits, kv_caches = model(batch, kv_caches)
        routed_cache, routed_rows = capturer.end_forward(batch.num_tokens)
        next_ids = sample(logits, batch.sampling)
        # Rows that only end a prompt chunk also write here; no step reads a slot's last token
        # before the step that samples the request's real next token has written it.
        last_tokens = last_tokens.at[batch.req_pool_indices].set(next_ids)
        return next_ids, logits, kv_caches, last_tokens, routed_cache, routed_rows

    def forward(self, batch: ForwardBatch) -> StepOutput:
        """Dispatches one step (asynchronously: the outputs are futures until read)."""
        before = self.num_compiles
        t0 = time.perf_counter()
        with jax.set_mesh(self.mesh):  # the model's shard_map regions run on this mesh
            next_ids, logits, self.kv_caches, self.last_tokens, routed_cache, rows = self._step(
                self.param_leaves, self.kv_caches, self.last_tokens, self.capturer.device_cache(),
                batch,
            )
        self.capturer.set_device_cache(routed_cache)
        if self.num_compiles != before:
            next_ids.block_until_ready()
            key = shape_key(batch)
            self.compile_seconds[key] = time.perf_counter() - t0
            logger.debug("compiled %s in %.2fs", key, self.compile_seconds[key])
        return StepOutput(next_ids, logits, rows)

    # -- padding buckets ------------------------------------------------------------------------
    def padded_decode_bs(self, bs: int) -> int:
        return _bucket(self.bs_paddings, bs)

    def padded_extend_tokens(self, num_tokens: int) -> int:
        return _bucket(self.token_paddings, num_tokens)

    def extend_rows(self, padded_tokens: int) -> int:
        """Rows of an extend batch of ``padded_tokens``: one per request, each >= 1 token."""
        return min(padded_tokens, self.max_running_requests)

    def precompile(self) -> None:
        shapes = [(ForwardMode.DECODE, bs, bs) for bs in self.bs_paddings]
        shapes += [(ForwardMode.EXTEND, t, self.extend_rows(t)) for t in self.token_paddings]
        t0 = time.perf_counter()
        for mode, tokens, rows in tqdm(shapes, desc="Precompiling", unit="shape"):
            batch = make_padding_batch(
                mode, tokens, rows, self.page_width, self.model_config.vocab_size,
                self.no_req_slot,
            )
            self.forward(batch).next_token_ids.block_until_ready()
        logger.info(
            "Precompiled %d shapes in %.1fs (decode bs %s; extend tokens %s)",
            len(shapes), time.perf_counter() - t0, self.bs_paddings, self.token_paddings,
        )


def _bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket >= n; past the largest, a multiple of 64 (compiled on demand)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else round_up(n, 64)


def forward_worker_batch(runner: ModelRunner, mwb: ModelWorkerBatch) -> tuple[ForwardBatch, StepOutput]:
    """Pads ``mwb`` to its bucket and dispatches it; returns the padded batch and the output."""
    if mwb.forward_mode.is_decode:
        rows = runner.padded_decode_bs(mwb.batch_size)
        tokens = rows
    else:
        tokens = runner.padded_extend_tokens(mwb.num_tokens)
        rows = runner.extend_rows(tokens)
    batch = build_forward_batch(
        mwb, runner.req_to_token_pool.req_to_token, tokens, rows, runner.model_config.vocab_size,
        runner.no_req_slot,
    )
    return batch, runner.forward(batch)
