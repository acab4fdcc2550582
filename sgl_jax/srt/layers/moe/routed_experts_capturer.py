"""Routed-experts capture: the consumer of the step's routing that fills the host table.

Only the device-facing side lives here (it needs JAX); the host table of rows is
``mem_cache/routed_experts_host_cache.py`` and the wire format ``routed_experts_codec.py``
(re-exported here: ``extract_routed_experts_from_meta_info`` is importable from this module,
the path users copy from SGLang-JAX's documentation).

Flow (the routed-experts contract, docs/routed_experts.md):
1. The capturer says what the step must output (``routing_spec``: the top-k ids, and the
   routing weights when the server captures them). The model returns its layers' routing as
   part of the jitted step's output, stacked once (``layers/moe/routing.py``: ``[num_tokens,
   num_hidden_layers, k]``, -1 for layers without a router); nothing is written into Python
   objects while the step is traced. ``step_rows`` (traced, pure) casts the ids in the graph
   to the host table's narrow dtype: these rows are a fresh output of every step, no device
   buffer is carried from step to step (and none is donated).
2. At dispatch the runner starts the rows' device-to-host copy (``start_copy``), so it overlaps
   with the rest of the step and the next one; ``on_forward_end`` scatters the real (unpadded)
   rows into the ``RoutedExpertsHostCache`` at the tokens' KV slots. In a batch where only
   some requests asked, only their tokens' rows are copied: ``select_rows`` gathers them on
   the device first (``GatheredRows``), and only their slots are marked valid. With DP
   attention the step's rows come in its rank-by-rank token order and are put in the
   scheduler's on the host (a row gather in the step would cost more than the rows).
3. When a request ends, the scheduler's memory (``ReqMemory.routed_rows_of``) gathers its
   rows from the host table through ``req_to_token``, before its KV is freed.

The design's names: ``_RoutedExpertsDeviceCache`` is the device half (a step's ``Routing``
output, its rows), ``_RoutedExpertsHostCache`` the host table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.moe.routing import Routing, RoutingSpec
from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache
from sgl_jax.srt.routed_experts_codec import (  # noqa: F401  (re-exported: the users' import path)
    extract_routed_expert_weights_from_meta_info,
    extract_routed_experts_from_meta_info,
)

# The design's names of the two halves.
_RoutedExpertsDeviceCache = Routing
_RoutedExpertsHostCache = RoutedExpertsHostCache


def _take_rows(rows: Any, index: jax.Array) -> Any:
    return jax.tree.map(lambda r: jnp.take(r, index, axis=0), rows)


# A separate small jit, not part of the step: the step keeps one compiled shape per bucket
# whatever the batch asks (an index input inside it would multiply the step's compiles by the
# index buckets, and every all-asking batch would pay for a gather it does not need). This
# compiles once per (step bucket, power-of-two index count): a bounded, small set of tiny
# programs, dispatched after the step only when a batch mixes askers and non-askers (and the
# askers' rows are fewer than the step's).
_gather_rows = jax.jit(_take_rows)


def index_bucket(n: int) -> int:
    """The gather's index count for ``n`` rows: the next power of two (bounded compiles)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class GatheredRows:
    """Rows on their way to the host: the batch tokens ``tokens`` (the scheduler's order)
    hold rows ``at`` of ``rows`` (device, a ``Routing``).

    A mixed batch (only some requests asked): the askers' rows gathered on the device,
    ``at = arange(len(tokens))`` (rows past it are the gather's padding), or, when the gather
    would not be smaller than the step's rows, the step's own rows, of which only the askers'
    are written. With DP attention the step's rows are in its rank-by-rank token order
    (``at``: each token's place there, from the batch's ``DpOrder``): reordered on the host,
    not by a gather in the step.
    """

    rows: Routing
    tokens: np.ndarray
    at: np.ndarray


class RoutedExpertsCapturer(ABC):
    """A runner's capture strategy; ``create`` picks the real or the no-op one.

    Each ModelRunner owns one and reads the step's routing output with it (two runners in one
    process, as in tests and tools, never see each other's rows). ``host_cache`` is the table
    of rows the capture fills (None when disabled).
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
        """``num_tokens``: KV slots of the host table. ``weights``: also capture the routing
        weights (``return_routed_expert_weights``), copied with the ids by every step that
        copies ids. Fused shared-expert columns (``num_fused_shared_experts``) follow the
        top-k in a router's output and are never captured (``stack_routing`` keeps k)."""
        if not enable:
            return _RoutedExpertsCapturerNoop()
        return _RoutedExpertsCapturerReal(model_config, num_tokens, weights)

    @property
    def enabled(self) -> bool:
        return False

    @property
    def routing_spec(self) -> RoutingSpec:
        """What the step must output for this capturer."""
        return RoutingSpec()

    @abstractmethod
    def step_rows(self, routing: Routing | None) -> Routing | None:
        """Traced (pure): the step's rows from its routing output, ids in the host table's
        dtype (None when disabled)."""

    # -- on the host, around each step -------------------------------------------------------
    @abstractmethod
    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool | np.ndarray) -> None:
        """Records whether the rows of the KV slots a launched step writes will be known
        (``copy``: for the whole batch, or a bool per token)."""

    def select_rows(self, rows: Routing | None, tokens: np.ndarray,
                    places: np.ndarray | None = None, gather: bool = True) -> Any:
        """The rows to copy of the batch tokens ``tokens`` (the askers of a mixed batch, or
        every token), the step's row of token j being ``places[j]`` (DP attention) or j (see
        GatheredRows). ``gather``: gathered on the device when that copies fewer rows (a
        mixed batch), else the step's own rows are copied and picked on the host."""
        return rows

    def start_copy(self, rows: Any) -> int:
        """At dispatch: start the device-to-host copy of a step's rows (when it copies them).
        Returns the bytes copied."""
        return 0

    @abstractmethod
    def on_forward_end(
        self, rows: Any, out_cache_loc: np.ndarray, num_real_tokens: int, copy: bool,
    ) -> None:
        """Scatter this step's real rows to the host table (when the step copies them)."""

    def memory_report(self) -> dict[str, int]:
        return {}


class _RoutedExpertsCapturerNoop(RoutedExpertsCapturer):
    """Disabled: the step outputs no rows for it and nothing is copied."""

    def step_rows(self, routing: Routing | None) -> None:
        return None

    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool | np.ndarray) -> None:
        pass

    def on_forward_end(
        self, rows: Any, out_cache_loc: np.ndarray, num_real_tokens: int, copy: bool,
    ) -> None:
        pass


class _RoutedExpertsCapturerReal(RoutedExpertsCapturer):
    def __init__(self, model_config: ModelConfig, num_tokens: int, weights: bool = False) -> None:
        self.capture_weights = weights
        self.host_cache = RoutedExpertsHostCache(
            num_tokens, model_config.num_hidden_layers, model_config.num_experts_per_tok,
            model_config.num_experts, weights=weights,
        )

    @property
    def enabled(self) -> bool:
        return True

    @property
    def routing_spec(self) -> RoutingSpec:
        return RoutingSpec(ids=True, weights=self.capture_weights)

    def step_rows(self, routing: Routing | None) -> Routing:
        assert routing is not None, "the step must output the routing_spec it was given"
        # -1 (no router) wraps to the narrow dtype's maximum, the host table's marker.
        ids = routing.ids.astype(self.host_cache.dtype)
        return Routing(ids, routing.weights if self.capture_weights else None)

    def select_rows(self, rows: Routing | None, tokens: np.ndarray,
                    places: np.ndarray | None = None, gather: bool = True) -> Any:
        if rows is None:
            return None
        at = tokens if places is None else np.asarray(places)[tokens]
        step_tokens = rows.ids.shape[0]
        bucket = index_bucket(len(tokens))
        if not gather or bucket >= step_tokens:  # copy the step's rows, pick on the host
            return GatheredRows(rows, tokens, at)
        index = np.zeros(bucket, np.int32)  # padding gathers the first row again (unused)
        index[: len(tokens)] = at
        return GatheredRows(_gather_rows(rows, index), tokens, np.arange(len(tokens)))

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
        """``rows`` as the step returned them (``StepOutput.routed_rows``): the step's own rows
        of every token, or a ``GatheredRows`` (a mixed batch's, or under DP attention)."""
        loc = out_cache_loc[:num_real_tokens]
        if not copy or rows is None:
            return
        take: Any = slice(0, num_real_tokens)  # which host rows are written, to which slots
        if isinstance(rows, GatheredRows):
            loc, take, rows = loc[rows.tokens], rows.at, rows.rows
        # np.asarray waits for the copy started at dispatch; the rows are a fresh output of the
        # forward (or of its gather), never donated, so reading them cannot race with a later
        # step.
        self.host_cache.write(loc, np.asarray(rows.ids)[take])
        if rows.weights is not None:
            self.host_cache.write_weights(loc, np.asarray(rows.weights)[take])

    def on_forward_launch(self, out_cache_loc: np.ndarray, copy: bool | np.ndarray) -> None:
        """``copy``: for the whole batch, or per token (a mixed batch: the askers' tokens)."""
        self.host_cache.set_valid(out_cache_loc, copy)

    def memory_report(self) -> dict[str, int]:
        return {"routed_experts_host_cache": self.host_cache.nbytes()}


# The capturer of the scheduler running in this context. A context variable, not a process
# global: a thread starts with its own (empty) context, so with several schedulers in one
# process (M18: engines inside a trainer) each scheduler's thread sees the capturer it set;
# each scheduler process of an Engine sets its own at start-up.
_current_capturer: ContextVar[RoutedExpertsCapturer | None] = ContextVar(
    "sgl_jax_experts_capturer", default=None)
_NOOP = _RoutedExpertsCapturerNoop()


def get_global_experts_capturer() -> RoutedExpertsCapturer:
    """The capturer of the scheduler running in this thread (its runner's, set when the
    scheduler starts); a no-op capturer where no scheduler set one (e.g. the Engine's own
    process, whose schedulers run in their own processes)."""
    capturer = _current_capturer.get()
    return _NOOP if capturer is None else capturer


def set_global_experts_capturer(capturer: RoutedExpertsCapturer) -> None:
    """Makes ``capturer`` what ``get_global_experts_capturer()`` returns in this thread (and
    in asyncio tasks created from it afterwards); other threads keep theirs."""
    _current_capturer.set(capturer)
