"""The bytes a device sends over the interconnect in one run of a compiled module, from the
collectives of its optimized HLO text, and the part of them that is the MoE dispatch."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

# Bytes of one element of an HLO array type.
HLO_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "ragged-all-to-all",
                  "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (?P<type>.+?) (?P<op>" + "|".join(COLLECTIVE_OPS)
    + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([0-9,]*)\]")


def _group_size(line: str, n_devices: int) -> int:
    """Devices per replica group of a collective, from its ``replica_groups`` in any of the
    three printed forms: explicit ``{{0,1},{2,3}}``, iota ``[G,S]<=[N]``, or mesh axes
    ``mesh['axis_0'=4,'axis_1'=2], device_ids=(...) {'axis_0'}`` (the named axes)."""
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\{('[^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return n_devices  # replica_groups={} : all devices


def _frame_files(hlo: str) -> dict[int, set[str]]:
    """stack_frame_id -> the source files of that frame and its callers, from the compiled
    module's FileNames / FileLocations / StackFrames tables (parent_frame_id is 1-based,
    0 = none)."""
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
        elif not line.strip():
            current = None
        elif current is not None:
            key, _, value = line.partition(" ")
            if key.isdigit():
                current[int(key)] = value
    files = sections.get("FileNames", {})
    locations = {k: re.search(r"file_name_id=(\d+)", v) for k, v in
                 sections.get("FileLocations", {}).items()}
    frames = {k: (int(re.search(r"file_location_id=(\d+)", v).group(1)),
                  int(re.search(r"parent_frame_id=(\d+)", v).group(1)))
              for k, v in sections.get("StackFrames", {}).items()}
    out: dict[int, set[str]] = {}
    for frame in frames:
        seen, f = set(), frame
        while f in frames and len(seen) < 256:
            loc, parent = frames[f]
            m = locations.get(loc)
            if m:
                seen.add(files.get(int(m.group(1)), ""))
            f = parent - 1
        out[frame] = seen
    return out


def _instructions(lines: list[str]) -> Iterator[tuple[str, str]]:
    """(computation name, line) of every line of an HLO module's text but the computations'
    headers."""
    computation = ""
    for line in lines:
        head = re.match(r"^(?:ENTRY )?%([^\s(]+) *[({]", line)
        if head:
            computation = head.group(1)
        else:
            yield computation, line


def collective_bytes(hlo: str, n_devices: int) -> tuple[float, float, dict[str, float]]:
    """(all, MoE dispatch, per op) bytes one device sends over the interconnect in one run
    of the compiled module ``hlo`` (``compiled.as_text()``), estimated from every collective
    as a ring algorithm over its replica group of n devices, S the bytes of its result:
    all-reduce ``2 S (n-1)/n``, all-gather and all-to-all ``S (n-1)/n``, reduce-scatter ``S
    (n-1)``, collective-permute ``S``; ragged-all-to-all ``S (n-1)/n`` of its static output
    buffer (an upper bound). XLA:TPU may emit a reduce-scatter as a fusion calling an
    ``all-reduce-scatter`` computation, whose all-reduce of the (padded) input is counted as
    the reduce-scatter it is, ``S_in (n-1)/n``. A collective belongs to the MoE dispatch when
    its source location (the stack frames XLA keeps: its own, or its reduction's) is in
    ``layers/moe/``. Collectives inside a loop body or a ``cond`` branch are counted once
    (the sampler's sort fallback among them)."""
    frames = _frame_files(hlo)
    lines = hlo.splitlines()
    # computation -> its ROOT's stack frame (a reduction's add keeps the psum's location)
    root_frame: dict[str, int] = {}
    for computation, line in _instructions(lines):
        if line.lstrip().startswith("ROOT "):
            frame = re.search(r"stack_frame_id=(\d+)", line)
            if frame:
                root_frame[computation] = int(frame.group(1))
    total = moe = 0.0
    per_op: dict[str, float] = {}
    for computation, line in _instructions(lines):
        m = _COLLECTIVE.match(line)
        if m is None:
            continue
        op = m.group("op")
        arrays = [math.prod(int(d) for d in dims.split(",") if d) * HLO_ITEMSIZE[t]
                  for t, dims in _ARRAY.findall(m.group("type")) if dims and t in HLO_ITEMSIZE]
        if not arrays:
            continue
        n = _group_size(line, n_devices)
        if m.group("start") and op == "all-gather":
            # (operands, results): results are n times the operands
            size = sum(arrays) * n / (n + 1)
        elif m.group("start") and op == "collective-permute":
            size = sum(arrays) / 2  # (operands, results[, sync flags])
        else:
            size = float(sum(arrays))  # a combined collective: every result
        if op == "all-reduce" and computation.startswith("all-reduce-scatter"):
            op, sent = "reduce-scatter", size * (n - 1) / n
        elif op == "all-reduce":
            sent = 2 * size * (n - 1) / n
        elif op == "reduce-scatter":
            sent = size * (n - 1)
        elif op == "collective-permute":
            sent = size
        else:
            sent = size * (n - 1) / n
        frame = re.search(r"stack_frame_id=(\d+)", line)
        frame_id = int(frame.group(1)) if frame else None
        if frame_id is None:
            reduction = re.search(r"to_apply=%(\S+?),", line)
            frame_id = root_frame.get(reduction.group(1)) if reduction else None
        in_moe = frame_id is not None and any(
            "/layers/moe/" in f for f in frames.get(frame_id, ()))
        total += sent
        moe += sent if in_moe else 0.0
        per_op[op] = per_op.get(op, 0.0) + sent
    return total, moe, per_op
