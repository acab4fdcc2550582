"""What the engine's options may be: the choices of the flags that take one of a few values,
and the rules between options. ``normalize_and_check`` runs once, when a ``ServerArgs`` is
made (its ``__post_init__``): it fills the defaults that depend on other options and raises
``ValueError("invalid server args: ...")`` naming what to change.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from sgl_jax.srt.server_args import ServerArgs  # the same layer; never imported at run time

DTYPES = ("auto", "float32", "bfloat16")
ATTENTION_BACKENDS = ("native", "pallas")
MOE_BACKENDS = ("auto", "dense", "ragged", "gmm")
LOG_LEVELS = ("debug", "info", "warning", "error")
ROUTED_EXPERTS_DTYPES = ("int32", "int16", "uint16", "uint8")  # routed_experts_codec's names
EXPERT_DISTRIBUTION_MODES = ("stat", "per_pass", "per_token")  # layers/moe/expert_distribution
EPLB_ALGORITHMS = ("greedy", "hierarchical")  # layers/moe/eplb
MOE_DISPATCHES = ("all_gather", "ragged_all_to_all")  # layers/moe/dispatch.py
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens")  # DP attention
SPECULATIVE_ALGORITHMS = ("NGRAM", "EAGLE", "NEXTN")  # speculative/
# entrypoints/openai/tool_parsers.py and reasoning_parsers.py (their registries' keys).
TOOL_CALL_PARSERS = ("qwen25", "qwen3_coder", "glm45", "minimax-m2", "deepseekv3", "gpt-oss")
REASONING_PARSERS = ("qwen3", "deepseek-r1")
GRAMMAR_BACKENDS = ("llguidance", "none")  # constrained/


def normalize_and_check(args: ServerArgs) -> None:
    """Fills ``args``' derived defaults in place and refuses combinations that cannot run."""

    def fail(msg: str) -> NoReturn:
        raise ValueError(f"invalid server args: {msg}")

    if args.max_running_requests is None:
        pads = args.precompile_bs_paddings
        args.max_running_requests = (max(pads) if pads else 64) * max(args.dp_size, 1)
    if args.dtype not in DTYPES:
        fail(f"dtype={args.dtype!r}; use one of {', '.join(DTYPES)}")
    if args.log_level not in LOG_LEVELS:
        fail(f"log_level={args.log_level!r}; use one of {', '.join(LOG_LEVELS)}")
    for name in ("max_running_requests", "chunked_prefill_size", "stream_interval",
                 "tp_size", "ep_size", "attention_block_size", "nnodes",
                 "max_prompts_per_request", "http_max_connections",
                 "max_weight_update_bytes", "dp_size"):
        if getattr(args, name) < 1:
            fail(f"{name}={getattr(args, name)} must be >= 1")
    if args.sequence_parallel_min_tokens < 0:
        fail(f"sequence_parallel_min_tokens={args.sequence_parallel_min_tokens} must be "
             f">= 0 (0: never split the residual stream)")
    if not 0 <= args.node_rank < args.nnodes:
        fail(f"node_rank={args.node_rank} must be in [0, nnodes={args.nnodes})")
    if args.nnodes > 1 and not args.dist_init_addr:
        fail(f"nnodes={args.nnodes} needs dist_init_addr (host:port of node 0)")
    if args.enable_single_process and args.nnodes > 1:
        fail(f"enable_single_process runs on one node; nnodes={args.nnodes} needs the "
             "scheduler's process of its own (drop enable_single_process)")
    if args.device_indexes is not None:
        idx = args.device_indexes
        if not idx or min(idx) < 0 or len(set(idx)) != len(idx):
            fail(f"device_indexes={idx} must be distinct device positions >= 0")
        if args.nnodes > 1:
            fail("device_indexes picks devices of one host; a multi-node job uses them all")
    if args.dist_init_addr and not args.dist_init_addr.rpartition(":")[2].isdigit():
        fail(f"dist_init_addr={args.dist_init_addr!r} must be host:port")
    if args.http_header_timeout <= 0:
        fail(f"http_header_timeout={args.http_header_timeout} must be > 0 seconds")
    if args.api_key is not None and args.api_key == args.admin_api_key:
        fail("api_key and admin_api_key are the same: every client would be an admin; "
             "give the admin key a value of its own")
    if args.graceful_shutdown_timeout < 0:
        fail(f"graceful_shutdown_timeout={args.graceful_shutdown_timeout} must be >= 0 "
             "seconds")
    if args.dist_timeout <= 0:
        fail(f"dist_timeout={args.dist_timeout} must be > 0 seconds")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        fail(f"page_size={args.page_size} must be a power of two >= 1")
    if args.attention_backend not in ATTENTION_BACKENDS:
        fail(f"attention_backend={args.attention_backend!r}; use one of "
             f"{', '.join(ATTENTION_BACKENDS)}")
    if args.enable_return_routed_expert_weights and not args.enable_return_routed_experts:
        fail("enable_return_routed_expert_weights needs enable_return_routed_experts")
    if args.return_routed_experts_default and not args.enable_return_routed_experts:
        fail("return_routed_experts_default needs enable_return_routed_experts (without "
             "it no request can have routed experts); add --enable-return-routed-experts")
    if args.routed_experts_shm_mb < 0:
        fail(f"routed_experts_shm_mb={args.routed_experts_shm_mb}; use 0 (no shared "
             "memory) or a size in MiB")
    if args.routed_experts_dtype not in ROUTED_EXPERTS_DTYPES:
        fail(f"routed_experts_dtype={args.routed_experts_dtype!r}; use one of "
             f"{', '.join(ROUTED_EXPERTS_DTYPES)}")
    mode = args.expert_distribution_recorder_mode
    if mode is not None and mode not in EXPERT_DISTRIBUTION_MODES:
        fail(f"expert_distribution_recorder_mode={mode!r}; use one of "
             f"{', '.join(EXPERT_DISTRIBUTION_MODES)}")
    if args.expert_distribution_recorder_buffer_size < 1:
        fail(f"expert_distribution_recorder_buffer_size="
             f"{args.expert_distribution_recorder_buffer_size} must be >= 1")
    if args.eplb_algorithm not in EPLB_ALGORITHMS:
        fail(f"eplb_algorithm={args.eplb_algorithm!r}; use one of "
             f"{', '.join(EPLB_ALGORITHMS)}")
    if args.ep_num_redundant_experts < 0 or args.eplb_rebalance_num_iterations < 0:
        fail("ep_num_redundant_experts and eplb_rebalance_num_iterations must be >= 0")
    if not args.enable_eplb and (args.ep_num_redundant_experts
                                 or args.eplb_rebalance_num_iterations
                                 or args.init_expert_location):
        fail("ep_num_redundant_experts, eplb_rebalance_num_iterations and "
             "init_expert_location need enable_eplb")
    if args.enable_eplb:
        if args.expert_distribution_recorder_mode is None:
            args.expert_distribution_recorder_mode = "stat"
        elif args.expert_distribution_recorder_mode != "stat":
            fail("enable_eplb rebalances from the recorder's 'stat' counts; use "
                 "--expert-distribution-recorder-mode stat (or leave it unset)")
        if args.enable_deterministic_inference:
            fail("enable_eplb and enable_deterministic_inference are exclusive (the replica "
                 "of an expert a token uses depends on its position in the batch)")
        if args.ep_expert_mapping:
            fail("enable_eplb and ep_expert_mapping are exclusive (EPLB places the experts; "
                 "give an initial placement with init_expert_location)")
    if args.grammar_backend not in GRAMMAR_BACKENDS:
        fail(f"grammar_backend={args.grammar_backend!r}; use one of "
             f"{', '.join(GRAMMAR_BACKENDS)} (xgrammar needs torch: not offered)")
    if args.load_balance_method not in LOAD_BALANCE_METHODS:
        fail(f"load_balance_method={args.load_balance_method!r}; use one of "
             f"{', '.join(LOAD_BALANCE_METHODS)}")
    if args.dp_size > 1 and not args.enable_dp_attention:
        fail(f"dp_size={args.dp_size} needs enable_dp_attention (data-parallel attention "
             "ranks); add --enable-dp-attention")
    if args.dp_size > 1 and args.dp_size != args.ep_size:
        fail(f"enable_dp_attention with dp_size={args.dp_size} and ep_size={args.ep_size}: "
             "the attention ranks are the rows of the 'expert' mesh axis, so dp_size must "
             f"equal ep_size (e.g. --ep-size {args.dp_size} --dp-size {args.dp_size}, each "
             "rank tp_size devices)")
    if args.moe_dispatch not in MOE_DISPATCHES:
        fail(f"moe_dispatch={args.moe_dispatch!r}; use one of {', '.join(MOE_DISPATCHES)}")
    if args.moe_dispatch != "all_gather" and args.dp_size == 1:
        fail(f"moe_dispatch={args.moe_dispatch} moves tokens between DP attention ranks; "
             "it needs --enable-dp-attention --dp-size > 1")
    _check_speculative(args, fail)
    if args.moe_backend not in MOE_BACKENDS:
        fail(f"moe_backend={args.moe_backend!r}; use one of {', '.join(MOE_BACKENDS)}")
    if args.enable_deterministic_inference:
        if args.moe_backend in ("ragged", "gmm"):
            fail(f"enable_deterministic_inference needs the dense MoE backend "
                 f"({args.moe_backend} groups depend on the other tokens of the batch); use "
                 "--moe-backend auto or dense")
        if args.attention_backend != "native":
            fail("enable_deterministic_inference needs --attention-backend native")
    if args.context_length is not None and args.context_length < 2:
        fail(f"context_length={args.context_length} must be >= 2")
    if args.max_total_tokens is not None and args.max_total_tokens < 2:
        fail(f"max_total_tokens={args.max_total_tokens} must be >= 2")
    if not 0 < args.port < 65536:
        fail(f"port={args.port} must be in 1..65535")
    if args.precompile_bs_paddings is not None:
        pads = args.precompile_bs_paddings
        if not pads or min(pads) < 1:
            fail(f"precompile_bs_paddings={pads} must be a non-empty list of sizes >= 1")
        # With DP attention the buckets are per rank, and so are the running requests.
        per_rank = -(-args.max_running_requests // max(args.dp_size, 1))
        if max(pads) < per_rank:
            ranks = f" / dp_size={args.dp_size}" if args.dp_size > 1 else ""
            fail(
                f"precompile_bs_paddings={pads} cannot hold max_running_requests="
                f"{args.max_running_requests}{ranks}; add a bucket >= {per_rank}"
                f" or lower max_running_requests to {max(pads) * max(args.dp_size, 1)}"
            )
    if args.precompile_token_paddings is not None:
        pads = args.precompile_token_paddings
        if not pads or min(pads) < 1:
            fail(f"precompile_token_paddings={pads} must be a non-empty list of sizes >= 1")
        if max(pads) < args.chunked_prefill_size:
            fail(
                f"precompile_token_paddings={pads} cannot hold a prefill batch of "
                f"chunked_prefill_size={args.chunked_prefill_size} tokens; add a bucket >= "
                f"{args.chunked_prefill_size} or lower chunked_prefill_size to {max(pads)}"
            )


def _check_speculative(args: ServerArgs, fail: Any) -> None:
    algo = args.speculative_algorithm
    if algo is None:
        if args.speculative_draft_model_path or any(
                getattr(args, f) is not None for f in (
                    "speculative_num_steps", "speculative_eagle_topk",
                    "speculative_num_draft_tokens")):
            fail("the speculative_* options need --speculative-algorithm")
        return
    if algo not in SPECULATIVE_ALGORITHMS:
        fail(f"speculative_algorithm={algo!r}; use one of "
             f"{', '.join(SPECULATIVE_ALGORITHMS)}")
    if algo != "EAGLE" and args.speculative_draft_model_path:
        fail(f"speculative_draft_model_path is for EAGLE; {algo} needs none (NGRAM drafts "
             "from the request's tokens, NEXTN from the model's own MTP layer)")
    if algo == "EAGLE" and not args.speculative_draft_model_path:
        from sgl_jax.srt.configs.model_config import (
            BUNDLED_EAGLE_DRAFT_PATH,
            BUNDLED_MODEL_PATH,
        )

        bundled = os.path.realpath(BUNDLED_MODEL_PATH)
        if args.model_path is not None and os.path.realpath(args.model_path) != bundled:
            fail("speculative_algorithm=EAGLE needs --speculative-draft-model-path (a draft "
                 "is bundled only for the bundled model)")
        args.speculative_draft_model_path = BUNDLED_EAGLE_DRAFT_PATH
    if args.speculative_num_steps is None:
        args.speculative_num_steps = 3
    if args.speculative_eagle_topk is None:
        args.speculative_eagle_topk = 1
    if args.speculative_num_draft_tokens is None:
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1
    if args.speculative_num_steps < 1:
        fail(f"speculative_num_steps={args.speculative_num_steps} must be >= 1")
    if args.speculative_eagle_topk != 1:
        fail(f"speculative_eagle_topk={args.speculative_eagle_topk}: only chain drafts "
             "(topk 1) are supported")
    if args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        fail(f"speculative_num_draft_tokens={args.speculative_num_draft_tokens}: a chain "
             f"draft verifies speculative_num_steps + 1 = {args.speculative_num_steps + 1}")
    lo = args.speculative_ngram_min_match_window_size
    hi = args.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        fail(f"speculative_ngram_min/max_match_window_size={lo}/{hi} must satisfy "
             "1 <= min <= max")
    if args.dp_size > 1:
        fail("speculative decoding with DP attention is not supported yet; drop "
             "--speculative-algorithm or --enable-dp-attention")
    if args.nnodes > 1:
        fail("speculative decoding runs on one node for now; drop --speculative-algorithm "
             f"or use nnodes=1 (got {args.nnodes})")
    # NGRAM: the host proposes the next drafts once it knows what the last step accepted.
    # per_token expert records name each token's position when the step is launched.
    # EAGLE / NEXTN keep overlap: the next verify step's inputs are on the device.
    if (args.speculative_algorithm == "NGRAM"
            or args.expert_distribution_recorder_mode == "per_token"):
        args.disable_overlap_schedule = True


def check_for_linear_attention(args: ServerArgs, linear_layers: tuple[bool, ...],
                               family: str) -> None:
    """The options a model with linear-attention (Gated DeltaNet) layers runs with, checked
    once its config is read (``launch_engine``, the runner). ``ValueError`` naming the flag for
    what is not supported yet (--tp-size / --ep-size are: the linear layers split by head
    like the attention, the experts over both axes); prefix reuse is turned off
    (``disable_radix_cache``), logged: a cached prefix's KV does not give the linear layers' states at its end (they are a
    function of every earlier token, not stored per position), so a hit would be wrong."""
    if not any(linear_layers):
        return
    # NGRAM and NEXTN verify steps keep the states after the accepted tokens only
    # (layers/linear_attention/verify.py); an EAGLE draft head is trained for a GQA target.
    if args.speculative_algorithm not in (None, "NGRAM", "NEXTN"):
        raise ValueError(
            f"--speculative-algorithm {args.speculative_algorithm} is not supported for "
            f"{family} (linear-attention layers): use NEXTN (the checkpoint's MTP layer) or "
            "NGRAM")
    for flag, value in (("--dp-size (DP attention)", args.dp_size),
                        ("--nnodes", args.nnodes)):
        if value != 1:
            raise ValueError(f"{flag} {value} is not supported for {family} "
                             "(linear-attention layers) yet: use --tp-size / --ep-size on one "
                             "node")
    if args.enable_eplb:
        raise ValueError(f"--enable-eplb is not supported for {family} (linear-attention "
                         "layers) yet; drop it")
    if not args.disable_radix_cache:
        logging.getLogger(__name__).info(
            "%s has linear-attention layers: prefix caching is off (a cached prefix's KV does "
            "not give those layers' states at its end)", family)
        args.disable_radix_cache = True
