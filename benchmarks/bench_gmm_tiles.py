"""The gmm expert backend's tiles, per shape, through XLA's and the kernel's cost estimates.

Compiles for compile-only TPU devices (libtpu; no TPU needed) and prints, for the per-device
expert shapes of Qwen3-30B-A3B (tp 4: H 2048, I 192, 128 experts) and Qwen3-235B-A22B (tp 4 x
ep 4: H 4096, I 384, 32 experts per device, every device sized for all T*k assignments):

1. per projection (gate/up: [M, H] x [E_l, H, I]; down: [M, I] x [E_l, I, H]), candidate
   tilings with the kernel's CostEstimate bytes, the pipelined bytes, the padded MXU work and
   the modelled time (``gmm.estimate`` / ``gmm.modelled_seconds``); ``*`` marks the tiling
   ``gmm.gmm_tiling`` picks. Then the compiled cost (XLA's ``cost_analysis``: the kernel's
   estimate for the custom call plus everything XLA adds around it, e.g. a relayout copy of
   the weights) of one gmm at the chosen tiling and of one ``jax.lax.ragged_dot``;
2. per shape, the whole backend compiled: ``gmm`` vs ``ragged`` (sort, gather, three grouped
   matmuls, weighting, un-permute, k-sum), ``ragged`` with gmm's tile-shaped row gathers
   (``gmm.take_rows``), and gmm with gate and up fused into one call over weights
   concatenated inside the step (what fusing costs when the weights are stored apart);
3. the backend's fused kernels (gate + up + activation; down + the per-token combine)
   against the Megablox calls they replace, each compiled alone.

Usage (the TPU venv)::

    TPU_WORKER_HOSTNAMES=localhost PYTHONPATH=$PWD /work/.venv-tpu/bin/python \\
        benchmarks/bench_gmm_tiles.py [--topology v6e:2x2] [--tokens 64 256 8192] [--all]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only TPU devices next to the CPU
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from sgl_jax.srt.layers.moe import gmm, gmm_combine, gmm_gate_up, vmem_rows  # noqa: E402
from sgl_jax.srt.layers.moe.ragged import ragged_experts, sorted_assignments  # noqa: E402

# name -> (hidden H, intermediate per device I, experts per device E_l, top k)
MODELS = {
    "qwen3-30b-a3b tp4": (2048, 768 // 4, 128, 8),
    "qwen3-235b-a22b tp4 ep4": (4096, 1536 // 4, 128 // 4, 8),
}
BF16 = jnp.bfloat16


def compiled_cost(fn: Callable[..., Any], *shapes: jax.ShapeDtypeStruct) -> tuple[float, float]:
    """(FLOPs, bytes) of ``fn`` compiled for the shapes' device (XLA's cost analysis)."""
    cost = jax.jit(fn).lower(*shapes).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def candidates(m: int, k: int, n: int, groups: int) -> list[tuple[int, int, int]]:
    """The chosen tiling and its neighbours: every tm at the chosen tk, tn; the next smaller
    tk and tn (multiples of 128 dividing K, N) at the chosen tm."""
    tm, tk, tn = gmm.gmm_tiling(m, k, n, groups)
    out = [(r, tk, tn) for r in gmm.ROW_TILES if r <= gmm.pad_rows(m, 16)]
    lanes_k, lanes_n = vmem_rows.lane_tiles(k), vmem_rows.lane_tiles(n)
    out += [(tm, t, tn) for t in lanes_k[lanes_k.index(tk) + 1:][:1]]
    out += [(tm, tk, t) for t in lanes_n[lanes_n.index(tn) + 1:][:1]]
    return sorted(set(out), key=lambda t: (-t[1], -t[2], -t[0]))


def projection_table(device: Any, tokens: int, model: str, compile_all: bool) -> None:
    hidden, inter, groups, top_k = MODELS[model]
    m = tokens * top_k
    sh = SingleDeviceSharding(device)
    print(f"\n### {model}, T = {tokens} (M = {m} assignments), {groups} experts per device\n")
    print("| projection | tm | tk | tn | est GB | pipelined GB | MXU GFLOP | VMEM MiB "
          "| modelled us | compiled GB | compiled GFLOP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for proj, (k, n) in (("gate/up", (hidden, inter)), ("down", (inter, hidden))):
        chosen = gmm.gmm_tiling(m, k, n, groups)
        for tiling in candidates(m, k, n, groups):
            c = gmm.estimate(m, k, n, groups, tiling, 2)
            compiled = ("", "")
            if tiling == chosen or compile_all:
                m_pad = gmm.pad_rows(m, tiling[0])
                transpose = gmm.k_minor(k, n)

                def one(lhs: jax.Array, w: jax.Array, sizes: jax.Array, tiling=tiling,
                        transpose=transpose) -> jax.Array:
                    rhs = w.swapaxes(1, 2) if transpose else w
                    return megablox_gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                                        tiling=tiling, transpose_rhs=transpose)

                fl, by = compiled_cost(
                    one, jax.ShapeDtypeStruct((m_pad, k), BF16, sharding=sh),
                    jax.ShapeDtypeStruct((groups, k, n), BF16, sharding=sh),
                    jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=sh))
                compiled = (f"{by / 1e9:.3f}", f"{fl / 1e9:.1f}")
            mark = "*" if tiling == chosen else ""
            print(f"| {proj}{mark} | {tiling[0]} | {tiling[1]} | {tiling[2]} "
                  f"| {c['bytes'] / 1e9:.3f} | {c['pipelined_bytes'] / 1e9:.3f} "
                  f"| {c['mxu_flops'] / 1e9:.1f} | {c['vmem'] / 2**20:.1f} "
                  f"| {gmm.modelled_seconds(c) * 1e6:.1f} | {compiled[0]} | {compiled[1]} |")
        fl, by = compiled_cost(
            lambda lhs, w, sizes: jax.lax.ragged_dot(lhs, w, sizes,
                                                     preferred_element_type=jnp.float32),
            jax.ShapeDtypeStruct((m, k), BF16, sharding=sh),
            jax.ShapeDtypeStruct((groups, k, n), BF16, sharding=sh),
            jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=sh))
        print(f"| {proj} ragged_dot | | | | | | | | | {by / 1e9:.3f} | {fl / 1e9:.1f} |")


def fused_gate_up(x: jax.Array, local_ids: jax.Array, topk_weights: jax.Array,
                  w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """gmm with gate and up as ONE call over ``concat([w_gate, w_up], -1)`` built in the step
    (the weights are stored apart): the variant gmm.py does not use, measured here."""
    num_tokens, top_k = local_ids.shape
    groups, _, inter = w_gate.shape
    order, weight, inverse, sizes = sorted_assignments(local_ids, topk_weights, groups)
    m = order.shape[0]
    tm = max(gmm.gmm_tiling(m, w_gate.shape[1], 2 * inter, groups)[0],
             gmm.gmm_tiling(m, inter, w_down.shape[2], groups)[0])
    m_pad = gmm.pad_rows(m, tm)
    xs = jnp.pad(gmm.take_rows(x, order // top_k), ((0, m_pad - m), (0, 0)))
    both = gmm.grouped_matmul(xs, jnp.concatenate([w_gate, w_up], axis=2), sizes, m, False)
    act = (jax.nn.silu(both[:, :inter]) * both[:, inter:]).astype(x.dtype)
    down = gmm.grouped_matmul(act, w_down, sizes, m, False)[:m]
    rows = jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], down * weight[:, None], 0.0)
    return gmm.take_rows(rows, inverse).reshape(num_tokens, top_k, -1).sum(axis=1)


def ragged_take_rows(x: jax.Array, local_ids: jax.Array, topk_weights: jax.Array,
                     w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """``ragged`` with its two row gathers done by ``gmm.take_rows``: separates what the
    gathers and what the grouped matmuls contribute to the difference."""
    num_tokens, top_k = local_ids.shape
    order, weight, inverse, sizes = sorted_assignments(local_ids, topk_weights, w_gate.shape[0])
    m = order.shape[0]
    xs = gmm.take_rows(x, order // top_k)

    def grouped(lhs: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(lhs, w, sizes, preferred_element_type=jnp.float32)

    act = (jax.nn.silu(grouped(xs, w_gate)) * grouped(xs, w_up)).astype(x.dtype)
    down = grouped(act, w_down)
    rows = jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], down * weight[:, None], 0.0)
    return gmm.take_rows(rows, inverse).reshape(num_tokens, top_k, -1).sum(axis=1)


def backend_table(device: Any, tokens_list: list[int]) -> None:
    sh = SingleDeviceSharding(device)
    print("\n### Whole backend, one MoE layer on one device (compiled)\n")
    print("| model | T | ragged GB | ragged + take_rows GB | gmm GB | gmm fused gate+up GB "
          "| ragged GFLOP | gmm GFLOP | weights GB (read once) |")
    print("|---|---|---|---|---|---|---|---|---|")
    backends = {
        "ragged": ragged_experts,
        "ragged_rows": ragged_take_rows,
        "gmm": gmm.GmmExperts("tpu"),
        "fused": fused_gate_up,
    }
    for model, (hidden, inter, groups, top_k) in MODELS.items():
        weights = 3 * groups * hidden * inter * 2
        for tokens in tokens_list:
            shapes = (
                jax.ShapeDtypeStruct((tokens, hidden), BF16, sharding=sh),
                jax.ShapeDtypeStruct((tokens, top_k), jnp.int32, sharding=sh),
                jax.ShapeDtypeStruct((tokens, top_k), jnp.float32, sharding=sh),
                jax.ShapeDtypeStruct((groups, hidden, inter), BF16, sharding=sh),
                jax.ShapeDtypeStruct((groups, hidden, inter), BF16, sharding=sh),
                jax.ShapeDtypeStruct((groups, inter, hidden), BF16, sharding=sh),
            )
            cost = {name: compiled_cost(fn, *shapes) for name, fn in backends.items()}
            print(f"| {model} | {tokens} | {cost['ragged'][1] / 1e9:.3f} "
                  f"| {cost['ragged_rows'][1] / 1e9:.3f} | {cost['gmm'][1] / 1e9:.3f} | {cost['fused'][1] / 1e9:.3f} "
                  f"| {cost['ragged'][0] / 1e9:.1f} | {cost['gmm'][0] / 1e9:.1f} "
                  f"| {weights / 1e9:.3f} |")


def kernel_row(device: Any, tokens: int, shape: tuple[int, int, int, int],
               shards: int) -> dict[str, float | None]:
    """GB of each kernel compiled alone (see :func:`kernel_table`) for one model and T."""
    hidden, inter, groups, top_k = shape
    sh = SingleDeviceSharding(device)

    def spec(shape: tuple[int, ...], dtype: Any = BF16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    rows = gmm.pass_rows(tokens * top_k, shards, gmm.CAPACITY_FACTOR)
    tm = gmm.row_tile(rows, jax.ShapeDtypeStruct((groups, hidden, inter), BF16),
                      jax.ShapeDtypeStruct((groups, inter, hidden), BF16))
    m_pad, minor = gmm.pad_rows(rows, tm), gmm.k_minor(hidden, inter)
    xs, w_in, w_down = spec((m_pad, hidden)), spec((groups, hidden, inter)), spec(
        (groups, inter, hidden))
    sizes, token = spec((groups,), jnp.int32), spec((m_pad,), jnp.int32)
    weight, act = spec((m_pad,), jnp.float32), spec((m_pad, inter))

    def megablox_gate_up(x, a, b, w, s):
        gate, up = (gmm.grouped_matmul(x, v, s, rows, False) for v in (a, b))
        return (jax.nn.silu(gate) * up * w[:, None]).astype(x.dtype)

    def fused_gate_up(x, t, a, b, w, s):
        return gmm_gate_up.gate_up_act(x, t, a, b, w, s, tm, minor, False)

    def megablox_down(a, w, s, t):
        down = gmm.grouped_matmul(a, w, s, rows, False, BF16)
        index = jnp.arange(tokens * top_k).reshape(tokens, top_k) % m_pad
        return gmm.sum_token_rows(down, index, jnp.ones((tokens, top_k), bool))

    def fused_down(a, w, s, t):
        return gmm_combine.down_and_combine(a, w, s, t, None, tokens, tm, False)

    gb = {
        "rows": m_pad,
        "gu_megablox": compiled_cost(megablox_gate_up, xs, w_in, w_in, weight, sizes)[1],
        "gu_fused": compiled_cost(lambda x, a, b, w, s: fused_gate_up(x, None, a, b, w, s),
                                  xs, w_in, w_in, weight, sizes)[1],
        "gu_taking": None,
        "down_megablox": compiled_cost(megablox_down, act, w_down, sizes, token)[1],
        "down_fused": compiled_cost(fused_down, act, w_down, sizes, token)[1],
    }
    if gmm_gate_up.token_mode(tokens, hidden, inter, BF16, m_pad, tm) is not None:
        gb["gu_taking"] = compiled_cost(fused_gate_up, spec((tokens, hidden)), token, w_in,
                                        w_in, weight, sizes)[1]
    return gb


def kernel_table(device: Any, tokens_list: list[int], shards: dict[str, int]) -> None:
    """The fused kernels against the Megablox calls they replace (still the backend's path
    where their blocks do not fit), each compiled alone on one device: gate + up + the
    activation (``gmm_gate_up.gate_up_act``, given the sorted rows, or taking x's rows
    itself: picked from x held in VMEM at decode, by row DMAs at prefill) and down + the per-token combine
    (``gmm_combine.down_and_combine`` against Megablox's down and ``gmm.sum_token_rows``).
    Rows: a device's sorted assignments, the pass window under EP (``gmm.pass_rows``)."""
    print("\n### Fused kernels vs Megablox calls, one layer on one device (compiled, GB)\n")
    print("| model | T | rows | gate+up+act: Megablox | fused | fused, taking x's rows "
          "| down+combine: Megablox + sum_token_rows | fused |")
    print("|---|---|---|---|---|---|---|---|")
    for model, shape in MODELS.items():
        for tokens in tokens_list:
            gb = kernel_row(device, tokens, shape, shards[model])
            cells = [f"{gb[k] / 1e9:.3f}" if gb[k] is not None else "-"
                     for k in ("gu_megablox", "gu_fused", "gu_taking", "down_megablox",
                               "down_fused")]
            print(f"| {model} | {tokens} | {gb['rows']} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default="v6e:2x2")
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 8192])
    p.add_argument("--all", action="store_true", help="compile every candidate tiling")
    p.add_argument("--skip-projections", action="store_true")
    args = p.parse_args()
    device = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices[0]
    print(f"{args.topology}: {device.device_kind}; jax {jax.__version__}")
    if not args.skip_projections:
        for model in MODELS:
            for tokens in args.tokens:
                projection_table(device, tokens, model, args.all)
    backend_table(device, args.tokens)
    kernel_table(device, args.tokens, {"qwen3-30b-a3b tp4": 1, "qwen3-235b-a22b tp4 ep4": 4})


if __name__ == "__main__":
    main()
