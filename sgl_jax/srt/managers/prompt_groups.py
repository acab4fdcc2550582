"""A generate request's prompts, grouped: requests with the same prompt ids (``n > 1``, or
one prompt repeated) are prefilled once, and ``routed_experts_split`` returns a prompt's rows
once per group."""

from __future__ import annotations

import dataclasses

from sgl_jax.srt.managers.io_struct import TokenizedGenerateReqInput


def same_prompt_groups(tokenized: list[TokenizedGenerateReqInput]) -> list[list[int]]:
    """Indices of the requests with the same prompt ids, grouped, in first-seen order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, req in enumerate(tokenized):
        groups.setdefault(tuple(req.input_ids), []).append(i)
    return list(groups.values())


def split_routed_rows(
    tokenized: list[TokenizedGenerateReqInput], groups: list[list[int]]
) -> dict[int, int]:
    """For ``routed_experts_split``: the first request of each prompt that asks returns the
    prompt's rows apart (index -> where its rows split); the others of that prompt return
    only their generated rows (their ``routed_experts_start_len`` becomes the prompt length,
    so the prompt's rows are neither gathered nor sent again)."""
    split_at: dict[int, int] = {}
    for group in groups:
        askers = [i for i in group if tokenized[i].options.routed_experts_split]
        for j, i in enumerate(askers):
            prompt_len = len(tokenized[i].input_ids)
            if j == 0:
                split_at[i] = prompt_len
            else:
                tokenized[i] = dataclasses.replace(tokenized[i], options=dataclasses.replace(
                    tokenized[i].options, routed_experts_start_len=prompt_len))
    return split_at
