"""One bucket's record: the compiled cost against the ideal, the peak HBM, the roofline time
on the chip and the tokens per second; a verify step's cost against decode's."""

from __future__ import annotations

import argparse
from typing import Any

from sgl_jax.tools.aot.accounting import (
    active_params_per_token,
    dispatch_bytes_per_moe_layer,
    grouped_matmul_excess_flops,
    ideal_attention_flops,
    ideal_flops,
    kernel_cost_per_call,
    kv_bytes_per_token_per_device,
    linear_state_bytes_per_request,
)
from sgl_jax.tools.aot.buckets import Bucket
from sgl_jax.tools.aot.compile_step import Compiled
from sgl_jax.tools.aot.hlo.op_classes import CLASSES
from sgl_jax.tools.aot.memory_fit import max_requests_that_fit
from sgl_jax.tools.aot.topology import Chip


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
    ideal_attention = ideal_attention_flops(cfg, b)
    peak_flops, bandwidth = chip.bf16_flops * share, chip.hbm_bandwidth * share
    t_compute, t_memory = flops_pd / peak_flops, bytes_pd / bandwidth
    roofline = max(t_compute, t_memory)
    outputs = c.outputs - c.aliased
    peak = c.arguments + outputs + c.temporaries + c.code
    excess = grouped_matmul_excess_flops(cfg, b, args.resolved_moe_backend, args.tp_size,
                                         args.ep_size, args.dtype)
    # Sums over devices: the kernel's per-device figure is the busiest rank's; idle ranks
    # (fewer requests than ranks) attend to nothing (rank_load = 1 without DP).
    compiled_flops = (flops_pd - kernel_flops) * n_dev + kernel_flops * n_dev * b.rank_load
    compiled_bytes = (bytes_pd - kernel_bytes) * n_dev + kernel_bytes * n_dev * b.rank_load
    kv_per_token = kv_bytes_per_token_per_device(cfg, args.tp_size, itemsize)
    hbm = chip.hbm_bytes * share
    # Linear-attention layers (Qwen3.5): each request's conv and recurrent states, read and
    # written once per step; the tables split by head over "tensor", so a device moves its
    # 1 / tp of its rank's requests' states.
    state_req = linear_state_bytes_per_request(cfg, itemsize)
    state_step = 2 * b.rank_requests * state_req // args.tp_size
    # One read of the device's parameters and of its rank's requests' context, plus the
    # linear states' read and write (decode's floor; every expert is read at these batch
    # sizes).
    min_bytes = params + b.rank_requests * b.context_len * kv_per_token + state_step
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
        "linear_layers": sum(cfg.linear_layers),
        "linear_state_bytes_per_request": state_req,
        "linear_state_bytes_per_step_per_device": state_step,
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
                                                  args.context_len, args.dp_size,
                                                  state_req // args.tp_size),
        "max_requests_fit_with_step": max_requests_that_fit(hbm - (peak - kv), kv_per_token,
                                                            args.context_len, args.dp_size,
                                                            state_req // args.tp_size),
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
    exact) / (estimate - exact): hlo.breakdown.scale_classes)."""
    if not c.breakdown:
        return {}
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
