"""How a request travels over HTTP: body, errors, API key, and generation tied to the client.

- Bodies are read with a size limit, decoded as strict UTF-8 and validated by pydantic.
- Every failure becomes an OpenAI-style ``{"error": {message, type, param, code}}`` body with
  the right status: 400 bad input (pydantic or the tokenizer manager's ValueError), 401 API
  key, 404 unknown model or route, 413 body too large, 503 engine dead / shutting down; only a
  bug is a 500.
- Generation runs in a task of its own (:class:`Generation`), so a client that goes away (the
  handler or the streaming response is cancelled) is noticed outside the tokenizer manager,
  and its requests are aborted by rid while the manager still tracks them.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_jax.srt.bounded_text import MAX_MESSAGE_CHARS, log_safe
from sgl_jax.srt.entrypoints.openai.protocol import (
    OpenAIError,
    describe_validation_error,
    error_body,
    short_repr,
)
from sgl_jax.srt.entrypoints.wire import (
    JSON_WIRE,
    Buffer,
    Payload,
    Spliced,
    Wire,
    negotiate,
    payload_slices,
)
from sgl_jax.srt.managers.control import MemoryReleasedError
from sgl_jax.srt.managers.io_struct import GenerateReqInput
from sgl_jax.srt.managers.request_options import InvalidRequestError
from sgl_jax.srt.managers.tokenizer_manager import (
    EngineDeadError,
    StreamBehindError,
    TokenizerManager,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
# Bodies up to this size are decoded and validated on the event loop (well under a
# millisecond); larger ones in a thread, so that one large body never delays other clients.
INLINE_PARSE_BYTES = 256 * 1024
# return_routed_experts as a header, for gateways that forward headers but drop body fields
# they do not know (sglang-router 0.3.2 forwards neither: docs/scaling.md).
ROUTED_EXPERTS_HEADER = "X-Return-Routed-Experts"
_HEADER_BOOLEANS = {"1": True, "true": True, "0": False, "false": False}
OPEN_PATHS = frozenset({"/health", "/health_generate"})  # reachable without the API key
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class Plan(Protocol):
    """A request for the manager and how to format its outputs in its ``wire``'s format
    (``serve`` sets it from the Accept header): JSON bytes (a large routed-experts body is
    never turned into a str and encoded back), or a spliced MessagePack body."""

    obj: GenerateReqInput
    rids: list[str]
    wire: Wire

    @property
    def stream(self) -> bool: ...
    def response(self, results: list[dict[str, Any]]) -> Payload: ...
    def chunks(self, out: dict[str, Any]) -> list[Payload]: ...
    def tail(self) -> list[Payload]: ...


class ClientGone(Exception):
    pass


class Generation:
    """``tm.generate_request(obj)`` pumped into a queue by its own task.

    Invariant: the consumer never awaits inside the manager, so cancelling the consumer leaves
    the manager's request states in place; ``close()`` (synchronous, so it also works inside a
    cancelled scope) cancels the pump, and the manager's generator, cancelled, aborts its own
    submissions by their keys (not by rid: a new request may already reuse an aborted rid).
    """

    _END = object()

    def __init__(self, tm: TokenizerManager, obj: GenerateReqInput,
                 borrow_arrays: bool = False) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(tm.generate_request(obj, borrow_arrays)))

    async def _pump(self, agen: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for out in agen:
                self._queue.put_nowait(out)
        except Exception as e:  # handed to the consumer
            self._queue.put_nowait(e)
        else:
            self._queue.put_nowait(self._END)

    async def next(self) -> dict[str, Any] | None:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return None if item is self._END else item

    async def collect(self) -> list[dict[str, Any]]:
        results = []
        while (item := await self.next()) is not None:
            results.append(item)
        return results

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Awaits ``aw``, cancelling it and raising ClientGone if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(aw), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise ClientGone()


class _StreamResponse(StreamingResponse):
    """A stream (server-sent events, or MessagePack values back to back) that runs
    ``on_close`` however it ends (done, error or disconnect)."""

    def __init__(self, content: AsyncIterator[Buffer], media_type: str,
                 on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _SplicedResponse(Response):
    """A MessagePack body sent as its parts (``wire.Spliced``), in slices: its arrays are
    never copied into one body."""

    def __init__(self, body: Spliced, media_type: str) -> None:
        self._spliced = body
        super().__init__(None, media_type=media_type,
                         headers={"content-length": str(body.nbytes)})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        for piece in self._spliced.slices():
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _respond(payload: Payload, wire: Wire) -> Response:
    if isinstance(payload, Spliced):
        return _SplicedResponse(payload, wire.media_type)
    return Response(payload, media_type=wire.media_type)


async def _stream(plan: Plan, gen: Generation, first: dict[str, Any]) -> AsyncIterator[Buffer]:
    frame = plan.wire.frame
    try:
        item: dict[str, Any] | None = first
        while item is not None:
            for data in plan.chunks(item):
                for piece in payload_slices(frame(data)):
                    yield piece
            item = await gen.next()
        for data in plan.tail():
            for piece in payload_slices(frame(data)):
                yield piece
    except Exception as e:  # the status line is sent: report the error in the stream
        status, body = _error_for(e)
        logger.warning("stream ended with HTTP-equivalent %d: %s", status,
                       log_safe(body["error"]["message"], MAX_MESSAGE_CHARS))
        for piece in payload_slices(frame(plan.wire.dumps(body))):
            yield piece
    finally:
        gen.close()
    if plan.wire.end is not None:
        yield plan.wire.end


def apply_routed_experts_header(request: Request, obj: GenerateReqInput) -> None:
    """``X-Return-Routed-Experts: 1`` (or true, 0, false) asks like the body field; the body
    wins when it gives the field, and either wins over the server's default."""
    raw = request.headers.get(ROUTED_EXPERTS_HEADER)
    if raw is None:
        return
    value = _HEADER_BOOLEANS.get(raw.strip().lower())
    if value is None:
        raise InvalidRequestError(
            f"the {ROUTED_EXPERTS_HEADER} header must be 1, true, 0 or false, not "
            f"{short_repr(raw)}",
            "return_routed_experts")
    obj.options.setdefault("return_routed_experts", value)


def choose_wire(request: Request, obj: GenerateReqInput) -> Wire:
    """The body format the ``Accept`` header asks for (``wire.negotiate``), and the request's
    ``routed_experts_format`` to match: MessagePack takes the arrays as numpy (unless the body
    asks for base64); JSON cannot carry numpy arrays, so asking for them is a 400."""
    wire = negotiate(request.headers.get("accept"))
    given = obj.options.get("routed_experts_format")
    if wire is JSON_WIRE:
        if "numpy" in (given if isinstance(given, list) else [given]):
            raise InvalidRequestError(
                "routed_experts_format='numpy' needs a binary response: send "
                "'Accept: application/msgpack' for raw arrays, or leave the field out for "
                "base64 in JSON", "routed_experts_format")
    elif isinstance(given, list):  # one per prompt: those not given follow the wire
        obj.options["routed_experts_format"] = [
            wire.routed_experts_format if g is None else g for g in given]
    elif given is None:
        obj.options["routed_experts_format"] = wire.routed_experts_format
    return wire


async def serve(request: Request, tm: TokenizerManager, plan: Plan,
                unavailable: str | None = None) -> Response:
    """Runs ``plan`` and answers in the body format the client accepts (JSON, or MessagePack
    on request): one body, or a stream once the first piece is ready."""
    if unavailable is not None:
        raise EngineDeadError(unavailable)
    apply_routed_experts_header(request, plan.obj)
    plan.wire = wire = choose_wire(request, plan.obj)
    # A binary body sends numpy results as they are, and drops them once sent: it may borrow
    # them from shared memory (shm_arena.py) instead of copying them out.
    gen = Generation(tm, plan.obj, borrow_arrays=wire is not JSON_WIRE)
    try:
        if not plan.stream:
            return _respond(plan.response(await until_disconnect(request, gen.collect())), wire)
        # The first piece is awaited before the status line, so a bad request is a 4xx.
        first = await until_disconnect(request, gen.next())
    except BaseException:
        gen.close()
        raise
    if first is None:
        gen.close()
        return _respond(plan.response([]), wire)
    return _StreamResponse(_stream(plan, gen, first), wire.stream_media_type, on_close=gen.close)


# -- errors, bodies, API key ----------------------------------------------------------------------
def _error_for(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, OpenAIError):
        return exc.status, error_body(exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, ValidationError):
        message, param = describe_validation_error(exc)
        return 400, error_body(message, param=param)
    if isinstance(exc, StreamBehindError):  # the client did not read its stream
        return 408, error_body(str(exc), code="stream_backlog")
    if isinstance(exc, EngineDeadError):
        return 503, error_body(str(exc), "server_error", code="engine_unavailable")
    if isinstance(exc, MemoryReleasedError):  # until /resume_memory_occupation
        return 503, error_body(str(exc), "server_error", code="memory_released")
    if isinstance(exc, TimeoutError):
        return 503, error_body("the engine did not answer in time", "server_error", code="timeout")
    # The tokenizer manager, SamplingParams and the chat template report bad input as
    # ValueErrors with user-facing messages.
    if isinstance(exc, ValueError):
        return 400, error_body(str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, error_body(str(exc.detail))
    return 500, error_body("internal server error", "server_error")


async def handle_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ClientGone):
        logger.info("%s: client disconnected; its requests were aborted",
                    log_safe(request.url.path))
        return Response(status_code=499)
    status, body = _error_for(exc)
    if status == 500:
        logger.error("%s -> 500: %s", log_safe(request.url.path),
                     log_safe(repr(exc), MAX_MESSAGE_CHARS), exc_info=exc)
    else:  # the client's problem, or a known engine state (503): worth a line, not an alarm
        level = logging.WARNING if status >= 500 else logging.INFO
        logger.log(level, "%s -> %d: %s", log_safe(request.url.path), status,
                   log_safe(body["error"]["message"], MAX_MESSAGE_CHARS))
    return JSONResponse(body, status_code=status)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes (declared,
    or while it streams in)."""
    declared = request.headers.get("content-length", "")
    too_big = OpenAIError(413, f"the request body exceeds {limit} bytes",
                          code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, model: type[M]) -> M:
    body = await read_body(request)
    if len(body) <= INLINE_PARSE_BYTES:
        return parse_json(body, model)
    return await asyncio.to_thread(parse_json, body, model)  # a large body: off the event loop


def parse_json(body: bytes, model: type[M]) -> M:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpenAIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    return model.model_validate_json(text)


ADMIN_SCOPE_KEY = "sgl_jax_admin"


def is_admin_request(request: Request) -> bool:
    """Whether the request holds the admin key (True on a server without keys, where every
    client may use every route)."""
    return bool(request.scope.get("state", {}).get(ADMIN_SCOPE_KEY, True))


class AuthMiddleware:
    """The API keys (docs/security.md): ``Authorization: Bearer KEY`` on every path but the
    health checks when ``api_key`` is set, and on ``admin_paths`` the admin key when
    ``admin_api_key`` is set (without it, ``api_key`` opens them too, as in SGLang). The admin
    key opens every path. A missing or unknown key is a 401; a valid non-admin key on an
    admin path is a 403."""

    def __init__(self, app: Any, api_key: str | None, admin_api_key: str | None,
                 admin_paths: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.admin_key = admin_api_key.encode() if admin_api_key else None
        self.admin_paths = admin_paths

    def _key_of(self, scope: Any) -> bytes | None:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = header.partition(b" ")
        return key.strip() if scheme.lower() == b"bearer" else None

    def _refusal(self, scope: Any) -> tuple[int, dict[str, Any]] | None:
        path = scope["path"]
        if path in OPEN_PATHS:
            return None
        key = self._key_of(scope)
        # compare_digest on both keys, whichever matches: no timing tells which key was near.
        is_admin = key is not None and self.admin_key is not None and hmac.compare_digest(
            key, self.admin_key)
        is_user = key is not None and self.api_key is not None and hmac.compare_digest(
            key, self.api_key)
        # Read by routes that show more to the admin (/get_server_info's filesystem paths).
        # Without an admin key, every key holder may use the admin routes: all are admins.
        scope.setdefault("state", {})[ADMIN_SCOPE_KEY] = is_admin or self.admin_key is None
        if path in self.admin_paths and self.admin_key is not None:
            if is_admin:
                return None
            if is_user:
                return 403, error_body(
                    f"{path} changes the server for everyone and needs the admin API key "
                    "(--admin-api-key)", "permission_error", code="admin_key_required")
            return 401, _invalid_key("the admin API key")
        if self.api_key is None or is_user or is_admin:
            return None
        return 401, _invalid_key("the API key")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                status, body = refusal
                logger.info("%s -> %d: %s", log_safe(scope["path"]), status,
                            log_safe(body["error"]["message"], MAX_MESSAGE_CHARS))
                await JSONResponse(body, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _invalid_key(which: str) -> dict[str, Any]:
    return error_body(f"missing or invalid API key (send 'Authorization: Bearer KEY' with "
                      f"{which})", "authentication_error", code="invalid_api_key")
