"""/v1/chat/completions: the messages rendered by the model's chat template, then a completion.

The template output already holds every special token the model expects, so it is tokenized
here WITHOUT adding special tokens (a second BOS would change the model's input), and the ids
go to the manager as ``input_ids``. Without ``max_tokens`` / ``max_completion_tokens`` a chat
may use the rest of the context, as with OpenAI.

Token in / token out (SGLang's): ``input_ids`` is the prompt exactly (no template); the ids
come back in ``sglext`` (``return_input_ids_in_sglext`` / ``return_output_ids_in_sglext``, the
``x-sglext-return-*`` headers or the server's ``--return-input-ids`` / ``--return-output-ids``).
``return_meta_info`` keeps each choice's ``meta_info`` whole (``output_token_logprobs`` too).

Tools: ``tools`` go to the chat template; with ``tool_choice`` "auto" (the default when tools
are given) the text is parsed for calls by the ``--tool-call-parser`` (qwen25 when unset).
"required" and a named function are enforced by a grammar of one call (tool_grammar.py).
``response_format`` (json_object, json_schema) becomes the ``json_schema`` constraint.
With a ``--reasoning-parser``, ``<think>...</think>`` goes to ``reasoning_content``.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import BaseModel

from sgl_jax.srt.constrained.grammar import request_grammar
from sgl_jax.srt.entrypoints.openai.logprobs import (
    chat_logprobs,
    chat_options,
    without_logprobs,
)
from sgl_jax.srt.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    OpenAIError,
    ToolCall,
    UsageInfo,
)
from sgl_jax.srt.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    StreamReasoning,
    get_reasoning_parser,
)
from sgl_jax.srt.entrypoints.openai.serving_completions import (
    OpenAIPlan,
    OpenAIServing,
    finish_reason,
    matched_stop,
    stream_meta,
)
from sgl_jax.srt.entrypoints.openai.sglext import SglextOptions
from sgl_jax.srt.entrypoints.openai.tool_grammar import special_markers, tool_call_grammar
from sgl_jax.srt.entrypoints.openai.tool_parsers import (
    StreamToolParser,
    ToolParser,
    get_tool_parser,
    new_call_id,
)


class ChatPlan(OpenAIPlan):
    def __init__(self, *args: Any, logprobs: bool = False, meta_info_whole: bool = False,
                 tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None, stream_reasoning: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logprobs = logprobs
        self.meta_info_whole = meta_info_whole  # return_meta_info: logprob lists kept
        self.tool_parser = tool_parser  # None: no tools, or tool_choice "none"
        self.reasoning_parser = reasoning_parser  # None: no parser, or separate_reasoning off
        self.stream_reasoning = stream_reasoning
        self._reasoning: dict[int, StreamReasoning] = {}
        self._role_sent: set[int] = set()  # choices whose first chunk (with the role) is out
        self._streams: dict[int, StreamToolParser] = {}
        self._called: set[int] = set()  # streamed choices that made a tool call

    def _logprobs(self, meta: dict[str, Any]) -> dict[str, Any] | None:
        return chat_logprobs(meta) if self.logprobs else None

    def _meta(self, meta: dict[str, Any] | None) -> dict[str, Any] | None:
        return meta if self.meta_info_whole else without_logprobs(meta)

    def _message(self, text: str) -> tuple[ChatMessageOut, bool]:
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.split(text)
        if self.tool_parser is None:
            return ChatMessageOut(content=text, reasoning_content=reasoning), False
        content, calls = self.tool_parser.parse(text)
        if not calls:
            return ChatMessageOut(content=text, reasoning_content=reasoning), False
        tool_calls = [ToolCall(id=new_call_id(), type="function",
                               function={"name": c.name, "arguments": c.arguments})
                      for c in calls]
        return ChatMessageOut(content=content or None, reasoning_content=reasoning,
                              tool_calls=tool_calls), True

    def make_response(self, results: list[dict[str, Any]], usage: UsageInfo) -> BaseModel:
        choices = []
        for r in results:
            message, called = self._message(r["text"])
            reason = finish_reason(r["meta_info"])
            choices.append(ChatCompletionChoice(
                index=r["index"], message=message,
                logprobs=self._logprobs(r["meta_info"]),
                finish_reason="tool_calls" if called and reason == "stop" else reason,
                matched_stop=matched_stop(r["meta_info"]),
                meta_info=self._meta(r["meta_info"]),
            ))
        return ChatCompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                      usage=usage)

    def make_chunk(self, out: dict[str, Any], final: bool) -> BaseModel:
        index, meta = out["index"], out["meta_info"]
        first = index not in self._role_sent
        self._role_sent.add(index)
        text, calls, reasoning = out["text"], None, None
        if self.reasoning_parser is not None:
            split = self._reasoning.setdefault(
                index, StreamReasoning(self.reasoning_parser, self.stream_reasoning))
            reasoning, text = split.feed(text, final)
        if self.tool_parser is not None:
            stream = self._streams.setdefault(index, StreamToolParser(self.tool_parser))
            text, deltas = stream.feed(text, final)
            if deltas:
                calls = [ToolCall(**d) for d in deltas]
                self._called.add(index)
        delta = DeltaMessage(
            role="assistant" if first else None,
            content=text if text or (first and not calls and not reasoning) else None,
            reasoning_content=reasoning or None,
            tool_calls=calls,
        )
        reason = finish_reason(meta)
        if reason == "stop" and index in self._called:
            reason = "tool_calls"
        choice = ChatStreamChoice(
            index=index, delta=delta, logprobs=self._logprobs(meta),
            finish_reason=reason, matched_stop=matched_stop(meta),
            meta_info=self._meta(stream_meta(meta, final)),
        )
        return ChatCompletionStreamResponse(id=self.response_id, model=self.model,
                                            choices=[choice])

    def make_usage_chunk(self, usage: UsageInfo | None) -> BaseModel:
        return ChatCompletionStreamResponse(id=self.response_id, model=self.model, choices=[],
                                            usage=usage)


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    @cached_property
    def special_markers(self) -> dict[str, int]:
        """The tool-call markers the served tokenizer holds as special tokens."""
        return special_markers(self.tm.tokenizer)

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump() for m in req.messages]
        tools = None
        if req.tools and req.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        prompt = self.tm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tools=tools)
        self.tm.check_prompt_chars(len(prompt), "messages")
        return self.tm.tokenizer.encode(prompt, add_special_tokens=False)

    def tool_parser(self, req: ChatCompletionRequest) -> ToolParser | None:
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise OpenAIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
            return None
        if choice == "none":
            return None
        name = self.tm.server_args.tool_call_parser or "qwen25"
        return get_tool_parser(name, [t.model_dump() for t in req.tools])

    def constraint(self, req: ChatCompletionRequest) -> dict[str, str]:
        """The sampling parameters that constrain the output: ``response_format``'s schema,
        or the grammar of a call that ``tool_choice`` requires (at most one of these, and
        not with the json_schema / regex / ebnf fields)."""
        asked = {k: getattr(req, k) for k in ("json_schema", "regex", "ebnf")
                 if getattr(req, k) is not None}
        schema = None if req.response_format is None else req.response_format.schema_text()
        if schema is not None:
            asked["response_format"] = schema
        grammar = None
        if req.tools and req.tool_choice is not None:
            grammar = tool_call_grammar(req.tools, req.tool_choice,
                                        self.tm.server_args.tool_call_parser or "qwen25",
                                        self.special_markers)
        if grammar is not None:
            asked["tool_choice"] = grammar
        if len(asked) > 1:
            raise OpenAIError(400, f"give at most one output constraint; got {', '.join(asked)}",
                              param=list(asked)[1])
        if schema is not None:
            return {"json_schema": schema}
        return {"ebnf": grammar} if grammar is not None else {}

    def check_constraint(self, req: ChatCompletionRequest, constraint: dict[str, str]) -> None:
        """Compiles (and caches) a constraint the chat fields made, so that its errors name
        those fields ("response_format", "tool_choice") rather than the sampling parameter
        it becomes; in the tokenizer threads."""
        field = ("response_format" if "json_schema" in constraint and req.json_schema is None
                 else "tool_choice" if "ebnf" in constraint and req.ebnf is None else None)
        if field is None:
            return  # the request's own field: checked by name with the sampling parameters
        try:
            request_grammar(self.tm.grammars, (*constraint.items(),)[0],
                            self.tm.server_args.speculative_algorithm, field)
        except ValueError as e:
            raise OpenAIError(400, str(e), param=field) from None

    async def plan(self, req: ChatCompletionRequest,
                   headers: dict[str, bool] | None = None) -> ChatPlan:
        """``headers``: the ``x-sglext-return-*`` flags (``input_ids``, ``output_ids``)."""
        self.check_model(req.model)
        options = chat_options(req.logprobs, req.top_logprobs)
        parser = self.tool_parser(req)
        constraint = self.constraint(req)
        if constraint:
            await self.tm.in_tokenizer_thread(self.check_constraint, req, constraint)
        # The template only adds text: messages already longer than the bound never fit.
        self.tm.check_prompt_chars(sum(_content_chars(m.content) for m in req.messages),
                                   "messages")
        if req.input_ids is not None:  # token in: the prompt exactly, no template
            self.tm.check_prompt(req.input_ids, "input_ids")
            ids = list(req.input_ids)
        else:
            ids = await self.tm.in_tokenizer_thread(self.prompt_ids, req)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if max_new is None:
            # The rest of the context (the manager rejects a prompt that leaves no room).
            max_new = max(self.tm.context_len - len(ids), 0)
        obj, rids, response_id = self.make_batch(req, [ids], [max_new], options)
        for params in obj.sampling_params:
            params.update(constraint)
            if "ebnf" in constraint and req.ebnf is None and self.special_markers:
                # A call grammar may write markers as special tokens: the parser needs them
                # in the text.
                params["skip_special_tokens"] = False
        args, headers = self.tm.server_args, headers or {}
        ext = SglextOptions(
            input_ids=req.return_input_ids_in_sglext or headers.get("input_ids", False)
            or args.return_input_ids,
            output_ids=req.return_output_ids_in_sglext or headers.get("output_ids", False)
            or args.return_output_ids,
            cached_tokens_details=req.return_cached_tokens_details,
            routed_experts=not req.return_meta_info,
        )
        reasoning = get_reasoning_parser(args.reasoning_parser) \
            if req.separate_reasoning else None
        return ChatPlan(obj, rids, response_id, self.served_model_name, req.n,
                        req.include_usage, logprobs=bool(options),
                        meta_info_whole=req.return_meta_info, tool_parser=parser,
                        reasoning_parser=reasoning, stream_reasoning=req.stream_reasoning,
                        ext=ext, prompt_ids=[ids])


def _content_chars(content: str | list[dict[str, Any]] | None) -> int:
    """Characters of a message's text (its text parts, for a list of content parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p.get("text"), str))
    return 0
