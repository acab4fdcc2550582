"""SGLang's tensor weight routes (``weight_tensors.py`` says what maps onto JAX and why).

``POST /update_weights_from_tensor`` takes either

- the safetensors bytes as the body (``Content-Type: application/octet-stream``), with
  ``load_format``, ``flush_cache``, ``abort_all_requests`` and ``weight_version`` as query
  parameters, or
- SGLang's JSON body, ``serialized_named_tensors`` a list of base64 safetensors payloads.

The body is capped by ``--max-weight-update-bytes`` (413 before anything is parsed), read and
then decoded in a worker thread (base64, JSON and safetensors: nothing heavy on the event
loop), and applied by the typed ``UpdateWeightsFromArrays`` control operation: all or nothing.
``flush_cache`` is accepted for SGLang's clients, and the prefix cache is flushed whatever it
says: KV computed with the old weights would be wrong under the new ones.

``POST /init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group`` answer 501 with what to use instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from sgl_jax.srt.entrypoints.http_transport import parse_json, read_body
from sgl_jax.srt.entrypoints.openai.protocol import OpenAIError
from sgl_jax.srt.entrypoints.weight_tensors import (
    DISTRIBUTED_UNSUPPORTED,
    PayloadLimits,
    check_load_format,
    decode_serialized_named_tensors,
    parse_safetensors,
)
from sgl_jax.srt.managers import control
from sgl_jax.srt.managers.request_options import InvalidRequestError
from sgl_jax.srt.managers.tokenizer_manager import TokenizerManager

WEIGHT_TENSOR_PATHS = frozenset({
    "/update_weights_from_tensor", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group",
})
_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


class UpdateWeightsFromTensorRequest(BaseModel):
    """SGLang's ``UpdateWeightsFromTensorReqInput`` fields, each tensor payload safetensors."""

    model_config = ConfigDict(extra="forbid", strict=True)
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


def _query_bool(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = _BOOLEANS.get(raw.lower())
    if value is None:
        raise InvalidRequestError(f"query parameter {name!r} must be true or false", name)
    return value


def _decode(body: bytes, content_type: str, query: dict[str, Any],
            limits: PayloadLimits) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors and the update's options of one request (run in a worker thread)."""
    if content_type == "application/octet-stream":
        check_load_format(query.pop("load_format"))
        return parse_safetensors(body, "the request body", limits), query
    req = parse_json(body, UpdateWeightsFromTensorRequest)
    check_load_format(req.load_format)
    options = {"weight_version": req.weight_version,
               "abort_all_requests": req.abort_all_requests}
    return decode_serialized_named_tensors(req.serialized_named_tensors, limits), options


def add_weight_tensor_routes(app: FastAPI, tm: TokenizerManager, max_bytes: int,
                             limits: PayloadLimits) -> None:
    # One upload at a time: a body (up to max_bytes) and its decoded tensors are held until
    # the update is applied, so a second one is refused before its body is read.
    uploading = asyncio.Lock()

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        query = {"load_format": request.query_params.get("load_format"),
                 "weight_version": request.query_params.get("weight_version"),
                 "abort_all_requests": _query_bool(request, "abort_all_requests", False)}
        _query_bool(request, "flush_cache", True)  # checked; the cache is always flushed
        if uploading.locked():
            raise OpenAIError(409, "another weight update is being uploaded; retry when it "
                                   "has finished", code="update_in_progress")
        async with uploading:
            return await _update(request, content_type, query)

    async def _update(request: Request, content_type: str, query: dict[str, Any]) -> Response:
        body = await read_body(request, max_bytes)
        refused: InvalidRequestError | None = None
        try:
            arrays, options = await asyncio.to_thread(_decode, body, content_type, query,
                                                      limits)
        except InvalidRequestError as e:
            # A fresh error, raised outside this block: the original's traceback holds the
            # decoding frames, and with them the refused body and whatever was built from it.
            refused = InvalidRequestError(str(e), e.param)
        del body
        if refused is not None:
            raise refused
        if not arrays:
            raise InvalidRequestError("the payload holds no tensor", "serialized_named_tensors")
        out = await tm.control(control.UpdateWeightsFromArrays(arrays=arrays, **options))
        if not out.success:
            raise OpenAIError(400, f"the weights were not updated: {out.message}",
                              param="serialized_named_tensors")
        return JSONResponse(dataclasses.asdict(out))

    def unsupported(path: str) -> None:
        async def route() -> Response:
            raise OpenAIError(501, DISTRIBUTED_UNSUPPORTED.format(what=path),
                              type="not_implemented", code="not_supported_in_jax")

        app.post(path)(route)

    for path in ("/init_weights_update_group", "/update_weights_from_distributed",
                 "/destroy_weights_update_group"):
        unsupported(path)
