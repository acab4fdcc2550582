"""Engine: starts the scheduler and detokenizer processes and serves generate calls.

``Engine(**server_args)`` blocks until the model is loaded and compiled. ``generate`` is
synchronous (a background event loop runs the tokenizer manager's coroutines), so it works
from any thread and from inside a running event loop (which it blocks meanwhile);
``async_generate`` runs in the caller's own loop. ``shutdown()`` (also on context exit and at
interpreter exit) stops every child process.

With ``enable_single_process=True`` the scheduler and the detokenizer are threads of this
process instead (``worker_threads.py``), on its JAX runtime and, with ``mesh=``, on the
caller's mesh; everything else is the same.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import CancelledError
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.entrypoints import scoring, weight_tensors
from sgl_jax.srt.entrypoints.named_arrays import Names, hf_named_arrays
from sgl_jax.srt.managers import array_handoff
from sgl_jax.srt.managers.control import (
    ControlOp,
    DumpExpertRecord,
    FlushCache,
    GetExpertLoad,
    PauseGeneration,
    RebalanceExperts,
    ReleaseMemoryOccupation,
    ResumeMemoryOccupation,
    StartExpertRecord,
    StopExpertRecord,
    UpdateWeightsFromArrays,
    UpdateWeightsFromDisk,
    UpdateWeightsInProcess,
    check_reply,
)
from sgl_jax.srt.managers.io_struct import GenerateReqInput
from sgl_jax.srt.managers.request_options import RequestOptions
from sgl_jax.srt.managers.tokenizer_manager import EngineDeadError, TokenizerManager
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.server_args_checks import check_for_linear_attention
from sgl_jax.srt.utils import EngineStartupError, configure_logging

if TYPE_CHECKING:
    from jax.sharding import Mesh

logger = logging.getLogger(__name__)

_SAMPLING_KEYS = {f for f in SamplingParams.__dataclass_fields__}


class EngineWorkers(Protocol):
    """The scheduler and the detokenizer, as processes or as threads (single-process mode)."""

    info: dict[str, dict[str, Any]]  # each one's start-up report

    def watch(self, on_death: Callable[[str], None]) -> None: ...
    def pids(self) -> dict[str, int]: ...
    def stop(self) -> None: ...


class Subprocesses:
    """The scheduler and detokenizer processes, their start-up handshake and their watchdog."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        self.port_args = port_args
        self.procs: dict[str, subprocess.Popen] = {}
        readers: dict[str, Connection] = {}
        payload = pickle.dumps((server_args, port_args))
        for name in ("scheduler", "detokenizer"):
            read_fd, write_fd = os.pipe()
            proc = subprocess.Popen(
                [sys.executable, "-m", "sgl_jax.srt.entrypoints.child_process", name,
                 str(write_fd)],
                stdin=subprocess.PIPE, pass_fds=(write_fd,),
            )
            os.close(write_fd)
            proc.stdin.write(payload)
            proc.stdin.close()
            self.procs[name] = proc
            readers[name] = Connection(read_fd, writable=False)
        self._stopping = False
        try:
            self.info = {name: self._handshake(name, r, server_args.startup_timeout)
                         for name, r in readers.items()}
        except BaseException:
            self.stop()
            raise
        finally:
            for reader in readers.values():
                reader.close()

    def _handshake(self, name: str, reader: Any, timeout: float) -> dict[str, Any]:
        proc = self.procs[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if reader.poll(0.2):
                try:
                    msg = reader.recv()
                except EOFError:
                    break
                if msg.get("status") == "ready":
                    return msg
                self.stop()
                raise EngineStartupError(f"the {name} process failed to start:\n{msg.get('error')}")
            if proc.poll() is not None:
                break
        self.stop()
        if proc.returncode is None:
            raise EngineStartupError(f"the {name} process was not ready within {timeout:.0f}s")
        raise EngineStartupError(f"the {name} process exited with code {proc.returncode} at start")

    def watch(self, on_death: Any, interval: float = 0.2) -> None:
        def run() -> None:
            while not self._stopping:
                for name, proc in self.procs.items():
                    if proc.poll() is not None and not self._stopping:
                        on_death(f"the {name} process died (exit code {proc.returncode}); "
                                 "the engine cannot serve requests any more")
                        return
                time.sleep(interval)

        threading.Thread(target=run, name="child-watchdog", daemon=True).start()

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(1.0)
        self.port_args.remove()  # the private ipc directory and its sockets


def launch_engine(server_args: ServerArgs,
                  mesh: Mesh | None = None) -> tuple[TokenizerManager, EngineWorkers]:
    """Starts the child processes (or, single-process, the threads: on ``mesh`` if given)
    and the tokenizer manager that talks to them."""
    model_config = ModelConfig.from_hf(server_args.model_path, server_args.context_length)
    # Refusals by flag, and no prefix cache, for linear-attention layers (before any child
    # process gets the args).
    check_for_linear_attention(server_args, model_config.linear_layers, model_config.family)
    port_args = PortArgs.new()
    t0 = time.perf_counter()
    procs: EngineWorkers
    if server_args.enable_single_process:
        from sgl_jax.srt.entrypoints.worker_threads import WorkerThreads  # imports JAX

        procs = WorkerThreads(server_args, port_args, mesh)
    else:
        procs = Subprocesses(server_args, port_args)
    try:
        tm = TokenizerManager(server_args, port_args, model_config, child_pids=procs.pids)
    except BaseException:
        procs.stop()
        raise
    procs.watch(tm.set_dead)
    info = procs.info["scheduler"]
    logger.info(
        "Engine ready in %.1fs (load %.1fs): %s, %d KV slots, %d request slots, memory %s",
        time.perf_counter() - t0, info["load_seconds"], model_config.model_path,
        info["max_total_tokens"], info["max_running_requests"], info["memory_bytes"],
    )
    return tm, procs


class Engine:
    def __init__(self, *, mesh: Mesh | None = None, **kwargs: Any) -> None:
        """``kwargs`` are ServerArgs fields. ``mesh``: a ``jax.sharding.Mesh`` with the axes
        ("expert", "tensor") to run on, with ``enable_single_process=True`` (``tp_size`` and
        ``ep_size`` default to its axis sizes); else ``device_indexes`` or all devices."""
        if mesh is not None:
            # Its axis sizes by name (a Mesh's shape); anything else fails the check below.
            sizes = getattr(mesh, "shape", None)
            sizes = sizes if isinstance(sizes, Mapping) else {}
            kwargs = {"tp_size": sizes.get("tensor", 1), "ep_size": sizes.get("expert", 1),
                      **kwargs}
        self.server_args = ServerArgs(**kwargs)
        if self.server_args.node_rank > 0:
            raise ValueError(
                f"node_rank={self.server_args.node_rank}: only node 0 runs an Engine; on the "
                "other hosts run `python -m sgl_jax.launch_server` with the same flags and "
                "their --node-rank (they run node 0's steps)")
        if mesh is not None:
            _check_given_mesh(mesh, self.server_args)
        configure_logging(self.server_args.log_level)
        self.tokenizer_manager, self._procs = launch_engine(self.server_args, mesh)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="engine-loop", daemon=True
        )
        self._loop_thread.start()
        self._closed = False
        self._shutdown_lock = threading.Lock()
        atexit.register(self.shutdown)

    # -- generation -----------------------------------------------------------------------------
    @staticmethod
    def _make_request(
        prompt: str | list[str] | None,
        sampling_params: dict | list[dict] | None,
        input_ids: list[int] | list[list[int]] | None,
        stream: bool,
        rid: str | list[str] | None,
        kwargs: dict[str, Any],
    ) -> GenerateReqInput:
        """The one request object; keywords are request options or sampling parameters."""
        options = RequestOptions.pick(kwargs)
        sampling_kwargs = {k: v for k, v in kwargs.items() if k not in options}
        unknown = set(sampling_kwargs) - _SAMPLING_KEYS
        if unknown:
            raise TypeError(
                f"generate() got unknown keyword(s) {sorted(unknown)}; request options are "
                f"{sorted(RequestOptions.names())}, sampling keywords {sorted(_SAMPLING_KEYS)}"
            )
        if sampling_kwargs:
            if isinstance(sampling_params, list):
                sampling_params = [{**p, **sampling_kwargs} for p in sampling_params]
            else:
                sampling_params = {**(sampling_params or {}), **sampling_kwargs}
        return GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
            stream=stream, options=options,
        )

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_routed_experts: bool | list[bool] | None = None,
        routed_experts_start_len: int | list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """A dict with ``text``, ``output_ids``, ``meta_info`` (a list for a batch; an
        iterator of chunks when streaming).

        Keywords are request options (``RequestOptions``: ``return_routed_experts`` and
        ``routed_experts_start_len`` are spelt out as in SGLang; also ``routed_experts_dtype``,
        ``return_routed_expert_weights``, ``routed_expert_weights_dtype``, and
        ``routed_experts_format="numpy"`` for numpy arrays instead of base64) or sampling
        parameters, e.g.
        ``generate("Hi", max_new_tokens=16, temperature=0)``. Bad input raises ValueError.
        ``return_routed_experts`` None (not given) follows ``return_routed_experts_default``.
        """
        _add_routed_experts(kwargs, return_routed_experts, routed_experts_start_len)
        obj = self._make_request(prompt, sampling_params, input_ids, stream, rid, kwargs)
        agen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return self._iterate(agen)
        return obj.shape_results(self._run(_collect(agen)))

    def _iterate(self, agen: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_routed_experts: bool | list[bool] | None = None,
        routed_experts_start_len: int | list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """``generate`` in the caller's event loop."""
        _add_routed_experts(kwargs, return_routed_experts, routed_experts_start_len)
        obj = self._make_request(prompt, sampling_params, input_ids, stream, rid, kwargs)
        agen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return agen
        return obj.shape_results(await _collect(agen))

    # -- scoring --------------------------------------------------------------------------------
    def score(
        self, prompt_ids: list[int] | list[list[int]], completion_ids: list[list[int]], *,
        temperature: float = 1.0, return_routed_experts: bool = False,
    ) -> list[dict[str, Any]]:
        """The per-token logprobs of given completions (``scoring.py``): ``prompt_ids`` one
        prompt shared by every completion or one per completion. One record per completion:
        ``logprobs`` (``log_softmax(logits / temperature)`` of each completion token),
        ``cached_tokens``, ``weight_version`` and, with ``return_routed_experts``,
        ``routed_experts`` int32 ``[prompt + completion - 1, layers, k]``. One batch; a
        shared prompt is computed once. Bad input raises ValueError."""
        return self._run(scoring.score(self.tokenizer_manager, prompt_ids, completion_ids,
                                       temperature, return_routed_experts))

    async def async_score(
        self, prompt_ids: list[int] | list[list[int]], completion_ids: list[list[int]], *,
        temperature: float = 1.0, return_routed_experts: bool = False,
    ) -> list[dict[str, Any]]:
        """``score`` in the caller's event loop."""
        return await scoring.score(self.tokenizer_manager, prompt_ids, completion_ids,
                                   temperature, return_routed_experts)

    # -- control --------------------------------------------------------------------------------
    def get_server_info(self) -> dict[str, Any]:
        return self._run(self.tokenizer_manager.get_server_info())

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.control(FlushCache())).success

    def abort_request(self, rid: str) -> None:
        self.tokenizer_manager.abort_request(rid)

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Loads new weights from a checkpoint of the same architecture and shapes, in place
        (no recompilation), and flushes the prefix cache. Running requests finish on the old
        weights first (new ones wait), or are aborted with ``abort_all_requests``. Returns
        ``{"weight_version", "num_parameters", "seconds", ...}``; raises ValueError naming
        what is wrong (another architecture, a missing or mis-shaped tensor)."""
        return dataclasses.asdict(self._control(UpdateWeightsFromDisk(
            model_path=model_path, weight_version=weight_version,
            abort_all_requests=abort_all_requests)))

    def update_weights_from_arrays(
        self, arrays: Mapping[Any, Any], weight_version: str | None = None,
        abort_all_requests: bool = False, names: Names | None = None,
        measure_memory: bool = False,
    ) -> dict[str, Any]:
        """As ``update_weights_from_disk``, from tensors given by Hugging Face name (numpy or
        JAX arrays; a subset is fine, but all experts of a stacked projection together), or
        a nested state (``nnx.State``, dicts) with ``names`` mapping each leaf's path to its
        Hugging Face name (``named_arrays.py``).

        Single-process mode: the arrays reach the scheduler thread by reference (only a
        token crosses its socket) and JAX arrays are transposed, stacked, cast and resharded
        on the devices, one parameter at a time (``on_device_weights.py``): no byte through
        host memory (``host_bytes`` in the reply: the 1-byte finiteness verdict), device
        memory the parameters plus the largest new one (with ``measure_memory``, the reply's
        ``peak_device_bytes``: it costs a scan of every live array). Otherwise the scheduler
        runs in another process, so the arrays travel as host bytes."""
        named = hf_named_arrays(arrays, names)
        if not self.server_args.enable_single_process:
            return dataclasses.asdict(self._control(UpdateWeightsFromArrays(
                arrays=named, weight_version=weight_version,
                abort_all_requests=abort_all_requests)))
        token = array_handoff.hand_over(named)
        try:
            return dataclasses.asdict(self._control(UpdateWeightsInProcess(
                handle=token, weight_version=weight_version,
                abort_all_requests=abort_all_requests, measure_memory=measure_memory)))
        finally:
            array_handoff.withdraw(token)  # refused, failed early or interrupted

    def start_expert_distribution_record(self) -> None:
        """Starts a window of the expert distribution recorder (needs
        ``expert_distribution_recorder_mode``; docs/expert_load.md). ValueError if the
        recorder is off or already recording."""
        self._control(StartExpertRecord())

    def stop_expert_distribution_record(self) -> None:
        """Ends the window (ValueError if not recording); it can still be dumped."""
        self._control(StopExpertRecord())

    def dump_expert_distribution_record(self) -> str:
        """Writes the window recorded so far as .npz in ``expert_distribution_recorder_dir``
        and returns the path (ValueError if nothing was started)."""
        return self._control(DumpExpertRecord()).path

    def get_expert_load(self) -> dict:
        """``stat`` mode: the current window's counts, as ``GET /expert_load`` serves them."""
        return self._control(GetExpertLoad()).load

    def rebalance_experts(self) -> dict:
        """EPLB (``enable_eplb``): a new expert placement from the recorder's ``stat`` counts,
        applied between steps without a restart or a recompilation. Returns the per-layer
        imbalance before and after and the new ``physical_to_logical`` tables."""
        return self._control(RebalanceExperts()).load

    def pause_generation(self) -> None:
        """Stops launching steps; running requests keep their state (and their callers wait)."""
        self._control(PauseGeneration(pause=True))

    def continue_generation(self) -> None:
        """Resumes after ``pause_generation``, exactly where every request stopped."""
        self._control(PauseGeneration(pause=False))

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """SGLang's: frees the KV cache ("kv_cache") and the weights ("weights", kept in host
        memory); ``tags`` None = both. Only on an idle engine (ValueError while requests run or
        wait); until resumed, generate raises ``MemoryReleasedError``. Returns ``released``
        (the tags released now) and the scheduler's ``device_bytes_before`` / ``_after``."""
        return dataclasses.asdict(self._control(ReleaseMemoryOccupation(tags=tags)))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Puts released memory back (``tags`` None = every released tag) without
        recompiling: outputs are then what they were before the release."""
        return dataclasses.asdict(self._control(ResumeMemoryOccupation(tags=tags)))

    def update_weights_from_tensor(
        self, named_tensors: dict[str, Any] | list[tuple[str, Any]],
        load_format: str | None = None, flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: str | None = None,
    ) -> dict[str, Any]:
        """SGLang's name for ``update_weights_from_arrays``: ``named_tensors`` a dict or a list
        of ``(hf_name, array)`` pairs (numpy or JAX arrays; a name given twice is a
        ValueError). ``load_format`` must be None (tensors are taken as given);
        ``flush_cache`` is accepted, and the prefix cache is always flushed (KV of the old
        weights would be wrong)."""
        if load_format is not None:
            raise ValueError(f"load_format={load_format!r}: pass None, the arrays are taken "
                             "as given (SGLang's torch formats do not apply)")
        del flush_cache
        return self.update_weights_from_arrays(
            weight_tensors.named_arrays(named_tensors), weight_version=weight_version,
            abort_all_requests=abort_all_requests)

    def init_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        """Not available: NCCL groups have no JAX counterpart (raises NotImplementedError
        saying what to use instead)."""
        raise NotImplementedError(
            weight_tensors.DISTRIBUTED_UNSUPPORTED.format(what="init_weights_update_group"))

    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> None:
        """Not available, as ``init_weights_update_group``."""
        raise NotImplementedError(
            weight_tensors.DISTRIBUTED_UNSUPPORTED.format(what="update_weights_from_distributed"))

    def destroy_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        """Not available, as ``init_weights_update_group``."""
        raise NotImplementedError(
            weight_tensors.DISTRIBUTED_UNSUPPORTED.format(what="destroy_weights_update_group"))

    def _control(self, op: ControlOp) -> Any:
        """The reply to ``op``; ValueError with the scheduler's reason if it refused."""
        return check_reply(self._run(self.tokenizer_manager.control(op)))

    def child_pids(self) -> dict[str, int]:
        """The scheduler's and detokenizer's pids ({} in single-process mode)."""
        return self._procs.pids()

    def shutdown(self) -> None:
        """Stops the engine (idempotent). Calls still waiting, in any thread, raise
        EngineDeadError; no process or thread of the engine is left."""
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        self._procs.stop()
        self.tokenizer_manager.close()  # fails the requests still waiting
        if self._loop_thread is not threading.current_thread():
            # What still runs on the loop (a caller's generate) ends before the loop stops.
            try:
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(5)
            except TimeoutError:
                logger.warning("calls still running on the engine's loop did not end in 5s")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=2)
        if not self._loop_thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(self, coro: Any) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError("the engine is shut down")
        if threading.current_thread() is self._loop_thread:
            coro.close()
            raise RuntimeError("a synchronous Engine call from the engine's own event loop "
                               "would wait for itself; use async_generate")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except CancelledError:
            if self._closed:  # shutdown() cancelled it
                raise EngineDeadError("the engine was shut down during the call") from None
            raise


def _add_routed_experts(kwargs: dict[str, Any], want: bool | list[bool] | None,
                        start_len: int | list[int] | None) -> None:
    # Left out when not given, so that the server's return_routed_experts_default applies.
    if want is not None:
        kwargs["return_routed_experts"] = want
    kwargs["routed_experts_start_len"] = start_len


def _check_given_mesh(mesh: Mesh, server_args: ServerArgs) -> None:
    if not server_args.enable_single_process:
        raise ValueError("Engine(mesh=...) needs enable_single_process=True: the model runs "
                         "on the mesh in this process (a mesh cannot cross into the "
                         "scheduler's process; there, pick devices with device_indexes)")
    if server_args.device_indexes is not None:
        raise ValueError("give either mesh or device_indexes, not both")
    from sgl_jax.srt.distributed import check_mesh  # imports JAX, as the mesh did

    check_mesh(mesh, server_args.tp_size, server_args.ep_size)


async def _cancel_tasks() -> None:
    """Cancels every other task of the running loop and waits for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(agen: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return [out async for out in agen]
