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
   rows into the ``RoutedExpertsHostCache`` at the tokens' KV slots. In a batch where only
   some requests asked, only their tokens' rows are copied: ``select_rows`` gathers them on
   the device first (``GatheredRows``), and only their slots are marked valid.
3. When a request ends, the scheduler's memory (``ReqMemory.routed_rows_of``) gathers its
   rows from the host table through ``req_to_token``, before its KV is freed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.mem_cache.routed_experts_host_cache import NO_ROUTER, RoutedExpertsHostCache


def _take_rows(rows: Any, index: jax.Array) -> Any:
    return jax.tree.map(lambda r: jnp.take(r, index, axis=0), rows)


# A separate small jit, not part of the step: the step keeps one compiled shape per bucket
# whatever the batch asks (an index input inside it would multiply the step's compiles by the
# index buckets, and every all-asking batch would pay for a gather it does not need). This
# compiles once per (step bucket, power-of-two index count): a bounded, small set of tiny
# programs, dispatched after the step only when a batch mixes askers and non-askers.
_gather_rows = jax.jit(_take_rows)


def index_bucket(n: int) -> int:
    """The gather's index count for ``n`` rows: the next power of two (bounded compiles)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class GatheredRows:
    """A mixed batch's rows on their way to the host: those of the requests that asked.

    ``rows`` (device; an array, or (ids, weights)) holds in row i the row of batch token
    ``tokens[i]`` (rows past ``len(tokens)`` are the gather's padding), or, when ``gathered``
    is False (the gather would not be smaller than the step's rows), the step's own rows, of
    which only ``tokens`` are written.
    """

    rows: Any
    tokens: np.ndarray
    gathered: bool = True


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
        self, rows: Any, out_cache_loc: np.ndarray, num_real_tokens: int, copy: bool,
    ) -> None: ...

    @abstractmethod
    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool | np.ndarray) -> None:
        """Records whether the rows of the KV slots a launched step writes will be known
        (``copy``: for the whole batch, or a bool per token)."""

    def start_copy(self, rows: Any) -> int:
        """At dispatch: start the device-to-host copy of a step's rows (when it copies them).
        Returns the bytes copied."""
        return 0

    def select_rows(self, rows: Any, tokens: np.ndarray) -> Any:
        """The rows to copy when only the batch tokens ``tokens`` asked (see GatheredRows)."""
        return rows

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

    def select_rows(self, rows, tokens):
        return rows

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

    def select_rows(self, rows: Any, tokens: np.ndarray) -> Any:
        if rows is None:
            return None
        step_tokens = jax.tree.leaves(rows)[0].shape[0]
        bucket = index_bucket(len(tokens))
        if bucket >= step_tokens:  # no smaller than the step's rows: copy those
            return GatheredRows(rows, tokens, gathered=False)
        index = np.zeros(bucket, np.int32)  # padding gathers token 0's row again (unused)
        index[: len(tokens)] = tokens
        return GatheredRows(_gather_rows(rows, index), tokens)

    def start_copy(self, rows: Any) -> int:
        if isinstance(rows, GatheredRows):
            rows = rows.rows
        copied = 0
        for array in jax.tree.leaves(rows):
            array.copy_to_host_async()
            copied += array.nbytes
        return copied

    def on_forward_end(
        self, rows: Any, out_cache_loc: np.ndarray, num_real_tokens: int, copy: bool,
    ) -> None:
        """Scatter this step's real rows to the host cache (when the step copies them):
        ``rows`` as the step returned them (``StepOutput.routed_rows``): the step's own rows
        of every token, or a mixed batch's ``GatheredRows``."""
        loc = out_cache_loc[:num_real_tokens]
        if not copy or rows is None:
            return
        take: Any = slice(0, num_real_tokens)  # which host rows are written, to which slots
        if isinstance(rows, GatheredRows):
            tokens = rows.tokens
            loc = loc[tokens]
            take = slice(0, len(tokens)) if rows.gathered else tokens
            rows = rows.rows
        weights = None
        if isinstance(rows, tuple):
            rows, weights = rows
        # np.asarray waits for the copy started at dispatch; the rows are a fresh output of the
        # forward (or of its gather), never donated, so reading them cannot race with a later
        # step.
        self.host_cache.write(loc, np.asarray(rows)[take])
        if weights is not None:
            self.host_cache.write_weights(loc, np.asarray(weights)[take])

    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool | np.ndarray) -> None:
        """``copy``: for the whole batch, or per token (a mixed batch: the askers' tokens)."""
        self.host_cache.set_valid(out_cache_loc, copy)

    def memory_report(self) -> dict[str, int]:
        return {"routed_experts_host_cache": self.host_cache.nbytes()}
