"""``python -m sgl_jax.tools.aot_report``: the command line (argparse), running the report and
printing it (a table, or JSON), the exit codes."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import sgl_jax.tools.aot
from sgl_jax.tools.aot.errors import DoesNotFit, ReportError
from sgl_jax.tools.aot.report import run
from sgl_jax.tools.aot.tables import print_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sgl_jax.tools.aot_report",
        description=sgl_jax.tools.aot.__doc__.split("\n\n")[0],
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
                   "total (sgl_jax/tools/aot/hlo/)")
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
        print_report(records, args)
    return 0
