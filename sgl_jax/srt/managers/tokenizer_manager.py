"""TokenizerManager: the caller's side of the engine (main process).

It validates and tokenizes requests, sends them to the scheduler, and hands each request's
outputs back to whoever awaits it. It works from any asyncio loop: a receiver thread reads the
detokenizer's messages and wakes the loop that owns each request, so the Engine (its own
background loop), user code (``async_generate``) and the HTTP server (uvicorn's loop) share
this one implementation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from sgl_jax.srt.bounded_text import log_safe
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.constrained.grammar import compiler_for, request_grammar
from sgl_jax.srt.managers.control import (
    ControlOp,
    ControlReply,
    GetServerInfo,
    MemoryOccupationReqOutput,
    MemoryReleasedError,
    memory_released_message,
)
from sgl_jax.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    GenerateReqInput,
    ReqOutput,
    TokenizedGenerateReqInput,
)
from sgl_jax.srt.managers.logprob_record import logprobs_meta_info
from sgl_jax.srt.managers.prompt_groups import same_prompt_groups, split_routed_rows
from sgl_jax.srt.managers.request_options import InvalidRequestError, RequestOptions
from sgl_jax.srt.managers.shm_arena import is_borrowed
from sgl_jax.srt.managers.transport import SideReceiver, recv_obj
from sgl_jax.srt.metrics import RequestObserver, create_observer
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Threads that tokenize and render chat templates, off the event loop (the tokenizers library
# releases the GIL while it encodes). Few: a huge prompt then queues instead of taking memory
# side by side with others.
TOKENIZER_THREADS = 2
# How much a normalizer may shrink a text before it is tokenized (Unicode composition turns
# three Hangul jamo into one syllable): margin of the cheap prompt-length bound.
_NORMALIZER_SHRINK = 4


class EngineDeadError(RuntimeError):
    """A child process died: nothing more can be served."""


class StreamBehindError(RuntimeError):
    """More than ``max_stream_backlog`` outputs (one a decode step) waited for the caller, as
    when a client never reads its stream: the request was aborted (memory and a batch slot)."""




@dataclass
class ReqState:
    rid: str  # the caller's request id
    key: str  # the id the scheduler and detokenizer know: unique per submission
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event
    pending: deque = field(default_factory=deque)  # output pieces, appended by the receiver
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    error: str | None = None
    options: RequestOptions = field(default_factory=RequestOptions)  # validated
    # routed_experts_split: rows before this index (the prompt's) are ``prompt_routed_experts``
    split_at: int | None = None
    logprobs: dict[str, list] = field(default_factory=dict)  # every entry so far, by key
    progress: Any = None  # the RequestObserver's record of it (metrics, --log-requests)
    # Numpy results may be views of the shared-memory arena (shm_arena.py), lent until the
    # caller drops them: only for a caller that drops them soon (the binary HTTP route);
    # everyone else gets copies.
    borrow_arrays: bool = False
    behind: bool = False  # dropped for not taking its outputs (StreamBehindError)


class TokenizerManager:
    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, model_config: ModelConfig,
        child_pids: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.server_args = server_args
        self.model_config = model_config
        # Default: the model directory's name, never its absolute path (the name is quoted in
        # responses, errors and metrics); a hub id ("org/name") is kept as given.
        self.served_model_name = server_args.served_model_name or default_served_name(
            model_config.model_path)
        self._child_pids = child_pids or dict
        self.max_stream_backlog = server_args.max_stream_backlog
        # --enable-metrics / --log-requests; a no-op object when both are off.
        self.observer: RequestObserver = create_observer(server_args, self.served_model_name)
        self.tokenizer = Tokenizer.from_pretrained(
            server_args.tokenizer_path or model_config.model_path
        )
        self.context_len = model_config.context_len
        self.vocab_size = model_config.vocab_size
        self.grammars = compiler_for(  # constrained decoding (constrained/grammar.py)
            server_args.grammar_backend, self.tokenizer, self.vocab_size,
            [*model_config.eos_token_ids, *self.tokenizer.eos_token_ids],
            not server_args.constrained_json_disable_any_whitespace)
        # Running requests by the caller's rid, and the same states by their per-submission key.
        # A caller may reuse a rid once its request ended here, while the scheduler may still
        # be sending the old request's last outputs (an abort is asynchronous): those carry the
        # old key and find no state, instead of being taken for the new request's.
        self.states: dict[str, ReqState] = {}
        self._by_key: dict[str, ReqState] = {}
        self._keys = itertools.count()
        self.dead_reason: str | None = None
        # The memory tags released in the scheduler (release_memory_occupation), as its last
        # release / resume reply said: generation fails fast until they are resumed.
        self.released_memory: list[str] = []
        self._control: dict[int, Future] = {}  # control calls awaiting a reply, by call id
        self._call_ids = itertools.count(1)
        self._ctx = zmq.Context(2)
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.connect(port_args.scheduler_ipc)
        self._send_lock = threading.Lock()
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.bind(port_args.tokenizer_ipc)
        # Large routed-experts arrays come straight from the scheduler (transport.py).
        self._side = SideReceiver(self._ctx, port_args.tokenizer_ipc)
        self._closing = False
        self._receiver = threading.Thread(target=self._receive_loop, name="tm-recv", daemon=True)
        self._receiver.start()
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, "tokenize")
        # A text longer than this cannot fit the context, whatever its tokens: refused before
        # it is tokenized (tokens >= UTF-8 bytes / longest token >= characters / longest token).
        self.max_prompt_chars = (_NORMALIZER_SHRINK * self.context_len
                                 * self.tokenizer.max_token_bytes)

    # -- cheap checks, before any work ----------------------------------------------------------
    def check_sequence_count(self, count: int, what: str = "prompts", param: str = "text") -> None:
        """One HTTP request may ask for at most ``--max-prompts-per-request`` sequences (the
        Engine's caller is trusted: its batches are not capped)."""
        limit = self.server_args.max_prompts_per_request
        if count > limit:
            raise InvalidRequestError(
                f"the request asks for {count} {what}; this server takes at most {limit} per "
                f"request (--max-prompts-per-request): split it into several requests", param)

    def check_prompt_chars(self, chars: int, param: str = "text") -> None:
        """Refuses a prompt text that is certainly longer than the context, in O(1)."""
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {chars} characters; it cannot fit the context length of "
                f"{self.context_len} tokens (a prompt of more than {self.max_prompt_chars} "
                f"characters never does)", param)

    async def in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs tokenizer work (encoding, a chat template) and the checking and sending of
        control operations off the event loop, in the manager's pool (joined at close)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, functools.partial(fn, *args))

    # -- validation -----------------------------------------------------------------------------
    def check_prompt_size(self, obj: GenerateReqInput) -> None:
        """The checks of one prompt that cost O(1): its type and a bound on its length."""
        self.check_prompt(obj.text if obj.text is not None else obj.input_ids,
                          "text" if obj.text is not None else "input_ids")

    def check_prompt(self, prompt: Any, param: str) -> None:
        """A prompt (text, or token ids) that certainly cannot fit the context is refused."""
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), param)
        elif not isinstance(prompt, list):
            raise InvalidRequestError(f"'{param}' must be a string or a list of integers", param)
        elif len(prompt) >= self.context_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; the context length is "
                f"{self.context_len}, so prompts must be shorter", param)

    def tokenize(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        """Checks one single-prompt request and turns it into what the scheduler takes."""
        self.check_prompt_size(obj)
        if obj.text is not None:
            input_ids = self.tokenizer.encode(obj.text)
        else:
            input_ids = obj.input_ids
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
                raise ValueError("'input_ids' must be a list of integers")
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"'input_ids' holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})"
                )
        if not input_ids:
            raise ValueError("the prompt is empty; give a non-empty 'text' or 'input_ids'")
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens; the context length is "
                f"{self.context_len}, so prompts must be shorter"
            )
        params = SamplingParams.from_dict(obj.sampling_params)
        params.verify(self.vocab_size, self.context_len)
        params.normalize()
        if params.n != 1:
            raise ValueError("sampling_params.n must be 1 here; send a batch of prompts instead")
        if len(input_ids) + params.max_new_tokens > self.context_len:
            raise ValueError(
                f"max_new_tokens={params.max_new_tokens} plus the prompt's {len(input_ids)} "
                f"tokens exceeds the context length {self.context_len}; lower max_new_tokens "
                f"to at most {self.context_len - len(input_ids)}"
            )
        given = obj.options
        if self.server_args.return_routed_experts_default:
            given = {"return_routed_experts": True, **given}
        options = RequestOptions(**given).validate(
            len(input_ids), self.server_args.enable_return_routed_experts,
            num_experts=self.model_config.num_experts,
            default_dtype=self.server_args.routed_experts_dtype,
            weights_enabled=self.server_args.enable_return_routed_expert_weights,
            vocab_size=self.vocab_size,
        )
        grammar = request_grammar(self.grammars, params.constraint(),  # cached; off the loop
                                  self.server_args.speculative_algorithm)
        return TokenizedGenerateReqInput(
            rid=obj.rid, input_ids=list(input_ids), sampling_params=params, stream=obj.stream,
            options=options, grammar=grammar,
        )

    # -- generation -----------------------------------------------------------------------------
    async def generate_request(
        self, obj: GenerateReqInput, borrow_arrays: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Yields the result (or, when streaming, the chunks) of every prompt of ``obj``.

        A batch yields dicts with an ``index`` key. Everything is validated before anything
        is sent, so a bad prompt in a batch rejects the whole batch. ``borrow_arrays``: numpy
        results (``routed_experts_format="numpy"``) may be read-only views of shared memory
        that stays taken until they are dropped (for a caller that drops them soon).
        """
        self._check_alive()
        self._check_memory()
        prompts = obj.split()
        for prompt in prompts:  # O(1) each: a hopeless request costs no tokenizing
            self.check_prompt_size(prompt)
        tokenized = await self.in_tokenizer_thread(lambda: [self.tokenize(p) for p in prompts])
        self._check_rids_free(tokenized)
        groups = same_prompt_groups(tokenized)
        split_at = split_routed_rows(tokenized, groups)
        loop = asyncio.get_running_loop()
        keys: list[str] = []
        try:
            await self._prefill_shared_prompts(tokenized, groups, loop, keys)
            # Checked again with no await until every rid is registered: another request may
            # have taken one meanwhile (or the memory been released).
            self._check_rids_free(tokenized)
            self._check_memory()
            for i, t in enumerate(tokenized):
                keys.append(self._submit(t, loop, split_at.get(i), borrow_arrays=borrow_arrays))
            if obj.is_single:
                async for out in self._wait_one(tokenized[0]):
                    yield out
            else:
                async for out in self._wait_many(tokenized):
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            # The request states are gone by now (_wait_one's finally); the scheduler ignores
            # rids that already finished.
            if self.dead_reason is None:
                for key in keys:
                    self._send_obj(AbortReq(rid=key))
            raise

    def _check_rids_free(self, tokenized: list[TokenizedGenerateReqInput]) -> None:
        if len({t.rid for t in tokenized}) != len(tokenized) or any(
            t.rid in self.states for t in tokenized
        ):
            raise InvalidRequestError(
                "request ids ('rid') must be unique among running requests", "rid"
            )

    def _submit(self, req: TokenizedGenerateReqInput, loop: asyncio.AbstractEventLoop,
                split_at: int | None = None, observe: bool = True,
                borrow_arrays: bool = False) -> str:
        """Registers ``req``'s state and sends it; returns its per-submission key.
        ``observe``: a caller's request (counted by the metrics), not an internal one."""
        state = ReqState(rid=req.rid, key=f"{req.rid}#{next(self._keys)}", loop=loop,
                         event=asyncio.Event(), options=req.options, split_at=split_at,
                         borrow_arrays=borrow_arrays)
        if observe:
            self.observer.start(state)
        self.states[req.rid] = self._by_key[state.key] = state
        self._send_obj(dataclasses.replace(req, rid=state.key))
        return state.key

    async def _prefill_shared_prompts(
        self, tokenized: list[TokenizedGenerateReqInput], groups: list[list[int]],
        loop: asyncio.AbstractEventLoop, keys: list[str],
    ) -> None:
        """A prompt given more than once in one request (OpenAI ``n``, or a batch repeating
        it) is prefilled once, by a request that generates nothing, before its copies are
        sent: they find its KV and routed-experts rows in the prefix cache and compute only
        the prompt's last (partial) page. Without the prefix cache every copy prefills it."""
        if self.server_args.disable_radix_cache:
            return
        warm = []
        for group in groups:
            members = [tokenized[i] for i in group]
            if len(members) < 2 or len(members[0].input_ids) - 1 < self.server_args.page_size:
                continue  # alone, or nothing as long as a whole page to share
            # The copy asking the most: cached rows are reused only where they were captured.
            first = max(members, key=lambda t: (t.options.return_routed_experts,
                                                t.options.return_routed_expert_weights))
            # Captures rows (and weights) if a copy asks, but sends none back; no logprobs.
            options = dataclasses.replace(
                first.options, routed_experts_split=False, return_logprob=False,
                logprob_start_len=None, top_logprobs_num=0, token_ids_logprob=None,
                return_text_in_logprobs=False,
                routed_experts_start_len=len(first.input_ids)
                if first.options.return_routed_experts else None)
            warm.append(TokenizedGenerateReqInput(
                rid=f"shared-prefill-{uuid.uuid4().hex}", input_ids=first.input_ids,
                sampling_params=dataclasses.replace(first.sampling_params, max_new_tokens=0),
                options=options,
            ))
        for req in warm:
            keys.append(self._submit(req, loop, observe=False))
        for req in warm:
            async for _ in self._wait_one(req):
                pass

    async def _wait_many(self, reqs: list[TokenizedGenerateReqInput]):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: TokenizedGenerateReqInput) -> None:
            try:
                async for out in self._wait_one(req):
                    await queue.put({**out, "index": i})
            except BaseException as e:  # handed to the consumer below
                await queue.put(e)
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _wait_one(self, req: TokenizedGenerateReqInput):
        state = self.states[req.rid]
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if state.error is not None:
                    raise EngineDeadError(state.error)
                while state.pending or state.behind:
                    if state.behind:  # checked at every piece: a stream resumes mid-loop
                        state.pending.clear()
                        raise StreamBehindError(f"request {state.rid} was aborted: more than "
                                                f"{self.max_stream_backlog} outputs were unread")
                    piece = state.pending.popleft()
                    state.text += piece["text"]
                    state.output_ids += piece["output_ids"]
                    done = piece["meta_info"]["finish_reason"] is not None
                    if req.stream:
                        yield piece
                    elif done:
                        # A whole result: every logprob entry, not the last piece's.
                        meta = {**piece["meta_info"], **state.logprobs}
                        yield {**piece, "text": state.text, "output_ids": state.output_ids,
                               "meta_info": meta}
                    if done:
                        return
        finally:
            self.observer.on_cancel(state)  # a no-op once its final piece was seen
            if self.states.get(req.rid) is state:  # not a later request that reuses the rid
                del self.states[req.rid]
            self._by_key.pop(state.key, None)

    def abort_request(self, rid: str) -> bool:
        """Aborts the running request ``rid`` (False if there is none). The rid is free for a
        new request at once; the aborted one still gets its final output (finish reason
        "abort"), which carries its own key."""
        state = self.states.pop(rid, None)
        if state is None:
            return False
        if self.dead_reason is None:
            self._send_obj(AbortReq(rid=state.key))
        return True

    # -- control --------------------------------------------------------------------------------
    async def control(self, op: ControlOp) -> Any:
        """Runs the control operation ``op`` (``control.py``) in the scheduler, between steps;
        returns its reply (an ``op.reply_type``). Raises InvalidRequestError for an operation
        the caller got wrong, TimeoutError after ``op.timeout`` seconds."""
        self._check_alive()
        # Checking and pickling an operation can be heavy (a weight update's arrays): both
        # run in the manager's worker threads (joined at close), off the event loop. A copy:
        # the id is this call's, whatever the caller does with its object.
        given = op
        op = await self.in_tokenizer_thread(lambda: dataclasses.replace(given.checked()))
        op.call_id = next(self._call_ids)
        fut: Future = Future()
        self._control[op.call_id] = fut
        await self.in_tokenizer_thread(self._send_obj, op)
        reply = await asyncio.wait_for(asyncio.wrap_future(fut), op.timeout)
        if not isinstance(reply, op.reply_type):
            raise TypeError(f"{type(op).__name__} got a {type(reply).__name__} reply")
        if isinstance(reply, MemoryOccupationReqOutput):
            self.released_memory = reply.released
        return reply

    async def get_server_info(self) -> dict[str, Any]:
        """What ``Engine.get_server_info()`` and ``GET /get_server_info`` return: the
        scheduler's state and counters, the processes, and the server args (API key redacted)."""
        out = await self.control(GetServerInfo())
        return {
            **out.info,
            "pid": os.getpid(),
            "pids": self._child_pids(),
            "served_model_name": self.served_model_name,
            "server_args": self.server_args.redacted(),
        }

    # -- plumbing -------------------------------------------------------------------------------
    def _send_obj(self, obj: Any) -> None:
        with self._send_lock:
            self._send.send_pyobj(obj)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _check_memory(self) -> None:
        # A request sent while a release is under way is ended by the scheduler instead.
        if self.released_memory:
            raise MemoryReleasedError(memory_released_message(self.released_memory))

    def _receive_loop(self) -> None:
        try:
            self._receive_until_closed()
        except Exception as e:  # a bug; every request would hang: fail them loudly instead
            logger.exception("the tokenizer manager's receiver thread failed")
            self.set_dead(f"the engine's output receiver failed ({type(e).__name__}: {e}); "
                          "the engine cannot serve requests any more")

    def _receive_until_closed(self) -> None:
        while not self._closing:
            try:
                if not self._recv.poll(timeout=100):
                    continue
                msg = recv_obj(self._recv, side=self._side)
            except zmq.ZMQError:
                return
            if isinstance(msg, BatchStrOut):
                self._dispatch(msg)
            elif isinstance(msg, ControlReply):
                # A caller that timed out cancelled its future; its late reply is consumed here
                # all the same, and must not raise: this thread delivers every request's outputs.
                fut = self._control.pop(msg.call_id, None)
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_result(msg.reply)
            else:
                logger.warning("tokenizer manager got an unexpected %s", type(msg).__name__)

    def _dispatch(self, out: BatchStrOut) -> None:
        for rec in out.outputs:
            state = self._by_key.get(rec.rid)
            if state is None:
                continue  # aborted by its caller
            if state.behind:
                continue
            if len(state.pending) >= self.max_stream_backlog:
                self._drop_behind(state)
                continue
            meta = self._meta_info(state, rec, out.weight_version)
            if self.observer.enabled:  # before the piece is handed over (it may end the wait)
                self.observer.on_output(state, meta, rec)
            state.pending.append({"text": rec.text, "output_ids": rec.new_ids, "meta_info": meta})
            state.loop.call_soon_threadsafe(state.event.set)

    def _drop_behind(self, state: ReqState) -> None:
        """(Receiver thread.) Aborts it; its caller's wait raises StreamBehindError."""
        state.behind = True
        self._by_key.pop(state.key, None)
        if self.states.get(state.rid) is state:
            del self.states[state.rid]
        if self.dead_reason is None:
            self._send_obj(AbortReq(rid=state.key))
        logger.warning("request %s aborted: its client left %d outputs unread",
                       log_safe(state.rid), len(state.pending))
        state.loop.call_soon_threadsafe(state.event.set)

    def _meta_info(self, state: ReqState, rec: ReqOutput, weight_version: str) -> dict[str, Any]:
        """A piece's ``meta_info``: counts, finish reason, and each payload's own keys."""
        meta: dict[str, Any] = {
            "id": state.rid,
            "prompt_tokens": rec.prompt_tokens,
            "completion_tokens": rec.completion_tokens,
            "cached_tokens": rec.cached_tokens,
            "finish_reason": rec.finish_reason,
            "weight_version": weight_version,
        }
        if rec.spec_verify_ct is not None:
            meta["spec_verify_ct"] = rec.spec_verify_ct
        if rec.finish_reason is not None:
            meta["e2e_latency"] = time.monotonic() - state.created
        if rec.routed is not None:
            routed = rec.routed.meta_info(state.split_at, state.options.raw_routed_experts)
            if not state.borrow_arrays:
                routed = {k: np.array(v) if is_borrowed(v) else v for k, v in routed.items()}
            meta.update(routed)
        if rec.logprobs is not None:
            entries = logprobs_meta_info(
                rec.logprobs, self._token_text if state.options.return_text_in_logprobs else None)
            for key, values in entries.items():  # the whole lists, for a whole result
                state.logprobs.setdefault(key, []).extend(values)
            meta.update(entries)
        return meta

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def set_dead(self, reason: str) -> None:
        """A child died: fail every waiting request now and every new one from now on."""
        if self.dead_reason is not None:
            return
        logger.error("%s", reason)
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        for state in list(self.states.values()):
            state.error = reason
            if not state.loop.is_closed():  # else its caller is gone already
                state.loop.call_soon_threadsafe(state.event.set)
        while self._control:
            _, fut = self._control.popitem()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(reason))

    def close(self) -> None:
        """Stops the receiver and tokenizer threads; a call still waiting, in any loop, fails
        with EngineDeadError."""
        if self.dead_reason is None:
            self._fail_all("the engine was shut down")
        self._closing = True
        # Waits for a prompt being tokenized (bounded by the prompt checks), so no thread stays.
        self._tokenizer_pool.shutdown(wait=True, cancel_futures=True)
        self._receiver.join(timeout=2)
        self._send.close(linger=0)
        self._recv.close(linger=0)
        self._side.close()
        self._ctx.term()


def default_served_name(model_path: str) -> str:
    """A local model directory's own name; anything else (a hub id) as given."""
    if os.path.isdir(model_path):
        return os.path.basename(os.path.normpath(model_path)) or model_path
    return model_path
