"""What the server tells an operator about its requests: Prometheus metrics (``--enable-metrics``,
``GET /metrics``) and one log line per finished request (``--log-requests``).

The tokenizer manager calls a :class:`RequestObserver`: ``start`` when a request is submitted,
``on_output`` for every piece of output it receives (in its receiver thread, off the event
loop) and ``on_cancel`` when a request ends without its final piece (client gone, engine
dead). With both flags off the observer is the no-op base class: nothing is timed, counted or
allocated per request.

Names follow SGLang's ``sglang:*`` metrics where SGLang has one (so its dashboards carry over);
what SGLang does not have is ``sglang_jax:*``. Every series carries ``model_name``. Per-request
numbers are recorded once per piece of output, never per token (the inter-token histogram
takes a piece's tokens as one weighted observation). Scheduler state (running, queued, KV
usage) and the expert load are read at scrape time (:meth:`PrometheusMetrics.render`).
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sgl_jax.srt.bounded_text import log_safe
from sgl_jax.srt.routed_experts_output import RoutedExpertsOut

logger = logging.getLogger(__name__)
# --log-requests lines: a logger of their own, at INFO whatever --log-level says.
request_logger = logging.getLogger("sgl_jax.requests")

# Seconds. SGLang's buckets (TTFT and end-to-end up to 400 s / 2400 s; inter-token 2 ms - 8 s).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80,
                100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
               0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _State(Protocol):
    """What the observer reads of the tokenizer manager's ReqState."""

    rid: str
    created: float
    progress: Any


class _Piece(Protocol):
    """What the observer reads of a piece of a request's output (``io_struct.ReqOutput``, a
    layer above: the observer sits below the managers that call it)."""

    @property
    def routed(self) -> RoutedExpertsOut | None: ...
    @property
    def first_token_time(self) -> float | None: ...


@dataclass
class _Progress:
    """One request's progress as the observer saw it (held by its ReqState)."""

    tokens: int = 0  # completion tokens accounted for so far
    last: float = 0.0  # when the piece that brought them arrived
    ttft_seen: bool = False
    done: bool = False
    routed_rows: int = 0  # routed-experts rows handed out so far


class RequestObserver:
    """The no-op observer (both flags off). Subclasses record."""

    enabled = False

    def start(self, state: _State) -> None:
        """Called for each request a caller submitted (not the manager's internal ones)."""

    def on_output(self, state: _State, meta: dict[str, Any], out: _Piece) -> None:
        """A piece of ``state``'s output arrived (receiver thread): ``out`` is its record and
        ``meta`` its ``meta_info`` (counts so far, ``finish_reason`` and ``e2e_latency`` on
        the last)."""

    def on_cancel(self, state: _State) -> None:
        """``state`` ended without its final piece (client gone or engine dead)."""

    def render(self, info: dict[str, Any], load: dict[str, Any] | None) -> bytes:
        raise LookupError("metrics are off (start the server with --enable-metrics)")


def create_observer(server_args: Any, model_name: str) -> RequestObserver:
    if not (server_args.enable_metrics or server_args.log_requests):
        return RequestObserver()
    return _Recorder(PrometheusMetrics(model_name) if server_args.enable_metrics else None,
                     server_args.log_requests)


class _Recorder(RequestObserver):
    enabled = True

    def __init__(self, metrics: PrometheusMetrics | None, log_requests: bool) -> None:
        self.metrics, self.log_requests = metrics, log_requests
        if log_requests:
            request_logger.setLevel(logging.INFO)

    def start(self, state: _State) -> None:
        state.progress = _Progress()

    def on_output(self, state: _State, meta: dict[str, Any], out: _Piece) -> None:
        p: _Progress | None = state.progress
        if p is None or p.done:
            return
        now = time.monotonic()
        n = meta["completion_tokens"]
        first_token_time = out.first_token_time
        m = self.metrics
        routed = out.routed
        if routed is not None:
            p.routed_rows += routed.num_rows
        if m is not None:
            if routed is not None and routed.ids_nbytes:
                m.routed_bytes.inc(routed.ids_nbytes)
            if routed is not None and routed.weights_nbytes:
                m.routed_weights_bytes.inc(routed.weights_nbytes)
            if first_token_time is not None and not p.ttft_seen:
                p.ttft_seen = True
                m.ttft.observe(max(first_token_time - state.created, 0.0))
            if n > p.tokens:
                # Tokens after the first, and when the previous one of them was known: the
                # first token's time for the piece that brings it, else the previous piece.
                start, count = (first_token_time, n - 1) if p.tokens == 0 else (p.last, n - p.tokens)
                if count > 0 and start is not None:
                    m.itl.observe((now - start) / count, count)
        if n > p.tokens:
            p.tokens, p.last = n, now
        reason = meta["finish_reason"]
        if reason is None:
            return
        p.done = True
        kind = reason.get("type", "unknown") if isinstance(reason, dict) else str(reason)
        if m is not None:
            m.finished(kind, meta["prompt_tokens"], n, meta["cached_tokens"],
                       meta.get("e2e_latency", now - state.created))
        if self.log_requests:
            request_logger.info(
                "request %s finished: prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                "finish_reason=%s e2e_latency=%.3fs routed_experts_rows=%d", log_safe(state.rid),
                meta["prompt_tokens"], n, meta["cached_tokens"], kind,
                meta.get("e2e_latency", now - state.created), p.routed_rows)

    def on_cancel(self, state: _State) -> None:
        p: _Progress | None = state.progress
        if p is None or p.done:
            return
        p.done = True
        latency = time.monotonic() - state.created
        if self.metrics is not None:
            self.metrics.finished("abort", 0, 0, 0, latency)
        if self.log_requests:
            request_logger.info(
                "request %s ended without its result (client gone or engine stopped): "
                "completion_tokens>=%d finish_reason=abort e2e_latency=%.3fs "
                "routed_experts_rows=%d", log_safe(state.rid), p.tokens, latency, p.routed_rows)

    def render(self, info: dict[str, Any], load: dict[str, Any] | None) -> bytes:
        if self.metrics is None:
            return super().render(info, load)
        return self.metrics.render(info, load)


class PrometheusMetrics:
    """The metrics of one server, in a registry of their own (several engines may share a
    process). Thread-safe: counters and histograms are written by the receiver thread and read
    by the scrape."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, [*names, *extra], registry=self.registry)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Gauge(name, doc, [*names, *extra], registry=self.registry)

        def labelled(metric: Any) -> Any:
            return metric.labels(**self.labels)

        self.prompt_tokens = labelled(counter(
            "sglang:prompt_tokens", "Prompt tokens of finished requests."))
        self.generation_tokens = labelled(counter(
            "sglang:generation_tokens", "Generated tokens of finished requests."))
        self.cached_tokens = labelled(counter(
            "sglang:cached_tokens", "Prompt tokens of finished requests served from the "
            "prefix cache."))
        self.num_requests = labelled(counter(
            "sglang:num_requests", "Finished requests (any finish reason)."))
        self.num_aborted = labelled(counter(
            "sglang:num_aborted_requests", "Requests that ended aborted (by the caller, a "
            "disconnect, the server's shutdown or an error)."))
        self._by_reason = counter(
            "sglang_jax:finished_requests", "Finished requests by finish reason (stop, length, "
            "abort).", ("finish_reason",))
        self.routed_bytes = labelled(counter(
            "sglang_jax:routed_experts_bytes", "Routed-experts bytes returned to clients (the "
            "decoded payloads, in their wire dtype)."))
        self.routed_weights_bytes = labelled(counter(
            "sglang_jax:routed_expert_weights_bytes", "Routing-weight bytes returned to "
            "clients (return_routed_expert_weights)."))
        self.ttft = labelled(Histogram(
            "sglang:time_to_first_token_seconds", "Time to first token: from the request's "
            "arrival to the scheduler taking its first output token.", names,
            buckets=TTFT_BUCKETS, registry=self.registry))
        self.e2e = labelled(Histogram(
            "sglang:e2e_request_latency_seconds", "End-to-end request latency in the server.",
            names, buckets=E2E_BUCKETS, registry=self.registry))
        self.itl = _WeightedHistogram(
            "sglang:inter_token_latency_seconds", "Time between consecutive output tokens (a "
            "piece of k tokens counts k times its interval / k).", ITL_BUCKETS, self.labels)
        self.registry.register(self.itl)

        self.num_running = labelled(gauge("sglang:num_running_reqs", "Running requests."))
        self.num_queue = labelled(gauge("sglang:num_queue_reqs", "Requests waiting to start."))
        self.num_used_tokens = labelled(gauge(
            "sglang:num_used_tokens", "KV slots held by requests (not the evictable cache)."))
        self.token_usage = labelled(gauge(
            "sglang:token_usage", "Fraction of the KV cache's slots held by requests."))
        self.cache_hit_rate = labelled(gauge(
            "sglang:cache_hit_rate", "Cached / prompt tokens of the requests finished since "
            "start (windowed: rate(sglang:cached_tokens_total) / "
            "rate(sglang:prompt_tokens_total))."))
        self.imbalance = gauge(
            "sglang_jax:expert_load_imbalance", "Per MoE layer: the most loaded expert's "
            "token count over the mean, in the expert distribution recorder's current window "
            "(only while it records; 1 = balanced).", ("layer",))
        self._lock = threading.Lock()
        self._prompt_total = self._cached_total = 0

    def finished(self, reason: str, prompt: int, generated: int, cached: int,
                 latency: float) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        if cached:
            self.cached_tokens.inc(cached)
        self.num_requests.inc()
        if reason == "abort":
            self.num_aborted.inc()
        self._by_reason.labels(**self.labels, finish_reason=reason).inc()
        self.e2e.observe(latency)
        with self._lock:
            self._prompt_total += prompt
            self._cached_total += cached

    def render(self, info: dict[str, Any], load: dict[str, Any] | None) -> bytes:
        """The exposition text, gauges set from the scheduler's ``info`` (control.GetServerInfo)
        and the recorder's ``load`` (None unless it records). Run off the event loop."""
        from prometheus_client import generate_latest

        total = max(info["total_kv_slots"], 1)
        used = info["total_kv_slots"] - info["available_kv_slots"] - info["evictable_kv_slots"]
        self.num_running.set(info["num_running_reqs"])
        self.num_queue.set(info["num_waiting_reqs"])
        self.num_used_tokens.set(used)
        self.token_usage.set(used / total)
        with self._lock:
            prompt, cached = self._prompt_total, self._cached_total
        self.cache_hit_rate.set(cached / prompt if prompt else 0.0)
        self.imbalance.clear()
        if load is not None and load.get("recording"):
            for layer, ratio in expert_load_imbalance(load).items():
                self.imbalance.labels(**self.labels, layer=str(layer)).set(ratio)
        return generate_latest(self.registry)


def expert_load_imbalance(load: dict[str, Any]) -> dict[int, float]:
    """max / mean of each MoE layer's expert counts (``/expert_load``'s shape); layers that
    saw no token are left out."""
    counts = np.asarray(load["counts"], np.float64)
    out = {}
    for layer, row in zip(load["moe_layers"], counts, strict=True):
        mean = row.mean() if row.size else 0.0
        if mean > 0:
            out[int(layer)] = float(row.max() / mean)
    return out


class _WeightedHistogram:
    """A histogram that takes ``count`` equal observations in one call (a piece of k output
    tokens is k inter-token intervals): prometheus_client's Histogram would need k calls."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...],
                 labels: dict[str, str]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        i = bisect.bisect_left(self._bounds, value)  # first bound >= value ("le")
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, c in zip(self._bounds, counts, strict=True):
            cumulative += c
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), buckets, sum_value=total)
        yield family
