"""Qwen3.5-MoE's checkpoint names, as the loader reads them (``models/qwen3_5_moe.py``).

A view over a source (a checkpoint or arrays by name) that gives the model's names:

* ``model.language_model.X`` (the released ``Qwen3_5MoeForConditionalGeneration``) is read as
  ``model.X`` (the text-only form's names, which pass unchanged);
* ``model.visual.*`` (the vision tower) is not part of the language model: left out, logged;
* ``mtp.*`` (the multi-token-prediction layers) are not the language model's: left out here;
  the NEXTN draft reads them through ``Qwen35MtpSource`` (``mtp.X`` as ``X``), at load and in a
  weight update (``model_executor/weight_updater.py``, which refuses them by name when no
  NEXTN draft runs);
* fused experts, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and
  ``mlp.experts.down_proj`` ``[E, H, I]``, are read as the per-expert tensors
  ``mlp.experts.<e>.{gate,up,down}_proj.weight`` (``[I, H]``, ``[I, H]``, ``[H, I]``) the
  stacked parameters name: each a slice of the fused tensor, read without copying the rest;
* a Gated DeltaNet layer's ``linear_attn.in_proj_qkv.weight`` and ``linear_attn.conv1d.weight``
  (rows ``[q | k | v]``) are read as ``in_proj_{q,k,v}.weight`` and ``conv1d_{q,k,v}.weight``,
  their row blocks: the model splits each part by head over "tensor", which a contiguous split
  of the concatenation would not (a device would get q heads and k heads).
"""

from __future__ import annotations

import logging
import re
from typing import Any, NamedTuple

from sgl_jax.srt.bounded_text import short_repr
from sgl_jax.srt.configs.model_config import ModelConfig

logger = logging.getLogger(__name__)

RELEASED_PREFIX = "model.language_model."
VISUAL_PREFIX = "model.visual."
MTP_PREFIX = "mtp."
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_QKV = re.compile(r"^(model\.layers\.\d+\.linear_attn)\.(in_proj_qkv|conv1d)\.weight$")


class _Target(NamedTuple):
    """Where a name the model reads lives: the source's tensor, one expert of it (its leading
    axis; None: no expert axis) and a block of rows of that (None: all of them)."""

    source: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


def _per_expert_targets(inner: Any, name: str, base: str, tensor: str) -> dict[str, _Target]:
    """The per-expert names a fused expert tensor ``name`` (``<base>.<tensor>``) is read as:
    ``down_proj`` [E, H, I] an expert each; ``gate_up_proj`` [E, 2I, H] gate rows, then up."""
    experts = inner.shape(name)[0]
    if tensor == "down_proj":
        return {f"{base}.{e}.down_proj.weight": _Target(name, e) for e in range(experts)}
    rows = inner.shape(name)[1] // 2
    targets = {}
    for e in range(experts):
        targets[f"{base}.{e}.gate_proj.weight"] = _Target(name, e, (0, rows))
        targets[f"{base}.{e}.up_proj.weight"] = _Target(name, e, (rows, 2 * rows))
    return targets


class Qwen35Source:
    """``qk_rows``: the q part's rows of ``in_proj_qkv`` (= the k part's: Hk x dk)."""

    def __init__(self, inner: Any, qk_rows: int, updating: bool = False) -> None:
        self.inner = inner
        self.where = inner.where
        names = inner.names()
        mtp = sorted(n for n in names if n.startswith(MTP_PREFIX))
        visual = [n for n in names if n.startswith(VISUAL_PREFIX)]
        if (mtp or visual) and not updating:
            logger.info("%s: %d vision-tower and %d MTP tensor(s) not read by the language "
                        "model (a NEXTN draft reads the MTP ones)", self.where, len(visual),
                        len(mtp))
        self._map: dict[str, _Target] = {}
        for name in names:
            if name.startswith((MTP_PREFIX, VISUAL_PREFIX)):
                continue
            model_name = ("model." + name[len(RELEASED_PREFIX):]
                          if name.startswith(RELEASED_PREFIX) else name)
            fused, qkv = _FUSED.match(model_name), _QKV.match(model_name)
            if qkv is not None:
                base, tensor = qkv.groups()
                stem = "in_proj" if tensor == "in_proj_qkv" else "conv1d"
                bounds = (0, qk_rows, 2 * qk_rows, inner.shape(name)[0])
                for part, start, stop in zip("qkv", bounds, bounds[1:], strict=False):
                    self._map[f"{base}.{stem}_{part}.weight"] = _Target(name, None, (start, stop))
            elif fused is not None:
                self._map.update(_per_expert_targets(inner, name, *fused.groups()))
            else:
                self._map[model_name] = _Target(name)

    def names(self) -> set[str]:
        return set(self._map)

    def _target(self, name: str) -> _Target:
        if name not in self._map:
            raise ValueError(f"{self.where} lacks the tensor {short_repr(name, 200)}")
        return self._map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        target = self._target(name)
        shape = tuple(self.inner.shape(target.source))
        if target.expert is not None:
            shape = shape[1:]
        if target.rows is not None:  # (a short tensor's real rows: its shape check then fails)
            first, last = target.rows
            shape = (max(min(last, shape[0]) - first, 0), *shape[1:])
        return shape

    def is_float(self, name: str) -> tuple[bool, str]:
        return self.inner.is_float(self._target(name).source)

    def read(self, name: str, index: tuple[slice, ...]) -> Any:
        target = self._target(name)
        if target.rows is not None:
            first, last = target.rows
            start, stop, step = (index[0] if index else slice(None)).indices(last - first)
            index = (slice(start + first, stop + first, step), *index[1:])
        if target.expert is None:
            return self.inner.read(target.source, index)
        one = slice(target.expert, target.expert + 1)
        return self.inner.read(target.source, (one, *index))[0]

    def get(self, name: str) -> Any:
        target = self._target(name)
        value = self.inner.get(target.source)
        if target.expert is not None:
            value = value[target.expert]
        return value if target.rows is None else value[target.rows[0]:target.rows[1]]


def family_source(config: ModelConfig, source: Any, updating: bool = False) -> Any:
    """``source`` as the family's model reads it (Qwen3.5-MoE: the view above)."""
    if config.family != "qwen3_5_moe":
        return source
    return Qwen35Source(source, config.linear_num_key_heads * config.linear_key_head_dim, updating)


# -- the MTP layers (NEXTN's draft, speculative/nextn.py) ---------------------------------------
_MTP_FUSED = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class Qwen35MtpSource(Qwen35Source):
    """The ``mtp.*`` tensors of a source, named as the MTP draft's parameters: ``mtp.X`` ->
    ``X`` (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm``,
    ``layers.<j>.*``: a gated-attention layer, no Gated DeltaNet), fused experts read per
    expert as above. Every other tensor is left out (the language model's view reads those)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.where = f"{inner.where} (MTP tensors, named without 'mtp.')"
        self._map: dict[str, _Target] = {}
        for name in inner.names():
            if not name.startswith(MTP_PREFIX):
                continue
            draft_name = name[len(MTP_PREFIX):]
            fused = _MTP_FUSED.match(draft_name)
            if fused is None:
                self._map[draft_name] = _Target(name)
                continue
            self._map.update(_per_expert_targets(inner, name, *fused.groups()))


def qwen35_mtp_names(names: Any) -> list[str]:
    """The names of Qwen3.5-MoE's MTP tensors among ``names``."""
    return sorted(n for n in names if isinstance(n, str) and n.startswith(MTP_PREFIX))
