"""One MoE layer forward, ``dense`` vs ``ragged`` expert backend, on the local JAX device.

For each shape and token count: both backends jitted (``ep_moe_forward`` without a mesh, the
same (topk_ids, topk_weights) for both), compiled and warmed up, then timed in interleaved
rounds (dense, ragged, dense, ragged, ...) so that drift of the machine hits both alike; prints
the medians as a markdown table, with each backend's FLOPs (and what XLA:CPU runs for
``ragged_dot``: a group-masked dense dot, ``E`` times the grouped-matmul FLOPs).

    python benchmarks/bench_moe_backends.py                 # the table of docs/moe_backends.md
    python benchmarks/bench_moe_backends.py --tokens 64 256 --repeats 21
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_utils import machine_description, markdown_table, median  # noqa: E402

from sgl_jax.srt.layers.moe.ep_moe import ep_moe_forward  # noqa: E402
from sgl_jax.srt.layers.moe.experts import get_moe_backend  # noqa: E402

BACKENDS = ("dense", "ragged")
# name -> (hidden, experts, top_k, moe_intermediate)
SHAPES = {
    "bundled (H64 E16 k4 I32)": (64, 16, 4, 32),
    "wide (H1024 E64 k8 I256)": (1024, 64, 8, 256),
}


def make_inputs(tokens: int, hidden: int, experts: int, top_k: int, inter: int,
                seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    w = rng.random((tokens, top_k)) + 0.1
    scale = 1.0 / np.sqrt(hidden)
    arrays = {
        "x": rng.standard_normal((tokens, hidden)),
        "topk_ids": ids.astype(np.int32),
        "topk_weights": w / w.sum(axis=1, keepdims=True),
        "w_gate": rng.standard_normal((experts, hidden, inter)) * scale,
        "w_up": rng.standard_normal((experts, hidden, inter)) * scale,
        "w_down": rng.standard_normal((experts, inter, hidden)) * scale,
    }
    return {k: jnp.asarray(v, jnp.int32 if k == "topk_ids" else jnp.float32)
            for k, v in arrays.items()}


def layer_fn(experts: int, backend: str) -> Any:
    order = tuple(range(experts))
    return jax.jit(lambda a: ep_moe_forward(
        a["x"], a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"], order,
        backend=get_moe_backend(backend),
    ))


def bench_case(tokens: int, shape: tuple[int, int, int, int], repeats: int,
               max_seconds: float) -> dict[str, float]:
    """Median milliseconds per backend (interleaved rounds; fewer if a round is slow)."""
    args = make_inputs(tokens, *shape)
    fns = {b: layer_fn(shape[1], b) for b in BACKENDS}
    outs = {b: fn(args).block_until_ready() for b, fn in fns.items()}  # compile + warm up
    scale = float(jnp.max(jnp.abs(outs["dense"])))
    err = float(jnp.max(jnp.abs(outs["ragged"] - outs["dense"]))) / scale
    assert err < 1e-4, f"the backends disagree: relative error {err}"
    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    start = time.perf_counter()
    for _ in range(repeats):
        for b, fn in fns.items():
            t0 = time.perf_counter()
            fn(args).block_until_ready()
            times[b].append(time.perf_counter() - t0)
        if time.perf_counter() - start > max_seconds and len(times["dense"]) >= 3:
            break
    return {b: 1e3 * median(ts) for b, ts in times.items()} | {"runs": len(times["dense"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds (at most)")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="stop adding rounds to a case after this long (at least 3 rounds)")
    args = p.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        hidden, experts, top_k, inter = shape
        for tokens in args.tokens:
            ms = bench_case(tokens, shape, args.repeats, args.max_seconds)
            dense_gflop = 6 * tokens * experts * hidden * inter / 1e9
            ragged_gflop = 6 * tokens * top_k * hidden * inter / 1e9
            # What XLA:CPU really runs for ragged: ragged_dot lowered to a dense dot over a
            # group-masked [E, T*k, .] copy of the rows, E times the grouped-matmul FLOPs.
            rows.append([
                name, tokens, f"{dense_gflop:.3g}", f"{ragged_gflop:.3g}",
                f"{ragged_gflop * experts:.3g}", ms["dense"], ms["ragged"],
                ms["ragged"] / ms["dense"], ms["runs"],
            ])
            print(f"  {name} T={tokens}: dense {ms['dense']:.2f} ms, ragged {ms['ragged']:.2f} ms",
                  file=sys.stderr, flush=True)
    print(f"One MoE layer forward (jit, float32, median of interleaved runs), "
          f"{machine_description()}\n")
    print(markdown_table(
        ["shape", "T", "dense GFLOP", "ragged GFLOP", "ragged GFLOP as lowered on CPU",
         "dense ms", "ragged ms", "ragged/dense", "runs"],
        rows,
    ))


if __name__ == "__main__":
    main()
