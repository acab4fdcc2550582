"""Experts stored fused, one tensor for all experts of a layer (gpt-oss), read into the stacked
``[E, H + 1, I]`` / ``[E, I, H]`` parameters of ``models/gpt_oss.GptOssMoeBlock``.

Hugging Face's float layout: ``experts.gate_up_proj`` ``[E, H, 2I]`` (gate in the even columns,
up in the odd ones: interleaved, not halves), ``gate_up_proj_bias`` ``[E, 2I]``,
``down_proj`` ``[E, I, H]``. A parameter marked ``fused=(tensor, part)`` is built per expert:
gate (up) = the even (odd) columns of ``gate_up_proj`` with the matching bias columns as one
more row; down = ``down_proj`` as is.

MXFP4 (the released checkpoints): ``<tensor>_blocks`` ``[E, N, K / 32, 16]`` uint8 (two 4-bit
E2M1 codes a byte, low nibble first) and ``<tensor>_scales`` ``[E, N, K / 32]`` uint8 (one
power-of-two exponent, biased by 127, per block of 32 values) stand for a float ``[E, N, K]``
that transposes to the float layout above. Dequantised here at load, exactly (each value is a
code times a power of two), into the served dtype: the model then holds the experts at 2
bytes a weight in bfloat16 (about 3.8x the 4.25 bits of MXFP4; gpt-oss-120b's experts:
~114 GB in bfloat16 against ~61 GB as released, docs/models.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

FUSED = "fused"  # the parameter metadata key: (HF tensor under experts., part)

# The E2M1 code points (sign bit 3; exponent bits 2-1; mantissa bit 0).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127


def fused_sources(prefix: str, fused: tuple[str, str], present: set[str]) -> list[str]:
    """The HF tensors a fused parameter is made of: its weight (float, or MXFP4's blocks and
    scales when the source holds those), then for gate/up its bias."""
    tensor, part = fused
    base = f"{prefix}.experts.{tensor}"
    names = [f"{base}_blocks", f"{base}_scales"] if f"{base}_blocks" in present else [base]
    return names + ([] if part == "down" else [f"{base}_bias"])


def is_mxfp4(names: Sequence[str]) -> bool:
    return names[0].endswith("_blocks")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``[..., N, G, 16]`` uint8 codes and ``[..., N, G]`` uint8 exponents -> float32
    ``[..., G * 32, N]`` (transposed to the float layout: input dim before output dim)."""
    blocks = np.asarray(blocks, np.uint8)
    low, high = FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]
    values = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], -1)  # [..., N, G, 32]
    exponent = np.asarray(scales, np.int32) - SCALE_BIAS
    values = np.ldexp(values, exponent[..., None]).astype(np.float32)
    return np.swapaxes(values.reshape(*values.shape[:-2], -1), -1, -2)


def expected_shapes(part: str, names: Sequence[str], experts: int, hidden: int,
                    inter: int) -> dict[str, tuple[int, ...]]:
    """Each source tensor's shape for a model of these sizes (``experts`` logical)."""
    rows, cols = (hidden, 2 * inter) if part != "down" else (inter, hidden)
    if is_mxfp4(names):
        if rows % 32:
            raise ValueError(f"MXFP4 packs the input dim in blocks of 32; {rows} is not a "
                             "multiple of 32")
        shapes = {names[0]: (experts, cols, rows // 32, 16), names[1]: (experts, cols, rows // 32)}
    else:
        shapes = {names[0]: (experts, rows, cols)}
    if part != "down":
        shapes[names[-1]] = (experts, cols)
    return shapes


def expert_block(read: Any, names: Sequence[str], part: str, expert: int) -> np.ndarray:
    """One expert's slice of the parameter, float32: gate/up ``[H + 1, I]`` (bias last),
    down ``[I, H]``. ``read(name, index)`` reads a block of a source tensor."""
    one = (slice(expert, expert + 1),)
    if is_mxfp4(names):
        weight = dequantize_mxfp4(read(names[0], one), read(names[1], one))[0]
    else:
        weight = np.asarray(read(names[0], one), np.float32)[0]
    if part == "down":
        return weight
    column = 0 if part == "gate" else 1  # interleaved: gate even, up odd
    bias = np.asarray(read(names[-1], one), np.float32)[0]
    return np.concatenate([weight[:, column::2], bias[None, column::2]], axis=0)
