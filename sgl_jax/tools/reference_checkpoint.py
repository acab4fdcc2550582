"""Checkpoint reading of the reference forward (see sgl_jax.tools.reference_forward).

Part of the independent yardstick: shares no code with ``sgl_jax.srt``.
"""

from __future__ import annotations

import json
import struct

import numpy as np
from safetensors.numpy import load_file

__all__ = ["load_safetensors_f64"]


# Raw safetensors dtypes the manual reader understands. BF16 is absent from
# safetensors.numpy (numpy has no bfloat16), and HF checkpoints are very often BF16.
_RAW_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 by shifting into the high half
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "U8": np.dtype("u1"),  # MXFP4 codes and exponents (gpt-oss)
}


def _load_safetensors_raw(path: str) -> dict[str, np.ndarray]:
    """Read a safetensors file by its documented layout: u64 header length, JSON header, data."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype_str = info["dtype"]
        if dtype_str not in _RAW_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype_str}")
        start, end = info["data_offsets"]
        arr = np.frombuffer(data[start:end], dtype=_RAW_DTYPES[dtype_str])
        if dtype_str == "BF16":
            # bfloat16 is the top 16 bits of a float32: exact widening.
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.reshape(info["shape"])
    return out


def load_safetensors_f64(path: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as float64 (every supported dtype widens exactly)."""
    try:
        tensors = load_file(path)
    except (KeyError, TypeError):
        # safetensors.numpy fails on a dtype numpy lacks (BF16): KeyError in older releases,
        # TypeError ("data type 'bfloat16' not understood") in newer ones.
        tensors = _load_safetensors_raw(path)
    return {name: np.asarray(t, dtype=np.float64) for name, t in tensors.items()}
