"""SGLang's ``sglext``: the top-level extension object of OpenAI responses and stream chunks.

What it may hold (each key only when it has something; an empty ``sglext`` is omitted):

- ``routed_experts``: base64 of little-endian int32 ids, logical shape
  ``[rows, num_hidden_layers, top_k]``, rows ``routed_experts_start_len`` .. seq_len - 2
  (whatever wire dtype ``choices[i].meta_info`` uses, ``sglext`` is always int32). Omitted
  with ``return_meta_info``: the rows are then read from ``choices[i].meta_info``, as SGLang
  does.
- ``cached_tokens_details`` (``return_cached_tokens_details``): ``{"device": n, "host": 0}``,
  the prompt tokens served from the device prefix cache (there is no host tier here).
- ``spec_tokens_details``: with speculative decoding, the verify steps the request took part
  in and the accepted length (tokens per verify step).
- chat only: ``input_ids`` (the prompt's ids, exactly what the model read) and ``output_ids``
  (the generated ids) when asked for.

``sglext`` describes one sequence: it is built for a response with one choice. With several
choices (``n`` > 1) it is omitted and each choice's ``meta_info`` carries its own data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_jax.srt.routed_experts_codec import (
    DEFAULT_DTYPE,
    decode_routed_experts,
    encode_routed_experts,
    to_wire_dtype,
)

_TRUE = frozenset({"1", "true", "yes", "on"})


def header_flag(value: str | None) -> bool:
    """An ``x-sglext-*`` header's value as a flag (``true``/``1``/``yes``/``on``)."""
    return value is not None and value.strip().lower() in _TRUE


@dataclass(frozen=True)
class SglextOptions:
    """What a request asked ``sglext`` to carry."""

    input_ids: bool = False
    output_ids: bool = False
    cached_tokens_details: bool = False
    # With return_meta_info the rows stay in choices[i].meta_info only.
    routed_experts: bool = True


def _rows(meta: dict[str, Any], prefix: str) -> np.ndarray | None:
    payload = meta.get(f"{prefix}routed_experts")
    if payload is None:
        return None
    name = meta.get(f"{prefix}routed_experts_dtype") or DEFAULT_DTYPE
    flat = decode_routed_experts(payload, name)
    shape = meta.get(f"{prefix}routed_experts_shape")
    rows = flat if shape is None else flat.reshape(tuple(shape))
    # Narrow unsigned wire dtypes mark a layer without a router with their maximum: -1 here.
    return to_wire_dtype(rows, "int32")


class SequenceExt:
    """One choice's ``sglext`` data, gathered from its whole result or its stream pieces."""

    def __init__(self, prompt_ids: list[int] | None) -> None:
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.parts: list[np.ndarray] = []
        self.ready: str | None = None  # the rows already as int32 base64 (a whole result)
        self.meta: dict[str, Any] = {}

    def add(self, out: dict[str, Any], whole: bool) -> None:
        """A piece of a stream (``whole`` False: its new ids and rows) or a whole result."""
        meta = out["meta_info"]
        ids = list(out.get("output_ids") or [])
        self.output_ids = ids if whole else self.output_ids + ids
        payload = meta.get("routed_experts")
        if (whole and isinstance(payload, str) and "prompt_routed_experts" not in meta
                and meta.get("routed_experts_dtype", DEFAULT_DTYPE) == "int32"):
            self.ready, self.meta = payload, meta  # the same bytes: no decode and re-encode
            return
        for prefix in ("prompt_", ""):  # the prompt's rows come before the generated ones
            rows = _rows(meta, prefix)
            if rows is not None:
                self.parts.append(rows)
        self.meta = meta

    def body(self, opts: SglextOptions) -> dict[str, Any]:
        ext: dict[str, Any] = {}
        if opts.routed_experts and self.ready is not None:
            ext["routed_experts"] = self.ready
        elif opts.routed_experts and self.parts:
            ext["routed_experts"] = encode_routed_experts(np.concatenate(self.parts), "int32")
        if opts.cached_tokens_details:
            ext["cached_tokens_details"] = {"device": int(self.meta.get("cached_tokens", 0)),
                                            "host": 0}
        verify_ct = self.meta.get("spec_verify_ct")
        if verify_ct is not None:
            completion = int(self.meta.get("completion_tokens", 0))
            ext["spec_tokens_details"] = {
                "spec_verify_ct": int(verify_ct),
                "spec_accept_length": completion / verify_ct if verify_ct else 0.0,
            }
        if opts.input_ids and self.prompt_ids is not None:
            ext["input_ids"] = list(self.prompt_ids)
        if opts.output_ids:
            ext["output_ids"] = list(self.output_ids)
        return ext
