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
  stacked parameters name: each a slice of the fused tensor, read without copying the rest.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from sgl_jax.srt.bounded_text import short_repr

logger = logging.getLogger(__name__)

RELEASED_PREFIX = "model.language_model."
VISUAL_PREFIX = "model.visual."
MTP_PREFIX = "mtp."
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")

# A name the model reads -> (the source's name, expert, part): part "gate" / "up" is a row
# block of gate_up_proj, "down" an expert of down_proj, None the whole tensor.
_Target = tuple[str, int | None, str | None]


class Qwen35Source:
    def __init__(self, inner: Any, updating: bool = False) -> None:
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
            fused = _FUSED.match(model_name)
            if fused is None:
                self._map[model_name] = (name, None, None)
                continue
            base, tensor = fused.groups()
            parts = ("gate", "up") if tensor == "gate_up_proj" else ("down",)
            for e in range(inner.shape(name)[0]):
                for part in parts:
                    self._map[f"{base}.{e}.{part}_proj.weight"] = (name, e, part)

    def names(self) -> set[str]:
        return set(self._map)

    def _target(self, name: str) -> _Target:
        if name not in self._map:
            raise ValueError(f"{self.where} lacks the tensor {short_repr(name, 200)}")
        return self._map[name]

    def _rows(self, fused: str) -> int:
        return self.inner.shape(fused)[1] // 2  # I: gate_up_proj is [E, 2I, H]

    def shape(self, name: str) -> tuple[int, ...]:
        source, expert, part = self._target(name)
        full = tuple(self.inner.shape(source))
        if expert is None:
            return full
        if part == "down":
            return full[1:]
        return (full[1] // 2, full[2])

    def is_float(self, name: str) -> tuple[bool, str]:
        return self.inner.is_float(self._target(name)[0])

    def _index(self, name: str, index: tuple[slice, ...]) -> tuple[str, tuple[slice, ...]]:
        source, expert, part = self._target(name)
        if expert is None:
            return source, index
        one = slice(expert, expert + 1)
        if part == "down":
            return source, (one, *index)
        rows = self._rows(source)
        start, stop, step = (index[0] if index else slice(None)).indices(rows)
        offset = rows if part == "up" else 0
        return source, (one, slice(start + offset, stop + offset, step), *index[1:])

    def read(self, name: str, index: tuple[slice, ...]) -> Any:
        source, expert, _ = self._target(name)
        source, full = self._index(name, index)
        block = self.inner.read(source, full)
        return block if expert is None else block[0]

    def get(self, name: str) -> Any:
        source, expert, part = self._target(name)
        value = self.inner.get(source)
        if expert is None:
            return value
        if part == "down":
            return value[expert]
        rows = value.shape[1] // 2
        return value[expert, rows:] if part == "up" else value[expert, :rows]


def family_source(family: str, source: Any, updating: bool = False) -> Any:
    """``source`` as the family's model reads it (Qwen3.5-MoE: the view above)."""
    return Qwen35Source(source, updating) if family == "qwen3_5_moe" else source


# -- the MTP layers (NEXTN's draft, speculative/nextn.py) ---------------------------------------
_MTP_FUSED = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class Qwen35MtpSource(Qwen35Source):
    """The ``mtp.*`` tensors of a source, named as the MTP draft's parameters: ``mtp.X`` ->
    ``X`` (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm``,
    ``layers.<j>.*``), fused experts read per expert as above. Every other tensor is left
    out (the language model's view reads those)."""

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
                self._map[draft_name] = (name, None, None)
                continue
            base, tensor = fused.groups()
            parts = ("gate", "up") if tensor == "gate_up_proj" else ("down",)
            for e in range(inner.shape(name)[0]):
                for part in parts:
                    self._map[f"{base}.{e}.{part}_proj.weight"] = (name, e, part)


def qwen35_mtp_names(names: Any) -> list[str]:
    """The names of Qwen3.5-MoE's MTP tensors among ``names``."""
    return sorted(n for n in names if isinstance(n, str) and n.startswith(MTP_PREFIX))
