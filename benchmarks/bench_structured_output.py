"""Decode throughput with and without a grammar (constrained decoding, docs/openai.md).

One Engine; each round runs a batch of --batch requests unconstrained (A) and the same
batch with a JSON schema (B), interleaved A, B, A, B, ... (this machine is noisy), and reads
the scheduler's decode-step statistics (tokens, seconds) around each run. The schema cannot
be completed within --output-len tokens (an array of at least 1,000 objects), so every
request of both arms decodes exactly --output-len tokens at the full batch. Prints the
medians and B/A.

A second table times the device side alone: the mask's unpack and apply (``apply_vocab_mask``)
on [batch, vocab] logits, jitted, at the bundled model's vocabulary and at Qwen3's 151,936,
to weigh always passing an all-ones mask (one compiled step per bucket, this cost on every
step) against passing none when no row has a grammar (what the engine does: a second compiled
variant per bucket, compiled the first time a constrained request reaches it).

    python benchmarks/bench_structured_output.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from bench_utils import machine_description, markdown_table, median, random_prompts  # noqa: E402

from sgl_jax import Engine  # noqa: E402
from sgl_jax.srt.layers.sampler import apply_vocab_mask  # noqa: E402

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}


def decode_run(engine: Engine, prompts: list[list[int]], params: dict) -> dict[str, float]:
    before = engine.get_server_info()["step_stats"]["decode"]
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    after = engine.get_server_info()["step_stats"]["decode"]
    if "json_schema" in params:  # the constraint held: every output is the array's start
        assert all(o["text"].startswith("[") for o in outs), outs[0]["text"]
    steps = after["steps"] - before["steps"]
    seconds = after["seconds"] - before["seconds"]
    tokens = after["tokens"] - before["tokens"]
    assert all(o["meta_info"]["completion_tokens"] == params["max_new_tokens"] for o in outs)
    return {"tok_s": tokens / seconds, "ms_step": 1e3 * seconds / steps,
            "wall_tok_s": sum(o["meta_info"]["completion_tokens"] for o in outs) / wall}


def host_fill_cost(batch: int, repeats: int = 20) -> float:
    """Median ms of the host's mask fill for ``batch`` rows of SCHEMA (bundled tokenizer),
    each matcher a few tokens into the array."""
    from sgl_jax.srt.constrained.grammar import GrammarCompiler, llg_tokenizer
    from sgl_jax.srt.constrained.matchers import GrammarMatchers
    from sgl_jax.srt.mem_cache.request_state import RequestStateTable
    from sgl_jax.srt.tokenizer import Tokenizer
    from sgl_jax.testing import ensure_test_model

    tok = Tokenizer.from_pretrained(ensure_test_model())
    lt = llg_tokenizer(tok, len(tok), tok.eos_token_ids)
    grammar = GrammarCompiler(lt).compile("json_schema", json.dumps(SCHEMA))
    states = RequestStateTable(batch)
    table = GrammarMatchers(lt, states)
    prefix = tok.encode('[{"id": 12, "name": "ab', add_special_tokens=False)
    reqs = []
    for _ in range(batch):
        req = argparse.Namespace(grammar=grammar, grammar_build=None,
                                 state_slot=states.alloc(), output_ids=list(prefix))
        reqs.append(req)
    table.mask(reqs, [True] * batch)  # builds and replays
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        table.mask(reqs, [True] * batch)
        times.append(time.perf_counter() - t0)
    table.close()
    return 1e3 * median(times)


def mask_cost(batch: int, vocab: int, repeats: int = 20) -> float:
    """Median ms of the jitted unpack + apply on [batch, vocab] float32 logits."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((batch, vocab), np.float32))
    mask = jnp.asarray(rng.integers(-(2**31), 2**31, (batch, (vocab + 31) // 32)).astype(np.int32))
    fn = jax.jit(apply_vocab_mask)
    fn(logits, mask).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(logits, mask).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 1e3 * median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the bundled tiny model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    kwargs = {"max_running_requests": args.batch, "precompile_bs_paddings": [args.batch]}
    if args.model_path:
        kwargs["model_path"] = args.model_path
    engine = Engine(**kwargs)
    try:
        prompts = random_prompts(args.batch, args.input_len, 500)  # ids every vocabulary has
        plain = {"max_new_tokens": args.output_len, "temperature": 1.0, "ignore_eos": True}
        arms = {"unconstrained": plain,
                "json_schema": {**plain, "json_schema": json.dumps(SCHEMA)}}
        for params in arms.values():  # warm-up: compiles, grammar cache
            decode_run(engine, prompts, params)
        compiles = engine.get_server_info()["num_compiles"]
        results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, params in arms.items():
                results[name].append(decode_run(engine, prompts, params))
        recompiles = engine.get_server_info()["num_compiles"] - compiles
    finally:
        engine.shutdown()
    print(f"# {machine_description()}; batch {args.batch}, {args.output_len} tokens each, "
          f"{args.rounds} interleaved rounds; compiles after warm-up: {recompiles}\n")
    med = {n: {k: median([r[k] for r in rs]) for k in ("tok_s", "ms_step", "wall_tok_s")}
           for n, rs in results.items()}
    base = med["unconstrained"]
    print(markdown_table(
        ["arm", "decode tok/s", "ms / decode step", "decode vs A", "wall tok/s", "wall vs A"], [
            [n, f"{m['tok_s']:.0f}", f"{m['ms_step']:.2f}", f"{m['tok_s'] / base['tok_s']:.3f}",
             f"{m['wall_tok_s']:.0f}", f"{m['wall_tok_s'] / base['wall_tok_s']:.3f}"]
            for n, m in med.items()]))
    print()
    print(markdown_table(["host mask fill (json_schema, bundled tokenizer)", "ms"],
                         [[f"{args.batch} rows", f"{host_fill_cost(args.batch):.3f}"]]))
    print()
    print(markdown_table(["mask unpack + apply (jitted)", "ms"], [
        [f"[{args.batch}, {v}]", f"{mask_cost(args.batch, v):.3f}"] for v in (512, 151936)]))


if __name__ == "__main__":
    main()
