"""``--scale-from-layers A B``: the truncated models a report compiles, and every compiled
figure extrapolated linearly from them to the model's depth."""

from __future__ import annotations

import dataclasses
from typing import Any

from sgl_jax.tools.aot.compile_step import Compiled
from sgl_jax.tools.aot.hlo.breakdown import scale_classes


def with_pattern(cfg: Any, pattern: tuple[bool, ...]) -> Any:
    """The config with ``len(pattern)`` decoder layers, layer i MoE iff ``pattern[i]``.
    Per-layer attention kinds (gpt-oss's sliding layers, Qwen3.5's linear-attention layers)
    keep the model's own order, cut to the slice's depth: with an even A and B, half of each
    gpt-oss slice slides; with A and B multiples of 4, each Qwen3.5 slice has the model's 3
    linear : 1 full mix."""
    n = len(pattern)
    return dataclasses.replace(cfg, num_hidden_layers=n, moe_layers=tuple(pattern),
                               sliding_layers=cfg.sliding_layers[:n],
                               linear_layers=cfg.linear_layers[:n])


def slice_patterns(cfg: Any, a: int, b: int) -> list[tuple[bool, ...]]:
    """The truncated models ``--scale-from-layers A B`` compiles. All layers of one kind: A and
    B of them. Dense and MoE layers (DeepSeek-V3's first 3, GLM-4.5's first, Qwen2-MoE's
    mlp_only_layers): A and B MoE layers, and one dense layer before A MoE layers, so that
    per-layer costs of both kinds are measured (a prefix of the model would have no MoE
    layer at all when it starts with dense layers)."""
    kinds = set(cfg.moe_layers)
    main = True in kinds
    patterns = [(main,) * a, (main,) * b]
    if len(kinds) > 1:
        patterns.append((not main,) + (main,) * a)
    return patterns


def describe_pattern(pattern: tuple[bool, ...]) -> str:
    moe = sum(pattern)
    dense = len(pattern) - moe
    parts = [f"{n} {what}" for n, what in ((dense, "dense"), (moe, "MoE")) if n]
    return " + ".join(parts) + " layers"


def extrapolate(points: list[tuple[tuple[bool, ...], Compiled]],
                target: tuple[bool, ...]) -> Compiled:
    """Every figure as ``base + n_moe * per_moe_layer (+ n_dense * per_dense_layer)``,
    solved exactly from the compiled slices (``slice_patterns``: 2 of them when the model
    has one kind of layer, 3 when it has both) and evaluated at the target's counts."""
    import numpy as np

    kinds = sorted(set(target))

    def row(pattern: tuple[bool, ...]) -> list[int]:
        return [1] + [sum(1 for x in pattern if x == k) for k in kinds]

    design = np.array([row(p) for p, _ in points], dtype=np.float64)
    at_target = np.array(row(target), dtype=np.float64)
    last = points[-1][1] if len(points) == 2 else points[1][1]

    def at(name: str) -> Any:
        values = [getattr(c, name) for _, c in points]
        if name == "code":  # program size grows sublinearly with depth: a bound
            return max(values)
        if name.startswith(("sampler", "native_counted")):  # independent of depth
            return getattr(last, name)
        if name == "seconds":
            return sum(values)
        if name == "breakdown":
            return extrapolated_breakdown(last.breakdown)
        return solve(values)

    def extrapolated_breakdown(keys: dict[str, float]) -> dict[str, float]:
        """Each class's unscaled estimate and its exact part extrapolated on their own (a
        depth-independent class such as the sampler stays what it is), then scaled as
        ``hlo.breakdown.scale_classes`` does so the classes sum to the extrapolated XLA
        total. (Extrapolating the scaled classes would not do: the
        scale differs a little between the compiles, and the extrapolation multiplies
        the difference of a constant class by the depth, even below zero.)"""
        if not keys:
            return {}
        out: dict[str, float] = {}
        for prop in ("flops", "bytes"):
            parts = {}
            for part in ("estimate", "exact"):
                prefix = f"{part}.{prop}."
                parts[part] = {k[len(prefix):]: solve([c.breakdown[k] for _, c in points])
                               for k in keys if k.startswith(prefix)}
                out.update({prefix + k: v for k, v in parts[part].items()})
            xla = solve([getattr(c, prop) for _, c in points])
            scaled, out[f"scale.{prop}"] = scale_classes(parts["estimate"],
                                                         parts["exact"], xla)
            out.update({f"{prop}.{k}": v for k, v in scaled.items()})
        return out

    def solve(values: list[float]) -> float:
        coef = np.linalg.solve(design, np.array(values, dtype=np.float64))
        return float(at_target @ coef)

    return Compiled(**{f.name: at(f.name) for f in dataclasses.fields(Compiled)})
