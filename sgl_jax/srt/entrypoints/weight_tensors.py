"""SGLang's tensor weight API mapped onto this engine: named tensors in, one typed update.

SGLang's ``update_weights_from_tensor`` sends ``serialized_named_tensors``: per tensor-parallel
rank, a pickle (``MultiprocessingSerializer``) of ``(name, torch.Tensor)`` pairs. A pickle is
code: this server never unpickles anything from the network. It takes the same fields with
each entry a **safetensors** payload (the format is a JSON header of names, dtypes, shapes and
offsets, then raw bytes; parsed by the ``safetensors`` library, no code runs). The tensors then
go through ``UpdateWeightsFromArrays``: every name, shape and dtype is checked and all of them
are placed before any parameter is swapped (all or nothing).

``init_weights_update_group`` / ``update_weights_from_distributed`` have no JAX counterpart:
they open an NCCL process group between the trainer's GPUs and the engine's and broadcast
into it, and JAX has no NCCL group an outside process can join (a JAX job's collectives run
inside one compiled program over devices fixed at start-up).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

from sgl_jax.srt.bounded_text import bound_message, short_repr
from sgl_jax.srt.managers.request_options import InvalidRequestError

# safetensors dtype names -> numpy (bfloat16 and float8 from ml_dtypes, as JAX uses).
_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
# load_format values: None (SGLang's default) names no format; we read safetensors only.
LOAD_FORMATS = (None, "safetensors")

SAFETENSORS_HINT = (
    "send each payload in the safetensors format: in Python "
    "`safetensors.numpy.save({hf_name: array})` (or `safetensors.torch.save` for torch "
    "tensors), as the request body with Content-Type application/octet-stream, or base64 in "
    "'serialized_named_tensors' of a JSON body")
PICKLE_REFUSED = (
    "the payload is a Python pickle (SGLang's MultiprocessingSerializer format); this server "
    "never unpickles data from the network (a pickle can run code): " + SAFETENSORS_HINT)

DISTRIBUTED_UNSUPPORTED = (
    "{what} is not available in this engine: it joins an NCCL process group between the "
    "trainer and the engine and broadcasts tensors into it, and JAX has no NCCL group another "
    "process can join (a JAX job's collectives run inside its compiled programs, over devices "
    "fixed at start-up). Send the weights with POST /update_weights_from_tensor (safetensors "
    "bytes), POST /update_weights_from_disk (a checkpoint directory), or run the engine in the "
    "trainer's process (Engine(enable_single_process=True)) and call "
    "Engine.update_weights_from_arrays with the trainer's JAX arrays (docs/rl_rollouts.md).")


def _looks_like_pickle(payload: bytes) -> bool:
    # PROTO opcode then protocol 2..5: what pickle.dumps / ForkingPickler write first.
    return len(payload) >= 2 and payload[0] == 0x80 and 2 <= payload[1] <= 5


def parse_safetensors(payload: bytes, what: str = "the payload") -> dict[str, np.ndarray]:
    """The tensors of one safetensors payload by name; InvalidRequestError if it is not one."""
    try:
        entries = safetensors.deserialize(payload)
    except Exception as e:  # noqa: BLE001 - safetensors' own error types
        if _looks_like_pickle(payload):
            raise InvalidRequestError(PICKLE_REFUSED, "serialized_named_tensors") from None
        raise InvalidRequestError(bound_message(
            f"{what} is not a safetensors payload ({type(e).__name__}: {e}); "
            f"{SAFETENSORS_HINT}"), "serialized_named_tensors") from None
    out: dict[str, np.ndarray] = {}
    for name, entry in entries:
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise InvalidRequestError(
                f"tensor {short_repr(name, 200)} of {what} has dtype {entry['dtype']!r}; "
                f"use one of {', '.join(_DTYPES)}", "serialized_named_tensors")
        out[name] = np.frombuffer(entry["data"], dtype=dtype).reshape(entry["shape"])
    return out


def merged(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``(name, tensor)`` pairs as one dict; a name given twice is an error (which to keep?)."""
    out: dict[str, Any] = {}
    for name, value in named:
        if name in out:
            raise InvalidRequestError(f"tensor {short_repr(name, 200)} is given twice",
                                      "serialized_named_tensors")
        out[name] = value
    return out


def decode_serialized_named_tensors(entries: list[str]) -> dict[str, np.ndarray]:
    """SGLang's JSON field: base64 safetensors payloads, merged (no name in two of them)."""
    if not entries:
        raise InvalidRequestError("'serialized_named_tensors' is empty: give at least one "
                                  "safetensors payload (base64)", "serialized_named_tensors")
    tensors: list[tuple[str, np.ndarray]] = []
    for i, text in enumerate(entries):
        try:
            payload = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(
                f"serialized_named_tensors[{i}] is not standard base64; {SAFETENSORS_HINT}",
                "serialized_named_tensors") from None
        tensors += parse_safetensors(payload, f"serialized_named_tensors[{i}]").items()
    return merged(tensors)


def check_load_format(load_format: Any) -> None:
    if load_format not in LOAD_FORMATS:
        raise InvalidRequestError(
            f"load_format={short_repr(load_format)} is not supported: tensors come as "
            "safetensors (load_format null or \"safetensors\"); SGLang's torch formats "
            "(\"direct\", \"flattened_bucket\") are pickles, which this server never reads",
            "load_format")


def named_arrays(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``Engine.update_weights_from_tensor``'s argument (a dict, or SGLang's list of
    ``(name, tensor)`` pairs) as the dict ``update_weights_from_arrays`` takes."""
    if isinstance(named_tensors, Mapping):
        return dict(named_tensors)
    pairs = list(named_tensors)
    if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
        raise InvalidRequestError("named_tensors must be a dict or a list of (name, array) "
                                  "pairs", "named_tensors")
    return merged(pairs)
