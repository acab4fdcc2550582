"""One report: the topology's devices, the abstract runner, every bucket compiled at every
depth asked for, and a record per bucket."""

from __future__ import annotations

import argparse
import logging
import os

from sgl_jax.tools.aot.accounting import (
    full_attention_layers,
    kv_bytes_per_token_per_device,
    linear_state_bytes_per_request,
    shard_bytes,
)
from sgl_jax.tools.aot.buckets import Bucket, dp_buckets, extend_buckets
from sgl_jax.tools.aot.compile_step import (
    Compiled,
    compile_bucket,
    compile_native_attention,
    compile_sampler,
)
from sgl_jax.tools.aot.depth import describe_pattern, extrapolate, slice_patterns, with_pattern
from sgl_jax.tools.aot.errors import ReportError
from sgl_jax.tools.aot.memory_fit import check_fit
from sgl_jax.tools.aot.model import build_runner, resolve_attention_backend, resolve_config_path
from sgl_jax.tools.aot.roofline import add_verify_ratios, make_record
from sgl_jax.tools.aot.topology import (
    GiB,
    chip_of,
    mesh_order,
    prepare_environment,
    topology_devices,
)

logger = logging.getLogger("aot_report")


def run(args: argparse.Namespace) -> list[dict]:
    prepare_environment()
    import jax
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
    kv = sum(shard_bytes(x) for x in jax.tree.leaves(full.kv_caches))  # + linear states
    itemsize = jnp.dtype(full.dtype).itemsize
    kv_per_token = kv_bytes_per_token_per_device(cfg, args.tp_size, itemsize)
    hbm = chip.hbm_bytes * share
    logger.info(
        "%s: %d x %s devices (%s), tp=%d ep=%d dp=%d; per device: parameters %.2f GiB, KV "
        "cache %.2f GiB, HBM %.2f GiB", args.topology, len(devices), kind, chip.name,
        args.tp_size, args.ep_size, args.dp_size, params / GiB, kv / GiB, hbm / GiB,
    )
    check_fit(params, kv, hbm, cfg, args, kv_per_token,
              linear_state_bytes_per_request(cfg, itemsize) // args.tp_size)
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
                # one attention loop per full-attention layer (linear layers have none)
                c.kernel_calls = float(full_attention_layers(with_pattern(cfg, pattern)))
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
        results = [extrapolate(list(zip(patterns, cs, strict=True)), full_pattern)
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
