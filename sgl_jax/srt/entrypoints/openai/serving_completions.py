"""/v1/completions, and the pieces every OpenAI route shares.

The serving layer only translates: an OpenAI request becomes one batched
:class:`GenerateReqInput` for the shared TokenizerManager (``n`` copies of every prompt, each an
independent request with its own rid and, when a seed is given, seed + copy index), and the
manager's outputs become OpenAI response bodies or stream chunks. Driving the generation
(queues, client disconnects, SSE framing) is the HTTP layer's job.

Choice ``i`` is copy ``i % n`` of prompt ``i // n``, as in OpenAI's API. Every choice carries
the manager's ``meta_info`` (token counts, ``routed_experts`` when asked for); in a stream the
choice's final chunk does, and its earlier chunks carry a ``meta_info`` with only the routed
experts keys when they bring new rows (``stream_meta``).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel

from sgl_jax.srt.entrypoints.openai.logprobs import (
    CompletionLogprobs,
    completion_options,
    without_logprobs,
)
from sgl_jax.srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    OpenAIError,
    OpenAISamplingRequest,
    UsageInfo,
    short_repr,
)
from sgl_jax.srt.entrypoints.openai.sglext import SequenceExt, SglextOptions
from sgl_jax.srt.entrypoints.wire import JSON_WIRE, Payload
from sgl_jax.srt.managers.io_struct import GenerateReqInput, order_results
from sgl_jax.srt.managers.tokenizer_manager import TokenizerManager
from sgl_jax.srt.routed_experts_output import routed_experts_keys

_FINISH_REASONS = {"stop": "stop", "length": "length"}
# SGLang's name for "the served model" (its requests' default): SGLang's examples send it.
DEFAULT_MODEL_NAME = "default"


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    return _FINISH_REASONS.get(reason.get("type"), "abort")


def stream_meta(meta: dict[str, Any], final: bool) -> dict[str, Any] | None:
    """A stream chunk's ``meta_info``: all of it on the final chunk; before, only the routed
    experts keys (the rows completed since the previous chunk, and the prompt's apart with
    ``routed_experts_split``), or none."""
    if final:
        return meta
    return routed_experts_keys(meta) or None


def matched_stop(meta: dict[str, Any]) -> int | str | None:
    reason = meta.get("finish_reason")
    return reason.get("matched") if reason else None


class OpenAIPlan:
    """One OpenAI request as a batch for the manager, plus how to format what comes back.

    The HTTP layer calls ``response`` with every final result (non-streaming), or ``chunks``
    with every streamed piece and then ``tail`` (streaming). They return JSON texts.
    """

    def __init__(
        self, obj: GenerateReqInput, rids: list[str], response_id: str, model: str, n: int,
        include_usage: bool, ext: SglextOptions | None = None,
        prompt_ids: list[list[int]] | None = None,
    ) -> None:
        self.obj, self.rids, self.response_id, self.model = obj, rids, response_id, model
        self.n, self.include_usage = n, include_usage
        self.final_metas: dict[int, dict[str, Any]] = {}  # index -> final meta_info (streaming)
        self.wire = JSON_WIRE  # serve() sets the one the client accepts
        self.ext = ext or SglextOptions()
        self.prompt_ids = prompt_ids  # per prompt, when known here
        # sglext describes one sequence: a response of one choice (see sglext.py).
        self.seq = SequenceExt(prompt_ids[0] if prompt_ids else None) \
            if len(rids) == 1 else None

    def _dumps(self, body: BaseModel, sglext: dict[str, Any] | None = None) -> Payload:
        """The body in the wire's format, written from the model's plain dump: pydantic
        neither revalidates nor re-encodes the large routed-experts payloads of ``meta_info``
        (its JSON serializer took 150-220 ms for a 32k-token request's 64 MiB base64)."""
        data = body.model_dump()
        if sglext:
            data["sglext"] = sglext
        return self.wire.dumps(data)

    @property
    def stream(self) -> bool:
        return self.obj.stream

    def usage(self, metas: dict[int, dict[str, Any]]) -> UsageInfo:
        # The n copies of a prompt share it: count its tokens once, like OpenAI does.
        prompt = sum(m["prompt_tokens"] for i, m in metas.items() if i % self.n == 0)
        completion = sum(m["completion_tokens"] for m in metas.values())
        cached = sum(m["cached_tokens"] for i, m in metas.items() if i % self.n == 0)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details={"cached_tokens": cached},
        )

    def response(self, results: list[dict[str, Any]]) -> Payload:
        ordered = order_results(results)
        body = self.make_response(ordered, self.usage({r["index"]: r["meta_info"] for r in ordered}))
        if self.seq is not None:
            self.seq.add(ordered[0], whole=True)
        return self._dumps(body, self.seq.body(self.ext) if self.seq else None)

    def chunks(self, out: dict[str, Any]) -> list[Payload]:
        meta = out["meta_info"]
        final = meta.get("finish_reason") is not None
        if final:
            self.final_metas[out["index"]] = meta
        if self.seq is not None:
            self.seq.add(out, whole=False)
        return [self._dumps(self.make_chunk(out, final))]

    def tail(self) -> list[Payload]:
        """After the finish chunks: one chunk of no choices with the whole ``sglext`` (when
        it has anything), then the usage chunk (when asked for)."""
        out = []
        ext = self.seq.body(self.ext) if self.seq is not None else None
        if ext:
            out.append(self._dumps(self.make_usage_chunk(None), ext))
        if self.include_usage:
            out.append(self._dumps(self.make_usage_chunk(self.usage(self.final_metas))))
        return out

    # Implemented per route.
    def make_response(self, results: list[dict[str, Any]], usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def make_chunk(self, out: dict[str, Any], final: bool) -> BaseModel:
        raise NotImplementedError

    def make_usage_chunk(self, usage: UsageInfo | None) -> BaseModel:
        """A chunk of no choices: the usage chunk, or (``usage`` None) the sglext chunk."""
        raise NotImplementedError


class OpenAIServing:
    """What the OpenAI routes share: the manager, model-name checks, batch construction."""

    id_prefix = "cmpl"

    def __init__(
        self, tokenizer_manager: TokenizerManager, served_model_name: str, model_names: set[str]
    ) -> None:
        self.tm = tokenizer_manager
        self.served_model_name = served_model_name
        self.model_names = model_names | {served_model_name}

    def check_model(self, model: str | None) -> None:
        """``model`` must name the served model; None and SGLang's "default" mean it."""
        if model is not None and model != DEFAULT_MODEL_NAME and model not in self.model_names:
            raise OpenAIError(
                404, f"the model {short_repr(model)} does not exist; this server serves "
                f"{self.served_model_name!r} (also reachable as {DEFAULT_MODEL_NAME!r})",
                param="model", code="model_not_found",
            )

    def make_batch(
        self, req: OpenAISamplingRequest, prompts: list[str] | list[list[int]],
        max_new_tokens: list[int | None], options: dict[str, Any] | None = None,
    ) -> tuple[GenerateReqInput, list[str], str]:
        """``n`` independent requests per prompt, in choice order."""
        self.tm.check_sequence_count(len(prompts) * req.n, "completions (prompts x n)", "n")
        response_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        params, expanded = [], []
        seed = req.request_seed
        for prompt, max_new in zip(prompts, max_new_tokens, strict=True):
            for j in range(req.n):
                p = req.sampling_params(max_new)
                if seed is not None:
                    p["seed"] = seed + j  # distinct but reproducible copies
                params.append(p)
                expanded.append(prompt)
        # rids derive from the response id, so a client can abort a choice via /abort_request.
        rids = [f"{response_id}-{i}" for i in range(len(params))]
        as_text = isinstance(expanded[0], str)
        obj = GenerateReqInput(
            text=expanded if as_text else None,
            input_ids=None if as_text else expanded,
            sampling_params=params, rid=rids, stream=req.stream,
            options={**req.options(), **(options or {})},
        )
        return obj, rids, response_id


class CompletionPlan(OpenAIPlan):
    def __init__(self, *args: Any, echo: list[str] | None = None, logprobs: bool = False,
                 token_ids: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo  # per prompt, its text, prepended to each of its choices (echo)
        self.logprobs = logprobs
        self.token_ids = token_ids  # return_token_ids (prompt_ids holds every prompt's)
        self._ids_started: set[int] = set()
        self._started: dict[int, CompletionLogprobs] = {}  # streamed choices' logprob state

    def _ids(self, out: dict[str, Any]) -> dict[str, Any]:
        """``prompt_token_ids`` (a choice's first piece) and ``token_ids`` (this piece's)."""
        if not self.token_ids:
            return {}
        index = out["index"]
        ids: dict[str, Any] = {"token_ids": list(out.get("output_ids") or [])}
        if index not in self._ids_started:
            self._ids_started.add(index)
            ids["prompt_token_ids"] = self.prompt_ids[index // self.n]
        return ids

    def _text_and_logprobs(self, out: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
        """A choice's text and logprobs of this piece; the echo comes with its first piece."""
        index = out["index"]
        first = index not in self._started
        state = self._started.setdefault(index, CompletionLogprobs(self.echo is not None))
        text = out["text"]
        if first and self.echo is not None:
            text = self.echo[index // self.n] + text
        return text, state.piece(out["meta_info"]) if self.logprobs else None

    def make_response(self, results: list[dict[str, Any]], usage: UsageInfo) -> BaseModel:
        choices = []
        for r in results:
            text, logprobs = self._text_and_logprobs(r)
            choices.append(CompletionChoice(
                index=r["index"], text=text, logprobs=logprobs,
                finish_reason=finish_reason(r["meta_info"]),
                matched_stop=matched_stop(r["meta_info"]),
                meta_info=without_logprobs(r["meta_info"]), **self._ids(r),
            ))
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                  usage=usage)

    def make_chunk(self, out: dict[str, Any], final: bool) -> BaseModel:
        meta = out["meta_info"]
        text, logprobs = self._text_and_logprobs(out)
        choice = CompletionChoice(
            index=out["index"], text=text, logprobs=logprobs, finish_reason=finish_reason(meta),
            matched_stop=matched_stop(meta),
            meta_info=without_logprobs(stream_meta(meta, final)), **self._ids(out),
        )
        return CompletionStreamResponse(id=self.response_id, model=self.model, choices=[choice])

    def make_usage_chunk(self, usage: UsageInfo | None) -> BaseModel:
        return CompletionStreamResponse(id=self.response_id, model=self.model, choices=[],
                                        usage=usage)


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"

    def plan(self, req: CompletionRequest) -> CompletionPlan:
        self.check_model(req.model)
        unsupported = {
            "suffix": req.suffix is not None,
            "best_of": req.best_of is not None and req.best_of != req.n,
        }
        for name, asked in unsupported.items():
            if asked:
                raise OpenAIError(400, f"'{name}' is not supported by this server", param=name)
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]  # one prompt given as token ids
        else:
            prompts = list(prompt)
        if not prompts:
            raise OpenAIError(400, "'prompt' must not be an empty list", param="prompt")
        for p in prompts:  # O(1) each, before the echo decodes anything
            self.tm.check_prompt(p, "prompt")
        options = completion_options(req.logprobs, req.echo)
        max_new = req.max_tokens if req.max_tokens is not None else 16
        # Token ids wanted back: text prompts are tokenized here, as the manager would.
        ids = [self.tm.tokenizer.encode(p) if isinstance(p, str) else list(p)
               for p in prompts] if req.return_token_ids else None
        obj, rids, response_id = self.make_batch(req, ids or prompts,
                                                 [max_new] * len(prompts), options)
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else
                    self.tm.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        return CompletionPlan(obj, rids, response_id, self.served_model_name, req.n,
                              req.include_usage, echo=echo, logprobs=bool(options),
                              token_ids=req.return_token_ids, prompt_ids=ids,
                              ext=SglextOptions(
                                  cached_tokens_details=req.return_cached_tokens_details))
