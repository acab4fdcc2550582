#!/usr/bin/env python3
"""Runs a named test suite through pytest and prints a summary.

    python run_suite.py            # the default suite (what CI runs)
    python run_suite.py unit|e2e|all [--jobs N] [-- extra pytest args]

The unit files and the end-to-end files that only check results (``E2E_IN_WORKERS``) run in
N pytest-xdist workers (a file to a worker; default 2 where pytest-xdist is installed and the
machine has 2 cores or more): they time nothing. The other end-to-end files run one at a time
after them: streams, drains, heartbeats, timeouts and rates, which a busy second worker could
starve.

Exits non-zero if any test fails or if the suite ran no test at all.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

UNIT = [
    "tests/test_tool_parsers.py",
    "tests/test_tool_grammars.py",
    "tests/test_reasoning_parsers.py",
    "tests/test_make_random_model.py",
    "tests/test_private_dumps.py",
    "tests/test_reference_forward.py",
    "tests/test_radix_cache.py",
    "tests/test_paged_memory.py",
    "tests/test_sampling_params.py",
    "tests/test_sampler.py",
    "tests/test_tokenizer.py",
    "tests/test_incremental_detokenizer.py",
    "tests/test_server_args.py",
    "tests/test_model_loader.py",
    "tests/test_model_forward.py",
    "tests/test_linear_verify.py",
    "tests/test_moe_backends.py",
    "tests/test_moe_gmm.py",
    "tests/test_norm_rope.py",
    "tests/test_qkv_projection.py",
    "tests/test_backends.py",
    "tests/test_mla.py",
    "tests/test_parallel.py",
    "tests/test_aot_report.py",
    "tests/test_aot_gmm.py",
    "tests/test_aot_breakdown.py",
    "tests/test_routed_experts_codec.py",
    "tests/test_request_options.py",
    "tests/test_sglang_fields.py",
    "tests/test_routed_experts_transport.py",
    "tests/test_output_records.py",
    "tests/test_finish_cast.py",
    "tests/test_shm_arena.py",  # servers, but only exactness is checked
    "tests/test_native_attention.py",
    "tests/test_expert_load_tool.py",
    "tests/test_eplb.py",
    "tests/test_eplb_parallel.py",
    "tests/test_integrations.py",
    "tests/test_dp_balancer.py",
    "tests/test_import_layering.py",
    "tests/test_qwen35_config.py",
    "tests/test_gated_delta.py",
    "tests/test_gated_delta_packed.py",
]
# End-to-end files whose engines and servers are checked for results only (exact tokens, rows
# and logprobs; counts; refusals), with no timing and generous timeouts: they run in the
# workers with the unit files (2 workers: 389 s against ~750 s of their tests' own time).
E2E_IN_WORKERS = [
    "tests/test_trained_model.py",
    "tests/test_train_eagle.py",
    "tests/test_routed_experts.py",
    "tests/test_routed_experts_gather.py",
    "tests/test_paged_engine.py",
    "tests/test_speculative.py",
    "tests/test_nextn_reference.py",
    "tests/test_logprobs.py",
    "tests/test_deterministic.py",
    "tests/test_families.py",
    "tests/test_families_2026.py",
    "tests/test_qwen35_engine.py",
    "tests/test_qwen35_speculative.py",
    "tests/test_expert_distribution.py",
    "tests/test_bad_updates.py",
    "tests/test_eplb_engine.py",
    "tests/test_scheduler_abort.py",
    "tests/test_seed_user_story.py",
    "tests/test_speculative_server.py",
]
# The other end-to-end files: streams, drains, heartbeats, timeouts, rates, multi-node; one at
# a time after the workers' group, so that a busy second worker cannot starve them.
E2E_SERIAL = [
    # Timed or networked, though they start no engine: a start-up timeout under a flood,
    # a sender that must not block, a coordinator's bind.
    "tests/test_coordinator_bind.py",
    "tests/test_step_channel_flood.py",
    "tests/test_side_channel.py",
    "tests/test_engine.py",
    "tests/test_http_server.py",
    "tests/test_msgpack_route.py",
    "tests/test_openai_api.py",
    "tests/test_openai_sglext.py",
    "tests/test_structured_output.py",
    "tests/test_reliability.py",
    "tests/test_weight_update.py",
    "tests/test_memory_occupation.py",
    "tests/test_multi_node.py",
    "tests/test_node_security.py",
    "tests/test_router.py",
    "tests/test_security.py",
    "tests/test_metrics.py",
    "tests/test_drain.py",
    "tests/test_single_process.py",
    "tests/test_score.py",
    "tests/test_weight_api_sglang.py",
    "tests/test_security_limits.py",
    "tests/test_stream_backlog.py",
    "tests/test_weight_update_on_device.py",
    "tests/test_dp_scheduler.py",
    "tests/test_dp_attention_server.py",
    "tests/test_dp_features.py",
]
E2E = E2E_IN_WORKERS + E2E_SERIAL
# Optional checks outside every suite (they skip without packages the project does not need).
# tests/tunix (the tunix extra) has its own CI stage and environment (.ci/run).
OPTIONAL = ["tests/test_hf_transformers.py", "tests/test_hf_families_2026.py", "tests/test_hf_qwen35.py"]
SUITES = {"unit": UNIT, "e2e": E2E, "all": UNIT + E2E}
DEFAULT = "all"


def default_jobs() -> int:
    if importlib.util.find_spec("xdist") is None:
        return 1
    return min(2, os.cpu_count() or 1)


def run_pytest(files: list[str], extra: list[str], jobs: int, here: str) -> int:
    # The slowest tests are printed every time: CI's time budget is docs/development.md's.
    workers = ["-n", str(jobs), "--dist", "loadfile"] if jobs > 1 else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=15",
           *workers, *files, *extra]
    print(f"$ {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, cwd=here)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("suite", nargs="?", default=DEFAULT, choices=sorted(SUITES))
    parser.add_argument("--jobs", type=int, default=None,
                        help="pytest-xdist workers for the unit files and E2E_IN_WORKERS "
                             "(default: 2 when "
                             "pytest-xdist is installed and there are 2 cores or more)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1:]  # pytest's own arguments, after --
    here = os.path.dirname(os.path.abspath(__file__))
    files = [f for f in SUITES[args.suite] if os.path.exists(os.path.join(here, f))]
    missing = sorted(set(SUITES[args.suite]) - set(files))
    if missing:
        print(f"run_suite: missing test files: {missing}", file=sys.stderr)
        return 2
    unlisted = sorted(
        f"tests/{name}" for name in os.listdir(os.path.join(here, "tests"))
        if name.startswith("test_") and name.endswith(".py")
        and f"tests/{name}" not in UNIT + E2E + OPTIONAL
    )
    if unlisted:
        print(f"run_suite: test files in no suite: {unlisted}; add them to UNIT, "
              "E2E_IN_WORKERS or E2E_SERIAL", file=sys.stderr)
        return 2
    jobs = default_jobs() if args.jobs is None else max(1, args.jobs)
    if jobs > 1 and importlib.util.find_spec("xdist") is None:
        print("run_suite: --jobs needs pytest-xdist (pip install -e '.[test]')", file=sys.stderr)
        return 2
    in_workers = [f for f in files if f in UNIT or f in E2E_IN_WORKERS]
    serial = [f for f in files if f not in in_workers]
    print(f"run_suite: {args.suite} ({len(in_workers)} files in {jobs} worker(s), then "
          f"{len(serial)} end-to-end files one at a time)", flush=True)
    t0 = time.monotonic()
    codes = [run_pytest(group, extra, group_jobs, here)
             for group, group_jobs in ((in_workers, jobs), (serial, 1)) if group]
    took = time.monotonic() - t0
    # pytest's 5: no test collected (e.g. a -k that matched nothing in one of the groups).
    if all(code == 5 for code in codes):
        print(f"run_suite: suite '{args.suite}' ran no test", file=sys.stderr)
        return 1
    failed = [code for code in codes if code not in (0, 5)]
    code = failed[0] if failed else 0
    status = "passed" if code == 0 else f"FAILED (pytest exit {code})"
    print(f"run_suite: suite '{args.suite}' {status} in {took:.0f}s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
