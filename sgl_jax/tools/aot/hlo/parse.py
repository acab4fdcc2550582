"""Parsing XLA's optimized HLO text (``compiled.as_text()``): instructions, computations, the
source stack of every op, and array sizes as XLA:TPU stores them (padded to layout tiles).
Used by the other modules of this package."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
            "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
            "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|c\d+)\[([0-9,]*)\]")


@dataclass
class Instr:
    name: str
    type: str  # the result type as printed
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    args: str = ""  # the text between the opcode's parentheses

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%?[\w.\-]+|\{{[^}}]*\}})", self.attrs)
        return m.group(1) if m else None

    @property
    def called(self) -> list[str]:
        """Computations this instruction calls (fusion bodies, branches, loop parts)."""
        out = []
        for key in ("calls", "to_apply", "body", "condition"):
            v = self.attr(key)
            if v and v.startswith("%"):
                out.append(v[1:])
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            out += [x.strip().lstrip("%") for x in m.group(1).split(",")]
        for key in ("true_computation", "false_computation"):
            v = self.attr(key)
            if v:
                out.append(v.lstrip("%"))
        return out

    @property
    def frame(self) -> int | None:
        m = re.search(r"stack_frame_id=(\d+)", self.attrs)
        return int(m.group(1)) if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    # stack_frame_id -> [(file, function)], innermost first
    frames: dict[int, list[tuple[str, str]]] = field(default_factory=dict)

    def types(self, computation: str) -> dict[str, str]:
        return {i.name: i.type for i in self.computations[computation]}


def _matching(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


_HEAD = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+)\s*=\s*")
_COMPUTATION = re.compile(r"^(ENTRY )?%([^\s(]+)\s*\(.*\{\s*$")  # a computation's header


def parse_instruction(line: str) -> Instr | None:
    m = _HEAD.match(line)
    if m is None:
        return None
    i = m.end()
    if line[i] == "(":  # a tuple type
        j = _matching(line, i)
    else:  # up to the first space outside brackets
        j = i
        while j < len(line) and line[j] != " ":
            j = _matching(line, j) if line[j] in "[{(" else j + 1
    type_ = line[i:j]
    op = re.match(r"\s*([\w\-]+)\(", line[j:])
    if op is None:
        return None
    open_paren = j + op.end() - 1
    close = _matching(line, open_paren)
    operands = re.findall(r"%([^\s,()]+)", line[open_paren:close])
    return Instr(m.group(2), type_, op.group(1), operands, line[close:], bool(m.group(1)),
                 line[open_paren + 1:close - 1].strip())


def _tables(lines: list[str]) -> dict[str, dict[int, str]]:
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
        elif not line.strip() or line.startswith(("%", "ENTRY")):
            current = None
        elif current is not None:
            key, _, value = line.partition(" ")
            if key.isdigit():
                current[int(key)] = value.strip().strip('"')
    return sections


def parse_frames(lines: list[str]) -> dict[int, list[tuple[str, str]]]:
    """stack_frame_id -> [(file, function)] of the frame and its callers, innermost first."""
    t = _tables(lines)
    files, functions = t.get("FileNames", {}), t.get("FunctionNames", {})
    locations = {}
    for k, v in t.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        fn = re.search(r"function_name_id=(\d+)", v)
        locations[k] = (files.get(int(f.group(1)), "") if f else "",
                        functions.get(int(fn.group(1)), "") if fn else "")
    frames = {}
    for k, v in t.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        parent = re.search(r"parent_frame_id=(\d+)", v)
        frames[k] = (int(loc.group(1)) if loc else 0, int(parent.group(1)) if parent else 0)
    out = {}
    for frame in frames:
        chain, f = [], frame
        while f in frames and len(chain) < 256:
            loc, parent = frames[f]
            if loc in locations:
                chain.append(locations[loc])
            f = parent - 1 if parent else -1  # parent_frame_id is 1-based, 0 = none
        out[frame] = chain
    return out


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def _open_braces(line: str) -> int:
    """``{`` minus ``}`` outside double-quoted strings (JSON in ``backend_config``,
    ``op_name`` metadata) of one line."""
    bare = _QUOTED.sub("", line)
    return bare.count("{") - bare.count("}")


def _instruction_lines(lines: list[str]) -> list[str]:
    """The module's lines with each instruction on one: a kernel's ``kernel_metadata`` may
    hold a newline (a Pallas call with side effects), the rest of the instruction (its
    ``backend_config``, with the cost estimate) on the lines after it. An instruction whose
    braces do not balance yet goes on with the next line, unless that line is blank or
    starts an instruction or a computation of its own."""
    joined: list[str] = []
    open_braces = 0
    for line in lines:
        if open_braces > 0 and line.strip() and not (_HEAD.match(line)
                                                     or _COMPUTATION.match(line)):
            joined[-1] += line
            open_braces += _open_braces(line)
            continue
        joined.append(line)
        open_braces = _open_braces(line) if _HEAD.match(line) else 0
    return joined


def parse_module(text: str) -> Module:
    lines = _instruction_lines(text.splitlines())
    computations: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in lines:
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(2)
            computations[current] = []
            if head.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            ins = parse_instruction(line)
            if ins is not None:
                computations[current].append(ins)
    return Module(computations, entry, parse_frames(lines))


# -- sizes ---------------------------------------------------------------------------------
def shape_dims(type_: str) -> list[tuple[str, list[int]]]:
    return [(t, [int(d) for d in dims.split(",") if d]) for t, dims in _ARRAY.findall(type_)]


_ARRAY_LAYOUT = re.compile(
    r"\b(pred|[suf]\d+|bf16|f8e\w+|c\d+)\[([0-9,]*)\](?:\{([0-9,]*)(?::T\(([0-9,]+)\))?)?")


def type_bytes(type_: str) -> float:
    """Bytes of an HLO type (tuples summed), each array padded to its TPU layout's tile as it
    is stored (``bf16[128,2048,192]{2,1,0:T(8,128)(2,1)}``: the minor dimension 192 padded to
    256), as XLA:TPU counts bytes."""
    total = 0.0
    for t, dims_s, layout, tile in _ARRAY_LAYOUT.findall(type_):
        dims = [int(d) for d in dims_s.split(",") if d]
        if dims and layout and tile:
            minor_to_major = [int(x) for x in layout.split(",") if x]
            sizes = [int(x) for x in tile.split(",")]
            for dim, t_size in zip(minor_to_major, reversed(sizes), strict=False):
                dims[dim] = -(-dims[dim] // t_size) * t_size
        total += math.prod(dims) * ITEMSIZE.get(t, 4)
    return total


def type_elements(type_: str) -> float:
    return float(sum(math.prod(d) for _, d in shape_dims(type_)))


def tile_rows(type_: str) -> int:
    """The rows (elements, of a 1-D array) of the first tile of an array's TPU layout: what a
    gather reads for each row it takes, as XLA:TPU counts it (``{1,0:T(8,128)(2,1)}``: 8;
    a 1-D ``{0:T(1024)}``: 1,024; compile-only v5p, 20,480 or 65,536 int32 or float32
    gathered from as many: 4 KB each), else 1."""
    one_d = re.search(r"\[\d+\]\{0:T\((\d+)\)", type_)
    if one_d is not None:
        return int(one_d.group(1))
    m = re.search(r":T\((\d+),", type_)
    return int(m.group(1)) if m else 1


def _dims(attr: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", attr or "")]
