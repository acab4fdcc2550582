"""Capture of the routed experts: which top-k experts the router chose, per token and layer.

Flow (DESIGN.md §4):
1. Inside the jitted forward, each MoE layer calls ``capture(layer_id, topk_ids)``; the ids are
   written into the device buffer of ``_RoutedExpertsDeviceCache``, which is an input and an
   output of the forward (donated). The forward also returns the batch's rows of that buffer
   as a small, separate array, so the host never slices a device array outside jit and never
   holds a view of a buffer that the next forward will overwrite.
2. ``on_forward_end`` copies those rows to the host and scatters the real (unpadded) ones into
   ``_RoutedExpertsHostCache`` at the tokens' KV slots. Keyed by KV slot, the rows of
   prefix-cached tokens stay valid as long as their KV does.
3. When a request finishes, ``get_routed_experts`` gathers its ``seq_len - 1`` rows through
   ``req_to_token`` before its KV is freed.

Rows of layers without a router hold -1: the device buffer starts at -1 and only MoE layers
write it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import pybase64
from jax.tree_util import register_pytree_node_class

from sgl_jax.srt.configs.model_config import ModelConfig

if TYPE_CHECKING:
    from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool

ROUTED_EXPERTS_DTYPE = np.int32  # wire format: little-endian int32


@register_pytree_node_class
class _RoutedExpertsDeviceCache:
    """Device buffer ``[max_tokens, num_hidden_layers, k + shared]`` int32 (-1 = no router)."""

    def __init__(self, buffer: jax.Array) -> None:
        self.buffer = buffer

    @classmethod
    def allocate(
        cls, max_tokens: int, num_hidden_layers: int, num_experts_per_tok: int,
        num_fused_shared_experts: int,
    ) -> _RoutedExpertsDeviceCache:
        shape = (max_tokens, num_hidden_layers, num_experts_per_tok + num_fused_shared_experts)
        return cls(jnp.full(shape, -1, dtype=jnp.int32))

    @property
    def max_tokens(self) -> int:
        return self.buffer.shape[0]

    def capture_fwd_routed_experts(self, layer_id: int, topk_ids: jax.Array) -> None:
        """Traced: writes rows ``[:num_tokens]`` of ``layer_id`` (a functional update)."""
        num_tokens, k = topk_ids.shape
        self.buffer = self.buffer.at[:num_tokens, layer_id, :k].set(topk_ids.astype(jnp.int32))

    def nbytes(self) -> int:
        return int(np.prod(self.buffer.shape)) * 4

    def tree_flatten(self) -> tuple[tuple[jax.Array], None]:
        return (self.buffer,), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: tuple[jax.Array]) -> _RoutedExpertsDeviceCache:
        return cls(children[0])


class _RoutedExpertsHostCache:
    """Host rows ``[num_token_slots, num_hidden_layers, k]`` int32, one per KV slot.

    ``valid[slot]`` says whether the step that last wrote the slot's KV captures its row: a
    batch in which no request asked for routed experts skips the device-to-host copy, so the
    rows of the KV it wrote are unknown, and a later request that would reuse that KV through
    the prefix cache must recompute it instead (see ``valid_prefix_len``).

    Validity is set when a step is *launched*, rows are written when it is *processed*. With
    overlap scheduling a slot can be freed and handed to a new step before the step that wrote
    it is processed; deciding validity at launch keeps it in launch order, and rows are
    written in the same order, so both always describe the slot's latest writer. A request
    that reuses a slot whose row is still in flight reads it only when it finishes, after
    that step has been processed.
    """

    def __init__(self, num_tokens: int, num_hidden_layers: int, num_experts_per_tok: int) -> None:
        self.num_tokens = num_tokens
        self.buffer = np.full(
            (num_tokens, num_hidden_layers, num_experts_per_tok), -1, dtype=ROUTED_EXPERTS_DTYPE
        )
        self.valid = np.zeros(num_tokens, dtype=bool)

    def set_experts_buffer(self, loc: np.ndarray, rows: np.ndarray) -> None:
        self.buffer[loc] = rows

    def set_valid(self, loc: np.ndarray, valid: bool) -> None:
        self.valid[loc] = valid

    def nbytes(self) -> int:
        return self.buffer.nbytes + self.valid.nbytes


class RoutedExpertsCapturer(ABC):
    """The process-wide capture strategy; ``create`` picks the real or the no-op one."""

    @staticmethod
    def create(
        enable: bool,
        model_config: ModelConfig,
        num_fused_shared_experts: int,
        num_tokens: int,
        max_running_requests: int,
        chunked_prefill_size: int | None = None,
    ) -> RoutedExpertsCapturer:
        if not enable:
            return _RoutedExpertsCapturerNoop()
        return _RoutedExpertsCapturerReal(
            model_config, num_tokens, max_running_requests, num_fused_shared_experts,
            chunked_prefill_size or 0,
        )

    @property
    def enabled(self) -> bool:
        return False

    # -- inside the traced forward ------------------------------------------------------------
    @abstractmethod
    def begin_forward(self, device_cache: _RoutedExpertsDeviceCache | None) -> None:
        """Traced: bind this forward's (traced) device cache so that ``capture`` can write it."""

    @abstractmethod
    def capture(self, layer_id: int, topk_ids: jax.Array) -> None:
        """Traced: record a layer's ``[num_tokens, k]`` top-k ids."""

    @abstractmethod
    def end_forward(self, num_tokens: int) -> tuple[Any, Any]:
        """Traced: returns (updated device cache, this batch's rows ``[num_tokens, L, k]``)."""

    # -- on the host, around each step -------------------------------------------------------
    @abstractmethod
    def device_cache(self) -> _RoutedExpertsDeviceCache | None: ...

    @abstractmethod
    def set_device_cache(self, cache: _RoutedExpertsDeviceCache | None) -> None: ...

    @abstractmethod
    def on_forward_end(
        self, rows: jax.Array | None, out_cache_loc: np.ndarray, num_real_tokens: int,
        copy: bool,
    ) -> None: ...

    @abstractmethod
    def get_routed_experts(
        self, req_pool_idx: int, seqlen: int, req_to_token_pool: ReqToTokenPool
    ) -> np.ndarray | None: ...

    @abstractmethod
    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool) -> None:
        """Records whether the rows of the KV slots a launched step writes will be known."""

    def valid_prefix_len(self, slots: np.ndarray) -> int:
        return len(slots)

    def max_tokens(self) -> int | None:
        return None

    def memory_report(self) -> dict[str, int]:
        return {}


class _RoutedExpertsCapturerNoop(RoutedExpertsCapturer):
    """Disabled: no buffer enters the jitted graph and nothing is copied."""

    def begin_forward(self, device_cache) -> None:
        pass

    def capture(self, layer_id, topk_ids) -> None:
        pass

    def end_forward(self, num_tokens) -> tuple[None, None]:
        return None, None

    def device_cache(self) -> None:
        return None

    def set_device_cache(self, cache) -> None:
        pass

    def on_forward_launch(self, out_cache_loc, copy) -> None:
        pass

    def on_forward_end(self, rows, out_cache_loc, num_real_tokens, copy) -> None:
        pass

    def get_routed_experts(self, req_pool_idx, seqlen, req_to_token_pool) -> None:
        return None


class _RoutedExpertsCapturerReal(RoutedExpertsCapturer):
    def __init__(
        self,
        model_config: ModelConfig,
        num_tokens: int,
        max_running_requests: int,
        num_fused_shared_experts: int,
        chunked_prefill_size: int = 0,
    ) -> None:
        self.num_fused_shared_experts = num_fused_shared_experts
        self.num_hidden_layers = model_config.num_hidden_layers
        self.num_experts_per_tok = model_config.num_experts_per_tok
        self.host_cache = _RoutedExpertsHostCache(
            num_tokens, self.num_hidden_layers, self.num_experts_per_tok
        )
        self._device_cache: _RoutedExpertsDeviceCache | None = _RoutedExpertsDeviceCache.allocate(
            max(chunked_prefill_size, max_running_requests),
            self.num_hidden_layers, self.num_experts_per_tok, num_fused_shared_experts,
        )
        self._traced: _RoutedExpertsDeviceCache | None = None

    @property
    def enabled(self) -> bool:
        return True

    def max_tokens(self) -> int:
        assert self._device_cache is not None
        return self._device_cache.max_tokens

    def device_cache(self) -> _RoutedExpertsDeviceCache | None:
        return self._device_cache

    def set_device_cache(self, cache: _RoutedExpertsDeviceCache | None) -> None:
        self._device_cache = cache

    def begin_forward(self, device_cache: _RoutedExpertsDeviceCache | None) -> None:
        self._traced = device_cache

    def capture(self, layer_id: int, topk_ids: jax.Array) -> None:
        if self._traced is None:
            raise RuntimeError("capture() called outside a forward that carries the device cache")
        self._traced.capture_fwd_routed_experts(layer_id, topk_ids)

    def end_forward(self, num_tokens: int) -> tuple[Any, Any]:
        cache, self._traced = self._traced, None
        if cache is None:
            return None, None
        rows = cache.buffer[:num_tokens, :, : self.num_experts_per_tok]
        return cache, rows

    def on_forward_end(
        self, rows: jax.Array | None, out_cache_loc: np.ndarray, num_real_tokens: int,
        copy: bool,
    ) -> None:
        """Scatter this step's real rows to the host cache (when the step copies them)."""
        loc = out_cache_loc[:num_real_tokens]
        if not copy or rows is None:
            return
        # np.asarray waits for the forward; the rows array is a fresh output of the forward,
        # never donated, so reading it cannot race with a later step.
        self.host_cache.set_experts_buffer(loc, np.asarray(rows)[:num_real_tokens])

    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool) -> None:
        self.host_cache.set_valid(out_cache_loc, copy)

    def get_routed_experts(
        self, req_pool_idx: int, seqlen: int, req_to_token_pool: ReqToTokenPool
    ) -> np.ndarray:
        slots = req_to_token_pool.req_to_token[req_pool_idx, : max(seqlen - 1, 0)]
        return self.host_cache.buffer[slots]  # fancy indexing copies: safe after KV is freed

    def valid_prefix_len(self, slots: np.ndarray) -> int:
        """Length of the leading run of ``slots`` whose rows are known."""
        invalid = np.flatnonzero(~self.host_cache.valid[slots])
        return int(invalid[0]) if len(invalid) else len(slots)

    def memory_report(self) -> dict[str, int]:
        assert self._device_cache is not None
        return {
            "routed_experts_host_cache": self.host_cache.nbytes(),
            "routed_experts_device_cache": self._device_cache.nbytes(),
        }


_global_expert_capturer: RoutedExpertsCapturer = _RoutedExpertsCapturerNoop()


def get_global_experts_capturer() -> RoutedExpertsCapturer:
    return _global_expert_capturer


def set_global_experts_capturer(capturer: RoutedExpertsCapturer) -> None:
    global _global_expert_capturer
    _global_expert_capturer = capturer


def encode_routed_experts(rows: np.ndarray) -> str:
    """``[n, layers, k]`` ids -> base64 of their little-endian int32 bytes."""
    data = np.ascontiguousarray(rows, dtype="<i4")
    return pybase64.b64encode(data.tobytes()).decode("ascii")


def decode_routed_experts(encoded: str) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(encoded.encode("ascii"), validate=True), dtype="<i4")


def extract_routed_experts_from_meta_info(data: dict) -> np.ndarray | None:
    """Flat int32 ids from a response's ``meta_info["routed_experts"]`` (None when absent).

    Reshape with ``.reshape(-1, num_hidden_layers, num_experts_per_tok)``.
    """
    encoded = (data.get("meta_info") or {}).get("routed_experts")
    if encoded is None:
        return None
    return decode_routed_experts(encoded).astype(np.int32)
