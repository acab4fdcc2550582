"""Shared pieces of the benchmark scripts: workloads, timing, tables, machine description."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab, 500), length).tolist() for _ in range(n)]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import jax

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__)).stdout.strip()
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
            f"jax {jax.__version__} on {jax.default_backend()}, commit {rev or '?'}, "
            f"{time.strftime('%Y-%m-%d')}")
