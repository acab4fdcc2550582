"""ServerArgs: one dataclass behind ``Engine(**kwargs)`` and the command line.

Every field becomes a flag in SGLang's spelling (``max_running_requests`` ->
``--max-running-requests``); the help text lives next to the field. Invalid combinations
fail in ``__post_init__`` with a message that says what to change (the rules and the flags'
choices: ``server_args_checks.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints

from sgl_jax.srt.server_args_checks import (
    ATTENTION_BACKENDS,
    DTYPES,
    EPLB_ALGORITHMS,
    EXPERT_DISTRIBUTION_MODES,
    GRAMMAR_BACKENDS,
    LOAD_BALANCE_METHODS,
    LOG_LEVELS,
    MOE_BACKENDS,
    MOE_DISPATCHES,
    REASONING_PARSERS,
    ROUTED_EXPERTS_DTYPES,
    SPECULATIVE_ALGORITHMS,
    TOOL_CALL_PARSERS,
    normalize_and_check,
)


def _arg(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ServerArgs:
    # Model
    model_path: str | None = _arg(
        None, "Local Hugging Face checkpoint directory (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, "
        "GLM-4.5, MiniMax-M2 or gpt-oss; docs/models.md). Default: the bundled tiny Qwen3-MoE.")
    tokenizer_path: str | None = _arg(None, "Tokenizer directory. Default: the model path.")
    served_model_name: str | None = _arg(
        None, "Model name reported by the API and expected in requests ('default' always "
        "reaches it too). Default: the model directory's name.")
    dtype: str = _arg("auto", "Parameter and activation dtype ('auto': bfloat16 on TPU/GPU, "
                      "float32 on CPU). The router always runs in float32.", choices=DTYPES)
    context_length: int | None = _arg(
        None, "Maximum tokens per request (prompt + output). Default: the model's.")
    random_seed: int = _arg(42, "Seed for requests that do not give their own.")

    # OpenAI routes (docs/openai.md)
    tool_call_parser: str | None = _arg(
        None, "How tool calls are read from chat output when a request gives tools. "
        "Default: qwen25 (<tool_call>{json}</tool_call>).", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = _arg(
        None, "Split the model's <think>...</think> into reasoning_content. Default: none.",
        choices=REASONING_PARSERS)
    grammar_backend: str = _arg(
        "llguidance", "Constrained decoding (response_format, regex, ebnf, json_schema, "
        "tool_choice required / named): llguidance, or none to refuse such requests.",
        choices=GRAMMAR_BACKENDS)
    constrained_json_disable_any_whitespace: bool = _arg(
        False, "JSON from a json_schema / json_object constraint has no whitespace between "
        "its tokens (compact output, fewer tokens).")
    return_input_ids: bool = _arg(
        False, "Put every chat response's prompt token ids in sglext.input_ids.")
    return_output_ids: bool = _arg(
        False, "Put every chat response's generated token ids in sglext.output_ids.")

    # HTTP server
    host: str = _arg("127.0.0.1", "Address the HTTP server binds.")
    port: int = _arg(30000, "Port of the HTTP server.")
    api_key: str | None = _arg(
        None, "If set, every route but /health and /health_generate needs 'Authorization: "
              "Bearer KEY' (the admin key is accepted too). Without --admin-api-key, this key "
              "also opens the admin routes (docs/security.md).")
    admin_api_key: str | None = _arg(
        None, "If set, the routes that change the server for everyone (weight updates, "
              "pause/continue, flush_cache, the expert distribution recorder, rebalance, "
              "abort_request) need 'Authorization: Bearer ADMIN_KEY'; --api-key no longer "
              "opens them (403). Other routes take either key (docs/security.md).")
    max_prompts_per_request: int = _arg(
        1024, "Most sequences one HTTP request may ask for: prompts of a batch times n "
              "(OpenAI 'n'). More is a 400 before any work is done. Engine.generate's "
              "batches (a trusted caller) are not capped.")
    http_header_timeout: float = _arg(
        10.0, "Seconds a client has to send a request's headers (from its connection, or from "
              "the previous response on a kept-alive one) before it is disconnected.")
    max_weight_update_bytes: int = _arg(
        1 << 30, "Largest body of POST /update_weights_from_tensor (safetensors bytes, or JSON "
                 "with them in base64), refused with 413 before it is parsed. Other bodies "
                 "stay capped at 32 MiB.")
    max_safetensors_header_bytes: int | None = _arg(
        None, "Largest safetensors header POST /update_weights_from_tensor accepts, checked "
              "from its first 8 bytes before any parsing (400 beyond it). Default: max(1 MiB, "
              "1 KiB x the model's tensor count).")
    max_stream_backlog: int = _arg(
        4096, "Most outputs (one per decode step) a request may leave waiting for its caller. "
              "A caller that leaves more unread (a stream whose client never reads) has its "
              "request aborted (HTTP 408, code stream_backlog).")
    http_max_connections: int = _arg(
        2048, "Most open HTTP connections. A new connection beyond it closes the one that has "
              "waited longest for its headers (or itself, if every connection is busy), so a "
              "flood of idle connections cannot take the file descriptors /health needs.")

    # Scheduling and memory
    max_running_requests: int | None = _arg(
        None, "Most requests decoded together (request slots). Default: the largest "
              "precompile_bs_paddings bucket if given, else 64.")
    max_total_tokens: int | None = _arg(
        None, "KV cache size in tokens. Default: enough for max_running_requests requests of "
              "2048 tokens, at least the context length.")
    chunked_prefill_size: int = _arg(
        1024, "Most prompt tokens per prefill batch; longer prompts are prefilled in chunks.")
    page_size: int = _arg(
        1, "KV cache page size in tokens: the allocator hands out pages and the prefix cache "
           "matches whole pages. The pallas attention backend wants 16 or more on TPU.")
    schedule_conservativeness: float = _arg(
        1.0, "How much KV room to reserve for running requests' future tokens (0..1+).")
    disable_radix_cache: bool = _arg(False, "Turn off prefix (radix) caching.")
    stream_interval: int = _arg(1, "Send a streaming chunk every this many tokens.")
    disable_overlap_schedule: bool = _arg(
        False, "Process each step's results before launching the next (by default the host "
               "prepares step N+1 and processes step N while the device computes).")

    # Compilation
    precompile_bs_paddings: list[int] | None = _arg(
        None, "Decode batch-size buckets, compiled at start-up. Default: powers of two up to "
              "max_running_requests.", nargs="+")
    precompile_token_paddings: list[int] | None = _arg(
        None, "Prefill token-count buckets, compiled at start-up. Default: powers of two from "
              "64 up to chunked_prefill_size.", nargs="+")
    disable_precompile: bool = _arg(False, "Compile buckets on first use instead of at start.")
    attention_backend: str = _arg(
        "native", "Attention kernel: 'native' (pure JAX, blocked by request; any device) or "
                  "'pallas' (JAX's ragged paged attention TPU kernel; head_dim must be a "
                  "multiple of 128; on CPU it runs in interpret mode, for tests only).",
        choices=ATTENTION_BACKENDS)
    moe_backend: str = _arg(
        "auto", "Expert compute: 'dense' (every expert on every token, then masked: fastest "
                "on CPU at small sizes), 'ragged' (tokens sorted by expert, grouped matmuls "
                "with jax.lax.ragged_dot: only the top-k experts' FLOPs), 'gmm' (the same "
                "grouping with JAX's Megablox grouped-matmul TPU kernel, tiles per shape; "
                "interpret mode off TPU, for tests) or 'auto' (gmm on TPU, dense elsewhere). "
                "Routing is identical in all.",
        choices=MOE_BACKENDS)
    attention_block_size: int = _arg(
        128, "KV positions per iteration of the native attention loop (rounded up to whole "
             "pages).")
    compilation_cache_dir: str | None = _arg(
        os.path.join(os.path.expanduser("~"), ".cache", "sgl_jax", "jax_compilation_cache"),
        "Persistent JAX compilation cache ('' to disable): a second start of the same "
        "configuration skips compilation.")

    # Parallelism
    tp_size: int = _arg(1, "Tensor-parallel size (devices along the 'tensor' mesh axis).")
    ep_size: int = _arg(1, "Expert-parallel size (devices along the 'expert' mesh axis).")
    enable_dp_attention: bool = _arg(
        False, "Data-parallel attention: split the devices into --dp-size attention ranks, each "
               "with its own requests and KV pages (nothing of attention, the dense layers or "
               "the LM head is replicated over them), while the routed experts stay spread over "
               "every device; tokens go to their experts' owners and back in each MoE layer "
               "(docs/parallelism.md). The ranks are the rows of the 'expert' axis: dp_size = "
               "ep_size.")
    dp_size: int = _arg(
        1, "Attention ranks with --enable-dp-attention (each has tp_size devices; equal to "
           "ep_size). 1: attention runs on every device for every token.")
    load_balance_method: str = _arg(
        "round_robin", "How the scheduler gives a new request to a DP attention rank: "
        "round_robin, shortest_queue (fewest requests), minimum_tokens (fewest tokens held "
        "or queued). A request whose prompt prefix is cached on a rank goes there.",
        choices=LOAD_BALANCE_METHODS)
    moe_dispatch: str = _arg(
        "all_gather", "With --enable-dp-attention, how a MoE layer moves tokens to their "
        "experts' devices and back: all_gather (every rank's tokens to every device, "
        "reduce-scatter back; T rows each way) or ragged_all_to_all (each assignment to its "
        "expert's device and back; k*T/ep rows each way, less when top-k < ep, but in "
        "buffers sized for the worst case: compiled for TPU, Qwen3-235B-A22B at DP 4 moves "
        "1.9x all_gather's bytes per device at decode 256 and 12x at an 8k-token prefill). "
        "docs/parallelism.md.", choices=MOE_DISPATCHES)
    sequence_parallel_min_tokens: int = _arg(
        1024, "With tensor parallelism, a step of at least this many tokens (per DP "
              "attention rank) keeps the residual stream split by token over the "
              "tensor-parallel devices (of each rank) between the layers' projections: "
              "norms, residual adds and the router run on 1/tp of the tokens, and each "
              "block's all-reduce becomes a reduce-scatter. Smaller steps (decode) stay "
              "replicated. 0: never. docs/parallelism.md.")
    device_indexes: list[int] | None = _arg(
        None, "Run on these devices (positions in jax.devices()), e.g. '0 1' next to a trainer "
              "on the other devices of the host; tp_size x ep_size of them form the mesh. "
              "Default: all devices.", nargs="+")
    enable_single_process: bool = _arg(
        False, "Run the scheduler and the detokenizer as threads of the caller's process "
               "(next to the tokenizer manager), on its JAX runtime (the model's arrays live "
               "there), instead of child processes: for an RL trainer that owns the chips and "
               "generates its own rollouts (Engine(enable_single_process=True, mesh=...); "
               "docs/rl_rollouts.md). One node only. Default: child processes.")
    ep_expert_mapping: str | None = _arg(
        None, "Which experts each 'expert'-axis device holds: JSON (inline or a file) with a "
              "table [ep_size][num_experts/ep_size] of expert ids for every MoE layer, or "
              "{\"default\": table, \"<layer_id>\": table}. Default: contiguous blocks.")
    dist_init_addr: str | None = _arg(
        None, "host:port of node 0's JAX coordinator, for multi-node (nnodes > 1).")
    nnodes: int = _arg(
        1, "Number of nodes (hosts) the mesh spans. Run the same command on every host with "
           "its --node-rank: node 0 serves HTTP and schedules, the others run its steps "
           "(docs/parallelism.md).")
    node_rank: int = _arg(0, "This node's rank, 0..nnodes-1.")
    dist_timeout: float = _arg(
        30.0, "Multi-node: seconds a node may send nothing (heartbeats are sent every quarter "
              "of it) before the job stops with an error; a node that exits is noticed at once.")
    node_secret_file: str | None = _arg(
        None, "Multi-node: a file holding the secret every node of the job shares (the same "
              "bytes on every host, at least 16; chmod 600); only holders of it can join the "
              "job or send it steps. Alternatively set the environment variable "
              "SGL_JAX_NODE_SECRET (never pass the secret itself as a flag: ps shows it).")

    # Routed experts
    enable_return_routed_experts: bool = _arg(
        False, "Capture the router's top-k expert ids so requests can ask for them with "
               "return_routed_experts.")
    return_routed_experts_default: bool = _arg(
        False, "Return the routed experts of every request that does not say "
               "return_routed_experts=false, as if it had asked. For gateways that drop the "
               "request field: sglang-router forwards neither it nor a header on /generate and "
               "chat (docs/scaling.md). Needs --enable-return-routed-experts.")
    enable_return_routed_expert_weights: bool = _arg(
        False, "Also capture the router's top-k weights, so requests can ask for them with "
               "return_routed_expert_weights (needs --enable-return-routed-experts; 4 more "
               "bytes per id in host memory and device-to-host copies).")
    routed_experts_dtype: str = _arg(
        "int32", "Wire dtype of routed experts for requests that give no routed_experts_dtype: "
                 "int32, int16, uint16 or uint8 (little-endian; unsigned dtypes mark a layer "
                 "without a router with their maximum, 65535 / 255). A dtype too narrow for "
                 "the model's experts is a 400 for the requests that use it.",
        choices=ROUTED_EXPERTS_DTYPES)
    routed_experts_shm_mb: int = _arg(
        1024, "Shared memory (MiB, taken as used and then kept) through which a finishing "
              "request's routed experts (1 MiB or more) go from the scheduler to the HTTP "
              "process without a socket copy; arrays that find no room take a socket. The "
              "default holds a round of 64 requests x 8k tokens of a 48-layer top-8 model in "
              "int32 (768 MiB). 0: always a socket. Used with "
              "--enable-return-routed-experts.")

    # Expert distribution recorder (docs/expert_load.md)
    expert_distribution_recorder_mode: str | None = _arg(
        None, "Record which experts the routers pick, per layer and logical expert, between "
              "/start_expert_distribution_record and /stop_expert_distribution_record: 'stat' "
              "(counts accumulated on the device; also served live by /expert_load), "
              "'per_pass' (counts of every forward pass, with its mode and token count) or "
              "'per_token' (every token's top-k ids with its request id and position). "
              "Default: off (the step is unchanged).",
        choices=EXPERT_DISTRIBUTION_MODES)
    expert_distribution_recorder_buffer_size: int = _arg(
        1000, "per_pass: how many forward passes are kept; per_token: how many tokens. When "
              "full, the oldest are dropped (the dump says how many in 'dropped').")
    expert_distribution_recorder_dir: str | None = _arg(
        None, "Directory /dump_expert_distribution_record writes its .npz files to (created "
              "if missing). Default: $XDG_CACHE_HOME/sgl_jax/expert_distribution "
              "(~/.cache/...), mode 0700. Files are always created 0600.")

    # EPLB: expert-parallel load balancing with redundant experts (docs/expert_load.md)
    enable_eplb: bool = _arg(
        False, "Expert-parallel load balancing: each MoE layer holds num_experts + "
               "--ep-num-redundant-experts physical experts (replicas of hot experts), placed "
               "by a logical-to-physical map held as device data, and rebalanced at runtime "
               "from the expert distribution recorder's 'stat' counts without a restart or a "
               "recompilation (implies --expert-distribution-recorder-mode stat).")
    ep_num_redundant_experts: int = _arg(
        0, "EPLB: redundant physical expert slots R per MoE layer (num_experts + R must be a "
           "multiple of ep_size).")
    eplb_algorithm: str = _arg(
        "greedy", "EPLB placement algorithm: 'greedy' (replicate the hottest experts, then "
                  "pack the slots onto devices heaviest first) or 'hierarchical' (DeepSeek "
                  "EPLB style: expert groups onto device groups first, then replicate and "
                  "pack within each group).",
        choices=EPLB_ALGORITHMS)
    eplb_rebalance_num_iterations: int = _arg(
        0, "EPLB: rebalance automatically every N forward passes (0: only on an explicit "
           "Engine.rebalance_experts() / POST /rebalance_experts).")
    init_expert_location: str | None = _arg(
        None, "EPLB: the initial placement, from a recorder dump (.npz with 'stat' counts "
              "[layers, experts]: balanced from them) or a JSON mapping "
              "{\"physical_to_logical\": [[...] per MoE layer] or one [P] list}. Default: "
              "logical experts in order, then replicas round-robin.")

    # Determinism
    enable_deterministic_inference: bool = _arg(
        False, "Batch-invariant computation: a request's tokens, logprobs and routed experts "
               "are bitwise the same whatever else is in the batch, the chunking of its "
               "prompt and the overlap schedule. Every decode step runs at one padded batch "
               "size (max_running_requests) and every prefill step at one padded token count "
               "(chunked_prefill_size), the MoE runs the dense backend, and attention reads "
               "KV blocks at fixed absolute positions. Costs throughput "
               "(docs/determinism.md); needs --attention-backend native.")

    # Speculative decoding
    speculative_algorithm: str | None = _arg(
        None, "Speculative decoding: each decode step verifies a request's last token and up to "
              "--speculative-num-steps draft tokens in one target step, and keeps the longest "
              "run of drafts the target itself samples (plus the target's next token). Output, "
              "logprobs and routed experts are those without speculation; the rows of rejected "
              "drafts never leave the step (docs/speculative.md). NGRAM drafts from the "
              "request's own earlier tokens (prompt lookup); EAGLE runs a one-layer draft head on "
              "the target's hidden states inside the target's step (the bundled model ships "
              "one); NEXTN runs the multi-token-prediction layer of a DeepSeek-V3 / GLM-4.5 "
              "checkpoint the same way.", choices=SPECULATIVE_ALGORITHMS)
    speculative_draft_model_path: str | None = _arg(
        None, "EAGLE: the draft head's checkpoint directory (docs/speculative.md has its "
              "format). Default for the bundled model: its bundled draft.")
    speculative_num_steps: int | None = _arg(
        None, "Draft tokens proposed per request per step (a chain). Default: 3.")
    speculative_eagle_topk: int | None = _arg(
        None, "Branches per draft step; only 1 (a chain draft) is supported. Default: 1.")
    speculative_num_draft_tokens: int | None = _arg(
        None, "Tokens per request in a verify step: the last token plus the drafts, so "
              "speculative_num_steps + 1 for a chain. Default: that.")
    speculative_ngram_min_match_window_size: int = _arg(
        1, "NGRAM: the shortest suffix of the sequence looked up in its earlier tokens.")
    speculative_ngram_max_match_window_size: int = _arg(
        12, "NGRAM: the longest suffix looked up (the longest that matches wins).")

    # Operation
    log_level: str = _arg("info", "Logging level.", choices=LOG_LEVELS)
    enable_metrics: bool = _arg(
        False, "Serve Prometheus metrics at GET /metrics (SGLang's sglang:* names where they "
               "exist: running / queued requests, KV token usage, cache hit rate, token "
               "counters, TTFT / inter-token / end-to-end latency histograms; docs/"
               "reliability.md). Off: /metrics is 404 and nothing is recorded.")
    log_requests: bool = _arg(
        False, "Log one line per finished request: rid, prompt / completion / cached tokens, "
               "finish reason, end-to-end latency, routed-experts rows returned. Never the "
               "prompt or output text.")
    graceful_shutdown_timeout: float = _arg(
        30.0, "On SIGTERM, stop admitting (new generation requests and /health answer 503 "
              "'draining') and let running requests finish for up to this many seconds, then "
              "abort what is left and exit 0. A second SIGTERM / SIGINT stops at once; 0 "
              "stops at once (running requests end with finish_reason abort).")
    startup_timeout: float = _arg(600.0, "Seconds to wait for the scheduler to load and compile.")

    def __post_init__(self) -> None:
        normalize_and_check(self)

    def redacted(self) -> dict[str, Any]:
        """The fields as a dict, fit to show (``/get_server_info``): secrets replaced."""
        out = dataclasses.asdict(self)
        for secret in ("api_key", "admin_api_key"):
            if out[secret]:
                out[secret] = "<redacted>"
        return out

    # -- buckets --------------------------------------------------------------------------------
    def bs_paddings(self) -> list[int]:
        if self.enable_deterministic_inference:  # one decode shape: batch-invariant
            return [self.max_running_requests]
        if self.precompile_bs_paddings is not None:
            return sorted(set(self.precompile_bs_paddings))
        return _powers_of_two_up_to(1, self.max_running_requests)

    def token_paddings(self) -> list[int]:
        if self.enable_deterministic_inference:  # one prefill shape: batch-invariant
            return [self.chunked_prefill_size]
        if self.precompile_token_paddings is not None:
            return sorted(set(self.precompile_token_paddings))
        return _powers_of_two_up_to(min(64, self.chunked_prefill_size), self.chunked_prefill_size)

    # -- command line ---------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        hints = get_type_hints(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            help_text = meta.pop("help", "")
            default = f.default_factory() if callable(f.default_factory) else f.default
            kind = hints[f.name]
            if kind is bool:
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            base = next((a for a in get_args(kind) if a is not type(None)), kind)
            if get_origin(base) is list:
                base = get_args(base)[0]
            parser.add_argument(
                flag, type=base, default=default,
                help=f"{help_text} (default: {default})", **meta,
            )

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> ServerArgs:
        return ServerArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)})


def _powers_of_two_up_to(start: int, limit: int) -> list[int]:
    out, n = [], start
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return out


@dataclass(frozen=True)
class PortArgs:
    """Fresh ``ipc://`` endpoints for one engine, so several engines can share a machine.

    They live in a directory of their own made with mode 0700 (``mkdtemp``): other users of
    the host can neither connect to the engine's sockets (and send the scheduler requests or
    read its outputs) nor put a socket of theirs in the engine's place. ``remove`` deletes it
    at shutdown."""

    ipc_dir: str  # private (0700), removed at shutdown
    tokenizer_ipc: str  # detokenizer -> tokenizer manager
    scheduler_ipc: str  # tokenizer manager -> scheduler
    detokenizer_ipc: str  # scheduler -> detokenizer

    @staticmethod
    def new() -> PortArgs:
        ipc_dir = tempfile.mkdtemp(prefix=f"sgl_jax_{os.getpid()}_")  # mode 0700
        return PortArgs(
            ipc_dir=ipc_dir,
            tokenizer_ipc=f"ipc://{ipc_dir}/tokenizer",
            scheduler_ipc=f"ipc://{ipc_dir}/scheduler",
            detokenizer_ipc=f"ipc://{ipc_dir}/detokenizer",
        )

    def remove(self) -> None:
        """Deletes the directory and the sockets in it (once no process binds them)."""
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
