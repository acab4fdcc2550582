"""The FLOPs and bytes of one op of a compiled module's optimized HLO, estimated as
XLA:TPU counts them, and whether XLA's total holds an op at exactly its estimate.

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
  not donated, XLA adds a copy of the whole buffer, its own op, counted as a copy).
  Parameters, constants, tuples, bitcasts and ``get-tuple-element`` count nothing; async
  ``*-done`` count nothing (their ``*-start`` does).
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

Loops, conditionals, the classes and the scaling to XLA's total: ``breakdown``.
"""

from __future__ import annotations

import json
import math
import re

from sgl_jax.tools.aot.hlo.parse import (
    Instr,
    Module,
    _dims,
    shape_dims,
    tile_rows,
    type_bytes,
    type_elements,
)

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency"}
TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh",
                  "logistic", "sqrt", "rsqrt", "cbrt", "sine", "cosine", "tan", "atan2",
                  "power", "erf"}
ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
               "compare", "select", "clamp", "convert", "and", "or", "xor", "not", "remainder",
               "sign", "floor", "ceil", "round-nearest-even", "round-nearest-afz",
               "shift-left", "shift-right-logical", "shift-right-arithmetic", "is-finite",
               "popcnt", "clz", "real", "imag", "stochastic-convert"} | TRANSCENDENTAL


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
