"""Whether a layout holds the model in HBM: the largest batch whose KV cache fits next to
the parameters, and the error (exit code 2) that says what to change when nothing fits."""

from __future__ import annotations

import argparse
from typing import Any

from sgl_jax.tools.aot.errors import DoesNotFit
from sgl_jax.tools.aot.topology import GiB


def max_requests_that_fit(free_bytes: float, kv_per_token: float, context_len: int,
                          dp: int, state_per_request: float = 0.0) -> int:
    """Largest GLOBAL number of requests at ``context_len`` positions whose KV fits in
    ``free_bytes`` per device: each attention rank holds its own requests' KV (``dp`` ranks,
    1 without DP), a device ``kv_per_token`` bytes per token of its rank's requests, plus
    ``state_per_request`` (Qwen3.5's linear-attention states on a device: its heads' share
    of a slot's row in every linear layer's tables)."""
    if free_bytes <= 0:
        return 0
    return dp * int(free_bytes // (kv_per_token * context_len + state_per_request))


def check_fit(params: int, kv: int, hbm: float, cfg: Any, args: argparse.Namespace,
              kv_per_token: float, state_per_request: float = 0.0) -> None:
    if params + kv <= hbm:
        return
    free = hbm - params
    if free > 0:
        # Global requests: with DP each rank holds its own requests' KV.
        max_bs = max_requests_that_fit(free, kv_per_token, args.context_len, args.dp_size,
                                       state_per_request)
        rank_bs = -(-max(args.decode_bs) // args.dp_size)
        max_ctx = max(0, int((free / rank_bs - state_per_request) // kv_per_token))
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
