"""The model side of a report: ``--model-config`` to a config, the attention backend it
compiles with, and the engine's ModelRunner built in abstract mode (no weights)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from sgl_jax.tools.aot.buckets import extend_padding
from sgl_jax.tools.aot.errors import ReportError

logger = logging.getLogger("aot_report")

BUNDLED_CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"


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


def resolve_attention_backend(cfg: Any, requested: str | None) -> str:
    """pallas for GQA (the TPU default); native for MLA, which JAX's ragged paged attention
    kernel cannot run (it reads separate K/V heads, not a latent row), and for attention
    sinks (gpt-oss), which it has no sink logit for."""
    if cfg.attention == "mla":
        why = (f"{cfg.architecture}'s multi-head latent attention (MLA: one latent KV row per "
               "token; JAX's ragged paged attention kernel reads separate K/V heads)")
    elif cfg.attention_sinks:
        why = (f"{cfg.architecture}'s attention sinks (JAX's ragged paged attention kernel has "
               "no sink logit)")
    else:
        return requested or "pallas"
    if requested == "pallas":
        raise ReportError(
            f"--attention-backend pallas cannot run {why}. Omit --attention-backend (such "
            "models default to native) or pass --attention-backend native"
        )
    if requested is None:
        logger.info("--attention-backend native: %s", why)
    return "native"


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
