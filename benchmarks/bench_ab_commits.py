"""A/B of two commits with the same benchmark, interleaved in one run (this machine is noisy).

Exports ``--base`` (a git revision) into a temporary directory, then runs this tree's copy of a
benchmark script in turn against each tree's ``sgl_jax`` (base, head, base, head, ...: the
tree first on PYTHONPATH), and parses the markdown table each run prints. The script must
only use options both trees accept. For every table row it prints the
median of every numeric cell for base and head, and head/base.

    python benchmarks/bench_ab_commits.py --base c6db0ee --rounds 3 -- \\
        benchmarks/bench_offline_throughput.py --num-prompts 64 --concurrency 32
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from bench_utils import machine_description, markdown_table, median  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def export_tree(rev: str, into: str) -> None:
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)


def run(tree: str, script_args: list[str]) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": tree}
    script = [os.path.join(REPO, script_args[0]), *script_args[1:]]
    out = subprocess.run([sys.executable, *script], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout
    rows: dict[str, list[float]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 1 and not set(cells[1]) <= set("-"):
            values = [float(c) for c in cells[1:] if _NUMBER.match(c)]
            if values:
                rows[cells[0]] = values
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="git revision to compare HEAD's work tree with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- benchmark script and its args")
    args = p.parse_args()
    script = [a for a in args.script if a != "--"]
    results: dict[str, list[dict[str, list[float]]]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="sgl_jax_base_") as base_tree:
        export_tree(args.base, base_tree)
        for _ in range(args.rounds):
            for name, tree in (("base", base_tree), ("head", REPO)):
                results[name].append(run(tree, script))
    table = []
    for key in results["head"][0]:
        if key not in results["base"][0]:
            continue
        width = min(len(results["base"][0][key]), len(results["head"][0][key]))
        for i in range(width):
            b = median([r[key][i] for r in results["base"]])
            h = median([r[key][i] for r in results["head"]])
            table.append([key, i + 1, b, h, h / b if b else float("nan")])
    print(f"\n### A/B: base {args.base} vs head, `{' '.join(script)}`\n")
    print(f"{machine_description()}; median of {args.rounds} interleaved rounds\n")
    print(markdown_table(["row", "numeric cell", "base", "head", "head/base"], table))


if __name__ == "__main__":
    main()
