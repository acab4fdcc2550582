"""TPU ahead-of-time cost and memory report of the engine's step, on a machine without a TPU.

    python -m sgl_jax.tools.aot_report --model-config qwen3-30b-a3b --topology v6e:2x2 \\
        --tp-size 4 --decode-bs 64 256 --prefill-tokens 2048 --prefill-requests 8 \\
        --context-len 4096 [--json]

libtpu (``pip install "sgl_jax[tpu]"``) provides compile-only TPU devices for a named topology
(``jax.experimental.topologies``); the CPU stays JAX's default backend. The model runner is
built in abstract mode (no weights: parameters, KV cache and buffers are sharded
``jax.ShapeDtypeStruct``), and for every bucket the very step the engine serves
(``ModelRunner.lower_bucket``) is compiled by XLA:TPU. ``--model-config`` needs only a
``config.json`` (a checkpoint directory, the file itself, or a bundled name:
``qwen3-30b-a3b``, ``qwen3-235b-a22b``, ``deepseek-v3``, ``glm-4.5-air``, ``mixtral-8x7b``,
``qwen2-57b-a14b``). Multi-head latent attention (DeepSeek-V3) compiles with the ``native``
attention backend (the Pallas kernel cannot read its latent cache; asking for pallas is a
usage error).

Buckets: decode at each ``--decode-bs`` with every request at ``--context-len`` positions of
context; prefill of ``--prefill-tokens`` tokens split evenly over ``--prefill-requests`` new
requests (no cached prefix), compiled with the rows the engine uses for that token bucket.

What is reported, per bucket (``--json``: one list, one object per bucket):

- ``compiled_flops`` / ``bytes_accessed``: the compiled program's cost, summed over all devices
  = ``xla_*`` + ``kernel_*``. ``xla_*`` is XLA's ``cost_analysis()``, which on JAX 0.10.2 /
  libtpu is PER DEVICE (a matmul sharded 4 ways reports 1/4 of the FLOPs; checked), so it is
  multiplied by the device count. XLA cannot see inside a Pallas kernel (it counts 0 FLOPs and
  ~0 bytes for the ragged paged attention custom call), so ``kernel_*`` adds each kernel call's
  work analytically: ``4 * (heads / tp) * head_dim * sum(q_len * kv_len)`` FLOPs and one read of
  each sequence's K/V plus the queries and outputs (a lower bound: the kernel re-reads K/V per
  query block in prefill). With the ``native`` backend, XLA's own count of its attention loop
  (one compiled call alone at the bucket's shape, ``native_attention_xla_*``) is taken out per
  layer and the analytic cost put in. MLA: ``attention_flops_per_pair`` FLOPs per pair and
  head, and one read of the replicated latent rows. Two more properties of XLA's count: a ``while`` loop's body is
  counted once whatever its trip count (the ``native`` attention backend's block loop is thus
  nearly invisible), and a ``cond`` counts its most expensive branch (the sampler's
  full-vocabulary sort fallback, which runs only when some row's top-k/top-p support is not
  inside the 1024 most probable ids, is counted in every bucket; ``--sampler-breakdown``
  compiles the sampler alone and reports its share and ``roofline_ms_without_sampler``). With
  the ragged expert backend and ``ep_size > 1``, XLA counts every ``ragged_dot`` at its static
  size, all ``T * k`` token-expert rows on every device of the "expert" axis, though only the
  device's own share is in its groups: ``ragged_static_excess_flops`` is that excess
  (``(ep - 1)`` times the ideal expert FLOPs) and ``flops_ratio_local_rows`` the ratio without it.
  With gmm the static size is one pass window, 1.25 times the device's share padded to the
  row tile (``gmm.pass_rows``, ``gmm.row_tile``; the excess is then a quarter of the ideal
  expert FLOPs).
- ``ideal_flops``: from the config, ``2 * active_params * tokens + 2 * hidden * vocab *
  sampled + attention`` (sampled: one row per request, one per token in a verify step);
  active parameters per token and layer are the attention projections
  (``attention_params``: GQA q/k/v/o; MLA q_a/q_b or q_proj, kv_a_proj_with_mqa, kv_b_proj,
  which also accounts for the absorbed matmuls, and o_proj) plus, in a MoE layer, the router
  (``hidden * experts``), the top-k experts' three matrices (``k * 3 * hidden *
  moe_intermediate``), the shared experts (``3 * hidden * shared width``) and Qwen2-MoE's
  shared-expert gate, in a dense layer the MLP (``3 * hidden * intermediate``); the LM head
  counts once per sampled row; attention over the actual context is ``heads *
  attention_flops_per_pair * sum(q_len * kv_len)`` per layer (GQA ``4 * head_dim`` per pair;
  MLA ``2 * (kv_lora + qk_rope) + 2 * kv_lora``; decode: one query per request over
  ``context_len`` positions; prefill: causal, ``n * (n + 1) / 2`` per request of ``n``
  tokens). ``flops_ratio = compiled / ideal``: above 1
  by work replicated over devices (attention, router and LM head on every device of the
  "expert" axis; the sampler on all), padded rows, the sampler and the static ragged_dot count.
- ``peak_hbm_bytes_per_device``: from ``memory_analysis()`` (per device): arguments (parameters
  + KV cache + buffers) + outputs not aliased to donated arguments + temporaries + program code.
  Parameters and KV cache per device are broken out from the shardings.
- ``roofline_ms``: ``max(flops / peak FLOP/s, bytes / HBM bandwidth)`` per device, with the
  chip's published bf16 peak and HBM bandwidth (communication over ICI is not modelled);
  ``tokens_per_s = tokens / roofline``.

``--dp-size D`` (= ``--ep-size``) compiles the step of data-parallel attention
(``enable_dp_attention``): ``--decode-bs`` and the prefill are GLOBAL, their requests dealt
round robin over the D ranks, each rank padded to the busiest one (``dp_buckets``); each
device holds and attends for its rank's requests only (the KV cache per device is 1 / D of
the total; the analytic attention is the busiest rank's, summed with ``rank_load``);
``max_requests_fit`` is the largest global batch at ``--context-len`` whose KV fits next to
the parameters. Every bucket also reports the bytes a device sends over the interconnect:
the MoE dispatch per layer from the formula (``dispatch_bytes_per_moe_layer``) and from the
compiled HLO's collectives (``collective_bytes``), and all of the step's collectives.

``--verify-tokens K`` (speculative decoding; not with ``--dp-size``, which the engine does not
combine with speculation yet) adds after each decode bucket the TARGET_VERIFY step of the same
requests: K tokens each (the last token and K - 1 drafts, the engine's
``--speculative-num-draft-tokens``) over ``context_len - K`` cached positions, logits and
sampling at every token, compiled by a runner built with ``--speculative-algorithm`` (NGRAM
by default: the target's step only; EAGLE with ``--speculative-draft-model-path``, or NEXTN
with the model's MTP layer: the draft's extend and chain are compiled into the step).
Each verify record carries ``bytes_vs_decode``, ``flops_vs_decode``, ``roofline_vs_decode``
and the same per verified token (``bytes_per_token_vs_decode``, ...).

``--breakdown`` splits each bucket's XLA count over op classes (expert matmuls, MoE
dispatch, router, attention, KV write, projections, sampler, the sampler's sort fallback,
collectives, copies, other), summing exactly to XLA's total (``hlo_breakdown``; the attention
kernel's analytic work is listed next to them). ``--extend-tokens N ...`` adds, per N, an
extend bucket of one request appending N tokens to a cached context (last token at
``--context-len`` positions), compiled at the engine's token bucket for N.

A layout that cannot hold parameters + KV cache in HBM (per device) exits with code 2 and says
what to change (MLA: its latent KV cache is replicated, tp does not split it); a compiled
peak above HBM is flagged (``peak_exceeds_hbm``, a warning). ``--scale-from-layers A B``
compiles truncated models and extrapolates every compiled figure linearly to the model's depth
(for deep models, whose full compile takes long): A and B layers of the model's majority kind,
plus one dense layer before A MoE layers when the model has both kinds (DeepSeek-V3's first 3
layers are dense), solved for per-dense-layer and per-MoE-layer costs separately; the
per-device parameter and KV figures are always the full model's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("aot_report")

BUNDLED_CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float  # peak bf16 FLOP/s per chip
    hbm_bytes: float  # HBM capacity per chip
    hbm_bandwidth: float  # HBM bytes/s per chip
    cores_per_chip: int  # TensorCores per chip (a compile-only device may be one core)


# Published per-chip figures, Google Cloud TPU documentation ("System architecture" tables):
#   v4:  https://cloud.google.com/tpu/docs/v4   275 TFLOPs bf16, HBM2 32 GiB, 1200 GBps, 2 cores
#   v5e: https://cloud.google.com/tpu/docs/v5e  197 TFLOPs bf16, HBM2 16 GB, 819 GBps
#   v5p: https://cloud.google.com/tpu/docs/v5p  459 TFLOPs bf16, HBM2e 95 GB, 2765 GBps, 2 cores
#   v6e: https://cloud.google.com/tpu/docs/v6e  918 TFLOPs bf16, HBM 32 GB, 1640 GBps
# (GB/GBps taken as 1e9, GiB as 2**30, as printed. XLA:TPU itself lets a program use about
# 15.7 GiB on v5e, 31.2 GiB on v6e, 95.7 GiB on v5p and 15.2 GiB per v4 core.)
CHIPS = {
    "v4": Chip("v4", 275e12, 32 * GiB, 1200e9, 2),
    "v5e": Chip("v5e", 197e12, 16e9, 819e9, 1),
    "v5p": Chip("v5p", 459e12, 95e9, 2765e9, 2),
    "v6e": Chip("v6e", 918e12, 32e9, 1640e9, 1),
}
# jax.Device.device_kind -> chip
DEVICE_KINDS = {
    "TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
    "TPU v6 lite": "v6e", "TPU v6e": "v6e",
}
# Names the Pallas ragged paged attention kernel carries in compiled HLO (op_name metadata).
ATTENTION_KERNEL = "ragged_paged_attention"


class DoesNotFit(Exception):
    """The layout cannot hold the model: exit code 2."""


class ReportError(Exception):
    """A usage or environment error with a message for the user: exit code 1."""


# -- environment ----------------------------------------------------------------------------
def prepare_environment() -> None:
    """Before JAX is imported: compile-only TPU devices next to a default CPU backend."""
    if importlib.util.find_spec("libtpu") is None:
        raise ReportError(
            "compiling for TPU topologies needs libtpu, which is not installed. "
            'Install it with: pip install "sgl_jax[tpu]"'
        )
    # The CPU stays the default backend (no TPU is attached; on a TPU VM this also leaves the
    # chips free). Without TPU_WORKER_HOSTNAMES libtpu logs an error looking for TPU workers;
    # TPU_SKIP_MDS_QUERY avoids asking a GCE metadata server about TPUs; libtpu's lockfile
    # would otherwise allow one such process per machine (tests, two reports at once).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(name: str) -> list[Any]:
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu raises JaxRuntimeError / ValueError with its own text
        raise ReportError(
            f"cannot create the TPU topology {name!r} ({e}); use names like v5e:2x2, "
            "v6e:2x4, v5p:2x2x1, v4:2x2x1"
        ) from e


def chip_of(device: Any, overrides: argparse.Namespace) -> tuple[Chip, float]:
    """The chip and the fraction of it one compile-only device is (v4: one of two cores)."""
    key = DEVICE_KINDS.get(device.device_kind)
    chip = CHIPS.get(key) if key else None
    if chip is None:
        if None in (overrides.peak_tflops, overrides.hbm_gb, overrides.hbm_gbps):
            raise ReportError(
                f"no published figures for device kind {device.device_kind!r}; pass "
                "--peak-tflops, --hbm-gb and --hbm-gbps"
            )
        chip = Chip(device.device_kind, 0.0, 0.0, 0.0, 1)
    chip = dataclasses.replace(
        chip,
        bf16_flops=overrides.peak_tflops * 1e12 if overrides.peak_tflops else chip.bf16_flops,
        hbm_bytes=overrides.hbm_gb * 1e9 if overrides.hbm_gb else chip.hbm_bytes,
        hbm_bandwidth=overrides.hbm_gbps * 1e9 if overrides.hbm_gbps else chip.hbm_bandwidth,
    )
    cores = getattr(device, "num_cores", chip.cores_per_chip) or chip.cores_per_chip
    return chip, min(1.0, cores / chip.cores_per_chip)


@contextlib.contextmanager
def kernel_tuning_for(device_kind: str) -> Iterator[None]:
    """JAX's ragged paged attention picks its block sizes from a table keyed by
    ``jax.devices()[0].device_kind``, the CPU here (it then refuses to run: "TPU version must
    be 4 or higher"). While lowering, it is told the target chip instead, so the compiled
    kernel is the one a real TPU of that kind would run."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            tuned_block_sizes as tuned,
        )
    except ImportError:
        yield
        return
    kind = device_kind[: -len(" lite")] if device_kind.endswith(" lite") else device_kind
    version = int(kind[-1]) if kind[-1:].isdigit() else -1
    name = " ".join(device_kind.split()[:2])
    saved = tuned.get_tpu_version, tuned.get_device_name
    tuned.get_tpu_version = lambda: version
    tuned.get_device_name = lambda num_devices=None: (
        name if num_devices is None else f"{name}-{num_devices}"
    )
    try:
        yield
    finally:
        tuned.get_tpu_version, tuned.get_device_name = saved


# -- model ----------------------------------------------------------------------------------
def resolve_config_path(spec: str) -> tuple[str, dict]:
    """``--model-config`` -> (model directory, raw HF config)."""
    path = Path(os.path.expanduser(spec))
    if not path.exists() and (BUNDLED_CONFIGS / spec / "config.json").is_file():
        path = BUNDLED_CONFIGS / spec
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        bundled = sorted(p.name for p in BUNDLED_CONFIGS.iterdir() if p.is_dir())
        raise ReportError(
            f"--model-config {spec!r}: no config.json there; give a checkpoint directory, a "
            f"config.json file or a bundled config name ({', '.join(bundled)})"
        )
    with open(file, encoding="utf-8") as f:
        return str(file.parent), json.load(f)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One compiled step. With data-parallel attention (``dp > 1``) the figures are GLOBAL
    (all ranks): the requests are dealt round robin over the ``dp`` ranks, every rank's
    sub-batch is padded to the same per-rank size, and ``padded_tokens`` / ``rows`` are
    ``dp`` times that size (the shape the step is compiled with)."""

    mode: str  # "decode" | "verify" | "prefill"
    tokens: int  # real tokens of the step, all ranks
    requests: int  # real requests, all ranks
    rows: int  # padded rows the engine compiles this bucket with, all ranks
    q_len: int  # new tokens per request
    prefix: int  # cached positions per request before the step
    dp: int = 1  # attention ranks the requests are spread over
    padded_tokens: int = 0  # tokens compiled, all ranks (0: = tokens, no padding)

    @property
    def compiled_tokens(self) -> int:
        return self.padded_tokens or self.tokens

    @property
    def sampled(self) -> int:
        """Logits rows the step computes and samples: one per request; in a verify step one
        per token (each request's last token and every draft)."""
        return self.tokens if self.mode == "verify" else self.requests

    @property
    def compiled_sampled(self) -> int:
        """Logits rows the step is compiled with (padded)."""
        return self.compiled_tokens if self.mode == "verify" else self.rows

    @property
    def context_len(self) -> int:
        """KV length of each request's last token."""
        return self.prefix + self.q_len

    @property
    def pairs_per_request(self) -> int:
        """(query, key) pairs of one request's new tokens (causal)."""
        n, p = self.q_len, self.prefix
        return n * p + n * (n + 1) // 2

    @property
    def q_kv_pairs(self) -> int:
        """sum over query tokens of the positions each attends to (causal), all ranks."""
        return self.requests * self.pairs_per_request

    @property
    def rank_requests(self) -> int:
        """Requests of the busiest attention rank (all of them without DP)."""
        return -(-self.requests // self.dp)

    @property
    def rank_load(self) -> float:
        """Real attention work of all ranks over ``dp`` times the busiest rank's (1 when the
        requests divide evenly over the ranks; 0.5 when half the ranks are idle)."""
        return self.requests / (self.rank_requests * self.dp)


def dp_buckets(decode_bs: list[int], prefill_tokens: int, prefill_requests: int,
               context_len: int, dp: int, rank_rows: Any,
               verify_tokens: int | None = None) -> list[Bucket]:
    """The report's buckets. ``decode_bs`` and the prefill are GLOBAL: with ``dp`` ranks a
    decode batch of B requests is ``ceil(B / dp)`` rows per rank, and the prefill's requests
    (``prefill_tokens / prefill_requests`` new tokens each, whole requests: a request's KV
    lives on one rank) go round robin to the ranks, each rank padded to the busiest one's
    tokens. ``rank_rows(tokens)``: the rows one rank's extend sub-batch of ``tokens`` is
    compiled with (the engine's ``extend_rows``). dp = 1: exactly the buckets of a report
    without DP. ``verify_tokens`` K (speculative decoding, dp = 1 only): after each decode
    bucket, the TARGET_VERIFY step of the same requests, K tokens each (its last token and
    K - 1 drafts) on top of ``context_len - K`` cached positions, so that its last token is
    at ``context_len`` positions as the decode bucket's is (same KV read per request)."""
    per_req = prefill_tokens // prefill_requests
    buckets = []
    for bs in decode_bs:
        rank = -(-bs // dp)
        buckets.append(Bucket("decode", bs, bs, rank * dp, 1, context_len - 1, dp,
                              0 if rank * dp == bs else rank * dp))
        if verify_tokens:
            buckets.append(Bucket("verify", bs * verify_tokens, bs, bs, verify_tokens,
                                  context_len - verify_tokens))
    rank_tokens = -(-prefill_requests // dp) * per_req
    padded = rank_tokens * dp
    if not prefill_tokens:  # --prefill-tokens 0: no prefill bucket
        return buckets
    buckets.append(Bucket("prefill", prefill_tokens, prefill_requests,
                          rank_rows(rank_tokens) * dp, per_req, 0, dp,
                          0 if padded == prefill_tokens else padded))
    return buckets


def extend_padding(tokens: int, prefill_tokens: int) -> int:
    """The token bucket the engine pads an extend of ``tokens`` to (ServerArgs' default
    paddings: powers of two from 64, or from the chunk when it is smaller)."""
    chunk = max(prefill_tokens, tokens)
    padded = min(64, chunk)
    while padded < tokens:
        padded *= 2
    return min(padded, chunk)


def extend_buckets(extend_tokens: list[int], context_len: int, prefill_tokens: int,
                   rows: Any) -> list[Bucket]:
    """``--extend-tokens``: one request appending N new tokens to a cached context (a
    multi-turn rollout's next turn), its last token at ``context_len`` positions as in
    decode; compiled at the engine's token bucket for N and its rows (``rows(padded)``)."""
    out = []
    for n in extend_tokens:
        padded = extend_padding(n, prefill_tokens)
        out.append(Bucket("extend", n, 1, rows(padded), n, context_len - n, 1,
                          0 if padded == n else padded))
    return out


def attention_params(cfg: Any) -> int:
    """Per-token parameters of one layer's attention projections (biases, norms: negligible).

    GQA: q, k, v and o. MLA: q_a_proj + q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_b_proj
    and o_proj. kv_b_proj is counted whole: with absorbed weights its two halves are the
    per-head matmuls ``q_nope @ W_UK`` and ``o_latent @ W_UV``, run once per token, so
    ``2 * kv_lora * heads * (qk_nope + v_head)`` FLOPs per token, as a projection would."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.attention != "mla":
        d = cfg.head_dim
        return h * (heads + 2 * cfg.num_key_value_heads) * d + heads * d * h
    q_out = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q = h * q_out if cfg.q_lora_rank is None else h * cfg.q_lora_rank + cfg.q_lora_rank * q_out
    kv_a = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    kv_b = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv_a + kv_b + heads * cfg.v_head_dim * h


def moe_params(cfg: Any) -> int:
    """Per-token parameters of one MoE layer: router, top-k routed experts, shared experts
    (``3 * hidden * shared width``) and Qwen2-MoE's shared-expert gate (``hidden``)."""
    h = cfg.hidden_size
    routed = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    shared = 3 * h * cfg.shared_expert_intermediate_size if cfg.num_shared_experts else 0
    gate = h if cfg.num_shared_experts and cfg.shared_expert_gated else 0
    return h * cfg.num_experts + routed + shared + gate


def active_params_per_token(cfg: Any) -> tuple[int, int]:
    """(per-token parameters of all decoder layers, LM head parameters)."""
    attn, moe = attention_params(cfg), moe_params(cfg)
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    layers = sum(attn + (moe if is_moe else dense) for is_moe in cfg.moe_layers)
    return layers, cfg.hidden_size * cfg.vocab_size


def attention_flops_per_pair(cfg: Any) -> int:
    """FLOPs of one (query, key) pair of one head. GQA: ``4 * head_dim`` (scores and values).
    MLA as the engine computes it, in latent space: ``2 * (kv_lora + qk_rope)`` for the score
    over the cached row and ``2 * kv_lora`` for the value (the latent part of the row)."""
    if cfg.attention == "mla":
        return 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * cfg.kv_lora_rank
    return 4 * cfg.head_dim


def ideal_flops(cfg: Any, b: Bucket) -> int:
    layers, head = active_params_per_token(cfg)
    attention = (cfg.num_attention_heads * attention_flops_per_pair(cfg) * b.q_kv_pairs
                 * cfg.num_hidden_layers)
    return 2 * layers * b.tokens + 2 * head * b.sampled + attention


def kv_bytes_per_token_per_device(cfg: Any, tp: int, itemsize: int) -> float:
    """KV cache bytes of one token (all layers) on one device: split over tp by head for GQA;
    MLA's latent row (``kv_lora + qk_rope`` values per layer) is replicated, whatever tp."""
    per_token = cfg.num_hidden_layers * cfg.kv_cache_heads * cfg.kv_cache_head_dim * itemsize
    return per_token / tp if cfg.kv_cache_sharded else float(per_token)


def kernel_cost_per_call(cfg: Any, b: Bucket, tp: int, itemsize: int) -> tuple[float, float]:
    """Per device (FLOPs, bytes) of one layer's attention over the cache, added analytically
    to XLA's count: the Pallas kernel's (GQA; XLA counts a custom call as 0) or the native
    backend's block loop (XLA counts a loop body once). FLOPs: ``heads / tp`` heads times
    ``attention_flops_per_pair`` per causal (query, key) pair; bytes: one read of each
    sequence's cached K/V (MLA: its latent rows, replicated over tp: every device of a rank
    reads them all), the queries and the outputs. A device attends for its attention rank's
    requests only: all of them without DP, the busiest rank's ``ceil(requests / dp)`` with it
    (the per-device figure of the roofline; ``Bucket.rank_load`` scales it to the sum)."""
    heads = cfg.num_attention_heads / tp
    requests = b.rank_requests
    flops = heads * attention_flops_per_pair(cfg) * b.pairs_per_request * requests
    cache_heads = cfg.kv_cache_heads / tp if cfg.kv_cache_sharded else cfg.kv_cache_heads
    kv = requests * b.context_len * cache_heads * cfg.kv_cache_head_dim * itemsize
    if cfg.attention == "mla":
        q_dim, out_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    else:
        q_dim = out_dim = cfg.head_dim
    q_out = requests * b.q_len * heads * (q_dim + out_dim) * itemsize
    return flops, kv + q_out


def max_requests_that_fit(free_bytes: float, kv_per_token: float, context_len: int,
                          dp: int) -> int:
    """Largest GLOBAL number of requests at ``context_len`` positions whose KV fits in
    ``free_bytes`` per device: each attention rank holds its own requests' KV (``dp`` ranks,
    1 without DP), a device ``kv_per_token`` bytes per token of its rank's requests."""
    if free_bytes <= 0:
        return 0
    return dp * int(free_bytes // (kv_per_token * context_len))


def dispatch_bytes_per_moe_layer(tokens: int, hidden: int, top_k: int, itemsize: int,
                                 tp: int, ep: int, dp: int,
                                 dispatch: str = "all_gather") -> float:
    """Bytes one device sends (= receives) over the interconnect for one MoE layer's token
    dispatch, from the formula (ring collectives; ``tokens``: the compiled tokens of the
    step, all ranks; ``itemsize``: the activation dtype's).

    Without DP: ep_moe's ``psum`` of the ``[T, H]`` partial outputs over all ``n = ep * tp``
    devices, ``2 * T * H * itemsize * (n - 1) / n`` (XLA:TPU reduces them in the activation
    dtype, as the compiled HLO shows). With DP (ranks = rows of "expert", ``f = (ep - 1) /
    ep``), the all-gather dispatch: the all-gather over "expert" of x (``T * H * itemsize *
    f``) and of the top-k ids and weights (``T * k * 8 * f``), the reduce-scatter of the
    partial outputs (in the activation dtype) back to their ranks (``T * H * itemsize * f``),
    and the all-reduce over "tensor" of each rank's ``T / ep`` rows (``2 * T / ep * H *
    itemsize * (tp - 1) / tp``). The ragged all-to-all dispatch sends each of a rank's
    ``T / ep * k`` assignments once (on average a fraction ``f`` leaves the device): its token
    row, local expert row and weight (``H * itemsize + 8``), and gets its float32 weighted
    result back (``H * 4``), then the same "tensor" all-reduce."""
    if dp == 1:
        n = ep * tp
        return 2 * tokens * hidden * itemsize * (n - 1) / n
    f = (ep - 1) / ep
    tensor = 2 * tokens / ep * hidden * itemsize * (tp - 1) / tp
    if dispatch == "ragged_all_to_all":
        assignments = tokens / ep * top_k
        return assignments * f * (hidden * itemsize + 8 + hidden * 4) + tensor
    gather = tokens * hidden * itemsize * f + tokens * top_k * 8 * f
    scatter = tokens * hidden * itemsize * f
    return gather + scatter + tensor


def shard_bytes(x: Any) -> int:
    """Bytes of one device's shard of an abstract (sharded ShapeDtypeStruct) array."""
    import numpy as np

    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    return math.prod(shape) * np.dtype(x.dtype).itemsize


def with_pattern(cfg: Any, pattern: tuple[bool, ...]) -> Any:
    """The config with ``len(pattern)`` decoder layers, layer i MoE iff ``pattern[i]``."""
    return dataclasses.replace(cfg, num_hidden_layers=len(pattern), moe_layers=tuple(pattern))


def slice_patterns(cfg: Any, a: int, b: int) -> list[tuple[bool, ...]]:
    """The truncated models ``--scale-from-layers A B`` compiles. All layers of one kind: A and
    B of them. Dense and MoE layers (DeepSeek-V3's first 3, GLM-4.5's first, Qwen2-MoE's
    mlp_only_layers): A and B MoE layers, and one dense layer before A MoE layers, so that
    per-layer costs of both kinds are measured (a prefix of the model would have no MoE
    layer at all when it starts with dense layers)."""
    kinds = set(cfg.moe_layers)
    main = True in kinds
    patterns = [(main,) * a, (main,) * b]
    if len(kinds) > 1:
        patterns.append((not main,) + (main,) * a)
    return patterns


# -- compile --------------------------------------------------------------------------------
@dataclasses.dataclass
class Compiled:
    """Per-device figures of one compiled bucket (floats: they may be extrapolated)."""

    flops: float
    bytes: float
    arguments: float
    outputs: float
    aliased: float
    temporaries: float
    code: float
    kernel_calls: float
    seconds: float
    sampler_flops: float = 0.0  # the sampler alone (--sampler-breakdown), not extrapolated
    sampler_bytes: float = 0.0
    # XLA's own count of one native attention call (per layer), replaced by the analytic one
    native_counted_flops: float = 0.0
    native_counted_bytes: float = 0.0
    # Bytes one device sends over the interconnect (ring estimate of the compiled HLO's
    # collectives, ``collective_bytes``): all of them, and those of the MoE blocks' dispatch
    collective_bytes: float = 0.0
    moe_collective_bytes: float = 0.0
    # --breakdown: "flops.<class>" / "bytes.<class>" per device (hlo_breakdown), summing to
    # ``flops`` / ``bytes``; "scale.flops" / "scale.bytes": the scale of the ops XLA does not
    # count exactly as estimated (hlo_breakdown.scale_classes); "estimate.*" / "exact.*":
    # per class, the unscaled estimate and its exact part
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict)

    @staticmethod
    def extrapolate(points: list[tuple[tuple[bool, ...], Compiled]],
                    target: tuple[bool, ...]) -> Compiled:
        """Every figure as ``base + n_moe * per_moe_layer (+ n_dense * per_dense_layer)``,
        solved exactly from the compiled slices (``slice_patterns``: 2 of them when the model
        has one kind of layer, 3 when it has both) and evaluated at the target's counts."""
        import numpy as np

        kinds = sorted(set(target))

        def row(pattern: tuple[bool, ...]) -> list[int]:
            return [1] + [sum(1 for x in pattern if x == k) for k in kinds]

        design = np.array([row(p) for p, _ in points], dtype=np.float64)
        at_target = np.array(row(target), dtype=np.float64)
        last = points[-1][1] if len(points) == 2 else points[1][1]

        def at(name: str) -> Any:
            values = [getattr(c, name) for _, c in points]
            if name == "code":  # program size grows sublinearly with depth: a bound
                return max(values)
            if name.startswith(("sampler", "native_counted")):  # independent of depth
                return getattr(last, name)
            if name == "seconds":
                return sum(values)
            if name == "breakdown":
                return extrapolated_breakdown(last.breakdown)
            return solve(values)

        def extrapolated_breakdown(keys: dict[str, float]) -> dict[str, float]:
            """Each class's unscaled estimate and its exact part extrapolated on their own (a
            depth-independent class such as the sampler stays what it is), then scaled as
            ``hlo_breakdown.scale_classes`` does so the classes sum to the extrapolated XLA
            total. (Extrapolating the scaled classes would not do: the
            scale differs a little between the compiles, and the extrapolation multiplies
            the difference of a constant class by the depth, even below zero.)"""
            if not keys:
                return {}
            from sgl_jax.tools.hlo_breakdown import scale_classes

            out: dict[str, float] = {}
            for prop in ("flops", "bytes"):
                parts = {}
                for part in ("estimate", "exact"):
                    prefix = f"{part}.{prop}."
                    parts[part] = {k[len(prefix):]: solve([c.breakdown[k] for _, c in points])
                                   for k in keys if k.startswith(prefix)}
                    out.update({prefix + k: v for k, v in parts[part].items()})
                xla = solve([getattr(c, prop) for _, c in points])
                scaled, out[f"scale.{prop}"] = scale_classes(parts["estimate"],
                                                             parts["exact"], xla)
                out.update({f"{prop}.{k}": v for k, v in scaled.items()})
            return out

        def solve(values: list[float]) -> float:
            coef = np.linalg.solve(design, np.array(values, dtype=np.float64))
            return float(at_target @ coef)

        return Compiled(**{f.name: at(f.name) for f in dataclasses.fields(Compiled)})


# Bytes of one element of an HLO array type.
HLO_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "ragged-all-to-all",
                  "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (?P<type>.+?) (?P<op>" + "|".join(COLLECTIVE_OPS)
    + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([0-9,]*)\]")


def _group_size(line: str, n_devices: int) -> int:
    """Devices per replica group of a collective, from its ``replica_groups`` in any of the
    three printed forms: explicit ``{{0,1},{2,3}}``, iota ``[G,S]<=[N]``, or mesh axes
    ``mesh['axis_0'=4,'axis_1'=2], device_ids=(...) {'axis_0'}`` (the named axes)."""
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\{('[^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return n_devices  # replica_groups={} : all devices


def _frame_files(hlo: str) -> dict[int, set[str]]:
    """stack_frame_id -> the source files of that frame and its callers, from the compiled
    module's FileNames / FileLocations / StackFrames tables (parent_frame_id is 1-based,
    0 = none)."""
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
        elif not line.strip():
            current = None
        elif current is not None:
            key, _, value = line.partition(" ")
            if key.isdigit():
                current[int(key)] = value
    files = sections.get("FileNames", {})
    locations = {k: re.search(r"file_name_id=(\d+)", v) for k, v in
                 sections.get("FileLocations", {}).items()}
    frames = {k: (int(re.search(r"file_location_id=(\d+)", v).group(1)),
                  int(re.search(r"parent_frame_id=(\d+)", v).group(1)))
              for k, v in sections.get("StackFrames", {}).items()}
    out: dict[int, set[str]] = {}
    for frame in frames:
        seen, f = set(), frame
        while f in frames and len(seen) < 256:
            loc, parent = frames[f]
            m = locations.get(loc)
            if m:
                seen.add(files.get(int(m.group(1)), ""))
            f = parent - 1
        out[frame] = seen
    return out


def _instructions(lines: list[str]) -> Iterator[tuple[str, str]]:
    """(computation name, line) of every line of an HLO module's text but the computations'
    headers."""
    computation = ""
    for line in lines:
        head = re.match(r"^(?:ENTRY )?%([^\s(]+) *[({]", line)
        if head:
            computation = head.group(1)
        else:
            yield computation, line


def collective_bytes(hlo: str, n_devices: int) -> tuple[float, float, dict[str, float]]:
    """(all, MoE dispatch, per op) bytes one device sends over the interconnect in one run
    of the compiled module ``hlo`` (``compiled.as_text()``), estimated from every collective
    as a ring algorithm over its replica group of n devices, S the bytes of its result:
    all-reduce ``2 S (n-1)/n``, all-gather and all-to-all ``S (n-1)/n``, reduce-scatter ``S
    (n-1)``, collective-permute ``S``; ragged-all-to-all ``S (n-1)/n`` of its static output
    buffer (an upper bound). XLA:TPU may emit a reduce-scatter as a fusion calling an
    ``all-reduce-scatter`` computation, whose all-reduce of the (padded) input is counted as
    the reduce-scatter it is, ``S_in (n-1)/n``. A collective belongs to the MoE dispatch when
    its source location (the stack frames XLA keeps: its own, or its reduction's) is in
    ``layers/moe/``. Collectives inside a loop body or a ``cond`` branch are counted once
    (the sampler's sort fallback among them)."""
    frames = _frame_files(hlo)
    lines = hlo.splitlines()
    # computation -> its ROOT's stack frame (a reduction's add keeps the psum's location)
    root_frame: dict[str, int] = {}
    for computation, line in _instructions(lines):
        if line.lstrip().startswith("ROOT "):
            frame = re.search(r"stack_frame_id=(\d+)", line)
            if frame:
                root_frame[computation] = int(frame.group(1))
    total = moe = 0.0
    per_op: dict[str, float] = {}
    for computation, line in _instructions(lines):
        m = _COLLECTIVE.match(line)
        if m is None:
            continue
        op = m.group("op")
        arrays = [math.prod(int(d) for d in dims.split(",") if d) * HLO_ITEMSIZE[t]
                  for t, dims in _ARRAY.findall(m.group("type")) if dims and t in HLO_ITEMSIZE]
        if not arrays:
            continue
        n = _group_size(line, n_devices)
        if m.group("start") and op == "all-gather":
            # (operands, results): results are n times the operands
            size = sum(arrays) * n / (n + 1)
        elif m.group("start") and op == "collective-permute":
            size = sum(arrays) / 2  # (operands, results[, sync flags])
        else:
            size = float(sum(arrays))  # a combined collective: every result
        if op == "all-reduce" and computation.startswith("all-reduce-scatter"):
            op, sent = "reduce-scatter", size * (n - 1) / n
        elif op == "all-reduce":
            sent = 2 * size * (n - 1) / n
        elif op == "reduce-scatter":
            sent = size * (n - 1)
        elif op == "collective-permute":
            sent = size
        else:
            sent = size * (n - 1) / n
        frame = re.search(r"stack_frame_id=(\d+)", line)
        frame_id = int(frame.group(1)) if frame else None
        if frame_id is None:
            reduction = re.search(r"to_apply=%(\S+?),", line)
            frame_id = root_frame.get(reduction.group(1)) if reduction else None
        in_moe = frame_id is not None and any(
            "/layers/moe/" in f for f in frames.get(frame_id, ()))
        total += sent
        moe += sent if in_moe else 0.0
        per_op[op] = per_op.get(op, 0.0) + sent
    return total, moe, per_op


def compile_bucket(runner: Any, b: Bucket, device_kind: str,
                   breakdown: bool = False, top_ops: int = 0,
                   dump_path: str | None = None) -> Compiled:
    from sgl_jax.srt.forward_batch_info import ForwardMode

    mode = {"decode": ForwardMode.DECODE, "verify": ForwardMode.TARGET_VERIFY}.get(
        b.mode, ForwardMode.EXTEND)
    t0 = time.perf_counter()
    with kernel_tuning_for(device_kind):
        # With DP attention the runner's bucket is per rank (it lays out dp times as much).
        lowered = runner.lower_bucket(mode, b.compiled_tokens // b.dp, b.rows // b.dp)
    try:
        compiled = lowered.compile()
    except Exception as e:
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text and "memory space hbm" in text.lower():
            raise DoesNotFit(
                f"XLA:TPU could not fit the {b.mode} step of {b.tokens} tokens in HBM: "
                f"{text.splitlines()[0][:400]}"
            ) from e
        if "RESOURCE_EXHAUSTED" in text and ("vmem" in text or "smem" in text):
            raise ReportError(
                f"XLA:TPU could not compile the {b.mode} step of {b.tokens} tokens: a Pallas "
                "kernel's blocks exceed the chip's on-chip memory (the engine's kernel "
                "configuration, not the model's size). The ragged paged attention kernel needs "
                "fewer heads per device (a larger --tp-size) or, for SMEM (its page table), a "
                f"larger --page-size. XLA: {' '.join(text.split())[:600]}"
            ) from e
        raise
    seconds = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    if dump_path:
        Path(dump_path).write_text(hlo)
    calls = sum(
        1 for line in hlo.splitlines()
        if "custom-call(" in line and ATTENTION_KERNEL in line
    )
    sent, moe_sent, _ = collective_bytes(hlo, runner.mesh.size)
    classes = {}
    if breakdown:
        from sgl_jax.tools.hlo_breakdown import breakdown as per_class

        bd = per_class(hlo, float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)))
        classes = {**{f"flops.{k}": v for k, v in bd.flops.items()},
                   **{f"bytes.{k}": v for k, v in bd.bytes.items()},
                   "scale.flops": bd.flops_scale, "scale.bytes": bd.bytes_scale}
        # The unscaled per-op estimates and their parts XLA counts exactly so, for
        # extrapolating over depth (Compiled.extrapolate).
        for prop in ("flops", "bytes"):
            classes.update({f"estimate.{prop}.{k}": v for k, v in bd.estimates[prop].items()})
            classes.update({f"exact.{prop}.{k}": v
                            for k, v in bd.estimates[f"exact_{prop}"].items()})
        if top_ops:
            log_top_ops(hlo, top_ops, bd.bytes_scale)
    return Compiled(
        flops=float(cost.get("flops", 0.0)),
        bytes=float(cost.get("bytes accessed", 0.0)),
        arguments=float(mem.argument_size_in_bytes),
        outputs=float(mem.output_size_in_bytes),
        aliased=float(mem.alias_size_in_bytes),
        temporaries=float(mem.temp_size_in_bytes),
        code=float(mem.generated_code_size_in_bytes),
        kernel_calls=float(calls),
        seconds=seconds,
        collective_bytes=sent,
        moe_collective_bytes=moe_sent,
        breakdown=classes,
    )


def log_top_ops(hlo: str, n: int, scale: float) -> None:
    """--top-ops: the n ops of the compiled step with the most estimated bytes (per device;
    times the breakdown's scale unless XLA counts the op exactly so, as the classes count
    them), to see what a class is made of."""
    from sgl_jax.tools.hlo_breakdown import top_ops

    for cls, name, flops, nbytes, op_name, exact in top_ops(hlo, n):
        logger.info("  %9.1f MB %8.2f GFLOP  %-16s %-36s %s",
                    nbytes * (1.0 if exact else scale) / 1e6, flops / 1e9, cls, name[-36:],
                    op_name[:100])


def compile_native_attention(runner: Any, b: Bucket, cfg: Any) -> tuple[float, float]:
    """Per-device (FLOPs, bytes) XLA counts for ONE layer's call of the native attention
    backend at this bucket's shape, compiled alone with the step's shardings (queries split
    by head over "tensor"; the cache as the runner holds it). XLA counts the body of each of
    its loops once whatever the trip count, so this is neither the work done nor zero; the
    report replaces it, per layer, by the analytic cost (``kernel_cost_per_call``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sgl_jax.srt.layers.attention import AttentionMetadata

    mesh, dtype = runner.mesh, runner.dtype
    replicated = NamedSharding(mesh, P())

    def ints(*shape: int) -> Any:
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)

    # With DP attention every device runs one rank's call (inside the step's shard_map over
    # the ranks) on the rank's rows and its shard of the cache: compile that call (the
    # cache's rows of one rank, replicated over the ranks here; heads as the step splits them).
    tokens, rows = b.compiled_tokens // b.dp, b.rows // b.dp
    kv = runner.kv_caches[0]
    if b.dp > 1:
        spec = tuple(kv.sharding.spec) + (None,) * (len(kv.shape) - len(kv.sharding.spec))
        kv = jax.ShapeDtypeStruct((kv.shape[0] // b.dp, *kv.shape[1:]), kv.dtype,
                                  sharding=NamedSharding(mesh, P(None, *spec[1:])))
    meta = AttentionMetadata(
        positions=ints(tokens), token_to_req=ints(tokens), prefix_lens=ints(rows),
        extend_lens=ints(rows), extend_starts=ints(rows),
        page_indices=ints(rows, runner.req_to_page.shape[1]), page_size=runner.page_size,
        is_decode=b.mode == "decode",
    )
    backend = runner.backends.attention
    heads = cfg.num_attention_heads
    q_sharding = NamedSharding(mesh, P(None, "tensor", None))
    if cfg.attention == "mla":
        dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        q = jax.ShapeDtypeStruct((tokens, heads, dim), dtype, sharding=q_sharding)

        def fn(q: Any, kv: Any, meta: Any) -> Any:
            return backend.attend_latent(q, kv, meta, 1.0, cfg.kv_lora_rank)
    else:
        q = jax.ShapeDtypeStruct((tokens, heads, cfg.head_dim), dtype, sharding=q_sharding)

        def fn(q: Any, kv: Any, meta: Any) -> Any:
            return backend.attend(q, kv, meta, 1.0)
    with jax.set_mesh(mesh):
        cost = jax.jit(fn).lower(q, kv, meta).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def compile_sampler(runner: Any, rows: int, vocab: int) -> tuple[float, float]:
    """Per-device (FLOPs, bytes) of the engine's sampler alone on ``[rows, vocab]`` float32
    logits split over the vocabulary like the LM head's (XLA counts its most expensive
    branch: the full-vocabulary sort)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sgl_jax.srt.layers.sampler import sample, vocab_chunks_for
    from sgl_jax.srt.sampling.sampling_metadata import SamplingMetadata

    replicated = NamedSharding(runner.mesh, P())
    meta = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=replicated),
        SamplingMetadata.from_params([], [], [], rows, vocab),
    )
    logits = jax.ShapeDtypeStruct(
        (rows, vocab), jnp.float32, sharding=NamedSharding(runner.mesh, P(None, "tensor"))
    )
    with jax.set_mesh(runner.mesh):
        chunks = vocab_chunks_for(runner.platform)  # as the engine's step samples
        cost = jax.jit(sample, static_argnames="vocab_chunks").lower(
            logits, meta, vocab_chunks=chunks).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def build_runner(args: argparse.Namespace, model_dir: str, cfg: Any, devices: list) -> Any:
    from sgl_jax.srt.model_executor.model_runner import ModelRunner
    from sgl_jax.srt.server_args import ServerArgs

    max_running = max(max(args.decode_bs), args.prefill_requests)
    dp = args.dp_size
    # The runner's buckets are per attention rank (with DP: the busiest rank's share).
    rank_bs = sorted({-(-bs // dp) for bs in (*args.decode_bs, max_running)})
    # --prefill-tokens 0 (no prefill bucket): the runner still needs an extend bucket.
    prefill_tokens = args.prefill_tokens or args.prefill_requests
    extend_paddings = [extend_padding(n, prefill_tokens) for n in args.extend_tokens or ()]
    rank_tokens = -(-args.prefill_requests // dp) * (prefill_tokens // args.prefill_requests)
    server_args = ServerArgs(
        model_path=model_dir,
        context_length=args.context_len,
        max_running_requests=max_running,
        # KV for every decode request at full context (and a whole prefill batch).
        max_total_tokens=max(max_running * args.context_len, prefill_tokens),
        chunked_prefill_size=rank_tokens if dp > 1 else prefill_tokens,
        precompile_bs_paddings=rank_bs,
        precompile_token_paddings=[rank_tokens if dp > 1 else prefill_tokens,
                                   *extend_paddings],
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        dtype=args.dtype,
        attention_backend=args.resolved_attention_backend,
        moe_backend=args.moe_backend,
        page_size=args.page_size,
        enable_return_routed_experts=args.enable_return_routed_experts,
        disable_precompile=True,
        **({"enable_eplb": True, "ep_num_redundant_experts": args.ep_num_redundant_experts}
           if args.ep_num_redundant_experts else {}),
        **({"ep_expert_mapping": args.ep_expert_mapping} if args.ep_expert_mapping else {}),
        **({} if args.sequence_parallel_min_tokens is None
           else {"sequence_parallel_min_tokens": args.sequence_parallel_min_tokens}),
        # Speculative decoding: the runner's verify buckets are bs x K tokens. NGRAM: its
        # drafts need no model (no draft work in the step); EAGLE / NEXTN: the draft head or
        # MTP layer runs inside the step (draft extend + K - 2 chain steps); chain drafts:
        # K - 1 steps.
        **({"speculative_algorithm": args.speculative_algorithm,
            "speculative_num_draft_tokens": args.verify_tokens,
            "speculative_num_steps": args.verify_tokens - 1,
            **({"speculative_draft_model_path": resolve_config_path(
                args.speculative_draft_model_path)[0]}
               if args.speculative_algorithm == "EAGLE" else {}),
            } if args.verify_tokens else {}),
        # Data-parallel attention: the ranks are the rows of the "expert" axis (dp = ep);
        # max_total_tokens stays global, each rank holding 1 / dp of it.
        **({"enable_dp_attention": True, "dp_size": args.dp_size,
            "moe_dispatch": args.moe_dispatch} if args.dp_size > 1 else {}),
    )
    return ModelRunner(server_args, cfg, devices=devices, abstract=True)


# -- report ---------------------------------------------------------------------------------
def check_fit(params: int, kv: int, hbm: float, cfg: Any, args: argparse.Namespace,
              kv_per_token: float) -> None:
    if params + kv <= hbm:
        return
    free = hbm - params
    if free > 0:
        # Global requests: with DP each rank holds its own requests' KV.
        max_bs = max_requests_that_fit(free, kv_per_token, args.context_len, args.dp_size)
        rank_bs = -(-max(args.decode_bs) // args.dp_size)
        max_ctx = int(free // (kv_per_token * rank_bs))
        kv_hint = (
            f"at --context-len {args.context_len} at most {max_bs} requests fit next to the "
            f"parameters (or --decode-bs {max(args.decode_bs)} at --context-len <= {max_ctx})"
        )
    else:
        kv_hint = "the parameters alone exceed a device's HBM"
    dp_hint = (
        "" if args.dp_size > 1 else
        " Data-parallel attention (--dp-size equal to --ep-size) splits the KV cache over the "
        "ep ranks, each holding its own requests.")
    if cfg.kv_cache_sharded:
        to_fit = (
            "more devices (a larger --topology) with a larger --ep-size (experts are split "
            "over tp x ep devices) or --tp-size (attention, LM head and the KV cache are split "
            f"over tp, tp_size <= num_key_value_heads = {cfg.num_key_value_heads}), or a "
            "smaller --context-len / --decode-bs." + dp_hint
        )
    else:
        to_fit = (
            "for the parameters, more devices (a larger --topology) with a larger --ep-size or "
            "--tp-size (experts are split over tp x ep devices, attention and the LM head over "
            "tp); the KV cache is multi-head latent attention's latent rows "
            f"({cfg.kv_cache_head_dim} values per token and layer), not split by --tp-size: "
            "replicated on every device of an attention rank; only a smaller "
            "--context-len / --decode-bs or more ranks shrink it." + dp_hint
        )
    raise DoesNotFit(
        f"the model does not fit: parameters {params / GiB:.2f} GiB + KV cache {kv / GiB:.2f} "
        f"GiB ({max(args.decode_bs)} requests x {args.context_len} tokens) = "
        f"{(params + kv) / GiB:.2f} GiB per device > {hbm / GiB:.2f} GiB HBM per device "
        f"({args.topology}, tp_size={args.tp_size}, ep_size={args.ep_size}, "
        f"dp_size={args.dp_size}); {kv_hint}. "
        f"To fit: {to_fit}"
    )


def make_record(b: Bucket, c: Compiled, cfg: Any, args: argparse.Namespace, n_dev: int,
                chip: Chip, share: float, params: int, kv: int, itemsize: int) -> dict:
    # Per device: the busiest attention rank's kernel work (every device without DP).
    k_flops, k_bytes = kernel_cost_per_call(cfg, b, args.tp_size, itemsize)
    kernel_flops, kernel_bytes = c.kernel_calls * k_flops, c.kernel_calls * k_bytes
    # Native backend: XLA's once-per-loop count of each attention call is replaced by the
    # analytic cost (a Pallas call is counted 0 by XLA: nothing to take out).
    native_flops = c.kernel_calls * c.native_counted_flops
    native_bytes = c.kernel_calls * c.native_counted_bytes
    flops_pd = c.flops - native_flops + kernel_flops
    bytes_pd = c.bytes - native_bytes + kernel_bytes
    ideal = ideal_flops(cfg, b)
    ideal_attention = (cfg.num_attention_heads * attention_flops_per_pair(cfg) * b.q_kv_pairs
                       * cfg.num_hidden_layers)
    peak_flops, bandwidth = chip.bf16_flops * share, chip.hbm_bandwidth * share
    t_compute, t_memory = flops_pd / peak_flops, bytes_pd / bandwidth
    roofline = max(t_compute, t_memory)
    outputs = c.outputs - c.aliased
    peak = c.arguments + outputs + c.temporaries + c.code
    # XLA counts a grouped matmul at its static size, though each device's groups hold only
    # its own experts' share of the rows (the rest sort past the last group, where the kernel
    # has no work): ragged's holds all T*k assignments on every device of the "expert" axis,
    # gmm's one pass window (gmm.pass_rows: 1.25 times the device's share).
    excess = 0.0
    if args.resolved_moe_backend in ("ragged", "gmm") and args.ep_size > 1:
        top_k = cfg.num_experts_per_tok
        per_assignment = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        # A device's matmuls see every compiled token's k assignments (with DP: all ranks'
        # tokens, gathered; idle ranks' padding included), its experts' slice.
        rows = b.compiled_tokens * top_k
        if args.resolved_moe_backend == "gmm":
            import jax
            import jax.numpy as jnp

            from sgl_jax.srt.layers.moe import gmm

            # The pass window, padded to its row tile, as the kernels' estimates count it.
            rows = gmm.pass_rows(rows, args.ep_size, gmm.CAPACITY_FACTOR)
            inter = cfg.moe_intermediate_size // args.tp_size
            experts = cfg.num_physical_experts // args.ep_size
            dtype = jnp.dtype(args.dtype)
            w_gate = jax.ShapeDtypeStruct((experts, cfg.hidden_size, inter), dtype)
            w_down = jax.ShapeDtypeStruct((experts, inter, cfg.hidden_size), dtype)
            rows = gmm.pad_rows(rows, gmm.row_tile(rows, w_gate, w_down))
        excess = per_assignment * sum(cfg.moe_layers) * (args.ep_size * rows
                                                         - b.tokens * top_k)
    # Sums over devices: the kernel's per-device figure is the busiest rank's; idle ranks
    # (fewer requests than ranks) attend to nothing (rank_load = 1 without DP).
    compiled_flops = (flops_pd - kernel_flops) * n_dev + kernel_flops * n_dev * b.rank_load
    compiled_bytes = (bytes_pd - kernel_bytes) * n_dev + kernel_bytes * n_dev * b.rank_load
    kv_per_token = kv_bytes_per_token_per_device(cfg, args.tp_size, itemsize)
    hbm = chip.hbm_bytes * share
    # One read of the device's parameters and of its rank's requests' context (decode's
    # floor; every expert is read at these batch sizes).
    min_bytes = params + b.rank_requests * b.context_len * kv_per_token
    n_moe = sum(cfg.moe_layers)
    dispatch = dispatch_bytes_per_moe_layer(b.compiled_tokens, cfg.hidden_size,
                                            cfg.num_experts_per_tok, itemsize, args.tp_size,
                                            args.ep_size, args.dp_size, args.moe_dispatch)
    no_sampler = max((flops_pd - c.sampler_flops) / peak_flops,
                     (bytes_pd - c.sampler_bytes) / bandwidth)
    return {
        "mode": b.mode,
        "tokens": b.tokens,
        "batch_size": b.requests,
        "padded_rows": b.rows,
        "context_len": b.context_len,
        "topology": args.topology,
        "chip": chip.name,
        "devices": n_dev,
        "tp_size": args.tp_size,
        "ep_size": args.ep_size,
        "dp_size": args.dp_size,
        "compiled_tokens": b.compiled_tokens,
        "rank_requests": b.rank_requests,
        "family": cfg.family,
        "attention": cfg.attention,
        "attention_backend": args.resolved_attention_backend,
        "compiled_layers": args.compiled_layers,
        "compiled_slices": args.compiled_slices,
        "active_params_per_token": sum(active_params_per_token(cfg)),
        "kv_bytes_per_token_per_device": kv_per_token,
        "compiled_flops": compiled_flops,
        "xla_flops": c.flops * n_dev,
        "kernel_flops": kernel_flops * n_dev * b.rank_load,
        "attention_flops_ideal": ideal_attention,
        "native_attention_xla_flops": native_flops * n_dev,
        "native_attention_xla_bytes": native_bytes * n_dev,
        "ideal_flops": ideal,
        "ideal_flops_per_device": ideal / n_dev,
        "flops_ratio": compiled_flops / ideal,
        "ragged_static_excess_flops": excess,
        "flops_ratio_local_rows": (compiled_flops - excess) / ideal,
        "bytes_accessed": compiled_bytes,
        "xla_bytes_accessed": c.bytes * n_dev,
        "kernel_bytes_accessed": kernel_bytes * n_dev * b.rank_load,
        "min_bytes_per_device": min_bytes,
        "collective_bytes_per_device": c.collective_bytes,
        "moe_collective_bytes_per_device": c.moe_collective_bytes,
        "moe_collective_bytes_per_layer": c.moe_collective_bytes / n_moe if n_moe else 0.0,
        "dispatch_bytes_per_moe_layer_formula": dispatch if n_moe else 0.0,
        "flops_per_device": flops_pd,
        "bytes_accessed_per_device": bytes_pd,
        "parameters_bytes_per_device": params,
        "kv_cache_bytes_per_device": kv,
        "other_arguments_bytes_per_device": c.arguments - params - kv,
        "temporaries_bytes_per_device": c.temporaries,
        "outputs_bytes_per_device": outputs,
        "code_bytes_per_device": c.code,
        "peak_hbm_bytes_per_device": peak,
        "hbm_bytes_per_device": hbm,
        "peak_exceeds_hbm": peak > hbm,
        # Largest global batch at this context whose KV fits next to the parameters, and
        # next to everything else this bucket's compiled step holds (its temporaries, ...).
        "max_requests_fit": max_requests_that_fit(hbm - params, kv_per_token,
                                                  args.context_len, args.dp_size),
        "max_requests_fit_with_step": max_requests_that_fit(hbm - (peak - kv), kv_per_token,
                                                            args.context_len, args.dp_size),
        "roofline_ms": roofline * 1e3,
        "compute_ms": t_compute * 1e3,
        "memory_ms": t_memory * 1e3,
        "bound": "compute" if t_compute >= t_memory else "memory",
        "tokens_per_s": b.tokens / roofline,
        "sampler_flops": c.sampler_flops * n_dev,
        "sampler_bytes_accessed": c.sampler_bytes * n_dev,
        "roofline_ms_without_sampler": no_sampler * 1e3 if args.sampler_breakdown else None,
        "compile_s": c.seconds,
        **breakdown_fields(c, kernel_flops, kernel_bytes),
    }


def breakdown_fields(c: Compiled, kernel_flops: float, kernel_bytes: float) -> dict:
    """--breakdown: per class FLOPs and bytes per device (summing to XLA's count,
    ``xla_*_per_device``), the attention kernel's analytic work (added by the report on top of
    XLA's count) and the scale of the estimates XLA does not count exactly so ((XLA total -
    exact) / (estimate - exact): hlo_breakdown.scale_classes)."""
    if not c.breakdown:
        return {}
    from sgl_jax.tools.hlo_breakdown import CLASSES

    return {
        "breakdown_flops_per_device": {k: c.breakdown[f"flops.{k}"] for k in CLASSES},
        "breakdown_bytes_per_device": {k: c.breakdown[f"bytes.{k}"] for k in CLASSES},
        "xla_flops_per_device": c.flops,
        "xla_bytes_per_device": c.bytes,
        "attention_kernel_analytic_flops_per_device": kernel_flops,
        "attention_kernel_analytic_bytes_per_device": kernel_bytes,
        "breakdown_flops_scale": c.breakdown["scale.flops"],
        "breakdown_bytes_scale": c.breakdown["scale.bytes"],
    }


def format_breakdown(records: list[dict]) -> str:
    """Per class and bucket: GB and GFLOP per device and the share of the bucket's total
    (XLA's count + the attention kernel's analytic work, i.e. the table's GB/dev)."""
    from sgl_jax.tools.hlo_breakdown import CLASSES

    names = [f"{r['mode']} {r['tokens']}" + (f" x{r['batch_size']}" if r["mode"] == "prefill"
                                             else "") for r in records]
    lines = []
    for prop, unit, scale in (("bytes", "GB", 1e9), ("flops", "GFLOP", 1e9)):
        lines += [f"breakdown: {unit} per device (share of the step)",
                  "| class | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(records)]
        rows = [(k, [r[f"breakdown_{prop}_per_device"][k] for r in records]) for k in CLASSES]
        rows.append(("attention kernel (analytic, not in XLA's count)",
                     [r[f"attention_kernel_analytic_{prop}_per_device"] for r in records]))
        totals = [sum(v for _, vs in rows for v in [vs[i]]) for i in range(len(records))]
        rows.append(("total", totals))
        for k, vs in rows:
            cells = [f"{v / scale:.2f} ({100 * v / t:.0f}%)" if t else "0"
                     for v, t in zip(vs, totals, strict=True)]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("(kernels and all-gathers/-reduces, reduce-scatters, all-to-alls as "
                     "estimated, the other ops' estimates scaled by (XLA total - those) / "
                     "(estimate - those): "
                     + ", ".join(f"{r[f'breakdown_{prop}_scale']:.3f}" for r in records) + ")")
    return "\n".join(lines)


# (column, format, value) of the table output; sizes per device.
COLUMNS = [
    ("mode", "{}", lambda r: r["mode"]),
    ("tokens", "{}", lambda r: r["tokens"]),
    ("bs", "{}", lambda r: r["batch_size"]),
    ("ctx", "{}", lambda r: r["context_len"]),
    ("TFLOP", "{:.2f}", lambda r: r["compiled_flops"] / 1e12),
    ("ideal", "{:.2f}", lambda r: r["ideal_flops"] / 1e12),
    ("ratio", "{:.2f}", lambda r: r["flops_ratio"]),
    ("GB/dev", "{:.1f}", lambda r: r["bytes_accessed_per_device"] / 1e9),
    ("peak GiB/dev", "{:.2f}", lambda r: r["peak_hbm_bytes_per_device"] / GiB),
    ("params", "{:.2f}", lambda r: r["parameters_bytes_per_device"] / GiB),
    ("KV", "{:.2f}", lambda r: r["kv_cache_bytes_per_device"] / GiB),
    ("temp", "{:.2f}", lambda r: r["temporaries_bytes_per_device"] / GiB),
    ("roofline ms", "{:.2f}", lambda r: r["roofline_ms"]),
    ("bound", "{}", lambda r: r["bound"]),
    ("tok/s", "{:,.0f}", lambda r: r["tokens_per_s"]),
]
SAMPLER_COLUMN = ("ms w/o sampler", "{:.2f}", lambda r: r["roofline_ms_without_sampler"])


def format_table(records: list[dict], header: str) -> str:
    cols = list(COLUMNS)
    if records and records[0]["roofline_ms_without_sampler"] is not None:
        cols.insert(-2, SAMPLER_COLUMN)
    lines = [header, "| " + " | ".join(name for name, _, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt.format(get(r)) for _, fmt, get in cols) + " |"
              for r in records]
    return "\n".join(lines)


def format_notes(records: list[dict], context_len: int) -> str:
    """Lines under the table: per bucket the ratio without the static ragged_dot excess and
    the interconnect bytes, then the largest batch that fits."""
    lines = []
    for r in records:
        lines.append(
            f"{r['mode']} {r['tokens']}: flops_ratio_local_rows {r['flops_ratio_local_rows']:.2f};"
            f" interconnect per device: MoE dispatch {r['moe_collective_bytes_per_layer'] / 1e6:.2f}"
            f" MB per MoE layer (formula {r['dispatch_bytes_per_moe_layer_formula'] / 1e6:.2f}),"
            f" all collectives {r['collective_bytes_per_device'] / 1e9:.3f} GB per step")
    r = records[0]
    lines.append(
        f"largest global batch at {context_len} positions: {r['max_requests_fit']} requests "
        f"(KV next to the parameters), {min(x['max_requests_fit_with_step'] for x in records)} "
        "next to every bucket's compiled step")
    return "\n".join(lines)


def resolve_attention_backend(cfg: Any, requested: str | None) -> str:
    """pallas for GQA (the TPU default); native for MLA, which JAX's ragged paged attention
    kernel cannot run (it reads separate K/V heads, not a latent row)."""
    if cfg.attention != "mla":
        return requested or "pallas"
    if requested == "pallas":
        raise ReportError(
            f"--attention-backend pallas cannot run {cfg.architecture}'s multi-head latent "
            "attention (MLA: one latent KV row per token; JAX's ragged paged attention kernel "
            "reads separate K/V heads). Omit --attention-backend (MLA models default to "
            "native) or pass --attention-backend native"
        )
    if requested is None:
        logger.info("%s uses multi-head latent attention: --attention-backend native",
                    cfg.architecture)
    return "native"


def run(args: argparse.Namespace) -> list[dict]:
    prepare_environment()
    import jax.numpy as jnp

    from sgl_jax.srt.configs.model_config import ModelConfig

    if args.prefill_tokens % args.prefill_requests:
        raise ReportError("--prefill-tokens must be a multiple of --prefill-requests")
    model_dir, hf = resolve_config_path(args.model_config)
    cfg = ModelConfig.from_dict(hf, model_dir, args.context_len)
    args.resolved_attention_backend = resolve_attention_backend(cfg, args.attention_backend)
    devices = topology_devices(args.topology)
    need = args.tp_size * args.ep_size
    if need > len(devices):
        raise ReportError(
            f"tp_size={args.tp_size} x ep_size={args.ep_size} needs {need} devices; "
            f"{args.topology} has {len(devices)}"
        )
    devices = mesh_order(devices, args.ep_size, args.tp_size)
    chip, share = chip_of(devices[0], args)
    kind = devices[0].device_kind

    full = build_runner(args, model_dir, cfg, devices)
    params = sum(shard_bytes(x) for x in full.param_leaves)
    kv = sum(shard_bytes(x) for x in full.kv_caches)
    itemsize = jnp.dtype(full.dtype).itemsize
    kv_per_token = kv_bytes_per_token_per_device(cfg, args.tp_size, itemsize)
    hbm = chip.hbm_bytes * share
    logger.info(
        "%s: %d x %s devices (%s), tp=%d ep=%d dp=%d; per device: parameters %.2f GiB, KV "
        "cache %.2f GiB, HBM %.2f GiB", args.topology, len(devices), kind, chip.name,
        args.tp_size, args.ep_size, args.dp_size, params / GiB, kv / GiB, hbm / GiB,
    )
    check_fit(params, kv, hbm, cfg, args, kv_per_token)
    args.resolved_moe_backend = full.backends.moe.name

    buckets = dp_buckets(args.decode_bs, args.prefill_tokens, args.prefill_requests,
                         args.context_len, args.dp_size, full.extend_rows, args.verify_tokens)
    buckets += extend_buckets(args.extend_tokens or [], args.context_len,
                              args.prefill_tokens or args.prefill_requests, full.extend_rows)

    full_pattern = tuple(cfg.moe_layers)
    if args.scale_from_layers:
        la, lb = args.scale_from_layers
        main = any(cfg.moe_layers)
        have = sum(1 for x in cfg.moe_layers if x == main)
        if lb > have:
            raise ReportError(
                f"--scale-from-layers {la} {lb}: the model has only {have} "
                f"{'MoE' if main else 'dense'} layers")
        patterns = slice_patterns(cfg, la, lb)
    else:
        patterns = [full_pattern]
    args.compiled_layers = [len(p) for p in patterns]
    args.compiled_slices = [describe_pattern(p) for p in patterns]
    compiled: list[list[Compiled]] = []
    samplers: dict[int, tuple[float, float]] = {}
    native_counted: dict[Bucket, tuple[float, float]] = {}
    for pattern in patterns:
        runner = full if pattern == full_pattern else build_runner(
            args, model_dir, with_pattern(cfg, pattern), devices)
        compiled.append([])
        for b in buckets:
            logger.info("compiling %s: %d tokens, %d rows, %s ...", b.mode, b.tokens, b.rows,
                        describe_pattern(pattern))
            dump = (os.path.join(args.dump_hlo, f"{b.mode}-{b.tokens}x{b.rows}-"
                                 f"{sum(pattern)}moe{len(pattern)}.hlo")
                    if args.dump_hlo else None)
            c = compile_bucket(runner, b, kind, args.breakdown, args.top_ops, dump)
            if args.resolved_attention_backend == "native":
                c.kernel_calls = float(len(pattern))  # one attention loop per layer
                if b not in native_counted:  # independent of depth
                    native_counted[b] = compile_native_attention(runner, b, cfg)
                c.native_counted_flops, c.native_counted_bytes = native_counted[b]
            if args.sampler_breakdown:  # independent of depth: once per row count
                n = b.compiled_sampled
                if n not in samplers:
                    samplers[n] = compile_sampler(runner, n, cfg.vocab_size)
                c.sampler_flops, c.sampler_bytes = samplers[n]
            logger.info("  %.0fs: %.3g FLOPs, %.3g bytes per device", c.seconds, c.flops,
                        c.bytes)
            compiled[-1].append(c)
    if args.scale_from_layers:
        results = [Compiled.extrapolate(list(zip(patterns, cs, strict=True)), full_pattern)
                   for cs in zip(*compiled, strict=True)]
    else:
        results = compiled[0]
    records = [make_record(b, c, cfg, args, len(devices), chip, share, params, kv, itemsize)
               for b, c in zip(buckets, results, strict=True)]
    for r in records:
        if r["peak_exceeds_hbm"]:
            # Parameters and KV fit (checked above), the compiled step's peak does not: XLA
            # would refuse a full-depth compile (extrapolated temporaries: see the docs).
            logger.warning(
                "%s %d tokens: peak %.2f GiB per device > %.2f GiB HBM (temporaries %.2f GiB%s)",
                r["mode"], r["tokens"], r["peak_hbm_bytes_per_device"] / GiB,
                r["hbm_bytes_per_device"] / GiB, r["temporaries_bytes_per_device"] / GiB,
                ", extrapolated" if args.scale_from_layers else "")
    if args.verify_tokens:
        add_verify_ratios(records)
        for r in records:
            if r["mode"] == "verify":
                r["speculative_algorithm"] = args.speculative_algorithm
                r["draft_cost_included"] = args.speculative_algorithm != "NGRAM"
    return records


# With NGRAM the report compiles the target model's verify step only.
DRAFT_NOT_INCLUDED = (
    "the draft model's work (an EAGLE head, DeepSeek-V3's / GLM-4.5's NEXTN layer) is not "
    "included: the runner is built with NGRAM, whose drafts cost no device work "
    "(--speculative-algorithm EAGLE / NEXTN compiles the draft into the step)")


def add_verify_ratios(records: list[dict]) -> None:
    """Each verify record gets its cost against the decode record of the same batch:
    ``*_vs_decode`` = verify / decode for the whole step, and ``bytes_per_token_vs_decode``
    = (verify bytes / verified tokens) / (decode bytes / decoded tokens), i.e. the ratio / K
    (every verified token is a position decode would have needed a step for, if accepted)."""
    decode = {r["batch_size"]: r for r in records if r["mode"] == "decode"}
    for r in records:
        if r["mode"] != "verify":
            continue
        d = decode[r["batch_size"]]
        k = r["tokens"] // r["batch_size"]
        r["verify_tokens"] = k
        r["bytes_vs_decode"] = r["bytes_accessed_per_device"] / d["bytes_accessed_per_device"]
        r["flops_vs_decode"] = r["flops_per_device"] / d["flops_per_device"]
        r["roofline_vs_decode"] = r["roofline_ms"] / d["roofline_ms"]
        r["peak_hbm_vs_decode"] = (r["peak_hbm_bytes_per_device"]
                                   / d["peak_hbm_bytes_per_device"])
        r["bytes_per_token_vs_decode"] = r["bytes_vs_decode"] * d["tokens"] / r["tokens"]
        r["flops_per_token_vs_decode"] = r["flops_vs_decode"] * d["tokens"] / r["tokens"]
        r["bytes_per_verified_token_per_device"] = r["bytes_accessed_per_device"] / r["tokens"]
        if r["roofline_ms_without_sampler"] is not None:  # --sampler-breakdown
            # Without the sampler's full-vocabulary sort fallback, which XLA counts in every
            # step (a cond's costliest branch) at bs x K rows here, though it rarely runs.
            r["bytes_without_sampler_vs_decode"] = (
                bytes_without_sampler(r) / bytes_without_sampler(d))
            r["roofline_without_sampler_vs_decode"] = (
                r["roofline_ms_without_sampler"] / d["roofline_ms_without_sampler"])


def bytes_without_sampler(r: dict) -> float:
    """Bytes per device of a record's step less its sampler's (``--sampler-breakdown``)."""
    return r["bytes_accessed_per_device"] - r["sampler_bytes_accessed"] / r["devices"]


def format_verify_notes(records: list[dict]) -> str:
    """Lines under the table: each verify bucket against the decode bucket of its batch."""
    lines = []
    for r in records:
        if r["mode"] != "verify":
            continue
        lines.append(
            f"verify {r['batch_size']} x {r['verify_tokens']} vs decode {r['batch_size']}: "
            f"bytes {r['bytes_vs_decode']:.3f}x ({r['bytes_per_token_vs_decode']:.3f}x per "
            f"verified token), FLOPs {r['flops_vs_decode']:.2f}x "
            f"({r['flops_per_token_vs_decode']:.3f}x per verified token), roofline "
            f"{r['roofline_vs_decode']:.3f}x, peak HBM {r['peak_hbm_vs_decode']:.3f}x"
            + (f"; without the sampler: bytes {r['bytes_without_sampler_vs_decode']:.3f}x, "
               f"roofline {r['roofline_without_sampler_vs_decode']:.3f}x"
               if "bytes_without_sampler_vs_decode" in r else ""))
    algorithms = {r.get("speculative_algorithm", "NGRAM") for r in records
                  if r["mode"] == "verify"}
    if lines and algorithms == {"NGRAM"}:
        lines.append(f"verify: target model only; {DRAFT_NOT_INCLUDED}")
    elif lines:
        lines.append(f"verify: with the {', '.join(sorted(algorithms))} draft's work in the "
                     "step (draft extend over every token, then the chain)")
    return "\n".join(lines)


def format_extend_notes(records: list[dict]) -> str:
    """Each extend bucket against the decode bucket of the fewest requests."""
    decode = min((r for r in records if r["mode"] == "decode"), key=lambda r: r["tokens"],
                 default=None)
    lines = []
    for r in records:
        if r["mode"] != "extend":
            continue
        line = (f"extend {r['tokens']} token(s) of 1 request at {r['context_len']} positions "
                f"(compiled as {r['compiled_tokens']} tokens, {r['padded_rows']} rows): "
                f"{r['bytes_accessed_per_device'] / 1e9:.1f} GB, {r['roofline_ms']:.2f} ms")
        if decode:
            line += (f"; vs decode {decode['tokens']}: bytes "
                     f"{r['bytes_accessed_per_device'] / decode['bytes_accessed_per_device']:.2f}x,"
                     f" roofline {r['roofline_ms'] / decode['roofline_ms']:.2f}x")
        lines.append(line)
    return "\n".join(lines)


def describe_pattern(pattern: tuple[bool, ...]) -> str:
    moe = sum(pattern)
    dense = len(pattern) - moe
    parts = [f"{n} {what}" for n, what in ((dense, "dense"), (moe, "MoE")) if n]
    return " + ".join(parts) + " layers"


def mesh_order(devices: list, ep: int, tp: int) -> list:
    """The first ep x tp devices in an order where the "tensor" axis is physically close."""
    need = ep * tp
    if need == len(devices):
        try:
            from jax.experimental import mesh_utils

            return list(mesh_utils.create_device_mesh((ep, tp), devices).reshape(-1))
        except Exception:  # an unusual shape: keep the topology's own order
            pass
    return devices[:need]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sgl_jax.tools.aot_report",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model-config", required=True,
                   help="checkpoint dir, config.json, or bundled name (qwen3-30b-a3b, ...)")
    p.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:2x2, v6e:2x4")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel size")
    p.add_argument("--dp-size", type=int, default=1,
                   help="data-parallel attention ranks (the engine's --enable-dp-attention "
                   "--dp-size; must equal --ep-size): --decode-bs and the prefill are global, "
                   "split over the ranks")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[64, 256],
                   help="decode batch sizes (one bucket each)")
    p.add_argument("--prefill-tokens", type=int, default=2048,
                   help="tokens of the prefill bucket (0: no prefill bucket)")
    p.add_argument("--prefill-requests", type=int, default=8,
                   help="requests the prefill tokens are split over")
    p.add_argument("--context-len", type=int, default=4096,
                   help="context of every decode request (sizes the KV cache)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="parameter, activation and KV dtype")
    p.add_argument("--page-size", type=int, default=16, help="KV cache page size")
    p.add_argument("--attention-backend", default=None, choices=("pallas", "native"),
                   help="the engine's --attention-backend (default: pallas; native for MLA "
                   "models, which pallas cannot run)")
    p.add_argument("--moe-backend", default="auto", choices=("ragged", "gmm", "dense", "auto"),
                   help="the engine's --moe-backend (auto: what the engine runs on TPU, gmm)")
    p.add_argument("--moe-dispatch", default="all_gather",
                   choices=("all_gather", "ragged_all_to_all"),
                   help="the engine's --moe-dispatch (with --dp-size > 1)")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0, metavar="R",
                   help="compile the step with EPLB (the engine's --enable-eplb): R redundant "
                   "physical experts per MoE layer, the placement as device data (0: off)")
    p.add_argument("--ep-expert-mapping", default=None, metavar="JSON",
                   help="the engine's --ep-expert-mapping (a static placement other than "
                   "contiguous blocks)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="compile the step with routed-experts capture")
    p.add_argument("--sampler-breakdown", action="store_true",
                   help="also compile the sampler alone and report the roofline without it")
    p.add_argument("--verify-tokens", type=int, default=None, metavar="K",
                   help="also compile, for each decode batch size, the speculative TARGET_VERIFY "
                   "step of K tokens per request (its last token and K - 1 drafts; the "
                   "engine's --speculative-num-draft-tokens) and report it against decode "
                   "(with --speculative-algorithm EAGLE or NEXTN the draft's work in the step "
                   "is included)")
    p.add_argument("--speculative-algorithm", choices=("NGRAM", "EAGLE", "NEXTN"),
                   default="NGRAM",
                   help="with --verify-tokens: NGRAM (the target's step only), EAGLE (a draft "
                   "head: give --speculative-draft-model-path) or NEXTN (the model's MTP layer)")
    p.add_argument("--speculative-draft-model-path", default=None,
                   help="EAGLE: the draft's config (a directory, a config.json or a bundled "
                   "name such as qwen3-30b-a3b-eagle)")
    p.add_argument("--sequence-parallel-min-tokens", type=int, default=None, metavar="N",
                   help="the server's flag: steps of at least N tokens split the residual "
                        "stream over tp (0: never; default: the server's default)")
    p.add_argument("--breakdown", action="store_true",
                   help="bytes and FLOPs per op class (expert matmuls, attention, projections, "
                   "router, sampler, collectives, copies, ...) per bucket, summing to XLA's "
                   "total (sgl_jax/tools/hlo_breakdown.py)")
    p.add_argument("--top-ops", type=int, default=0, metavar="N",
                   help="with --breakdown: log, per compiled step, the N ops with the most "
                   "estimated bytes (class, MB, GFLOP, HLO name, source op)")
    p.add_argument("--extend-tokens", type=int, nargs="+", metavar="N",
                   help="also compile, per N, an extend of N new tokens of one request over a "
                   "cached context, its last token at --context-len positions")
    p.add_argument("--dump-hlo", metavar="DIR",
                   help="write each compiled step's optimized HLO text to DIR (one file per "
                   "bucket and depth) for reading what an op of --top-ops is")
    p.add_argument("--scale-from-layers", type=int, nargs=2, metavar=("A", "B"),
                   help="compile A- and B-layer truncations and extrapolate linearly (models "
                   "with dense and MoE layers: A and B MoE layers and 1 dense + A MoE)")
    p.add_argument("--peak-tflops", type=float, help="override the chip's bf16 peak")
    p.add_argument("--hbm-gb", type=float, help="override the chip's HBM capacity (1e9 B)")
    p.add_argument("--hbm-gbps", type=float, help="override the chip's HBM bandwidth")
    p.add_argument("--json", action="store_true", help="print one JSON list to stdout")
    args = p.parse_args(argv)
    if args.scale_from_layers:
        a, b = args.scale_from_layers
        if not 1 <= a < b:
            p.error("--scale-from-layers A B needs 1 <= A < B")
    if args.prefill_tokens < 0:
        p.error("--prefill-tokens must be >= 0 (0: no prefill bucket)")
    if min(args.decode_bs) < 1 or args.prefill_requests < 1 or args.context_len < 2:
        p.error("--decode-bs, --prefill-requests must be >= 1 and --context-len >= 2")
    if args.extend_tokens and not all(1 <= n < args.context_len for n in args.extend_tokens):
        p.error("--extend-tokens N needs 1 <= N < --context-len")
    if args.extend_tokens and args.dp_size > 1:
        p.error("--extend-tokens with --dp-size > 1 is not supported")
    if args.dump_hlo:
        Path(args.dump_hlo).mkdir(parents=True, exist_ok=True)  # before the first compile
    if args.top_ops and not args.breakdown:
        p.error("--top-ops needs --breakdown (its per-op estimate)")
    if args.top_ops < 0:
        p.error("--top-ops N needs N >= 0")
    if args.verify_tokens is not None and args.verify_tokens < 2:
        p.error("--verify-tokens K needs K >= 2 (the request's last token and >= 1 draft)")
    if args.verify_tokens and args.verify_tokens >= args.context_len:
        p.error("--verify-tokens K must be below --context-len (the verified tokens end at "
                "--context-len positions)")
    if args.speculative_algorithm == "EAGLE" and not args.speculative_draft_model_path:
        p.error("--speculative-algorithm EAGLE needs --speculative-draft-model-path")
    if args.verify_tokens and args.dp_size > 1:
        p.error("--verify-tokens with --dp-size > 1: the engine does not run speculative "
                "decoding with DP attention yet")
    if args.dp_size < 1 or (args.dp_size > 1 and args.dp_size != args.ep_size):
        p.error(f"--dp-size {args.dp_size} with --ep-size {args.ep_size}: the attention ranks "
                "are the rows of the 'expert' axis, so --dp-size must equal --ep-size "
                f"(e.g. --ep-size {args.dp_size} --dp-size {args.dp_size}), or be 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s aot_report: %(message)s", datefmt="%H:%M:%S")
    try:
        records = run(args)
    except DoesNotFit as e:
        print(f"aot_report: {e}", file=sys.stderr)
        return 2
    except (ReportError, ValueError) as e:
        print(f"aot_report: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        r = records[0]
        depth = ("full depth" if not args.scale_from_layers else
                 "extrapolated from " + ", ".join(r["compiled_slices"]))
        dp = f" dp={r['dp_size']}" if r["dp_size"] > 1 else ""
        header = (
            f"{args.model_config} on {r['topology']} ({r['devices']} x {r['chip']}), "
            f"tp={r['tp_size']} ep={r['ep_size']}{dp}, {r['attention_backend']} attention, "
            f"{depth}; TFLOP summed over devices, "
            f"GB and GiB per device"
        )
        print(format_table(records, header))
        print(format_notes(records, args.context_len))
        if args.verify_tokens:
            print(format_verify_notes(records))
        if args.extend_tokens:
            print(format_extend_notes(records))
        if args.breakdown:
            print(format_breakdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
