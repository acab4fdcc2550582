"""The compute backends a model's forward is traced with, chosen once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_jax.srt.layers.attention import AttentionBackend


@dataclass(frozen=True)
class ModelBackends:
    attention: AttentionBackend  # --attention-backend
    moe: str  # --moe-backend, resolved: "dense" or "ragged"
