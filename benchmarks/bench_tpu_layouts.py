"""Does the engine's step compile for TPU in the layouts and with the features users run?

Compiles the step with ``sgl_jax.tools.aot_report`` for compile-only TPU devices (libtpu; no
TPU needed) over a matrix of the bundled model families, topologies, parallel layouts and
features, and prints one line each: whether XLA:TPU compiled every bucket, how long it took,
and each bucket's FLOPs ratio (compiled / ideal). The models are the bundled configs at their
real widths with 2 layers and a 8,192-word vocabulary (a full vocabulary adds minutes of
XLA:TPU's compile of the sampler's sort), except one full-vocabulary run. A start-up failure
on a real TPU (a kernel's blocks over the chip's VMEM, a collective XLA cannot lower) shows
here first; the byte figures of the issue's commands are ``aot_report``'s own
(docs/performance.md).

Usage (the TPU venv; about 20 minutes on 2 cores)::

    TPU_WORKER_HOSTNAMES=localhost PYTHONPATH=$PWD /work/.venv-tpu/bin/python \\
        benchmarks/bench_tpu_layouts.py [--only SUBSTRING ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "sgl_jax" / "assets" / "configs"

# (label, bundled config, config overrides, topology, aot_report flags)
RUNS: list[tuple[str, str, dict, str, str]] = [
    ("30B v6e:2x2 tp2 ep2 dp2", "qwen3-30b-a3b", {}, "v6e:2x2",
     "--tp-size 2 --ep-size 2 --dp-size 2"),
    ("30B v6e:2x2 tp1 ep4 dp4", "qwen3-30b-a3b", {}, "v6e:2x2",
     "--tp-size 1 --ep-size 4 --dp-size 4"),
    ("30B v5e:2x2 tp4 page 64, 32k context", "qwen3-30b-a3b", {}, "v5e:2x2",
     "--tp-size 4 --page-size 64 --context-len 32768"),
    ("30B v5e:2x2 tp4 page 128", "qwen3-30b-a3b", {}, "v5e:2x2",
     "--tp-size 4 --page-size 128"),
    ("30B v5e:2x2 tp4 verify 4 tokens (NGRAM)", "qwen3-30b-a3b", {}, "v5e:2x2",
     "--tp-size 4 --verify-tokens 4"),
    ("30B v5e:2x2 tp2 ep2 EPLB + routed experts", "qwen3-30b-a3b", {}, "v5e:2x2",
     "--tp-size 2 --ep-size 2 --ep-num-redundant-experts 4 --enable-return-routed-experts"),
    ("30B v5e:2x2 tp2 ep2 dp2 all-to-all", "qwen3-30b-a3b", {}, "v5e:2x2",
     "--tp-size 2 --ep-size 2 --dp-size 2 --moe-dispatch ragged_all_to_all"),
    ("30B v5e:2x2 tp4 ragged", "qwen3-30b-a3b", {}, "v5e:2x2",
     "--tp-size 4 --moe-backend ragged"),
    ("30B v6e:2x2 tp4 full vocabulary", "qwen3-30b-a3b", {"vocab_size": 151936}, "v6e:2x2",
     "--tp-size 4"),
    ("235B v5p:2x2x4 tp4 ep4 dp4 page 128", "qwen3-235b-a22b", {}, "v5p:2x2x4",
     "--tp-size 4 --ep-size 4 --dp-size 4 --page-size 128"),
    ("235B v5p:2x2x4 tp2 ep8 dp8", "qwen3-235b-a22b", {}, "v5p:2x2x4",
     "--tp-size 2 --ep-size 8 --dp-size 8"),
    ("235B v5p:2x2x4 tp1 ep16 dp16", "qwen3-235b-a22b", {}, "v5p:2x2x4",
     "--tp-size 1 --ep-size 16 --dp-size 16"),
    ("235B v5p:2x4x4 tp4 ep8 dp8", "qwen3-235b-a22b", {}, "v5p:2x4x4",
     "--tp-size 4 --ep-size 8 --dp-size 8"),
    ("235B v5p:4x4x4 tp4 ep16 dp16", "qwen3-235b-a22b", {}, "v5p:4x4x4",
     "--tp-size 4 --ep-size 16 --dp-size 16"),
    ("Mixtral v5e:2x2 tp4", "mixtral-8x7b", {}, "v5e:2x2", "--tp-size 4"),
    ("Mixtral v5e:2x4 tp4 ep2", "mixtral-8x7b", {}, "v5e:2x4", "--tp-size 4 --ep-size 2"),
    ("Qwen2-57B v5e:2x2 tp4", "qwen2-57b-a14b", {}, "v5e:2x2", "--tp-size 4"),
    ("GLM-4.5-Air v5e:2x2 tp4", "glm-4.5-air", {}, "v5e:2x2", "--tp-size 4"),
    ("GLM-4.5-Air v6e:2x2 tp2 ep2 dp2", "glm-4.5-air", {}, "v6e:2x2",
     "--tp-size 2 --ep-size 2 --dp-size 2"),
    ("DeepSeek-V3 v5p:2x2x4 tp4 ep4 dp4", "deepseek-v3", {"first_k_dense_replace": 1},
     "v5p:2x2x4", "--tp-size 4 --ep-size 4 --dp-size 4"),
    ("DeepSeek-V3 v5p:2x2x4 tp4 ep4 NEXTN verify", "deepseek-v3",
     {"first_k_dense_replace": 1}, "v5p:2x2x4",
     "--tp-size 4 --ep-size 4 --verify-tokens 2 --speculative-algorithm NEXTN"),
]


def small_config(name: str, overrides: dict, folder: Path) -> Path:
    """The bundled config ``name`` with 2 layers, a small vocabulary and ``overrides``."""
    config = json.loads((CONFIGS / name / "config.json").read_text())
    config.update({"num_hidden_layers": 2, "vocab_size": 8192, **overrides})
    if "max_window_layers" in config:
        config["max_window_layers"] = 2
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def compile_run(config: Path, topology: str, flags: str) -> tuple[bool, str]:
    """(compiled, the buckets' FLOPs ratios or the last lines of the error)."""
    cmd = [sys.executable, "-m", "sgl_jax.tools.aot_report", "--model-config", str(config),
           "--topology", topology, *flags.split(), "--decode-bs", "8", "64",
           "--prefill-tokens", "4096", "--prefill-requests", "8", "--json"]
    if "--context-len" not in flags:
        cmd += ["--context-len", "4096"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if "WARNING" not in line]
        return False, " / ".join(lines[-2:])[:300]
    records = json.loads(proc.stdout)
    return True, ", ".join(f"{r['mode']} {r['tokens']}: {r['flops_ratio']:.2f}" for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[],
                        help="run only the layouts whose label contains one of these")
    args = parser.parse_args()
    print("| layout | compiled | s | FLOPs ratio per bucket (or the error) |")
    print("|---|---|---:|---|")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, name, overrides, topology, flags) in enumerate(RUNS):
            if args.only and not any(part in label for part in args.only):
                continue
            config = small_config(name, overrides, Path(tmp) / str(i))
            start = time.perf_counter()
            ok, detail = compile_run(config, topology, flags)
            failed += not ok
            print(f"| {label} | {'yes' if ok else 'NO'} | {time.perf_counter() - start:.0f} "
                  f"| {detail} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
