"""The native attention on a few new tokens over a long cached context (one layer, jitted).

One request with ``--context`` cached tokens brings 1, 8 or 64 new tokens in a 64-token
extend bucket, against a decode step of one row at the same context. With the short-extend
program (``SHORT_EXTEND``: rows of at most 8 new tokens take one 8-query block each) and
without it (the general program alone, one 64-query block per row), variants interleaved,
medians in ms.

    python benchmarks/bench_extend_attention.py --context 8192 32768
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.layers.attention import native
from sgl_jax.srt.layers.attention.base import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, PAGE, BUCKET = 4, 4, 64, 16, 64


def metadata(context: int, new: int, decode: bool) -> AttentionMetadata:
    """One request over ``context`` cached positions bringing ``new`` tokens (pages 1, 2, ...
    in order), padded to the bucket (1 token for a decode step)."""
    tokens = 1 if decode else BUCKET
    positions = np.zeros(tokens, np.int32)
    positions[:new] = np.arange(context, context + new)
    to_req = np.where(np.arange(tokens) < new, 0, 1).astype(np.int32)
    pages = np.arange(1, -(-(context + new) // PAGE) + 1, dtype=np.int32)[None, :]
    return AttentionMetadata(
        positions=jnp.asarray(positions), token_to_req=jnp.asarray(to_req),
        prefix_lens=jnp.asarray([context], jnp.int32), extend_lens=jnp.asarray([new], jnp.int32),
        extend_starts=jnp.asarray([0], jnp.int32), page_indices=jnp.asarray(pages),
        page_size=PAGE, is_decode=decode)


def run(contexts: list[int], repeats: int) -> None:
    rng = np.random.default_rng(0)
    print("| context | program | decode, 1 row | extend 1 | extend 8 | extend 64 |")
    print("|---:|---|---:|---:|---:|---:|")
    for context in contexts:
        num_pages = context // PAGE + 8
        cache = jnp.asarray(rng.standard_normal((num_pages, PAGE, 2 * KV_HEADS, HEAD_DIM),
                                                np.float32))
        cases = {"decode": (1, True), "1": (1, False), "8": (8, False), "64": (64, False)}
        calls = {}
        for short in (True, False):
            attention = native.NativeAttention()
            for name, (new, decode) in cases.items():
                meta = metadata(context, new, decode)
                q = jnp.asarray(rng.standard_normal((1 if decode else BUCKET, HEADS, HEAD_DIM),
                                                    np.float32))
                if short:  # the backend as it runs
                    fn = jax.jit(lambda q, c, m, a=attention: a.attend(q, c, m, 0.125))
                else:  # its general program alone (what ran before the short one existed)
                    q_block = native.query_block_size(q.shape[0], 1, decode)
                    fn = jax.jit(lambda q, c, m, a=attention, b=q_block:
                                 a._attend_blocked(q, c, m, 0.125, None, b))
                fn(q, cache, meta).block_until_ready()  # compile
                calls[short, name] = (fn, q, meta)
        times: dict = {key: [] for key in calls}
        for _ in range(repeats):
            for key, (fn, q, meta) in calls.items():
                t0 = time.perf_counter()
                fn(q, cache, meta).block_until_ready()
                times[key].append(time.perf_counter() - t0)
        for short in (True, False):
            cells = " | ".join(f"{statistics.median(times[short, n]) * 1e3:.1f}" for n in cases)
            print(f"| {context} | {'short' if short else 'general'} | {cells} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    run(args.context, args.repeats)


if __name__ == "__main__":
    main()
