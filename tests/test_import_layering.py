"""Imports point down only: no import cycle among ``sgl_jax``'s modules, and no module imports
one of a higher layer (``LAYERS``, bottom up).

The graph is read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` of every module, at module level or inside a function (a lazy import is
still a dependency), resolved to the ``sgl_jax`` module it names (``from pkg import name`` is
``pkg.name`` when that is a module, else ``pkg``). Imports under ``if TYPE_CHECKING:`` are left
out: they never run, so they can close no cycle at run time. Importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``; those implicit edges are not counted (a package's
``__init__`` that re-exports its submodules would otherwise look like a cycle with each of
them).

A new module needs a place in ``LAYERS`` (the test says so); a new edge that climbs, or closes
a cycle, fails with the chain and the lines that make it.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sgl_jax"

# Bottom up: a module may import modules of its own layer or of a lower one, never of a higher
# one. An entry names a module or a package (then it covers everything under it, unless a
# longer entry names the submodule; ONLY_ITSELF below). Within one layer, order is not checked; the cycle check
# still applies.
LAYERS: list[tuple[str, ...]] = [
    # Leaves: import nothing of sgl_jax (srt's __init__ is empty).
    ("srt", "srt.bounded_text", "srt.private_files", "srt.sglang_fields", "srt.routed_experts_codec",
     "srt.expert_load_plot", "srt.tokenizer"),
    # What a model, a request and its outputs are (ModelConfig.from_hf, SamplingParams,
    # the routed-experts payload), and the observer of finished requests.
    ("srt.configs", "srt.sampling", "srt.routed_experts_output", "srt.metrics"),
    # The engine's options and the device layout they ask for.
    ("srt.server_args", "srt.server_args_checks", "srt.distributed"),
    # Process helpers; the batch as every layer above sees it (the leaf of the step's data).
    ("srt.utils", "srt.forward_batch_info"),
    # Host memory: request and KV slots, the prefix tree, the routed-experts host table.
    ("srt.mem_cache",),
    # Constrained decoding (llguidance): grammars and the scheduler's matchers.
    ("srt.constrained",),
    # Building blocks of a model: attention, MoE, norms, rotary, the sampler.
    ("srt.layers",),
    # The model families, built from layers (registry: HF architecture -> class).
    ("srt.models",),
    # Checkpoints -> parameters of a model.
    ("srt.model_loader",),
    # Draft models (EAGLE, NEXTN), drafts (NGRAM) and the acceptance rule: used by the runner
    # (draft heads inside the step) and by the scheduler (through an interface, not its batch).
    ("srt.speculative",),
    # The jitted step and the device state it owns (ModelRunner).
    ("srt.model_executor",),
    # The processes' logic: scheduler, tokenizer manager, detokenizer, their messages.
    ("srt.managers",),
    # What a user starts: Engine, the HTTP server, child processes.
    ("srt.entrypoints",),
    # Offline tools (random checkpoints, references, AOT reports): users of srt, never used by it.
    ("tools",),
    # Adapters for other frameworks, test helpers and the server's command line.
    ("integrations", "testing", "launch_server"),
    # The package itself: ``from sgl_jax import Engine`` (lazy).
    ("",),
]

# Entries naming a package's __init__ alone, not the modules under it: the root and srt cover
# their own __init__ only, so a module missing from LAYERS is reported, not silently placed.
ONLY_ITSELF = {"", "srt"}

# Upward edges known today and being removed elsewhere: (importer, imported). Each must still
# exist (the test says when one is gone: delete it here then).


def _qualified(entry: str) -> str:
    return f"{PACKAGE}.{entry}" if entry else PACKAGE


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class ModuleGraph:
    """The modules of the package under ``root`` and the imports between them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # dotted name -> (file, whether it is a package's __init__)
        self.modules: dict[str, tuple[Path, bool]] = {}
        for path in sorted((root / PACKAGE).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            self.modules[".".join(parts)] = (path, is_package)
        # module -> {imported module: the first line that imports it}
        self.edges: dict[str, dict[str, int]] = {}
        for name in self.modules:
            targets: dict[str, int] = {}
            for imported, line in self._imported_names(name):
                parts = imported.split(".")
                while parts and ".".join(parts) not in self.modules:  # a name in a module
                    parts.pop()
                target = ".".join(parts)
                if target and target != name:
                    targets.setdefault(target, line)
            self.edges[name] = targets

    def _imported_names(self, name: str) -> list[tuple[str, int]]:
        """(dotted name, line) of every import of module ``name`` that runs (TYPE_CHECKING
        ones left out), relative imports made absolute."""
        path, is_package = self.modules[name]
        package = (name if is_package else name.rpartition(".")[0]).split(".")
        found: list[tuple[str, int]] = []

        def visit(node: ast.AST) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.orelse:
                    visit(child)
                return
            if isinstance(node, ast.Import):
                found.extend((alias.name, node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    found.append((sub if sub in self.modules else source, node.lineno))
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(path.read_text(), filename=str(path)))
        return found

    def where(self, module: str, line: int) -> str:
        return f"{self.modules[module][0].relative_to(self.root)}:{line}"

    def cycles(self) -> list[list[str]]:
        """The strongly connected components of more than one module (Tarjan, iterative)."""
        edges = self.edges
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        out: list[list[str]] = []

        def enter(node: str) -> None:
            index[node] = low[node] = len(index)
            stack.append(node)
            on_stack.add(node)

        for start in edges:
            if start in index:
                continue
            enter(start)
            work = [(start, iter(edges[start]))]
            while work:
                node, children = work[-1]
                child = next(children, None)
                if child is not None:
                    if child not in index:
                        enter(child)
                        work.append((child, iter(edges[child])))
                    elif child in on_stack:
                        low[node] = min(low[node], index[child])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        out.append(sorted(component))
        return out

    def shortest_cycle(self, component: list[str]) -> list[str]:
        """A shortest cycle through the component's first module: modules from it back to it."""
        start, inside = component[0], set(component)
        parent: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for child in self.edges[node]:
                if child == start:
                    path = [node]
                    while (up := parent[path[-1]]) is not None:
                        path.append(up)
                    return [*reversed(path), start]
                if child in inside and child not in parent:
                    parent[child] = node
                    queue.append(child)
        raise AssertionError(f"no cycle through {start}")

    def describe(self, chain: list[str]) -> str:
        return "\n    ".join(f"{a} -> {b} ({self.where(a, self.edges[a][b])})"
                              for a, b in itertools.pairwise(chain))


@cache
def package_graph() -> ModuleGraph:
    return ModuleGraph(ROOT)


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest entry covering ``module``."""
    best, best_len = None, -1
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            full = _qualified(entry)
            covers = module == full or (entry not in ONLY_ITSELF
                                        and module.startswith(full + "."))
            if covers and len(full) > best_len:
                best, best_len = index, len(full)
    return best


def _layer_name(index: int) -> str:
    return " / ".join(e or PACKAGE for e in LAYERS[index])


def upward_edges(g: ModuleGraph) -> list[tuple[str, str, int, int, int]]:
    """(importer, imported, line, importer's layer, imported's layer) of each edge that climbs."""
    out = []
    for module, targets in g.edges.items():
        for target, line in targets.items():
            mine, theirs = layer_of(module), layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                out.append((module, target, line, mine, theirs))
    return sorted(out)


def test_every_module_has_a_layer_and_every_entry_a_module() -> None:
    g = package_graph()
    unplaced = sorted(m for m in g.modules if layer_of(m) is None)
    assert not unplaced, f"modules with no place in LAYERS (add each where it belongs): {unplaced}"
    stale = [e for entries in LAYERS for e in entries if _qualified(e) not in g.modules
             and not any(m.startswith(_qualified(e) + ".") for m in g.modules)]
    assert not stale, f"LAYERS entries that name no module: {stale}"


def test_no_import_cycles() -> None:
    g = package_graph()
    report = [f"{', '.join(c)} import each other, e.g.:\n    {g.describe(g.shortest_cycle(c))}"
              for c in g.cycles()]
    assert not report, "import cycles:\n  " + "\n  ".join(report)


def test_imports_point_down() -> None:
    g = package_graph()
    found = upward_edges(g)
    report = [f"{g.where(m, line)}: {m} (layer {mine}: {_layer_name(mine)}) imports {t} "
              f"(layer {theirs}: {_layer_name(theirs)})"
              for m, t, line, mine, theirs in found]
    assert not report, "imports that climb:\n  " + "\n  ".join(report)


def test_the_checker_on_a_made_up_package(tmp_path: Path) -> None:
    """Lazy imports count, TYPE_CHECKING ones do not, relative imports resolve, ``from pkg
    import module`` names the module, and a cycle comes out as its chain."""
    files = {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sgl_jax import c\n"
                "def f():\n    from . import b\n",
        "b.py": "import sgl_jax.pkg.d as d\n",
        "c.py": "from sgl_jax.a import f\n",
        "pkg/__init__.py": "",
        "pkg/d.py": "from ..a import f\nfrom sgl_jax.pkg import e\n",
        "pkg/e.py": "import numpy\nx = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / rel).write_text(text)
    g = ModuleGraph(tmp_path)
    assert g.edges == {
        "sgl_jax": {}, "sgl_jax.a": {"sgl_jax.b": 5}, "sgl_jax.b": {"sgl_jax.pkg.d": 1},
        "sgl_jax.c": {"sgl_jax.a": 1}, "sgl_jax.pkg": {},
        "sgl_jax.pkg.d": {"sgl_jax.a": 1, "sgl_jax.pkg.e": 2}, "sgl_jax.pkg.e": {},
    }
    assert g.cycles() == [["sgl_jax.a", "sgl_jax.b", "sgl_jax.pkg.d"]]
    chain = g.shortest_cycle(["sgl_jax.a", "sgl_jax.b", "sgl_jax.pkg.d"])
    assert chain == ["sgl_jax.a", "sgl_jax.b", "sgl_jax.pkg.d", "sgl_jax.a"]
    assert g.describe(chain).splitlines()[0] == "sgl_jax.a -> sgl_jax.b (sgl_jax/a.py:5)"
