"""How much KV memory a runner takes and where its slots are.

The KV cache is one array per layer (the draft's layer last, with EAGLE / NEXTN) in pages of
``page_size`` slots. Without ``--max-total-tokens`` it holds 2,048 tokens per running request,
within a 1 GiB budget and never less than one full context. With DP attention the pages are
split over the ranks ("data" = the "expert" mesh axis): each rank has its own allocator over
its own contiguous range of pages, the first of which is that rank's padding page (the slot its
padded tokens write).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.attention import kv_cache_shape
from sgl_jax.srt.layers.moe.ep_moe import EXPERT_AXIS
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache
from sgl_jax.srt.model_executor.step_plan import round_up

DEFAULT_KV_BUDGET_BYTES = 1 << 30


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


def kv_bytes_per_token(cfg: ModelConfig, dtype: Any, kv_layers: int) -> int:
    return kv_layers * cfg.kv_cache_heads * cfg.kv_cache_head_dim * jnp.dtype(dtype).itemsize


def resolve_max_total_tokens(requested: int | None, max_running_requests: int,
                             context_len: int, page_size: int, bytes_per_token: int) -> int:
    """``--max-total-tokens`` if given, else the default above; in whole pages."""
    if requested is not None:
        tokens = int(requested)
    else:
        wanted = max_running_requests * 2048
        budget = DEFAULT_KV_BUDGET_BYTES // bytes_per_token
        tokens = max(context_len, min(wanted, budget))
    return round_up(tokens, page_size)


@dataclass(frozen=True)
class KvLayout:
    """The KV cache's slots: ``dp_size`` ranks of ``rank_pages`` pages each."""

    page_size: int
    dp_size: int
    rank_tokens: int  # the slots each rank hands out, in whole pages

    @classmethod
    def split(cls, max_total_tokens: int, dp_size: int, page_size: int) -> KvLayout:
        return cls(page_size, dp_size, round_up(-(-max_total_tokens // dp_size), page_size))

    @property
    def rank_pages(self) -> int:
        return self.rank_tokens // self.page_size + 1  # + the rank's padding page

    @property
    def num_slots(self) -> int:
        return self.dp_size * self.rank_pages * self.page_size

    def allocators(self) -> tuple[TokenToKVPoolAllocator, ...]:
        return tuple(
            TokenToKVPoolAllocator(self.rank_tokens, page_size=self.page_size,
                                   first_page=r * self.rank_pages)
            for r in range(self.dp_size)
        )

    def kv_caches(self, cfg: ModelConfig, kv_layers: int, dtype: Any, mesh: Mesh,
                  abstract: bool) -> list[Any]:
        """The zeroed cache, one array per layer: KV heads over "tensor" (unless the cache is
        replicated, as MLA's latent one), pages over the DP ranks."""
        head_axis = "tensor" if cfg.kv_cache_sharded else None
        page_axis = EXPERT_AXIS if self.dp_size > 1 else None  # DP: each rank's own pages
        sharding = NamedSharding(mesh, PartitionSpec(page_axis, None, head_axis, None))
        shape = kv_cache_shape(self.num_slots, self.page_size, cfg.kv_cache_heads,
                               cfg.kv_cache_head_dim)
        return [device_zeros(shape, dtype, sharding, abstract) for _ in range(kv_layers)]


def device_zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding,
                 abstract: bool) -> Any:
    """A zeroed device array (``abstract``: its ``ShapeDtypeStruct``, nothing allocated)."""
    if abstract:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def nbytes(x: Any) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
