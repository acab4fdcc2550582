"""A picture of which experts a checkpoint uses for which kind of text.

    python -m sgl_jax.tools.expert_specialisation --out docs/images/trained_expert_load.png
        [--model PATH] [--window 128]

The training text of the bundled model (``train_tiny.corpus_text``) is cut into windows and run
through the float64 reference forward (independent of the engine). Every token is labelled by
the line it comes from: ``code`` (indented lines, Python, shell and JSON), ``numbers`` (lines
that are mostly digits: tables, tide outputs) or ``prose``. The figure has one heatmap per
label and one for all tokens: per MoE layer, the share of the label's tokens routed to each
expert (a row sums to k; uniform is k / E). Over all tokens a balanced router is flat; a router
that specialises shows different hot experts for different kinds of text.

Needs the ``plot`` extra (matplotlib), like ``expert_load``; its share arithmetic is
``sgl_jax.srt.expert_load_plot.token_share``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH
from sgl_jax.srt.expert_load_plot import PLOT_EXTRA_HINT, PlotUnavailableError, token_share
from sgl_jax.tools.reference_forward import ReferenceModel

KINDS = ("prose", "code", "numbers")
_CODE = re.compile(r"^(    |def |import |for |print|\$ |>>> |[{}\[\]]|  \")")


def line_kind(line: str) -> str:
    if _CODE.match(line):
        return "code"
    visible = [c for c in line if not c.isspace()]
    digits = sum(c.isdigit() for c in visible)
    return "numbers" if visible and digits / len(visible) >= 0.3 else "prose"


def char_kinds(text: str) -> np.ndarray:
    """The kind index (into KINDS) of every character, by its line."""
    out = np.empty(len(text), dtype=np.int8)
    pos = 0
    for line in text.splitlines(keepends=True):
        out[pos:pos + len(line)] = KINDS.index(line_kind(line))
        pos += len(line)
    return out


def count_by_kind(model_path: str, text: str, window: int = 128) -> tuple[np.ndarray, int]:
    """([kinds + 1, layers, experts] picks per kind, the last row all tokens; k)."""
    tok = Tokenizer.from_file(f"{model_path}/tokenizer.json")
    ref = ReferenceModel(model_path)
    enc = tok.encode(text)
    kinds = char_kinds(text)[[start for start, _ in enc.offsets]]
    ids = np.asarray(enc.ids)
    counts = np.zeros((len(KINDS) + 1, ref.num_layers, ref.num_experts), dtype=np.int64)
    for start in range(0, len(ids), window):
        topk = ref.forward(ids[start:start + window].tolist()).topk_ids  # [T, L, k]
        for t, kind in enumerate(kinds[start:start + window]):
            for layer in range(ref.num_layers):
                counts[kind, layer, topk[t, layer]] += 1
                counts[-1, layer, topk[t, layer]] += 1
    return counts, ref.top_k


def render(counts: np.ndarray, top_k: int, title: str, dpi: int = 110) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailableError(f"the picture needs matplotlib: {PLOT_EXTRA_HINT}") from e
    import io

    labels = ("all tokens", *KINDS)
    panels = [counts[-1], *counts[:-1]]
    shares = [token_share(c, top_k) * 100 for c in panels]
    vmax = max(float(np.nanmax(s)) for s in shares)
    fig = Figure(figsize=(12, 7.2), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, share, label, c in zip(axes, shares, labels, panels, strict=True):
        img = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis",
                        vmin=0, vmax=vmax)
        tokens = int(c[0].sum()) // top_k
        ax.set_title(f"{label}: {tokens} tokens", fontsize=10, loc="left")
        ax.set_ylabel("layer")
        ax.set_yticks(range(share.shape[0]))
    axes[-1].set_xlabel(f"expert (0 .. {panels[0].shape[1] - 1})")
    axes[-1].set_xticks(range(panels[0].shape[1]))
    bar = fig.colorbar(img, ax=list(axes), pad=0.01, shrink=0.9)
    uniform = top_k / panels[0].shape[1] * 100
    bar.set_label(f"% of the tokens routed to the expert (uniform: {uniform:.2f}%)")
    fig.suptitle(title, fontsize=11)
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def main(argv: Sequence[str] | None = None) -> None:
    from sgl_jax.tools.train_tiny import corpus_text  # the text the bundled model learnt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=BUNDLED_MODEL_PATH)
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--window", type=int, default=128)
    args = p.parse_args(argv)
    counts, top_k = count_by_kind(args.model, corpus_text(), args.window)
    title = ("expert utilisation of the trained tiny Qwen3-MoE on its training text, by kind "
             "of line (float64 reference forward)")
    with open(args.out, "wb") as f:
        f.write(render(counts, top_k, title))
    share = token_share(counts[-1], top_k) * 100
    print(f"wrote {args.out}; all tokens: min {share.min():.2f}% max {share.max():.2f}% "
          f"per (layer, expert)")


if __name__ == "__main__":
    main()
