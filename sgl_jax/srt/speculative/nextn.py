"""NEXTN: the multi-token-prediction (MTP) layer a checkpoint ships, used as the draft the same
way as an EAGLE head (``eagle.draft_step``). Two layouts: DeepSeek-V3 / GLM-4.5's (below) and
Qwen3.5-MoE's ``mtp.*`` (``qwen35_mtp.py``); ``mtp_config``, ``load_mtp``,
``read_mtp_params`` and ``mtp_names`` choose by the target's family.

The checkpoint holds it as decoder layer ``L = num_hidden_layers`` (``config.json``:
``num_nextn_predict_layers``): ``enorm``, ``hnorm``, ``eh_proj [H, 2H]``, a full decoder
layer of the family (its attention, and a MoE block) and ``shared_head.norm``; its
``shared_head.head`` and ``embed_tokens`` are copies of the target's LM head and embedding,
which the draft uses instead (not loaded twice). Draft position p:
``z_p = eh_proj([enorm(embed(x_{p+1})), hnorm(f_p)])``, ``g_p = layer(z_p)``, logits
``shared_head.norm(g_p) @ lm_head``. The layer's MoE routing is computed and dropped: a
draft's routing never reaches the rows or the expert-distribution recorder. Its experts are
placed contiguously over the expert axis (EPLB moves the target's only). A weight update's
MTP tensors update this layer (``model_executor/weight_updater.py``); without them it keeps
its weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardBatch
from sgl_jax.srt.layers.attention import AttentionMetadata
from sgl_jax.srt.layers.moe.placement import ExpertPlacement
from sgl_jax.srt.layers.norm import RMSNorm
from sgl_jax.srt.model_loader.loader import (
    ArraySource,
    SafetensorsCheckpoint,
    mtp_tensor_names,
    read_params,
)
from sgl_jax.srt.model_loader.qwen35_names import Qwen35MtpSource, qwen35_mtp_names
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.models.common import DecoderLayer, param
from sgl_jax.srt.models.registry import get_model_class
from sgl_jax.srt.speculative.qwen35_mtp import Qwen35MtpDraft

QWEN35 = "qwen3_5_moe"  # the family whose MTP layers are ``mtp.*`` (qwen35_mtp.py)

# Copies of the target's tensors in the MTP layer, not loaded (the draft uses the target's).
_SHARED_COPIES = ("shared_head.head.weight", "embed_tokens.weight")


def mtp_config(target: ModelConfig) -> ModelConfig:
    """The MTP layer's config (one MoE decoder layer of the target's family; Qwen3.5: a
    full-attention one). ValueError when the checkpoint has none."""
    if target.family == QWEN35:
        if target.mtp_num_hidden_layers < 1:
            raise ValueError(f"speculative_algorithm=NEXTN: {target.model_path} ({target.family}) "
                             "has no MTP layer (config.json mtp_num_hidden_layers is 0 or "
                             "absent); use NGRAM")
        return dataclasses.replace(target, num_hidden_layers=1, moe_layers=(True,),
                                   linear_layers=(False,), eplb=False, num_redundant_experts=0)
    with open(os.path.join(target.model_path, "config.json")) as f:
        layers = int(json.load(f).get("num_nextn_predict_layers") or 0)
    if layers < 1:
        raise ValueError(f"speculative_algorithm=NEXTN: {target.model_path} ({target.family}) has "
                         "no MTP layer "
                         "(config.json num_nextn_predict_layers is 0 or absent); use EAGLE "
                         "with a draft head, or NGRAM")
    return dataclasses.replace(target, num_hidden_layers=1, moe_layers=(True,), eplb=False,
                               num_redundant_experts=0)


class _SharedHead(nnx.Module):
    def __init__(self, hidden: int, eps: float, dtype: jnp.dtype) -> None:
        self.norm = RMSNorm(hidden, eps, dtype)


class MtpDraft(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        family = get_model_class(config.architecture)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, dtype)
        self.hnorm = RMSNorm(hidden, eps, dtype)
        self.eh_proj = param((2 * hidden, hidden), dtype, (None, None))
        self.layers = nnx.List([DecoderLayer(config, 0, dtype, family.attention_cls,
                                             family.moe_name, family.expert_names)])
        self.shared_head = _SharedHead(hidden, eps, dtype)

    def output_norm(self, g: jax.Array) -> jax.Array:
        return self.shared_head.norm(g)

    # The step gives it the target's hidden states before the final norm.
    reads_normed_hidden = False

    def chain_features(self, g: jax.Array) -> jax.Array:
        return g  # a chained step's feature: the layer's output itself

    def __call__(self, embedded: jax.Array, features: jax.Array, batch: ForwardBatch,
                 meta: AttentionMetadata, kv: jax.Array, backends: ModelBackends,
                 ) -> tuple[jax.Array, jax.Array]:
        z = jnp.concatenate([self.enorm(embedded),
                             self.hnorm(features.astype(embedded.dtype))], axis=-1)
        g, kv, _ = self.layers[0](z @ self.eh_proj[...], batch, meta, kv, backends)
        return g, kv


class _MtpTensors:
    """The target checkpoint's MTP layer, named as ``MtpDraft``'s parameters
    (``model.layers.{L}.X`` -> ``X``, the decoder layer's under ``layers.0.``)."""

    def __init__(self, source: SafetensorsCheckpoint | ArraySource, layer: int) -> None:
        self.source = source
        self.where = f"{source.where} (MTP layer {layer})"
        self.prefix = f"model.layers.{layer}."
        own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
        self._hf = {}
        for name in source.names():
            if not name.startswith(self.prefix):
                continue
            rest = name[len(self.prefix):]
            if rest in _SHARED_COPIES:
                continue
            self._hf[rest if rest.startswith(own) else f"layers.0.{rest}"] = name

    def names(self) -> set[str]:
        return set(self._hf)

    def get(self, name: str) -> Any:
        return self.source.get(self._hf[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self._hf[name])

    def is_float(self, name: str) -> tuple[bool, str]:
        return self.source.is_float(self._hf[name])

    def read(self, name: str, index: tuple[slice, ...]) -> Any:
        return self.source.read(self._hf[name], index)


def mtp_names(target: ModelConfig, names: Any) -> list[str]:
    """The names among ``names`` (a source's, or an update's) of the target's MTP tensors:
    ``mtp.*`` (Qwen3.5), else those of layers past ``num_hidden_layers``."""
    if target.family == QWEN35:
        return qwen35_mtp_names(names)
    return mtp_tensor_names(set(names), target.num_hidden_layers)


def draft_class(target: ModelConfig) -> type[nnx.Module]:
    """The MTP draft module of the target's family."""
    return Qwen35MtpDraft if target.family == QWEN35 else MtpDraft


def read_mtp_params(config: ModelConfig, target: ModelConfig, state: nnx.State, mesh: Mesh,
                    source: SafetensorsCheckpoint | ArraySource,
                    partial: bool = False) -> dict[Any, jax.Array]:
    """The MTP draft's parameters of ``state`` read from the target's tensors in ``source``
    (its layer ``num_hidden_layers``, or Qwen3.5's ``mtp.*``; the copies of the target's
    embedding and head are not read: the draft uses the target's). CheckpointError names any
    tensor it cannot place."""
    placement = ExpertPlacement.contiguous(config.num_experts, mesh.shape["expert"])
    view = (Qwen35MtpSource(source) if target.family == QWEN35
            else _MtpTensors(source, target.num_hidden_layers))
    return read_params(config, state, mesh, placement, view, partial=partial)


def load_mtp(config: ModelConfig, target: ModelConfig, mesh: Mesh,
             dtype: jnp.dtype) -> nnx.Module:
    cls = draft_class(target)
    abstract = nnx.eval_shape(lambda: cls(config, dtype))
    graphdef, state = nnx.split(abstract)
    pure = read_mtp_params(config, target, state, mesh, SafetensorsCheckpoint(target.model_path))
    for path, var in nnx.to_flat_state(state):
        var.set_value(pure[path])
    return nnx.merge(graphdef, state)
