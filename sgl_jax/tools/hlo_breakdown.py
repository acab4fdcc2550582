"""Where a compiled step's bytes and FLOPs go: XLA's total cost split over op classes.

``breakdown(hlo_text, xla_flops, xla_bytes)`` reads the optimized HLO of a compiled program
(``compiled.as_text()``) and returns, per op class, the FLOPs and bytes of its instructions,
what XLA counts exactly as estimated kept and the rest scaled, so that the classes sum
exactly to XLA's own totals (``compiled.cost_analysis()``).

Counting (per device; the HLO after SPMD partitioning holds per-device shapes):

- Every top-level instruction of the entry computation, and of the computations it runs
  (``while`` bodies and conditions, ``conditional`` branches, ``call`` and async
  computations), is one op; a fusion is one op.
- Bytes of an op: its operands plus its result, each array padded to its TPU layout's tile as
  stored (``{2,1,0:T(8,128)}``: the minor dimension to a multiple of 128, the next to 8), except
  that a slice, dynamic-slice or async ``slice-start`` (and a fusion parameter read only
  through them) counts what it reads, a gather what it reads
  times the rows of the operand's layout tile (``T(8,128)``: a gathered row reads its whole
  tile of 8 rows; XLA:TPU's count of 8,192 rows gathered from a [1024, 2048] bf16 array
  compiled alone is 319 MB, this rule gives 302 MB; a 1-D ``T(1024)`` array: each element
  its whole 1,024-element tile, 65,536 float32 gathered from as many: XLA 270.5 MB, the rule
  269 MB), and a ``copy-start`` (a prefetch into
  on-chip memory) its operand twice (read, write). A dynamic-update-slice or scatter (also as a
  fusion's root) writes in place: it counts its update, read and written, and not the buffer
  (XLA:TPU's count of a 256-row scatter into a donated 8.4 MB cache compiled alone: 0.4 MB;
  not donated, XLA adds a copy of the whole buffer, its own op, counted as a copy). Parameters, constants, tuples, bitcasts and
  ``get-tuple-element`` count nothing; async ``*-done`` count nothing (their ``*-start`` does).
- FLOPs: a dot ``2 * result elements * contracted size``, a convolution ``2 * result elements *
  kernel elements / output features``, an elementwise op or a reduction one per element, a
  reduce-window one per result element and window element (a cumsum is one), a sort
  ``n log2 n`` per row; a fusion the sum of its fused instructions (its dots dominate).
- A custom call (a Pallas / Mosaic kernel: ``tpu_custom_call``) uses the kernel's own
  ``cost_estimate`` from its ``backend_config`` (``flops``, ``bytes_accessed``: JAX's
  ``ragged_dot`` is such a kernel on TPU, ``ragged-dot-none``, and its estimate is its static
  operand and result sizes); a kernel without one (JAX's ragged paged attention) counts 0
  FLOPs and 0 bytes, as XLA counts it (a Pallas call without ``cost_estimate`` compiled
  alone: no ``bytes accessed`` at all; with one: exactly its figures). The report adds the
  attention kernel's work analytically, outside this breakdown.
- A ``while`` body is counted once whatever its trip count, as XLA counts it. A
  ``conditional`` counts, per property, its most expensive branch (XLA's rule). When one branch
  is the sampler's full-vocabulary sort fallback (source function ``full_sort``), the other,
  cheapest branch is the common case: its ops keep their classes and the difference up to the
  counted maximum is the class ``sampler_full_sort``, so the rest of the table is the
  common-case cost.
- Scaling: a kernel's own estimate is what XLA's total holds for it, exactly, and so are the
  operands and results of all-gathers, all-reduces, reduce-scatters and all-to-alls
  (``counted_exactly``); the rest of each property's estimate is multiplied by ``(XLA
  total - exact) / (estimated total - exact)`` (``scale``, reported), so the classes sum
  exactly to XLA's total. A scale near 1 says the per-op rules reproduce XLA's accounting of
  its other ops; above 1, XLA counts them at more than their operands and results
  (compile-only v5p, each alone: a bf16 ``[512, 4,096]`` residual add and RMSNorm 1.29
  times, a ``[2,048, 2,048] @ [2,048, 4,096]`` dot 2.6 times).

Classes, from each op's source stack (the ``StackFrames`` XLA keeps: file and function,
innermost first), its ``op_name`` metadata and its opcode (``CLASSES`` in this order):
``expert_matmuls`` (grouped / dense expert matmuls: the gmm kernels (``MATMUL_KERNELS``), dots
in ``layers/moe/`` expert code, ``ragged_dot``), ``moe_dispatch`` (the rest of the expert code: sorting assignments by
expert, gathers, the weighted combine), ``router`` (``layers/moe/router.py``, routing),
``attention`` (the attention backend, the kernel's metadata, rotary embedding (not where the
token matmul kernel rotates q and k after their projections: ``projections``); not its
projections), ``kv_cache_write`` (``write_kv``: the step's new K/V into the cache),
``projections`` (every other dot: q/k/v/o, dense MLP, the LM head; the token matmul
kernel, ``PROJECTION_KERNELS``), ``sampler``
(``layers/sampler.py``, logprobs), ``sampler_full_sort`` (see above), ``collectives``
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, and XLA:TPU's
collective fusions: a reduce-scatter's pieces), ``copies`` (copy,
copy-start, transpose and fusions of only those: layout changes and prefetches without a
model source, e.g. a weight re-laid out for a kernel every step) and ``other``
(norms, embedding lookup, the batch's metadata, elementwise glue).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from sgl_jax.tools.hlo_parse import (  # noqa: F401  (re-exported: the parser's API)
    Instr,
    Module,
    _dims,
    parse_instruction,
    parse_module,
    shape_dims,
    tile_rows,
    type_bytes,
    type_elements,
)

CLASSES = ("expert_matmuls", "moe_dispatch", "router", "attention", "kv_cache_write",
           "projections", "sampler", "sampler_full_sort", "collectives", "copies", "other")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "ragged-all-to-all", "collective-permute", "collective-broadcast")
COPIES = {"copy", "copy-start", "transpose"}
TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh",
                  "logistic", "sqrt", "rsqrt", "cbrt", "sine", "cosine", "tan", "atan2",
                  "power", "erf"}
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
               "compare", "select", "clamp", "convert", "and", "or", "xor", "not", "remainder",
               "sign", "floor", "ceil", "round-nearest-even", "round-nearest-afz",
               "shift-left", "shift-right-logical", "shift-right-arithmetic", "is-finite",
               "popcnt", "clz", "real", "imag", "stochastic-convert"} | TRANSCENDENTAL
# (file path fragment or None, function name or None) -> class, first match wins, checked
# for each frame from the innermost outward.
FRAME_RULES: tuple[tuple[str | None, str | None, str], ...] = (
    (None, "full_sort", "sampler"),  # inside the fallback branch; its excess is split off
    (None, "write_kv", "kv_cache_write"),
    ("/layers/sampler.py", None, "sampler"),
    ("/layers/logprobs.py", None, "sampler"),
    ("/layers/moe/router.py", None, "router"),
    ("/layers/moe/routing.py", None, "router"),
    ("/layers/moe/ragged.py", None, "experts"),
    ("/layers/moe/dense.py", None, "experts"),
    ("/layers/moe/experts.py", None, "experts"),
    ("/layers/moe/dispatch.py", None, "moe_dispatch"),
    ("/layers/moe/ep_moe.py", None, "moe_dispatch"),
    ("/layers/attention/", None, "attention"),
    ("/ragged_paged_attention/", None, "attention"),
    ("/layers/rotary.py", None, "attention"),
    ("/layers/norm_rope.py", None, "attention"),  # q/k norm and rotary, one kernel
    ("/layers/norm.py", None, "other"),
    ("/forward_batch_info.py", None, "other"),
)
FALLBACK_FUNCTIONS = ("full_sort",)
# Pallas kernels of the gmm backend that are grouped matmuls (``jit(name)`` in their op
# name): Megablox's ``gmm``, gate + up + activation, and down with the per-token combine
# (whose adds into the sums are counted with its matmul).
MATMUL_KERNELS = ("gmm", "gate_up_act", "down_and_combine")
PROJECTION_KERNELS = ("token_matmul",)  # layers/token_matmul.py: a prefill's q/k/v


# -- costs ---------------------------------------------------------------------------------
def dot_flops(ins: Instr, types: dict[str, str]) -> float:
    lhs = shape_dims(types.get(ins.operands[0], ""))
    contracted = math.prod(lhs[0][1][d] for d in _dims(ins.attr("lhs_contracting_dims"))) \
        if lhs else 1
    return 2.0 * type_elements(ins.type) * contracted


def conv_flops(ins: Instr, types: dict[str, str]) -> float:
    rhs = shape_dims(types.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
    if not rhs or not labels:
        return 0.0
    kernel = rhs[0][1]
    out_features = kernel[labels.group(1).index("o")] if "o" in labels.group(1) else 1
    return 2.0 * type_elements(ins.type) * math.prod(kernel) / max(out_features, 1)


def kernel_estimate(ins: Instr) -> tuple[float, float] | None:
    """A Pallas / Mosaic kernel's own (flops, bytes_accessed) from its backend_config."""
    m = re.search(r'"cost_estimate":(\{[^}]*\})', ins.attrs)
    if m is None:
        return None
    est = json.loads(m.group(1))
    return float(est.get("flops", 0)), float(est.get("bytes_accessed", 0))


def inner_flops(module: Module, computation: str) -> float:
    """FLOPs of a fused computation's instructions."""
    types = module.types(computation)
    total = 0.0
    for ins in module.computations.get(computation, []):
        total += op_flops(module, ins, types)
    return total


def op_flops(module: Module, ins: Instr, types: dict[str, str]) -> float:
    op = ins.opcode
    if op == "dot":
        return dot_flops(ins, types)
    if op == "convolution":
        return conv_flops(ins, types)
    if op == "fusion":
        return sum(inner_flops(module, c) for c in ins.called)
    if op == "custom-call":
        est = kernel_estimate(ins)
        return est[0] if est else 0.0
    if op in ELEMENTWISE - TRANSCENDENTAL:
        return type_elements(ins.type)
    if op == "sort":  # compares: n log2 n per sorted row, every operand moved along
        dims = shape_dims(types.get(ins.operands[0], "")) if ins.operands else []
        axis = _dims(ins.attr("dimensions"))
        if dims and axis and dims[0][1]:
            n = dims[0][1][axis[0]]
            return math.prod(dims[0][1]) * math.log2(max(n, 2))
        return 0.0
    if op == "reduce-window":  # every output element reduces its whole window
        size = re.search(r"window=\{size=([0-9x]+)", ins.attrs)
        window = math.prod(int(x) for x in size.group(1).split("x")) if size else 1
        return type_elements(ins.type) * window
    if op in ("reduce", "all-reduce", "reduce-scatter"):
        return sum(type_elements(types.get(o, "")) for o in ins.operands[:1])
    return 0.0


_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


def fusion_bytes(module: Module, ins: Instr, types: dict[str, str]) -> float:
    """Operands (a parameter read only through slices or gathers: what they read) + result."""
    body = module.computations.get(ins.called[0], []) if ins.called else []
    params = {int(i.args): i for i in body if i.opcode == "parameter" and i.args.isdigit()}
    users: dict[str, list[Instr]] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    inner = {i.name: i for i in body}
    root = next((i for i in body if i.root), None)
    in_place_buffer = None
    total = type_bytes(ins.type)
    if root is not None and root.opcode in _IN_PLACE and len(root.operands) >= 2:
        # Written in place (XLA:TPU counts a scatter into a donated 8.4 MB cache compiled
        # alone as 0.4 MB: the update read and written; not donated, a copy of the whole
        # buffer appears as its own op).
        in_place_buffer = root.operands[0]
        update = root.operands[2] if root.opcode == "scatter" else root.operands[1]
        if update in inner:
            total = 2 * type_bytes(inner[update].type)
    for idx, operand in enumerate(ins.operands):
        size = type_bytes(types.get(operand, ""))
        p = params.get(idx)
        if p is None:
            total += size
            continue
        uses = users.get(p.name, [])
        if p.name == in_place_buffer and len(uses) == 1:
            continue  # the buffer updated in place: only the update moves
        if uses and all(u.opcode in _SLICING and u.operands[0] == p.name for u in uses):
            # What the slices read; a gather of rows reads each row's whole tile of rows
            # (``T(8,128)``: 8 rows; a 1-D ``T(1024)``: 1,024 elements), as XLA:TPU counts
            # it: may exceed the operand's size.
            tile = tile_rows(types.get(operand, ""))
            total += sum(type_bytes(u.type) * (tile if u.opcode == "gather" else 1)
                         for u in uses)
        else:
            total += size
    return total


def op_bytes(module: Module, ins: Instr, types: dict[str, str]) -> float:
    op = ins.opcode
    if op in FREE or op.endswith("-done"):
        return 0.0
    if op == "fusion":
        return fusion_bytes(module, ins, types)
    if op == "dynamic-update-slice" and len(ins.operands) >= 2:  # in place
        return 2 * type_bytes(types.get(ins.operands[1], ""))
    if op == "scatter" and len(ins.operands) >= 3:
        return (2 * type_bytes(types.get(ins.operands[2], ""))
                + type_bytes(types.get(ins.operands[1], "")))
    if op == "custom-call":  # XLA's total holds a kernel's own estimate, or nothing
        est = kernel_estimate(ins)
        return est[1] if est is not None else 0.0
    if op in ("slice", "dynamic-slice"):
        return 2 * type_bytes(ins.type)
    if op == "gather" and len(ins.operands) >= 2:
        tile = tile_rows(types.get(ins.operands[0], ""))
        return (1 + tile) * type_bytes(ins.type) + type_bytes(types.get(ins.operands[1], ""))
    if op == "copy-start" and ins.operands:
        return 2 * type_bytes(types.get(ins.operands[0], ""))
    if op == "slice-start" and ins.operands:
        # An async slice (XLA moving part of an operand to on-chip memory): what it reads,
        # written once; its tuple type holds the whole operand, the slice and an s32 counter.
        whole = sum(type_bytes(types.get(o, "")) for o in ins.operands)
        return 2 * max(type_bytes(ins.type) - whole - 4, 0.0)
    if op.endswith("-start") and ins.operands:  # async collective: operands + results
        return sum(type_bytes(types.get(o, "")) for o in ins.operands) * 2
    return sum(type_bytes(types.get(o, "")) for o in ins.operands) + type_bytes(ins.type)


# -- classes ---------------------------------------------------------------------------------
def _has_dot(module: Module, ins: Instr) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    if ins.opcode == "custom-call":
        return _expert_kernel(ins) or _projection_kernel(ins)
    if ins.opcode == "fusion":
        return any(_has_dot(module, i) for c in ins.called
                   for i in module.computations.get(c, []))
    return False


def _kernel_call(ins: Instr, kernels: tuple[str, ...]) -> bool:
    """A custom call made by one of the jitted kernel functions named ``kernels``."""
    return ins.opcode == "custom-call" and any(f"jit({k})" in ins.op_name for k in kernels)


def _expert_kernel(ins: Instr) -> bool:
    """A custom call that is a grouped expert matmul: ``ragged_dot`` or a gmm kernel."""
    return (ins.opcode == "custom-call"
            and ("ragged-dot" in ins.name or "ragged_dot" in ins.op_name)
            or _kernel_call(ins, MATMUL_KERNELS))


def _projection_kernel(ins: Instr) -> bool:
    """A custom call that is a projection's matmul kernel (``PROJECTION_KERNELS``)."""
    return _kernel_call(ins, PROJECTION_KERNELS)


def _frame_chain(module: Module, ins: Instr) -> list[tuple[str, str]]:
    """The op's stack (innermost first): its own frame, or for a fusion without one the frame
    of the fused instruction that has one (its root first)."""
    if ins.frame is not None:
        return module.frames.get(ins.frame, [])
    if ins.opcode == "fusion":
        body = [i for c in ins.called for i in module.computations.get(c, [])]
        for i in sorted(body, key=lambda i: not i.root):
            if i.frame is not None:
                return module.frames.get(i.frame, [])
    return []


def classify(module: Module, ins: Instr, default: str = "other") -> str:
    op = ins.opcode.removesuffix("-start")
    if op in COLLECTIVES or (op == "fusion" and '"collective_algorithm_config"' in ins.attrs):
        return "collectives"  # (XLA:TPU's collective fusions: a reduce-scatter's pieces)
    name = ins.op_name
    if "ragged_paged_attention" in name:
        return "attention"
    dot = _has_dot(module, ins)
    if _expert_kernel(ins) or "ragged_dot" in name:
        return "expert_matmuls"
    if _projection_kernel(ins):
        return "projections"
    for file, function in _frame_chain(module, ins):
        for frag, fn, cls in FRAME_RULES:
            if (frag is None or frag in file) and (fn is None or fn == function.split(".")[-1]):
                if cls == "experts":
                    return "expert_matmuls" if dot else "moe_dispatch"
                if cls == "attention" and dot and "/ragged_paged_attention/" not in file:
                    continue  # a projection called from the attention module
                return cls
    if dot:
        return "projections"
    if default != "other":  # inside a loop or branch of a known class (the sampler's)
        return default
    if ins.opcode in COPIES or _is_layout_fusion(module, ins):
        return "copies"
    return default


_LAYOUT = {"parameter", "bitcast", "copy", "transpose", "reshape", "tuple", "get-tuple-element"}


def _is_layout_fusion(module: Module, ins: Instr) -> bool:
    """A fusion that only moves data to another layout (``copy_bitcast_fusion``, ...)."""
    if ins.opcode != "fusion":
        return False
    body = [i for c in ins.called for i in module.computations.get(c, [])]
    return bool(body) and all(i.opcode in _LAYOUT for i in body)


def _in_fallback(module: Module, computation: str, seen: set[str] | None = None) -> bool:
    """Whether a computation (or a loop or call in it) holds ops of the sampler's sort
    fallback."""
    seen = seen if seen is not None else set()
    if computation in seen:
        return False
    seen.add(computation)
    for ins in module.computations.get(computation, []):
        if any(fn.split(".")[-1] in FALLBACK_FUNCTIONS for _, fn in _frame_chain(module, ins)):
            return True
        # Not into a nested conditional: a branch that holds the fallback's own cond (the
        # sampler's sampled_rows) is not the fallback.
        if ins.opcode not in ("fusion", "conditional") and any(
                _in_fallback(module, c, seen) for c in ins.called):
            return True
    return False


# class -> [flops, bytes, exact flops, exact bytes]: the last two the part of the first two
# that ops XLA counts exactly as estimated here make (:func:`counted_exactly`; unscaled).
Costs = dict[str, list[float]]

# Collectives whose bytes XLA counts as their operands and result, as estimated here (each
# compiled alone for v5p:2x2x4, bf16 and float32, over one axis and two: the same bytes). The
# synchronous ops only (the async ``*-start`` forms were not measured), and not
# collective-permute (XLA counted one at twice that).
EXACT_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")


def counted_exactly(ins: Instr, prop: int = 1) -> bool:
    """Whether XLA's total holds this op's FLOPs (``prop`` 0) or bytes (1) at exactly its
    estimate here: a kernel with its own cost estimate (both), one of
    ``EXACT_COLLECTIVES`` (bytes)."""
    if ins.opcode == "custom-call":
        return kernel_estimate(ins) is not None
    return prop == 1 and ins.opcode in EXACT_COLLECTIVES


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
    common = [i for i, (c, _) in enumerate(branches) if not _in_fallback(module, c)]
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
