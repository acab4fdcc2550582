"""Pictures of expert load: a per-layer x expert utilisation heatmap and per-device load bars.

    python -m sgl_jax.tools.expert_load DUMP.npz --out load.png
    python -m sgl_jax.tools.expert_load DUMP.npz --out load.png --ep-size 4 --balanced
    python -m sgl_jax.tools.expert_load DUMP.npz --out load.png --mapping mapping.json

``DUMP.npz`` is a dump of the expert distribution recorder in any of its modes:

- ``stat``: ``counts [layers, num_experts]`` (tokens per layer and logical expert), used as is;
- ``per_pass``: ``counts [passes, layers, num_experts]``, summed over the passes;
- ``per_token``: ``topk_ids [tokens, layers, k]`` (-1 on layers without a router), counted
  per layer.

Metadata arrays (``mode``, ``moe_layers``, ``num_experts``, ``num_experts_per_tok``,
``architecture``) are used when present; without ``mode`` the layout is recognised by its
arrays, without ``moe_layers`` the layers that counted any token are taken as the MoE layers.

The heatmap shows, per MoE layer, the share of the layer's tokens that each expert received
(each token picks ``k`` experts, so a row sums to ``k`` and a uniform router gives ``k / E``
everywhere); layers without a router are drawn grey and labelled "dense". With ``--ep-size N``
(or ``--mapping``) a bar chart adds the tokens per device of the expert axis, summed over the
MoE layers, for the contiguous placement (device d holds experts ``d*E/N .. (d+1)*E/N - 1``)
and, with ``--balanced`` (``balanced_mapping`` of the per-expert totals) or ``--mapping``
(the ``--ep-expert-mapping`` syntax: inline JSON or a file), for that placement. The
imbalance ``max / mean`` tokens per device is printed on the chart and on stdout, for the
totals and as the mean over layers of each layer's own ``max / mean`` (a layer waits for its
busiest device).

matplotlib is optional (``pip install "sgl_jax[plot]"``): the arithmetic (:func:`load_dump`,
:func:`device_load`, :func:`imbalance`) needs numpy only, and importing this module imports
neither matplotlib nor JAX.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The heatmap lives with the server, which serves it; this tool adds dumps and placements.
from sgl_jax.srt.expert_load_plot import (  # noqa: F401  (render_expert_load_png: public here too)
    PLOT_EXTRA_HINT,
    PlotUnavailableError,
    draw_heatmap,
    figure_class,
    full_layers,
    png_bytes,
    render_expert_load_png,
    token_share,
)

MODES = ("stat", "per_pass", "per_token")


# ---- reading dumps ----------------------------------------------------------------------------


@dataclass
class ExpertLoad:
    """Tokens per (layer, logical expert) of a dump, whatever its mode.

    ``counts`` has one row per decoder layer ``0 .. num_layers - 1``; rows of layers not in
    ``moe_layers`` (no router) are zero.
    """

    counts: np.ndarray  # [num_layers, num_experts] int64
    moe_layers: list[int]
    mode: str
    num_experts_per_tok: int | None = None
    num_tokens: int | None = None
    architecture: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    def expert_totals(self) -> np.ndarray:
        """``[E]``: tokens per logical expert summed over the MoE layers."""
        return self.counts[self.moe_layers].sum(axis=0) if self.moe_layers else (
            np.zeros(self.num_experts, np.int64))


def _scalar(value: Any) -> Any:
    arr = np.asarray(value)
    if arr.dtype.kind in "US":
        return str(arr.reshape(-1)[0]) if arr.size else ""
    if arr.dtype == object:
        return arr.reshape(-1)[0] if arr.size else None
    return arr.reshape(-1)[0].item() if arr.size else None


def _bincount_topk(topk_ids: np.ndarray, num_experts: int | None) -> np.ndarray:
    ids = np.asarray(topk_ids)
    if ids.ndim == 2:  # [tokens, layers] with k = 1
        ids = ids[..., None]
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"topk_ids must be integer [tokens, layers, k]; got shape {ids.shape}, {ids.dtype}")
    if ids.dtype.kind == "u":  # unsigned tables mark "no router" with the dtype's maximum
        ids = np.where(ids == np.iinfo(ids.dtype).max, -1, ids.astype(np.int64))
    ids = ids.astype(np.int64)
    valid = ids[ids >= 0]
    if num_experts is None:
        num_experts = int(valid.max()) + 1 if valid.size else 1
    if valid.size and int(valid.max()) >= num_experts:
        raise ValueError(f"topk_ids holds expert {int(valid.max())} >= num_experts={num_experts}")
    out = np.zeros((ids.shape[1], num_experts), np.int64)
    for layer in range(ids.shape[1]):
        flat = ids[:, layer].reshape(-1)
        out[layer] = np.bincount(flat[flat >= 0], minlength=num_experts)
    return out


def load_dump(path: str) -> ExpertLoad:
    """Reads a recorder dump (``stat``, ``per_pass`` or ``per_token``) into an
    :class:`ExpertLoad`; a ValueError names what is wrong with a file that is not one."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npz expert distribution dump ({e})") from e
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: a single .npy array, not an .npz expert distribution dump")
    try:
        with loaded as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npz expert distribution dump ({e})") from e
    if not arrays:
        raise ValueError(f"{path}: empty .npz, not an expert distribution dump")
    try:
        return load_arrays(arrays)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def load_arrays(arrays: Mapping[str, Any]) -> ExpertLoad:
    """:func:`load_dump` on arrays already read (a dict of the ``.npz`` members)."""
    mode = _scalar(arrays["mode"]) if "mode" in arrays else None
    if mode is None:
        if "topk_ids" in arrays:
            mode = "per_token"
        elif "counts" in arrays:
            mode = "per_pass" if np.ndim(arrays["counts"]) == 3 else "stat"
        else:
            raise ValueError(
                f"no 'counts' or 'topk_ids' array (found {sorted(arrays)}): not an expert "
                "distribution dump")
    mode = str(mode)
    if mode not in MODES:
        raise ValueError(f"unknown dump mode {mode!r}; expected one of {', '.join(MODES)}")
    num_experts = _scalar(arrays["num_experts"]) if "num_experts" in arrays else None
    k = _scalar(arrays["num_experts_per_tok"]) if "num_experts_per_tok" in arrays else None
    moe_layers = ([int(i) for i in np.asarray(arrays["moe_layers"]).reshape(-1)]
                  if "moe_layers" in arrays else None)
    num_layers = next((_scalar(arrays[n]) for n in ("num_hidden_layers", "num_layers")
                       if n in arrays), None)
    arch = _scalar(arrays["architecture"]) if "architecture" in arrays else None
    num_tokens: int | None = None
    extra: dict[str, Any] = {}

    def need(name: str) -> np.ndarray:
        if name not in arrays:
            raise ValueError(f"a {mode} dump needs the array {name!r}; found {sorted(arrays)}")
        return np.asarray(arrays[name])

    if mode == "stat":
        counts = need("counts")
        if counts.ndim != 2:
            raise ValueError(f"stat counts must be [layers, num_experts]; got {counts.shape}")
        if "num_tokens" in arrays:
            num_tokens = int(np.asarray(arrays["num_tokens"]).sum())
        if "dropped" in arrays:
            extra["dropped"] = int(_scalar(arrays["dropped"]))
    elif mode == "per_pass":
        per_pass = need("counts")
        if per_pass.ndim != 3:
            raise ValueError(
                f"per_pass counts must be [passes, layers, num_experts]; got {per_pass.shape}")
        counts = per_pass.astype(np.int64).sum(axis=0)
        extra["num_passes"] = int(per_pass.shape[0])
        if "dropped" in arrays:
            extra["dropped"] = int(_scalar(arrays["dropped"]))
        if "num_tokens" in arrays:
            num_tokens = int(np.asarray(arrays["num_tokens"]).astype(np.int64).sum())
    else:
        topk = need("topk_ids")
        counts = _bincount_topk(topk, None if num_experts is None else int(num_experts))
        num_tokens = int(topk.shape[0])
        if "dropped" in arrays:
            extra["dropped"] = int(_scalar(arrays["dropped"]))
        if k is None and topk.ndim == 3:
            k = int(topk.shape[2])
        if moe_layers is None and topk.ndim == 3 and topk.shape[0]:
            marks = np.asarray(topk) < 0 if topk.dtype.kind == "i" else (
                np.asarray(topk) == np.iinfo(topk.dtype).max)
            moe_layers = [int(i) for i in np.flatnonzero(~marks.all(axis=(0, 2)))]
    if not np.issubdtype(counts.dtype, np.integer) and not np.issubdtype(
            counts.dtype, np.floating):
        raise ValueError(f"counts must be numbers; got dtype {counts.dtype}")
    if np.any(np.asarray(counts) < 0):
        raise ValueError("counts holds negative values")
    if num_experts is not None and counts.shape[1] != int(num_experts):
        raise ValueError(f"counts has {counts.shape[1]} experts; num_experts={num_experts}")
    full, moe = full_layers(counts, moe_layers, None if num_layers is None else int(num_layers))
    return ExpertLoad(
        counts=full, moe_layers=moe, mode=mode,
        num_experts_per_tok=None if k is None else int(k), num_tokens=num_tokens,
        architecture=None if arch is None else str(arch), extra=extra,
    )


# ---- per-device load --------------------------------------------------------------------------


def contiguous_table(num_experts: int, ep_size: int) -> np.ndarray:
    """``[ep_size, E / ep_size]``: device d holds experts ``d*E/N .. (d+1)*E/N - 1``."""
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide num_experts={num_experts}")
    return np.arange(num_experts, dtype=np.int64).reshape(ep_size, -1)


def _table_for(mapping: Any, layer: int) -> np.ndarray:
    if hasattr(mapping, "for_layer"):  # placement.ExpertPlacement
        return np.asarray(mapping.for_layer(layer))
    if isinstance(mapping, Mapping):
        return np.asarray(mapping.get(layer, mapping.get("default")))
    return np.asarray(mapping)


def device_load(counts: np.ndarray, mapping: Any) -> np.ndarray:
    """Tokens per device of the expert axis, per layer.

    ``counts``: ``[layers, E]`` (or ``[E]``: one layer) tokens per logical expert.
    ``mapping``: one table ``[ep_size, E / ep_size]`` of logical expert ids (row d: the
    experts of device d) for every layer, a dict ``{layer: table, "default": table}``, or an
    ``placement.ExpertPlacement``. Returns ``[layers, ep_size]`` (``[ep_size]`` for ``[E]``
    counts): ``load[l, d] = sum(counts[l, table_l[d]])``.
    """
    counts = np.asarray(counts)
    one = counts.ndim == 1
    counts2 = counts[None] if one else counts
    if counts2.ndim != 2:
        raise ValueError(f"counts must be [layers, E] or [E]; got shape {counts.shape}")
    num_experts = counts2.shape[1]
    rows = []
    for layer in range(counts2.shape[0]):
        table = _table_for(mapping, layer)
        if table.ndim != 2 or table.size != num_experts or not np.array_equal(
                np.sort(table.reshape(-1)), np.arange(num_experts)):
            raise ValueError(
                f"the mapping of layer {layer} (shape {table.shape}) must place each of the "
                f"{num_experts} experts exactly once as [ep_size, num_experts / ep_size]")
        rows.append(counts2[layer][table].sum(axis=1))
    out = np.stack(rows)
    return out[0] if one else out


def imbalance(load: np.ndarray) -> float:
    """``max / mean`` of per-device loads ``[ep_size]`` (1.0: perfectly even; ``ep_size``: all
    on one device). A load of all zeros counts as even (1.0)."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean()
    return float(load.max() / mean) if mean > 0 else 1.0


@dataclass
class PlacementLoad:
    """Per-device load of one placement over the MoE layers of a dump."""

    name: str
    table: Any
    per_layer: np.ndarray  # [num_moe_layers, ep_size]
    total: np.ndarray  # [ep_size]: summed over the MoE layers
    imbalance: float  # max / mean of ``total``
    mean_layer_imbalance: float  # mean over layers of each layer's max / mean
    max_layer_imbalance: float


def placement_load(counts: np.ndarray, moe_layers: Sequence[int], mapping: Any,
                   name: str = "") -> PlacementLoad:
    """:func:`device_load` and :func:`imbalance` of ``mapping`` over the MoE layers: the
    totals and the per-layer figures (layers that received no token are left out of those)."""
    counts = np.asarray(counts)
    layers = list(moe_layers)
    full = device_load(counts, mapping)  # [all layers, ep_size]; the mapping is per layer id
    per_layer = full[layers] if layers else np.zeros((0, full.shape[1]), full.dtype)
    total = per_layer.sum(axis=0)
    busy = [imbalance(row) for row in per_layer if row.sum() > 0]
    return PlacementLoad(
        name=name, table=mapping, per_layer=per_layer, total=total, imbalance=imbalance(total),
        mean_layer_imbalance=float(np.mean(busy)) if busy else 1.0,
        max_layer_imbalance=float(np.max(busy)) if busy else 1.0,
    )


def describe(p: PlacementLoad) -> str:
    return (f"{p.name}: tokens per device {p.total.tolist()}, max/mean {p.imbalance:.3f} "
            f"(per layer: mean {p.mean_layer_imbalance:.3f}, worst {p.max_layer_imbalance:.3f})")


# ---- drawing ------------------------------------------------------------------------------------


def _draw_bars(ax, placements: Sequence[PlacementLoad]) -> None:
    ep_size = placements[0].total.size
    width = 0.8 / len(placements)
    x = np.arange(ep_size)
    colours = ["#d95f02", "#1b9e77", "#7570b3"]
    for i, p in enumerate(placements):
        label = (f"{p.name}: max/mean {p.imbalance:.2f} "
                 f"(per layer: mean {p.mean_layer_imbalance:.2f}, worst "
                 f"{p.max_layer_imbalance:.2f})")
        ax.bar(x + (i - (len(placements) - 1) / 2) * width, p.total, width,
               label=label, color=colours[i % len(colours)])
    mean = placements[0].total.mean()
    ax.axhline(mean, color="black", linestyle="--", linewidth=0.8)
    ax.text(ep_size - 0.5, mean, " mean", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels([f"device {d}" for d in range(ep_size)], fontsize=8)
    ax.set_ylabel("tokens (summed over MoE layers)")
    ax.set_title(f"load per device of the expert axis (ep_size={ep_size})", fontsize=11)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1,
              frameon=False)
    ax.set_ylim(0, max(float(p.total.max()) for p in placements) * 1.08 or 1)


def _draw_layer_imbalance(ax, placements: Sequence[PlacementLoad],
                          moe_layers: Sequence[int]) -> None:
    colours = ["#d95f02", "#1b9e77", "#7570b3"]
    for i, p in enumerate(placements):
        ratios = [imbalance(row) for row in p.per_layer]
        ax.plot(list(moe_layers), ratios, marker="o" if len(moe_layers) <= 16 else None,
                markersize=3, linewidth=1.6, color=colours[i % len(colours)], label=p.name)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=0.8, zorder=0)
    ax.set_xlabel("decoder layer (MoE layers)")
    ax.set_ylabel("max / mean")
    ax.set_title("per-layer imbalance: tokens of the busiest device / mean over devices",
                 fontsize=11)
    ax.legend(fontsize=8, loc="upper right", ncol=len(placements))
    top = max(p.max_layer_imbalance for p in placements)
    ax.set_ylim(0.9, max(1.1, top * 1.15))


def render_figure(load: ExpertLoad, title: str, placements: Sequence[PlacementLoad] = (),
                  dpi: int = 100) -> bytes:
    """PNG bytes of the heatmap, and under it the per-device bars of ``placements``."""
    figure = figure_class()
    if placements:
        fig = figure(figsize=(10, 11.5), layout="constrained")
        ax, bx, cx = fig.subplots(3, 1, height_ratios=[2.2, 1, 0.75])
    else:
        fig = figure(figsize=(10, 6), layout="constrained")
        ax = fig.subplots()
    draw_heatmap(fig, ax, load.counts, load.moe_layers, load.num_experts_per_tok, title)
    if placements:
        _draw_bars(bx, placements)
        _draw_layer_imbalance(cx, placements, load.moe_layers)
    return png_bytes(fig, dpi)


# ---- CLI ----------------------------------------------------------------------------------------


def _title(path: str, load: ExpertLoad) -> str:
    import os

    parts = [os.path.basename(path), f"{load.mode} dump"]
    if load.architecture:
        parts.append(load.architecture)
    parts.append(f"{len(load.moe_layers)} MoE layers x {load.num_experts} experts"
                 + (f", top-{load.num_experts_per_tok}" if load.num_experts_per_tok else ""))
    if load.num_tokens is not None:
        parts.append(f"{load.num_tokens} tokens")
    if load.extra.get("num_passes") is not None:
        parts.append(f"{load.extra['num_passes']} passes")
    if load.extra.get("dropped"):
        parts.append(f"{load.extra['dropped']} dropped")
    return "expert utilisation: " + ", ".join(parts)


BALANCED_KINDS = ("total", "per-layer", "both")


def balanced_placements(load: ExpertLoad, ep_size: int, kind: str = "total") -> list[tuple]:
    """``(name, mapping)`` of the balanced placements ``kind`` asks for: ``total``: one table
    for every layer, ``balanced_mapping`` of the per-expert totals; ``per-layer``: an
    ``ExpertPlacement`` with each MoE layer's own ``balanced_mapping`` of its counts."""
    from sgl_jax.srt.layers.moe.balancing import balanced_mapping
    from sgl_jax.srt.layers.moe.placement import ExpertPlacement

    if kind not in BALANCED_KINDS:
        raise ValueError(f"balanced={kind!r}; use one of {', '.join(BALANCED_KINDS)}")
    out: list[tuple] = []
    if kind in ("total", "both"):
        out.append(("balanced (totals)" if kind == "both" else "balanced",
                    balanced_mapping(load.expert_totals(), ep_size)))
    if kind in ("per-layer", "both"):
        per_layer = {i: balanced_mapping(load.counts[i], ep_size) for i in load.moe_layers}
        out.append(("balanced per layer",
                    ExpertPlacement(contiguous_table(load.num_experts, ep_size), per_layer)))
    return out


def placements_for(load: ExpertLoad, ep_size: int | None, mapping: str | None,
                   balanced: bool | str) -> list[PlacementLoad]:
    """The contiguous placement and (``balanced``: True or one of ``BALANCED_KINDS`` /
    ``mapping``) the other one(s), measured."""
    others: list[tuple] = []
    if mapping is not None:
        from sgl_jax.srt.layers.moe.placement import ExpertPlacement

        parsed = ExpertPlacement.parse(mapping)
        if ep_size is not None and parsed.ep_size != ep_size:
            raise ValueError(f"--mapping places experts on {parsed.ep_size} devices; "
                             f"--ep-size is {ep_size}")
        if parsed.num_experts != load.num_experts:
            raise ValueError(f"--mapping places {parsed.num_experts} experts; the dump has "
                             f"{load.num_experts}")
        ep_size = parsed.ep_size
        others = [("mapping", parsed)]
    if ep_size is None:
        if balanced:
            raise ValueError("--balanced needs --ep-size")
        return []
    before = placement_load(load.counts, load.moe_layers,
                            contiguous_table(load.num_experts, ep_size), "contiguous")
    out = [before]
    if balanced:
        others = balanced_placements(load, ep_size, "total" if balanced is True else balanced)
    out += [placement_load(load.counts, load.moe_layers, m, name) for name, m in others]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sgl_jax.tools.expert_load",
        description="Draw an expert distribution dump: a per-layer x expert utilisation "
        "heatmap and (with --ep-size or --mapping) the tokens per device of the expert axis "
        "before/after a placement. Needs matplotlib: " + PLOT_EXTRA_HINT)
    ap.add_argument("dump", help="a recorder dump .npz (stat, per_pass or per_token mode)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--ep-size", type=int, default=None,
                    help="devices of the expert axis: adds the per-device load bars")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--mapping", default=None,
                       help="the AFTER placement: a device-expert mapping, inline JSON or a "
                       "file (the --ep-expert-mapping syntax)")
    group.add_argument("--balanced", nargs="?", const="total", default=None,
                       choices=BALANCED_KINDS,
                       help="the AFTER placement: balanced_mapping of the per-expert totals "
                       "(total, the default: one table for every layer), of each layer's "
                       "counts (per-layer), or both side by side")
    ap.add_argument("--save-mapping", default=None,
                    help="write the (last) AFTER placement as --ep-expert-mapping JSON")
    ap.add_argument("--title", default=None)
    ap.add_argument("--dpi", type=int, default=100)
    args = ap.parse_args(argv)
    try:
        load = load_dump(args.dump)
        placements = placements_for(load, args.ep_size, args.mapping, args.balanced or False)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in placements:
        print(describe(p))
    if len(placements) >= 2:
        after = placements[-1]
        if isinstance(after.table, np.ndarray):
            print(f"{after.name} placement (rows: devices): " + _table_json(after.table))
        if args.save_mapping:
            with open(args.save_mapping, "w", encoding="utf-8") as f:
                f.write(_table_json(after.table, as_mapping=True))
            print(f"wrote the {after.name} placement to {args.save_mapping}")
    try:
        png = render_figure(load, args.title or _title(args.dump, load), placements, args.dpi)
    except PlotUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    with open(args.out, "wb") as f:
        f.write(png)
    print(f"wrote {args.out} ({len(png)} bytes)")
    return 0


def _table_json(table: Any, as_mapping: bool = False) -> str:
    import json

    if hasattr(table, "to_json"):
        return table.to_json()
    rows = np.asarray(table).tolist()
    return json.dumps({"default": rows} if as_mapping else rows, separators=(",", ":"))


if __name__ == "__main__":
    sys.exit(main())
