"""The HTTP server: a FastAPI app over ONE TokenizerManager, run by uvicorn.

Routes: native ``/generate``; OpenAI ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``; operations ``/health``, ``/health_generate``, ``/get_model_info``,
``/get_server_info``, ``/flush_cache``, ``/abort_request``. Every error is an OpenAI-style
``{"error": {message, type, param, code}}`` body; bad input is a 4xx, never a 500.

Generation runs in a task of its own (:class:`_Generation`), so a client that goes away (the
handler or the streaming response is cancelled) is noticed outside the tokenizer manager, and
its requests are aborted by rid while the manager still tracks them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_jax.srt.entrypoints.openai.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    describe_validation_error,
    error_body,
)
from sgl_jax.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sgl_jax.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sgl_jax.srt.managers.io_struct import GenerateReqInput
from sgl_jax.srt.managers.tokenizer_manager import EngineDeadError, TokenizerManager
from sgl_jax.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
HEALTH_GENERATE_TIMEOUT = 30.0
OPEN_PATHS = frozenset({"/health", "/health_generate"})  # reachable without the API key
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class Plan(Protocol):
    """A request for the manager and how to format its outputs (JSON texts)."""

    obj: GenerateReqInput
    rids: list[str]

    @property
    def stream(self) -> bool: ...
    def response(self, results: list[dict[str, Any]]) -> str: ...
    def chunks(self, out: dict[str, Any]) -> list[str]: ...
    def tail(self) -> list[str]: ...


@dataclass
class ServerContext:
    server_args: ServerArgs
    tm: TokenizerManager
    child_pids: Callable[[], dict[str, int]]
    served_model_name: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False

    def __post_init__(self) -> None:
        model_path = self.tm.model_config.model_path
        self.served_model_name = self.server_args.served_model_name or model_path
        names = {model_path, self.served_model_name}
        if self.server_args.model_path:
            names.add(self.server_args.model_path)
        self.completions = OpenAIServingCompletion(self.tm, self.served_model_name, names)
        self.chat = OpenAIServingChat(self.tm, self.served_model_name, names)

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort the running ones (their clients get finish "abort")."""
        self.shutting_down = True
        for rid in list(self.tm.states):
            self.tm.abort_request(rid)

    def unavailable_reason(self) -> str | None:
        if self.tm.dead_reason is not None:
            return self.tm.dead_reason
        return "the server is shutting down" if self.shutting_down else None


class _ClientGone(Exception):
    pass


class _NativePlan:
    def __init__(self, obj: GenerateReqInput, rids: list[str]) -> None:
        self.obj, self.rids = obj, rids

    @property
    def stream(self) -> bool:
        return self.obj.stream

    def response(self, results: list[dict[str, Any]]) -> str:
        body = results[0] if self.obj.is_single else sorted(results, key=lambda r: r["index"])
        return orjson.dumps(body).decode()

    def chunks(self, out: dict[str, Any]) -> list[str]:
        return [orjson.dumps(out).decode()]

    def tail(self) -> list[str]:
        return []


# -- generation, disconnects, streaming ---------------------------------------------------------
class _Generation:
    """``tm.generate_request(obj)`` pumped into a queue by its own task.

    Invariant: the consumer never awaits inside the manager, so cancelling the consumer leaves
    the manager's request states in place; ``close()`` (synchronous, so it also works inside a
    cancelled scope) then aborts every rid still running and cancels the pump.
    """

    _END = object()

    def __init__(self, tm: TokenizerManager, obj: GenerateReqInput, rids: list[str]) -> None:
        self._tm, self._rids = tm, rids
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(tm.generate_request(obj)))

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
            for rid in self._rids:
                self._tm.abort_request(rid)
            self._task.cancel()


async def _until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Awaits ``aw``, cancelling it and raising _ClientGone if the client disconnects first."""

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
    raise _ClientGone()


class _SSEResponse(StreamingResponse):
    """An event stream that runs ``on_close`` however it ends (done, error or disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _sse(plan: Plan, gen: _Generation, first: dict[str, Any]) -> AsyncIterator[str]:
    try:
        item: dict[str, Any] | None = first
        while item is not None:
            for text in plan.chunks(item):
                yield f"data: {text}\n\n"
            item = await gen.next()
        for text in plan.tail():
            yield f"data: {text}\n\n"
    except Exception as e:  # the status line is sent: report the error as an event
        status, body = _error_for(e)
        logger.warning("stream ended with HTTP-equivalent %d: %s", status, body["error"]["message"])
        yield f"data: {orjson.dumps(body).decode()}\n\n"
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


async def _serve(request: Request, ctx: ServerContext, plan: Plan) -> Response:
    reason = ctx.unavailable_reason()
    if reason is not None:
        raise EngineDeadError(reason)
    gen = _Generation(ctx.tm, plan.obj, plan.rids)
    try:
        if not plan.stream:
            return Response(plan.response(await _until_disconnect(request, gen.collect())),
                            media_type="application/json")
        # The first piece is awaited before the status line, so a bad request is a 4xx.
        first = await _until_disconnect(request, gen.next())
    except BaseException:
        gen.close()
        raise
    if first is None:
        gen.close()
        return Response(plan.response([]), media_type="application/json")
    return _SSEResponse(_sse(plan, gen, first), on_close=gen.close)


# -- errors and request bodies -----------------------------------------------------------------


def _error_for(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, OpenAIError):
        return exc.status, error_body(exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, ValidationError):
        message, param = describe_validation_error(exc)
        return 400, error_body(message, param=param)
    if isinstance(exc, EngineDeadError):
        return 503, error_body(str(exc), "server_error", code="engine_unavailable")
    if isinstance(exc, TimeoutError):
        return 503, error_body("the engine did not answer in time", "server_error", code="timeout")
    if isinstance(exc, ValueError):  # the tokenizer manager's user-facing validation
        return 400, error_body(str(exc))
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, error_body(str(exc.detail))
    return 500, error_body("internal server error", "server_error")


async def _handle_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, _ClientGone):
        logger.info("%s: client disconnected; its requests were aborted", request.url.path)
        return Response(status_code=499)
    status, body = _error_for(exc)
    if status == 500:
        logger.error("%s -> %d: %s", request.url.path, status, body["error"]["message"],
                     exc_info=status == 500)
    else:  # the client's problem, or a known engine state (503): worth a line, not an alarm
        level = logging.WARNING if status >= 500 else logging.INFO
        logger.log(level, "%s -> %d: %s", request.url.path, status, body["error"]["message"])
    return JSONResponse(body, status_code=status)


async def _read_json(request: Request, model: type[M]) -> M:
    declared = request.headers.get("content-length", "")
    too_big = OpenAIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes",
                          code="request_too_large")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpenAIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    return model.model_validate_json(text)


class _ApiKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` on every path but the health checks."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
                body = error_body("missing or invalid API key (send 'Authorization: Bearer KEY')",
                                  "authentication_error", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the app ------------------------------------------------------------------------------------
def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="sgl_jax", docs_url=None, redoc_url=None)
    # Specific types are handled in place; a bare Exception (a bug) becomes a logged 500.
    for exc_type in (OpenAIError, ValidationError, ValueError, EngineDeadError, TimeoutError,
                     StarletteHTTPException, _ClientGone, Exception):
        app.add_exception_handler(exc_type, _handle_error)
    if ctx.server_args.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=ctx.server_args.api_key)
    tm, cfg = ctx.tm, ctx.tm.model_config

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = await _read_json(request, GenerateRequest)
        obj = GenerateReqInput(**req.model_dump())
        n = obj.batch_size
        if not obj.is_single and n == 0:
            raise OpenAIError(400, "the batch is empty", param="text")
        # rids are fixed here, not by the manager, so a disconnect can abort them by id.
        if obj.rid is None:
            obj.rid = uuid.uuid4().hex if obj.is_single else [uuid.uuid4().hex for _ in range(n)]
        if obj.is_single != isinstance(obj.rid, str):
            raise OpenAIError(400, "'rid' must be a string for one prompt and a list of strings "
                              "(one per prompt) for a batch", param="rid")
        rids = [obj.rid] if obj.is_single else list(obj.rid)
        return await _serve(request, ctx, _NativePlan(obj, rids))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        plan = ctx.completions.plan(await _read_json(request, CompletionRequest))
        return await _serve(request, ctx, plan)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        plan = ctx.chat.plan(await _read_json(request, ChatCompletionRequest))
        return await _serve(request, ctx, plan)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.served_model_name, created=ctx.created, root=cfg.model_path,
                         max_model_len=cfg.context_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        reason = ctx.unavailable_reason()
        if reason is not None:
            raise EngineDeadError(reason)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        # One greedy token from a one-token prompt: proves the whole pipeline still works.
        rid = f"health-{uuid.uuid4().hex}"
        obj = GenerateReqInput(input_ids=[0], rid=rid,
                               sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        plan = _NativePlan(obj, [rid])
        await asyncio.wait_for(_serve(request, ctx, plan), HEALTH_GENERATE_TIMEOUT)
        return JSONResponse({"status": "ok"})

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return JSONResponse({
            "model_path": cfg.model_path,
            "served_model_name": ctx.served_model_name,
            "architecture": cfg.architecture,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_layers": list(cfg.moe_layer_ids),
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.context_len,
            "is_generation": True,
            "enable_return_routed_experts": ctx.server_args.enable_return_routed_experts,
            "routed_experts_dtype": "int32",
        })

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        args = dataclasses.asdict(ctx.server_args)
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        info = await tm.get_server_info()
        return JSONResponse({**info, "pid": os.getpid(), "pids": ctx.child_pids(),
                             "served_model_name": ctx.served_model_name, "server_args": args})

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        out = await tm.flush_cache()
        if not out.success:
            raise OpenAIError(400, f"the cache was not flushed: {out.message}")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        rid = (await _read_json(request, AbortRequest)).rid
        running = rid in tm.states
        tm.abort_request(rid)
        return JSONResponse({"success": running,
                             "message": "aborted" if running else f"no running request {rid!r}"})

    return app


# -- running ------------------------------------------------------------------------------------
def bind_socket(host: str, port: int) -> socket.socket:
    """Binds before the model loads, so a taken port fails in a second, not after loading.

    It does not listen yet (uvicorn does, once ready): until then clients are refused rather
    than left hanging in the accept queue.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run_server(server_args: ServerArgs) -> int:
    """Loads the engine, serves until SIGTERM / SIGINT (-> 0) or a child's death (-> 1)."""
    import uvicorn

    from sgl_jax.srt.entrypoints.engine import launch_engine

    class _Server(uvicorn.Server):
        exit_code = 0
        dead_since: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not uvicorn's: it re-raises the signal after a graceful stop, which would end
            # the process by SIGTERM instead of with exit code 0.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            elif not self.should_exit:
                logger.info("Got %s: shutting down", signal.Signals(sig).name)
            self.should_exit = True

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                logger.info("Server ready on http://%s:%d (model %s; routed experts %s)",
                            server_args.host, port, ctx.served_model_name,
                            "on" if server_args.enable_return_routed_experts else "off")

        async def on_tick(self, counter: int) -> bool:
            if ctx.tm.dead_reason is not None and not ctx.shutting_down:
                # Linger briefly so in-flight and new requests get their 503, then exit.
                if self.dead_since is None:
                    self.dead_since = time.monotonic()
                    logger.error("engine is dead (%s); exiting", ctx.tm.dead_reason)
                if time.monotonic() - self.dead_since > 1.0:
                    self.exit_code = 1
                    return True
            return await super().on_tick(counter)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            ctx.begin_shutdown()
            await super().shutdown(sockets)

    try:
        sock = bind_socket(server_args.host, server_args.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", server_args.host, server_args.port, e)
        return 1
    port = sock.getsockname()[1]
    tm, procs = launch_engine(server_args)
    ctx = ServerContext(server_args=server_args, tm=tm, child_pids=procs.pids)
    config = uvicorn.Config(create_app(ctx), log_config=None, log_level=server_args.log_level,
                            timeout_graceful_shutdown=3, lifespan="off")
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        logger.info("Stopping the engine's processes")
        procs.stop()
        tm.close()
    logger.info("Server stopped (exit code %d)", server.exit_code)
    return server.exit_code
