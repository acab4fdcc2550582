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
import glob
import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class PayloadLimits:
    """What one update may hold, checked on the header's bytes before the tensors are built.

    A safetensors header is JSON the server must parse; a header of a million zero-size
    tensors costs seconds of parsing and a million arrays while holding the GIL. No real
    update names more tensors than the model has, so the count is capped by the model's own
    tensor count, and the header's size by that count (generous bytes per entry)."""

    max_tensors: int
    max_header_bytes: int


HEADER_BYTES_PER_TENSOR = 1024  # a name of a few hundred characters, dtype, shape, offsets
MIN_HEADER_BYTES = 1 << 20
FALLBACK_MAX_TENSORS = 100_000  # a model whose tensors could not be counted


def checkpoint_tensor_count(model_path: str) -> int | None:
    """How many tensors the checkpoint at ``model_path`` names (headers only; None if none)."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    try:
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                return len(json.load(f)["weight_map"])
        count = 0
        for path in glob.glob(os.path.join(model_path, "*.safetensors")):
            with safetensors.safe_open(path, "numpy") as f:
                count += len(f.keys())
        return count or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def payload_limits(model_path: str | None, max_header_bytes: int | None = None) -> PayloadLimits:
    """The limits for a model; ``max_header_bytes`` (an operator's setting) overrides the
    header size derived from the tensor count."""
    from sgl_jax.srt.configs.model_config import resolve_model_path

    try:
        count = checkpoint_tensor_count(resolve_model_path(model_path))
    except ValueError:
        count = None
    max_tensors = count or FALLBACK_MAX_TENSORS
    header = max_header_bytes or max(MIN_HEADER_BYTES, HEADER_BYTES_PER_TENSOR * max_tensors)
    return PayloadLimits(max_tensors=max_tensors, max_header_bytes=header)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise InvalidRequestError(
            f"the safetensors header names {short_repr(dup, 200)} twice (which to keep?)",
            "serialized_named_tensors")
    return out


def check_header(payload: bytes, limits: PayloadLimits, what: str = "the payload") -> None:
    """Refuse an oversize header, too many tensors or a name given twice, before
    ``safetensors`` builds anything: the size is read from the first 8 bytes, the JSON is
    parsed only once it is known to be small."""
    if len(payload) < 8 or _looks_like_pickle(payload):
        return  # parse_safetensors says what is wrong
    (size,) = struct.unpack("<Q", payload[:8])
    if size > len(payload) - 8:
        return  # not a safetensors payload: parse_safetensors says so
    if size > limits.max_header_bytes:
        raise InvalidRequestError(
            f"the safetensors header of {what} is {size} bytes; at most "
            f"{limits.max_header_bytes} are accepted (--max-safetensors-header-bytes; the "
            f"model has {limits.max_tensors} tensors)", "serialized_named_tensors")
    try:
        header = json.loads(payload[8:8 + size], object_pairs_hook=_no_duplicate_keys)
    except InvalidRequestError:  # a ValueError too: not the case below
        raise
    except ValueError:
        return  # not JSON: safetensors' own error is clearer
    if isinstance(header, dict):
        count = len(header) - ("__metadata__" in header)
        if count > limits.max_tensors:
            raise InvalidRequestError(
                f"{what} holds {count} tensors; the model has {limits.max_tensors}",
                "serialized_named_tensors")


def parse_safetensors(payload: bytes, what: str = "the payload",
                      limits: PayloadLimits | None = None) -> dict[str, np.ndarray]:
    """The tensors of one safetensors payload by name; InvalidRequestError if it is not one."""
    if limits is not None:
        check_header(payload, limits, what)
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


def decode_serialized_named_tensors(entries: list[str], limits: PayloadLimits | None = None
                                    ) -> dict[str, np.ndarray]:
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
        tensors += parse_safetensors(payload, f"serialized_named_tensors[{i}]", limits).items()
        del payload
        if limits is not None and len(tensors) > limits.max_tensors:
            raise InvalidRequestError(f"the payloads hold {len(tensors)} tensors; the model "
                                      f"has {limits.max_tensors}", "serialized_named_tensors")
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
