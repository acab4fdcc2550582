"""Capture of the routed experts at trace time: which top-k experts the router chose.

Only the device side lives here (it needs JAX); the host table of rows is
``mem_cache/routed_experts_host_cache.py`` and the wire format ``routed_experts_codec.py``.

Flow (DESIGN.md §4):
1. Inside the jitted forward, each MoE layer calls ``capture(layer_id, topk_ids)`` on the
   capturer its runner traced the forward with (``ModelBackends.capturer``); the ids are only
   collected (trace-time Python values). ``end_forward`` stacks them once into the step's rows
   ``[num_tokens, num_hidden_layers, k]`` (-1 for layers without a router), cast in the graph
   to the host table's narrow dtype: one write per forward, not one update per layer, and no
   device buffer carried from step to step.
2. At dispatch the runner starts the rows' device-to-host copy (``start_copy``), so it overlaps
   with the rest of the step and the next one; ``on_forward_end`` scatters the real (unpadded)
   rows into the ``RoutedExpertsHostCache`` at the tokens' KV slots.
3. When a request ends, the scheduler's memory (``ReqMemory.routed_rows_of``) gathers its
   rows from the host table through ``req_to_token``, before its KV is freed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.mem_cache.routed_experts_host_cache import NO_ROUTER, RoutedExpertsHostCache


class RoutedExpertsCapturer(ABC):
    """A runner's capture strategy; ``create`` picks the real or the no-op one.

    Each ModelRunner owns one and traces its forward with it (there is no process-global
    capturer: two runners in one process, as in tests and tools, never see each other's).
    ``host_cache`` is the table of rows the capture fills (None when disabled).
    """

    host_cache: RoutedExpertsHostCache | None = None

    @staticmethod
    def create(
        enable: bool,
        model_config: ModelConfig,
        num_fused_shared_experts: int,
        num_tokens: int,
        max_running_requests: int,
        chunked_prefill_size: int | None = None,
        weights: bool = False,
    ) -> RoutedExpertsCapturer:
        """``weights``: also capture the routing weights (``return_routed_expert_weights``),
        copied with the ids by every step that copies ids."""
        if not enable:
            return _RoutedExpertsCapturerNoop()
        return _RoutedExpertsCapturerReal(
            model_config, num_tokens, max_running_requests, num_fused_shared_experts,
            chunked_prefill_size or 0, weights,
        )

    @property
    def enabled(self) -> bool:
        return False

    # -- inside the traced forward ------------------------------------------------------------
    @abstractmethod
    def begin_forward(self, device_cache: Any) -> None:
        """Traced: start collecting this forward's ids (``device_cache`` is always None now:
        no buffer is carried between steps)."""

    @abstractmethod
    def capture(
        self, layer_id: int, topk_ids: jax.Array, topk_weights: jax.Array | None = None
    ) -> None:
        """Traced: record a layer's ``[num_tokens, k]`` top-k ids (and routing weights)."""

    @abstractmethod
    def end_forward(self, num_tokens: int) -> tuple[Any, Any]:
        """Traced: returns (None, this batch's rows ``[num_tokens, L, k]`` in the host table's
        dtype, or None when disabled)."""

    # -- on the host, around each step -------------------------------------------------------
    @abstractmethod
    def device_cache(self) -> Any: ...

    @abstractmethod
    def set_device_cache(self, cache: Any) -> None: ...

    @abstractmethod
    def on_forward_end(
        self, rows: jax.Array | None, out_cache_loc: np.ndarray, num_real_tokens: int,
        copy: bool,
    ) -> None: ...

    @abstractmethod
    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool) -> None:
        """Records whether the rows of the KV slots a launched step writes will be known."""

    def start_copy(self, rows: jax.Array | None) -> None:
        """At dispatch: start the device-to-host copy of a step's rows (when it copies them)."""
        return None

    def max_tokens(self) -> int | None:
        return None

    def memory_report(self) -> dict[str, int]:
        return {}


class _RoutedExpertsCapturerNoop(RoutedExpertsCapturer):
    """Disabled: no buffer enters the jitted graph and nothing is copied."""

    def begin_forward(self, device_cache) -> None:
        pass

    def capture(self, layer_id, topk_ids, topk_weights=None) -> None:
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


class _RoutedExpertsCapturerReal(RoutedExpertsCapturer):
    def __init__(
        self,
        model_config: ModelConfig,
        num_tokens: int,
        max_running_requests: int,
        num_fused_shared_experts: int,
        chunked_prefill_size: int = 0,
        weights: bool = False,
    ) -> None:
        self.num_fused_shared_experts = num_fused_shared_experts
        self.capture_weights = weights
        self.num_hidden_layers = model_config.num_hidden_layers
        self.num_experts_per_tok = model_config.num_experts_per_tok
        self.host_cache = RoutedExpertsHostCache(
            num_tokens, self.num_hidden_layers, self.num_experts_per_tok, model_config.num_experts,
            weights=weights,
        )
        self._ids: dict[int, jax.Array] | None = None  # this trace's captured layers
        self._weights: dict[int, jax.Array] = {}  # their routing weights, when given

    @property
    def enabled(self) -> bool:
        return True

    def device_cache(self) -> None:
        return None

    def set_device_cache(self, cache: Any) -> None:
        pass

    def begin_forward(self, device_cache: Any) -> None:
        self._ids, self._weights = {}, {}

    def capture(
        self, layer_id: int, topk_ids: jax.Array, topk_weights: jax.Array | None = None
    ) -> None:
        if self._ids is None:
            raise RuntimeError("capture() called outside a traced forward")
        self._ids[layer_id] = topk_ids[:, : self.num_experts_per_tok]
        if topk_weights is not None and self.capture_weights:
            self._weights[layer_id] = topk_weights[:, : self.num_experts_per_tok]

    def end_forward(self, num_tokens: int) -> tuple[None, jax.Array | None]:
        ids, self._ids = self._ids, None
        if not ids:
            return None, None
        no_router = jnp.full((num_tokens, self.num_experts_per_tok), NO_ROUTER, jnp.int32)
        layers = [ids[i].astype(jnp.int32) if i in ids else no_router
                  for i in range(self.num_hidden_layers)]
        # -1 wraps to the narrow dtype's maximum, the host table's no-router marker.
        rows = jnp.stack(layers, axis=1).astype(self.host_cache.dtype)
        weights, self._weights = self._weights, {}
        if not weights:
            return None, rows
        # The routing weights beside the ids (float32; 0 for layers without a router): rows
        # become the pair (ids, weights), copied and written together.
        zero = jnp.zeros((num_tokens, self.num_experts_per_tok), jnp.float32)
        stacked = jnp.stack([weights[i].astype(jnp.float32) if i in weights else zero
                             for i in range(self.num_hidden_layers)], axis=1)
        return None, (rows, stacked)

    def start_copy(self, rows: Any) -> None:
        for array in rows if isinstance(rows, tuple) else (rows,):
            if array is not None:
                array.copy_to_host_async()

    def on_forward_end(
        self, rows: jax.Array | None, out_cache_loc: np.ndarray, num_real_tokens: int,
        copy: bool,
    ) -> None:
        """Scatter this step's real rows to the host cache (when the step copies them)."""
        loc = out_cache_loc[:num_real_tokens]
        if not copy or rows is None:
            return
        weights = None
        if isinstance(rows, tuple):
            rows, weights = rows
        # np.asarray waits for the copy started at dispatch; the rows are a fresh output of the
        # forward, never donated, so reading them cannot race with a later step.
        self.host_cache.write(loc, np.asarray(rows)[:num_real_tokens])
        if weights is not None:
            self.host_cache.write_weights(loc, np.asarray(weights)[:num_real_tokens])

    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool) -> None:
        self.host_cache.set_valid(out_cache_loc, copy)

    def memory_report(self) -> dict[str, int]:
        return {"routed_experts_host_cache": self.host_cache.nbytes()}
