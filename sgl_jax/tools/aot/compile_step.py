"""Compiling for compile-only TPU devices: the engine's own step per bucket
(``ModelRunner.lower_bucket`` with abstract arguments), its cost and memory analysis
(``Compiled``), and the native attention call and the sampler compiled alone."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sgl_jax.tools.aot.buckets import Bucket
from sgl_jax.tools.aot.errors import DoesNotFit, ReportError
from sgl_jax.tools.aot.hlo import breakdown as hlo_breakdown
from sgl_jax.tools.aot.hlo.collectives import collective_bytes

logger = logging.getLogger("aot_report")


# Names the Pallas ragged paged attention kernel carries in compiled HLO (op_name metadata).
ATTENTION_KERNEL = "ragged_paged_attention"


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
    # --breakdown: "flops.<class>" / "bytes.<class>" per device (hlo.breakdown), summing to
    # ``flops`` / ``bytes``; "scale.flops" / "scale.bytes": the scale of the ops XLA does not
    # count exactly as estimated (hlo.breakdown.scale_classes); "estimate.*" / "exact.*":
    # per class, the unscaled estimate and its exact part
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict)


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
        bd = hlo_breakdown.breakdown(hlo, float(cost.get("flops", 0.0)),
                                     float(cost.get("bytes accessed", 0.0)))
        classes = {**{f"flops.{k}": v for k, v in bd.flops.items()},
                   **{f"bytes.{k}": v for k, v in bd.bytes.items()},
                   "scale.flops": bd.flops_scale, "scale.bytes": bd.bytes_scale}
        # The unscaled per-op estimates and their parts XLA counts exactly so, for
        # extrapolating over depth (depth.extrapolate).
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
    for cls, name, flops, nbytes, op_name, exact in hlo_breakdown.top_ops(hlo, n):
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
    # The first full-attention layer's KV array (a linear layer's entry is its state tables).
    kv = next(x for x in runner.kv_caches if not isinstance(x, tuple))
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
