"""The HTTP server: a FastAPI app over ONE TokenizerManager, run by uvicorn.

Routes: native ``/generate``; OpenAI ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``; operations ``/health``, ``/health_generate``, ``/get_model_info`` (also
``/model_info``), ``/get_server_info`` (also ``/server_info``), ``/get_load``,
``/flush_cache``, ``/abort_request``, ``/update_weights_from_disk``,
``/update_weights_from_tensor`` (and SGLang's NCCL routes, 501: :mod:`weight_routes`),
``/pause_generation``, ``/continue_generation``, ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/metrics`` (``--enable-metrics``,
Prometheus: :mod:`sgl_jax.srt.metrics`); the expert distribution recorder
``/start_expert_distribution_record``, ``/stop_expert_distribution_record``,
``/dump_expert_distribution_record``, ``/expert_load``, ``/expert_load.png`` and
``POST /rebalance_experts`` (EPLB)
(docs/expert_load.md). Request plumbing (bodies, errors,
API key, disconnects, streaming) lives in :mod:`http_transport`; the OpenAI formatting in
:mod:`openai`. ``run_server`` owns the process: it binds, loads the engine, serves, and turns
SIGTERM into a graceful drain then a clean stop (exit 0; ``--graceful-shutdown-timeout``),
SIGINT or a second signal into a stop now (exit 0), and a dead child into exit code 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl_jax.srt.entrypoints.http_connections import bound_access_log, guarded_h11_protocol
from sgl_jax.srt.entrypoints.http_transport import (
    AuthMiddleware,
    ClientGone,
    Plan,
    handle_error,
    is_admin_request,
    read_json,
    serve,
)
from sgl_jax.srt.entrypoints.openai.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    MemoryOccupationRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    UpdateWeightsFromDiskRequest,
    error_body,
)
from sgl_jax.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sgl_jax.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sgl_jax.srt.entrypoints.openai.sglext import header_flag
from sgl_jax.srt.entrypoints.weight_routes import WEIGHT_TENSOR_PATHS, add_weight_tensor_routes
from sgl_jax.srt.entrypoints.weight_tensors import payload_limits
from sgl_jax.srt.entrypoints.wire import JSON_WIRE, Payload
from sgl_jax.srt.expert_load_plot import PlotUnavailableError, render_expert_load_png
from sgl_jax.srt.managers import control
from sgl_jax.srt.managers.io_struct import GenerateReqInput
from sgl_jax.srt.managers.tokenizer_manager import EngineDeadError, TokenizerManager
from sgl_jax.srt.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from sgl_jax.srt.private_files import without_paths
from sgl_jax.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The routes that change the server for everyone: with --admin-api-key they need the admin
# key (docs/security.md). A client cancels its own request by closing its connection.
ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/pause_generation", "/continue_generation", "/flush_cache",
    "/start_expert_distribution_record", "/stop_expert_distribution_record",
    "/dump_expert_distribution_record", "/rebalance_experts", "/abort_request",
    "/release_memory_occupation", "/resume_memory_occupation",
}) | WEIGHT_TENSOR_PATHS
HEALTH_GENERATE_TIMEOUT = 30.0
# After a child dies the server answers 503 for this long (in-flight requests get their error,
# health checks see the reason), then exits with code 1.
DEAD_LINGER_SECONDS = 1.0
# A drain that began with requests in flight keeps answering 503 "draining" this long after
# the last one finished before the process exits: a router that sent it traffic a moment ago
# sees a 503 it retries elsewhere (and a failed health check) instead of a refused
# connection. An idle server at SIGTERM exits at once.
DRAIN_LINGER_SECONDS = 2.0


@dataclass
class ServerContext:
    server_args: ServerArgs
    tm: TokenizerManager
    served_model_name: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    # Graceful drain (SIGTERM): no new generation, running requests finish until the deadline.
    draining: bool = False
    drain_deadline: float = 0.0
    drain_linger: float = 0.0  # seconds to keep refusing after the drain empties
    drained_at: float | None = None
    # Generation requests admitted but maybe not yet submitted to the manager (tokenizing):
    # the drain waits for them too. A stream's response exists only once it was submitted.
    admitting: int = 0

    def __post_init__(self) -> None:
        model_path = self.tm.model_config.model_path
        self.served_model_name = self.tm.served_model_name
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

    def begin_drain(self, timeout: float) -> None:
        """Stops admitting (new generation requests and /health answer 503 "draining") and
        gives the running requests, streams included, ``timeout`` seconds to finish."""
        self.draining = True
        self.drain_deadline = time.monotonic() + timeout
        busy = bool(self.tm.states) or self.admitting > 0
        self.drain_linger = DRAIN_LINGER_SECONDS if busy else 0.0
        logger.info("draining %d request(s), up to %.0f s (a second SIGTERM or Ctrl-C stops now)",
                    len(self.tm.states), timeout)

    def drain_over(self) -> bool:
        """True once nothing has run for ``drain_linger`` seconds (nothing new is admitted
        while draining, so empty stays empty), or at the deadline (what is left gets
        aborted)."""
        now = time.monotonic()
        if not self.tm.states and not self.admitting:
            if self.drained_at is None:
                self.drained_at = now
                logger.info("drained: every request finished%s", (
                    f"; refusing new ones {self.drain_linger:.0f} s more before exiting"
                    if self.drain_linger else ""))
            # Never past the deadline: the linger is part of the grace period.
            return now - self.drained_at >= self.drain_linger or now >= self.drain_deadline
        if now >= self.drain_deadline:
            logger.warning("drain timed out: aborting %d request(s)", len(self.tm.states))
            return True
        return False

    def unavailable_reason(self) -> str | None:
        if self.tm.dead_reason is not None:
            return self.tm.dead_reason
        if self.draining and not self.shutting_down:
            return ("the server is draining: it finishes its running requests and takes no new "
                    "ones; send the request to another replica")
        return "the server is shutting down" if self.shutting_down else None


class _NativePlan:
    def __init__(self, obj: GenerateReqInput, rids: list[str]) -> None:
        self.obj, self.rids = obj, rids
        self.wire = JSON_WIRE  # serve() sets the one the client accepts

    @property
    def stream(self) -> bool:
        return self.obj.stream

    def response(self, results: list[dict[str, Any]]) -> Payload:
        return self.wire.dumps(self.obj.shape_results(results))

    def chunks(self, out: dict[str, Any]) -> list[Payload]:
        return [self.wire.dumps(out)]

    def tail(self) -> list[Payload]:
        return []


# -- the app ------------------------------------------------------------------------------------
def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="sgl_jax", docs_url=None, redoc_url=None)
    # Specific types are handled in place; a bare Exception (a bug) becomes a logged 500.
    for exc_type in (OpenAIError, ValidationError, ValueError, EngineDeadError, TimeoutError,
                     control.MemoryReleasedError, StarletteHTTPException, ClientGone, Exception):
        app.add_exception_handler(exc_type, handle_error)
    args = ctx.server_args
    if args.api_key or args.admin_api_key:
        app.add_middleware(AuthMiddleware, api_key=args.api_key,
                           admin_api_key=args.admin_api_key, admin_paths=ADMIN_PATHS)
    tm, cfg = ctx.tm, ctx.tm.model_config

    async def run(request: Request, plan: Plan) -> Response:
        if ctx.draining and tm.dead_reason is None:
            raise OpenAIError(503, ctx.unavailable_reason() or "", type="server_error",
                              code="draining")
        ctx.admitting += 1
        try:
            return await serve(request, tm, plan, ctx.unavailable_reason())
        finally:
            ctx.admitting -= 1

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request, GenerateRequest)
        ctx.completions.check_model(body.model)
        obj = body.to_input()
        tm.check_sequence_count(obj.batch_size, param="text" if obj.text is not None
                                else "input_ids")
        # rids are fixed here, not by the manager, so a disconnect can abort them by id.
        return await run(request, _NativePlan(obj, obj.ensure_rids()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        plan = ctx.completions.plan(await read_json(request, CompletionRequest))
        return await run(request, plan)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        headers = {key: header_flag(request.headers.get(f"x-sglext-return-{key.replace('_', '-')}"))
                   for key in ("input_ids", "output_ids")}
        plan = await ctx.chat.plan(await read_json(request, ChatCompletionRequest), headers)
        return await run(request, plan)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=ctx.served_model_name, created=ctx.created, root=cfg.model_path,
                         max_model_len=cfg.context_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        reason = ctx.unavailable_reason()
        if ctx.draining and tm.dead_reason is None:
            # 503 takes the replica out of a router's rotation; the body says why.
            return JSONResponse({"status": "draining", "running_requests": len(tm.states),
                                 **error_body(reason or "draining", "server_error",
                                              code="draining")}, status_code=503)
        if reason is not None:
            raise EngineDeadError(reason)
        return JSONResponse({"status": "ok"})

    if ctx.server_args.enable_metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            # Two control calls to the scheduler (answered between steps), then the text is
            # rendered in a worker thread: the event loop does no heavy work.
            info = await tm.get_server_info()
            load = None
            if ctx.server_args.expert_distribution_recorder_mode == "stat":
                try:
                    load = control.check_reply(await tm.control(control.GetExpertLoad())).load
                except ValueError:  # nothing recorded yet: no imbalance gauges
                    pass
            body = await asyncio.to_thread(tm.observer.render, info, load)
            return Response(body, media_type=METRICS_CONTENT_TYPE)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        # One greedy token from a one-token prompt: proves the whole pipeline still works.
        rid = f"health-{uuid.uuid4().hex}"
        obj = GenerateReqInput(input_ids=[0], rid=rid,
                               sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                               options={"return_routed_experts": False})
        plan = _NativePlan(obj, [rid])
        await asyncio.wait_for(run(request, plan), HEALTH_GENERATE_TIMEOUT)
        return JSONResponse({"status": "ok"})

    # sglang-router reads /model_info and /server_info (SGLang's newer names) when it adds a
    # worker: the served model name becomes the worker's model id.
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> Response:
        return JSONResponse({
            "model_path": cfg.model_path,
            "served_model_name": ctx.served_model_name,
            "architecture": cfg.architecture,
            # family, num_hidden_layers, num_experts, num_experts_per_tok, moe_layers, router
            # rule and its parameters: what a client needs to reshape and read the rows.
            **cfg.routing_info(),
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.context_len,
            "is_generation": True,
            "enable_return_routed_experts": ctx.server_args.enable_return_routed_experts,
            "enable_return_routed_expert_weights":
                ctx.server_args.enable_return_routed_expert_weights,
            "routed_experts_dtype": ctx.server_args.routed_experts_dtype,
        })

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info(request: Request) -> Response:
        info = await tm.get_server_info()
        # Filesystem paths (model, caches, dump directory) tell a user key holder about the
        # host; the admin sees them.
        return JSONResponse(info if is_admin_request(request) else without_paths(info))

    @app.get("/get_load")
    async def get_load() -> Response:
        # SGLang's shape, one entry per data-parallel attention rank: sglang-router's
        # /get_loads and load-aware policies read num_tokens.
        info = await tm.get_server_info()
        ranks = info.get("dp_ranks") or [{"dp_rank": 0, **info}]

        def load(rank: dict) -> dict:
            waiting = rank["num_waiting_reqs"]
            in_use = (rank["total_kv_slots"] - rank["available_kv_slots"]
                      - rank["evictable_kv_slots"])
            return {"dp_rank": rank["dp_rank"], "num_reqs": rank["num_running_reqs"] + waiting,
                    "num_waiting_reqs": waiting, "num_tokens": in_use}

        return JSONResponse([load(rank) for rank in ranks])

    @app.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang's clients use both
    async def flush_cache() -> Response:
        out = await tm.control(control.FlushCache())
        if not out.success:
            raise OpenAIError(400, f"the cache was not flushed: {out.message}")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await read_json(request, UpdateWeightsFromDiskRequest)
        out = await tm.control(control.UpdateWeightsFromDisk(
            model_path=body.model_path, weight_version=body.weight_version,
            abort_all_requests=body.abort_all_requests))
        if not out.success:
            raise OpenAIError(400, f"the weights were not updated: {out.message}",
                              param="model_path")
        return JSONResponse(dataclasses.asdict(out))

    add_weight_tensor_routes(app, tm, args.max_weight_update_bytes, payload_limits(
        args.model_path, args.max_safetensors_header_bytes))

    @app.post("/pause_generation")
    async def pause_generation() -> Response:
        await tm.control(control.PauseGeneration(pause=True))
        return JSONResponse({"success": True, "message": "generation paused"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await tm.control(control.PauseGeneration(pause=False))
        return JSONResponse({"success": True, "message": "generation continued"})

    async def memory_occupation(request: Request, op: type[control.ControlOp]) -> Response:
        # SGLang's clients may send no body: every tag.
        empty = request.headers.get("content-length", "0") == "0" \
            and "transfer-encoding" not in request.headers
        body = MemoryOccupationRequest() if empty else \
            await read_json(request, MemoryOccupationRequest)
        out = await tm.control(op(tags=body.tags))
        if not out.success:
            raise OpenAIError(400, out.message)
        return JSONResponse(dataclasses.asdict(out))

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> Response:
        return await memory_occupation(request, control.ReleaseMemoryOccupation)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> Response:
        return await memory_occupation(request, control.ResumeMemoryOccupation)

    async def recorder(op: control.ControlOp) -> Any:
        try:
            return control.check_reply(await tm.control(op))
        except ValueError as e:  # off, or the wrong order: the caller's problem
            raise OpenAIError(400, str(e)) from None

    @app.post("/start_expert_distribution_record")
    async def start_expert_distribution_record() -> Response:
        out = await recorder(control.StartExpertRecord())
        return JSONResponse({"success": True, "message": out.message})

    @app.post("/stop_expert_distribution_record")
    async def stop_expert_distribution_record() -> Response:
        out = await recorder(control.StopExpertRecord())
        return JSONResponse({"success": True, "message": out.message})

    @app.post("/dump_expert_distribution_record")
    async def dump_expert_distribution_record() -> Response:
        out = await recorder(control.DumpExpertRecord())
        return JSONResponse({"success": True, "message": out.message, "path": out.path})

    @app.post("/rebalance_experts")
    async def rebalance_experts() -> Response:
        out = await recorder(control.RebalanceExperts())
        return JSONResponse({"success": True, "message": out.message, **out.load})

    @app.get("/expert_load")
    async def expert_load() -> Response:
        return JSONResponse((await recorder(control.GetExpertLoad())).load)

    @app.get("/expert_load.png")
    async def expert_load_png() -> Response:
        load = (await recorder(control.GetExpertLoad())).load
        title = (f"{load['architecture']}: expert load over {load['num_tokens']} tokens"
                 f"{' (recording)' if load['recording'] else ''}")
        try:
            png = await asyncio.to_thread(
                render_expert_load_png, np.asarray(load["counts"], np.int64),
                load["moe_layers"], title, num_experts_per_tok=load["num_experts_per_tok"],
                num_layers=load["num_hidden_layers"])
        except PlotUnavailableError as e:  # matplotlib missing; the message names the extra
            raise OpenAIError(501, str(e), type="not_implemented") from None
        return Response(png, media_type="image/png")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        rid = (await read_json(request, AbortRequest)).rid
        running = tm.abort_request(rid)
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


def _log_access_policy(args: ServerArgs) -> None:
    """Says at start-up who may do what (docs/security.md)."""
    if not args.api_key and not args.admin_api_key:
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("No --api-key: anyone who reaches %s:%d can generate and use the "
                           "admin routes (weights, pause, flush, ...)", args.host, args.port)
    elif not args.admin_api_key:
        logger.warning("--api-key without --admin-api-key: every key holder can also use the "
                       "admin routes (weights, pause, flush, ...)")


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
            if self.should_exit:
                if sig == signal.SIGINT:
                    self.force_exit = True
                return
            name = signal.Signals(sig).name
            if (sig == signal.SIGTERM and not ctx.draining
                    and server_args.graceful_shutdown_timeout > 0):
                logger.info("Got %s: draining before shutting down", name)
                ctx.begin_drain(server_args.graceful_shutdown_timeout)
                return  # on_tick ends the drain
            logger.info("Got %s: shutting down%s", name, " now" if ctx.draining else "")
            self.should_exit = True

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                logger.info("Server ready on http://%s:%d (model %s; routed experts %s)",
                            server_args.host, port, ctx.served_model_name,
                            "on" if server_args.enable_return_routed_experts else "off")

        async def on_tick(self, counter: int) -> bool:
            # A child that dies once we are stopping anyway (e.g. Ctrl-C reached it too) is
            # part of the stop, not a failure.
            if ctx.tm.dead_reason is not None and not self.should_exit:
                if self.dead_since is None:
                    self.dead_since = time.monotonic()
                    self.exit_code = 1
                    logger.error("the engine is dead; exiting in %.0fs", DEAD_LINGER_SECONDS)
                if time.monotonic() - self.dead_since > DEAD_LINGER_SECONDS:
                    return True
            if ctx.draining and not self.should_exit and ctx.drain_over():
                self.should_exit = True
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
    _log_access_policy(server_args)
    try:
        tm, procs = launch_engine(server_args)
    except BaseException:
        sock.close()
        raise
    ctx = ServerContext(server_args=server_args, tm=tm)
    bound_access_log()
    config = uvicorn.Config(
        create_app(ctx), log_config=None, log_level=server_args.log_level,
        timeout_graceful_shutdown=3, lifespan="off",
        http=guarded_h11_protocol(server_args.http_header_timeout,
                                  server_args.http_max_connections))
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        logger.info("Stopping the engine's processes")
        procs.stop()
        tm.close()
    logger.info("Server stopped (exit code %d)", server.exit_code)
    return server.exit_code
