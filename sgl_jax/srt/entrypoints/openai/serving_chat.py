"""/v1/chat/completions: the messages rendered by the model's chat template, then a completion.

The template output already holds every special token the model expects, so it is tokenized
here WITHOUT adding special tokens (a second BOS would change the model's input), and the ids
go to the manager as ``input_ids``. Without ``max_tokens`` / ``max_completion_tokens`` a chat
may use the rest of the context, as with OpenAI.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

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
    UsageInfo,
)
from sgl_jax.srt.entrypoints.openai.serving_completions import (
    OpenAIPlan,
    OpenAIServing,
    finish_reason,
    matched_stop,
    stream_meta,
)


class ChatPlan(OpenAIPlan):
    def __init__(self, *args: Any, logprobs: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logprobs = logprobs
        self._role_sent: set[int] = set()  # choices whose first chunk (with the role) is out

    def _logprobs(self, meta: dict[str, Any]) -> dict[str, Any] | None:
        return chat_logprobs(meta) if self.logprobs else None

    def make_response(self, results: list[dict[str, Any]], usage: UsageInfo) -> BaseModel:
        choices = [
            ChatCompletionChoice(
                index=r["index"], message=ChatMessageOut(content=r["text"]),
                logprobs=self._logprobs(r["meta_info"]),
                finish_reason=finish_reason(r["meta_info"]),
                matched_stop=matched_stop(r["meta_info"]),
                meta_info=without_logprobs(r["meta_info"]),
            )
            for r in results
        ]
        return ChatCompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                      usage=usage)

    def make_chunk(self, out: dict[str, Any], final: bool) -> BaseModel:
        index, meta = out["index"], out["meta_info"]
        first = index not in self._role_sent
        self._role_sent.add(index)
        delta = DeltaMessage(
            role="assistant" if first else None,
            content=out["text"] if out["text"] or first else None,
        )
        choice = ChatStreamChoice(
            index=index, delta=delta, logprobs=self._logprobs(meta),
            finish_reason=finish_reason(meta), matched_stop=matched_stop(meta),
            meta_info=without_logprobs(stream_meta(meta, final)),
        )
        return ChatCompletionStreamResponse(id=self.response_id, model=self.model,
                                            choices=[choice])

    def make_usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return ChatCompletionStreamResponse(id=self.response_id, model=self.model, choices=[],
                                            usage=usage)


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump() for m in req.messages]
        prompt = self.tm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        self.tm.check_prompt_chars(len(prompt), "messages")
        return self.tm.tokenizer.encode(prompt, add_special_tokens=False)

    async def plan(self, req: ChatCompletionRequest) -> ChatPlan:
        self.check_model(req.model)
        options = chat_options(req.logprobs, req.top_logprobs)
        # The template only adds text: messages already longer than the bound never fit.
        self.tm.check_prompt_chars(sum(_content_chars(m.content) for m in req.messages),
                                   "messages")
        ids = await self.tm.in_tokenizer_thread(self.prompt_ids, req)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if max_new is None:
            # The rest of the context (the manager rejects a prompt that leaves no room).
            max_new = max(self.tm.context_len - len(ids), 0)
        obj, rids, response_id = self.make_batch(req, [ids], [max_new], options)
        return ChatPlan(obj, rids, response_id, self.served_model_name, req.n,
                        req.include_usage, logprobs=bool(options))


def _content_chars(content: str | list[dict[str, Any]] | None) -> int:
    """Characters of a message's text (its text parts, for a list of content parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p.get("text"), str))
    return 0
