"""Scoring: the per-token logprobs of given completions (``Engine.score``).

A completion is scored by one generate request that samples nothing: ``input_ids`` = prompt +
completion, ``max_new_tokens: 0``, ``return_logprob`` with ``logprob_start_len`` = the prompt's
length, so that its ``input_token_logprobs`` are exactly the completion's tokens, each given
everything before it (``log_softmax(logits / T)``, T = 1 for ``temperature=0``). The same body
works on the native ``/generate`` route.

All completions go in one batch. A prompt shared by several completions is computed once:
it is prefilled alone first (a ``max_new_tokens: 0`` request, capturing routed-experts rows if
they are asked for), so that the completions find its KV in the prefix cache. They can reuse it
up to the token before the first scored position (a cached position has no logits), in whole
pages; each record's ``cached_tokens`` says how much they did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from sgl_jax.srt.managers.io_struct import GenerateReqInput, order_results
from sgl_jax.srt.managers.request_options import InvalidRequestError
from sgl_jax.srt.managers.tokenizer_manager import TokenizerManager
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def score_inputs(prompt_ids: Any, completion_ids: Any, vocab_size: int,
                 context_len: int) -> list[list[int]]:
    """One prompt per completion (the shared one repeated), after checking both: non-empty
    lists of token ids of the vocabulary, each prompt + completion shorter than the context."""
    if not isinstance(completion_ids, list) or not completion_ids or not all(
            _is_ids(c) for c in completion_ids):
        raise InvalidRequestError("'completion_ids' must be a non-empty list of lists of token "
                                  "ids (one list per completion)", "completion_ids")
    n = len(completion_ids)
    if _is_ids(prompt_ids) and prompt_ids:
        prompts = [prompt_ids] * n
    elif isinstance(prompt_ids, list) and prompt_ids and all(_is_ids(p) for p in prompt_ids):
        if len(prompt_ids) != n:
            raise InvalidRequestError(
                f"'prompt_ids' has {len(prompt_ids)} prompts for {n} completions: give one "
                "prompt (a list of ids) shared by all, or one per completion", "prompt_ids")
        prompts = prompt_ids
    else:
        raise InvalidRequestError("'prompt_ids' must be a non-empty list of token ids (one "
                                  "prompt for every completion) or one such list per "
                                  "completion", "prompt_ids")
    for i, (prompt, completion) in enumerate(zip(prompts, completion_ids, strict=True)):
        what = f"prompt {i}" if prompts is prompt_ids else "the prompt"
        if not prompt:
            raise InvalidRequestError(f"{what} is empty: the first completion token needs a "
                                      "context to be scored", "prompt_ids")
        if not completion:
            raise InvalidRequestError(f"completion {i} is empty: nothing to score",
                                      "completion_ids")
        for name, ids, param in ((what, prompt, "prompt_ids"),
                                 (f"completion {i}", completion, "completion_ids")):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{name} holds {bad}, outside the vocabulary [0, {vocab_size})", param)
        if len(prompt) + len(completion) >= context_len:
            raise InvalidRequestError(
                f"{what} + completion {i} is {len(prompt) + len(completion)} tokens; the "
                f"context length is {context_len}, so they must be shorter", "completion_ids")
    return [list(p) for p in prompts]


def shared_prompts(prompts: list[list[int]], page_size: int) -> list[list[int]]:
    """The prompts worth prefilling alone first: given for two or more completions, and with
    at least one whole page before their last token (the most a scored completion reuses)."""
    counts: dict[tuple[int, ...], int] = {}
    for p in prompts:
        counts[tuple(p)] = counts.get(tuple(p), 0) + 1
    return [list(p) for p, c in counts.items() if c >= 2 and len(p) - 1 >= page_size]


async def _results(agen: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    return order_results([out async for out in agen])


async def score(
    tm: TokenizerManager, prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]], temperature: float = 1.0,
    return_routed_experts: bool = False,
) -> list[dict[str, Any]]:
    """One record per completion, in order: ``logprobs`` (a float per completion token),
    ``cached_tokens`` (prompt tokens it took from the prefix cache), ``weight_version``, and
    with ``return_routed_experts`` ``routed_experts``: int32 ``[len(prompt) + len(completion)
    - 1, num_hidden_layers, num_experts_per_tok]`` (the engine's routed-experts contract)."""
    cfg = tm.model_config
    prompts = score_inputs(prompt_ids, completion_ids, cfg.vocab_size, tm.context_len)
    params = {"max_new_tokens": 0, "temperature": temperature}
    want = bool(return_routed_experts)
    warm = [] if tm.server_args.disable_radix_cache else \
        shared_prompts(prompts, tm.server_args.page_size)
    if warm:
        # Rows are captured (if asked) but none is sent back: they start at the prompt's end.
        options: dict[str, Any] = {"return_routed_experts": want}
        if want:
            options["routed_experts_start_len"] = [len(p) for p in warm]
        await _results(tm.generate_request(GenerateReqInput(
            input_ids=warm, sampling_params=params, options=options)))
    outs = await _results(tm.generate_request(GenerateReqInput(
        input_ids=[p + list(c) for p, c in zip(prompts, completion_ids, strict=True)],
        sampling_params=params,
        options={"return_logprob": True, "logprob_start_len": [len(p) for p in prompts],
                 "return_routed_experts": want,
                 # int32 whatever the server's default: -1 marks a layer without a router;
                 # arrays as they are, no base64 round trip.
                 **({"routed_experts_dtype": "int32", "routed_experts_format": "numpy"}
                    if want else {})})))
    records = []
    for out, completion in zip(outs, completion_ids, strict=True):
        meta = out["meta_info"]
        logprobs = [entry[0] for entry in meta["input_token_logprobs"]]
        if len(logprobs) != len(completion):  # aborted (by a caller, an update, a release)
            reason = (meta.get("finish_reason") or {}).get("message") or "no reason given"
            raise RuntimeError(
                f"scoring a completion of {len(completion)} tokens ended with "
                f"{len(logprobs)} logprobs: {reason}; score it again")
        record: dict[str, Any] = {
            "logprobs": logprobs,
            "cached_tokens": meta["cached_tokens"],
            "weight_version": meta["weight_version"],
        }
        if want:
            record["routed_experts"] = extract_routed_experts_from_meta_info(out).reshape(
                -1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        records.append(record)
    return records
