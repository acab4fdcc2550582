"""Where a compiled step's bytes and FLOPs go: XLA's total cost split over op classes.

``breakdown(hlo_text, xla_flops, xla_bytes)`` reads the optimized HLO of a compiled program
(``compiled.as_text()``) and returns, per op class, the FLOPs and bytes of its instructions,
what XLA counts exactly as estimated kept and the rest scaled, so that the classes sum
exactly to XLA's own totals (``compiled.cost_analysis()``).

Per op: ``op_costs`` (its FLOPs and bytes) and ``op_classes`` (its class).

A ``while`` body is counted once whatever its trip count, as XLA counts it. A
``conditional`` counts, per property, its most expensive branch (XLA's rule). When one branch
is the sampler's full-vocabulary sort fallback (source function ``full_sort``), the other,
cheapest branch is the common case: its ops keep their classes and the difference up to the
counted maximum is the class ``sampler_full_sort``, so the rest of the table is the
common-case cost.

Scaling: a kernel's own estimate is what XLA's total holds for it, exactly, and so are the
operands and results of all-gathers, all-reduces, reduce-scatters and all-to-alls
(``counted_exactly``); the rest of each property's estimate is multiplied by ``(XLA
total - exact) / (estimated total - exact)`` (``scale``, reported), so the classes sum
exactly to XLA's total. A scale near 1 says the per-op rules reproduce XLA's accounting of
its other ops; above 1, XLA counts them at more than their operands and results
(compile-only v5p, each alone: a bf16 ``[512, 4,096]`` residual add and RMSNorm 1.29
times, a ``[2,048, 2,048] @ [2,048, 4,096]`` dot 2.6 times).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from sgl_jax.tools.aot.hlo.op_classes import CLASSES, classify, in_fallback
from sgl_jax.tools.aot.hlo.op_costs import counted_exactly, op_bytes, op_flops
from sgl_jax.tools.aot.hlo.parse import Instr, Module, parse_module

# class -> [flops, bytes, exact flops, exact bytes]: the last two the part of the first two
# that ops XLA counts exactly as estimated here make (:func:`counted_exactly`; unscaled).
Costs = dict[str, list[float]]


def _add(into: Costs, other: Costs) -> None:
    for k, values in other.items():
        acc = into.setdefault(k, [0.0] * 4)
        for i, v in enumerate(values):
            acc[i] += v


def _total(c: Costs) -> tuple[float, float]:
    return sum(v[0] for v in c.values()), sum(v[1] for v in c.values())


def scale_classes(estimates: dict[str, float], exact: dict[str, float],
                  xla_total: float) -> tuple[dict[str, float], float]:
    """Per class, the part of its estimate XLA counts exactly as estimated (``exact``:
    :func:`counted_exactly`) as it is, plus the rest times ``(XLA total - exact) / (estimate
    - exact)``, so that the classes sum to ``xla_total``; and that scale. Every figure is
    scaled alike if the exact part alone reaches XLA's total (not seen)."""
    total, fixed = sum(estimates.values()), sum(exact.values())
    if total <= fixed or xla_total < fixed:
        scale = xla_total / total if total else 0.0
        return {k: v * scale for k, v in estimates.items()}, scale
    scale = (xla_total - fixed) / (total - fixed)
    return {k: exact.get(k, 0.0) + (v - exact.get(k, 0.0)) * scale
            for k, v in estimates.items()}, scale


def computation_costs(module: Module, computation: str, default: str = "other") -> Costs:
    """Estimated (flops, bytes) per class of one run of a computation (loop bodies once,
    conditionals at their costliest branch per property). ``default``: the class of an op
    with no source of its own (XLA drops the stack of some ops it creates): inside a loop or
    a branch, the class of the loop or the conditional."""
    types = module.types(computation)
    out: Costs = {}
    for ins in module.computations.get(computation, []):
        inherited = classify(module, ins, default)
        if ins.opcode == "while":
            for c in ins.called:
                _add(out, computation_costs(module, c, inherited))
        elif ins.opcode == "conditional":
            _add(out, conditional_costs(module, ins, inherited))
        elif ins.opcode in ("call", "async-start"):
            for c in ins.called:
                _add(out, computation_costs(module, c, inherited))
        else:
            cost = [op_flops(module, ins, types), op_bytes(module, ins, types)]
            exact = [v if counted_exactly(ins, prop) else 0.0 for prop, v in enumerate(cost)]
            _add(out, {inherited: cost + exact})
    return out


def conditional_costs(module: Module, ins: Instr, default: str = "other") -> Costs:
    branches = [(c, computation_costs(module, c, default)) for c in ins.called]
    if not branches:
        return {}
    totals = [_total(c) for _, c in branches]
    counted = (max(t[0] for t in totals), max(t[1] for t in totals))
    common = [i for i, (c, _) in enumerate(branches) if not in_fallback(module, c)]
    if common and len(common) < len(branches):
        # The sampler's fallback: the cheapest other branch is what the step runs; the rest
        # of what XLA counts is the fallback's excess.
        i = min(common, key=lambda i: totals[i][1])
        out: Costs = {k: list(v) for k, v in branches[i][1].items()}
        out["sampler_full_sort"] = [counted[0] - totals[i][0], counted[1] - totals[i][1],
                                    0.0, 0.0]
        return out
    out = {}
    for prop in (0, 1):  # per property, the classes of the branch XLA counts
        i = max(range(len(branches)), key=lambda i: totals[i][prop])
        for k, v in branches[i][1].items():
            acc = out.setdefault(k, [0.0] * 4)
            acc[prop] += v[prop]
            acc[prop + 2] += v[prop + 2]
    return out


@dataclass
class Breakdown:
    flops: dict[str, float]  # per class, scaled to XLA's total (:func:`scale_classes`)
    bytes: dict[str, float]
    estimated_flops: float  # the per-op estimate's totals before scaling
    estimated_bytes: float
    flops_scale: float  # of the rest of the estimate: (XLA - exact) / (estimate - exact)
    bytes_scale: float
    # Per class before scaling: the estimate ("flops" / "bytes") and its part XLA counts
    # exactly ("exact_flops" / "exact_bytes"), for extrapolating over depth (aot_report).
    estimates: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"flops": self.flops, "bytes": self.bytes,
                "estimated_flops": self.estimated_flops,
                "estimated_bytes": self.estimated_bytes,
                "flops_scale": self.flops_scale, "bytes_scale": self.bytes_scale}


def breakdown(hlo: str, xla_flops: float, xla_bytes: float) -> Breakdown:
    """Per-class FLOPs and bytes of the compiled module ``hlo`` summing exactly to XLA's
    ``xla_flops`` and ``xla_bytes`` (every class of ``CLASSES`` present, 0 when empty):
    what XLA counts as estimated as it is, the rest scaled (:func:`scale_classes`)."""
    module = parse_module(hlo)
    costs = computation_costs(module, module.entry)
    est_f, est_b = _total(costs)
    estimates = {name: {k: costs.get(k, [0.0] * 4)[i] for k in CLASSES}
                 for i, name in enumerate(("flops", "bytes", "exact_flops", "exact_bytes"))}
    flops, sf = scale_classes(estimates["flops"], estimates["exact_flops"], xla_flops)
    bytes_, sb = scale_classes(estimates["bytes"], estimates["exact_bytes"], xla_bytes)
    # Exact sums: the rounding residue goes to the largest class.
    for d, total in ((flops, xla_flops), (bytes_, xla_bytes)):
        if any(d.values()):
            top = max(d, key=lambda k: d[k])
            d[top] += total - sum(d.values())
    return Breakdown(flops, bytes_, est_f, est_b, sf, sb, estimates)


def top_ops(hlo: str, n: int = 20) -> Iterator[tuple[str, str, float, float, str, bool]]:
    """The n ops of largest estimated bytes: (class, name, flops, bytes, op_name, whether
    XLA counts it exactly so: :func:`counted_exactly`), for finding what a class is made of."""
    module = parse_module(hlo)
    rows = []

    def visit(computation: str, default: str = "other") -> None:
        types = module.types(computation)
        for ins in module.computations.get(computation, []):
            if ins.opcode in ("while", "conditional", "call", "async-start"):
                for c in ins.called:
                    visit(c, classify(module, ins, default))
                continue
            rows.append((classify(module, ins, default), f"{computation}/{ins.name}",
                         op_flops(module, ins, types), op_bytes(module, ins, types),
                         ins.op_name, counted_exactly(ins)))

    visit(module.entry)
    yield from sorted(rows, key=lambda r: -r[3])[:n]
