"""The expert-load heatmap the server draws (``GET /expert_load.png``), and the pieces the
``sgl_jax.tools.expert_load`` pictures share with it.

The heatmap shows, per MoE layer, the share of the layer's tokens each expert received (each
token picks ``k`` experts, so a row sums to ``k`` and a uniform router gives ``k / E``
everywhere); layers without a router are drawn grey and labelled "dense".

matplotlib is optional (``pip install "sgl_jax[plot]"``): importing this module imports
neither matplotlib nor JAX; drawing without it raises :class:`PlotUnavailableError`. Figures
are made without pyplot and saved by the Agg canvas (no display, no global backend switch,
safe from several threads: the HTTP server draws in worker threads).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

PLOT_EXTRA_HINT = 'pip install "sgl_jax[plot]"'


class PlotUnavailableError(ImportError):
    """matplotlib is not installed: the pictures need the ``plot`` extra."""


def figure_class():
    """matplotlib's ``Figure`` (used without pyplot), or a clear error."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailableError(
            f"drawing expert load needs matplotlib, which is not installed: {PLOT_EXTRA_HINT} "
            '(or pip install "matplotlib>=3.7")'
        ) from e
    del matplotlib
    return Figure


def full_layers(counts: np.ndarray, moe_layers: Sequence[int] | None,
                num_layers: int | None = None) -> tuple[np.ndarray, list[int]]:
    """``counts`` with one row per decoder layer (rows of ``counts`` may be the MoE layers
    only, in ``moe_layers`` order) and the sorted MoE layer ids."""
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise ValueError(f"counts must be [layers, num_experts]; got shape {counts.shape}")
    counts = counts.astype(np.int64)
    if moe_layers is None:
        moe = [int(i) for i in np.flatnonzero(counts.sum(axis=1) > 0)]
        return counts, moe
    moe = [int(i) for i in moe_layers]
    if any(i < 0 for i in moe) or len(set(moe)) != len(moe):
        raise ValueError(f"moe_layers {moe[:8]} holds a negative or repeated layer id")
    rows = counts.shape[0]
    if num_layers is not None and moe and max(moe) >= num_layers:
        raise ValueError(f"moe_layers reach layer {max(moe)}; num_hidden_layers={num_layers}")
    if rows == num_layers or (num_layers is None and not (moe and max(moe) >= rows) and (
            rows != len(moe) or moe == list(range(rows)))):
        return counts, sorted(moe)  # one row per decoder layer
    if len(moe) != rows:
        raise ValueError(
            f"counts has {rows} rows; moe_layers has {len(moe)} (up to layer "
            f"{max(moe) if moe else None}) and num_hidden_layers is {num_layers}: rows must be "
            "every decoder layer or exactly the MoE layers")
    # rows are the MoE layers, in moe_layers order (the recorder's layout)
    full = np.zeros((max(num_layers or 0, max(moe) + 1 if moe else 0), counts.shape[1]),
                    np.int64)
    full[moe] = counts
    return full, sorted(moe)


def token_share(counts: np.ndarray, num_experts_per_tok: int | None = None) -> np.ndarray:
    """Per row: the share of the layer's tokens each expert received (``counts * k / sum``: a
    row sums to k), or with ``k`` unknown the share of the layer's routed (token, expert)
    pairs (a row sums to 1). Rows without tokens are NaN."""
    counts = np.asarray(counts, dtype=np.float64)
    sums = counts.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = counts / sums
    share[sums[:, 0] == 0] = np.nan
    return share * (num_experts_per_tok or 1)


def draw_heatmap(fig, ax, counts: np.ndarray, moe_layers: Sequence[int],
                 num_experts_per_tok: int | None, title: str) -> None:
    import matplotlib as mpl

    moe = list(moe_layers)  # counts: one row per decoder layer
    num_layers, num_experts = counts.shape
    share = token_share(counts, num_experts_per_tok)
    dense = [i for i in range(num_layers) if i not in set(moe)]
    share[dense] = np.nan
    cmap = mpl.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    img = ax.imshow(share * 100, aspect="auto", interpolation="nearest", cmap=cmap,
                    origin="upper", vmin=0)
    ax.set_xlabel(f"logical expert (0 .. {num_experts - 1})")
    ax.set_ylabel("decoder layer")
    ax.set_title(title, fontsize=11)
    step = max(1, int(np.ceil(num_layers / 24)))
    ticks = list(range(0, num_layers, step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{i} dense" if i in dense else str(i) for i in ticks], fontsize=8)
    xstep = max(1, int(np.ceil(num_experts / 32)))
    ax.set_xticks(list(range(0, num_experts, xstep)))
    ax.tick_params(axis="x", labelsize=8)
    k = num_experts_per_tok
    uniform = (k or 1) / num_experts * 100
    what = ("% of the layer's tokens routed to the expert" if k else
            "% of the layer's routed (token, expert) pairs")
    bar = fig.colorbar(img, ax=ax, pad=0.01)
    bar.set_label(f"{what}\n(uniform: {uniform:.2f}%)", fontsize=9)
    if dense:
        ax.text(1.0, -0.09 if num_layers else 0, f"grey rows: {len(dense)} dense layer(s), "
                "no router", transform=ax.transAxes, ha="right", va="top", fontsize=8,
                color="#555555")


def png_bytes(fig, dpi: int) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def render_expert_load_png(counts: np.ndarray, moe_layers: list[int], title: str,
                           num_experts_per_tok: int | None = None, dpi: int = 100,
                           num_layers: int | None = None) -> bytes:
    """PNG bytes of the utilisation heatmap alone (what ``GET /expert_load.png`` serves).

    ``counts``: ``[layers, E]`` tokens per layer and logical expert (rows: every decoder
    layer, or exactly the ``moe_layers`` in that order, as the recorder keeps them);
    ``num_experts_per_tok`` turns shares of routed pairs into shares of tokens;
    ``num_layers`` (num_hidden_layers) places MoE-only rows exactly. Raises
    :class:`PlotUnavailableError` without matplotlib."""
    full, moe = full_layers(counts, moe_layers, num_layers)
    fig = figure_class()(figsize=(10, 6), layout="constrained")
    ax = fig.subplots()
    draw_heatmap(fig, ax, full, moe, num_experts_per_tok, title)
    return png_bytes(fig, dpi)
