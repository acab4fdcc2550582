"""The device state of a model with linear-attention (Gated DeltaNet) layers: the step's
``kv_caches`` list holds, per layer, the paged KV array of a full-attention layer or the pair of
state tables of a linear layer (``models/gated_deltanet.py``):

* conv, in the model dtype, in three parts: q ``[S + 1, Hk dk, K - 1]``, k likewise and v
  ``[S + 1, Hv dv, K - 1]``;
* recurrent ``[S + 1, Hv, dk, dv]`` in float32 (the delta rule's state, as transformers keeps it);

one row per request slot (``S = max_running_requests``; a request's slot has the lifetime of its
``req.state_slot``), row ``S`` the padding rows' scratch row (the runner's ``no_req_slot``). They
are donated into the step and replaced by its outputs with the KV arrays, so they are updated
in place. A new request's rows need no clearing: its first extend (``prefix_lens`` 0) starts
from zeros. Only the full-attention layers have KV pages (``kv_layers``).

Per slot at Qwen3.5-35B-A3B (30 linear layers, Hv 32, dk = dv = 128): 60 MiB recurrent +
1.4 MiB conv; the default KV budget (``kv_memory.py``) does not count them, they scale with
``--max-running-requests``. Every table splits by head over "tensor" (axis 1), as the layer's
weights do.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.linear_attention.gated_delta import state_shapes
from sgl_jax.srt.model_executor.kv_memory import KvLayout, device_zeros
from sgl_jax.srt.models.gated_deltanet import linear_dims


def kv_layers(cfg: ModelConfig) -> int:
    """Layers with KV pages: the full-attention ones."""
    return cfg.num_hidden_layers - sum(cfg.linear_layers)


def state_tables(cfg: ModelConfig, rows: int, dtype: Any, mesh: Mesh,
                 abstract: bool) -> tuple[Any, Any]:
    """One linear layer's zeroed (conv parts, recurrent) tables of ``rows`` rows, split by head
    over "tensor"."""
    by_head = NamedSharding(mesh, PartitionSpec(None, "tensor"))
    conv, recurrent = state_shapes(linear_dims(cfg), cfg.linear_conv_kernel_dim)
    return (tuple(device_zeros((rows, *shape), dtype, by_head, abstract) for shape in conv),
            device_zeros((rows, *recurrent), jnp.float32, by_head, abstract))


def hybrid_caches(layout: KvLayout, cfg: ModelConfig, dtype: Any, mesh: Mesh, abstract: bool,
                  rows: int) -> list[Any]:
    """Per layer, in layer order: the KV array (full attention) or the state tables (linear)."""
    kv = iter(layout.kv_caches(cfg, kv_layers(cfg), dtype, mesh, abstract))
    return [state_tables(cfg, rows, dtype, mesh, abstract) if linear else next(kv)
            for linear in cfg.linear_layers]
