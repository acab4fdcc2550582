"""Speculative decoding against plain decoding: interleaved A/B in one run.

Three engines live side by side in this process (each with its own scheduler process): A
without speculation (the default engine: overlap scheduling on), A0 without speculation and
with overlap scheduling off (``--no-a0`` drops it), and B with ``--speculative-algorithm``
(NGRAM by default, whose host-side drafts turn overlap scheduling off; EAGLE and NEXTN keep
it, their verify steps reading their inputs on the device: ``--disable-overlap-schedule``
turns it off for B as well, and B/A0 then isolates what the verify step itself costs or
gains). Every measurement alternates between them (A A0 B, then
B A0 A, ...), so the machine's drift hits all alike. Greedy, with
``ignore_eos`` so that every request decodes exactly ``--output-len`` tokens.

- single request: one request at a time, per prompt; decode tokens/s is
  ``(output_len - 1) / (wall - prefill wall)``, the prefill wall being the median wall of the
  same prompt with ``max_new_tokens=1`` (its one token comes from the prefill step, on both
  engines). Median over ``--repeats``.
- batch 8 and 32: that many requests sent at once (the prompts cycled), aggregate output
  tokens/s (all tokens, prefill included, over the wall time), median over ``--repeats``.
- accepted length, from each B response's ``meta_info["spec_verify_ct"]`` (its verify steps):
  ``completion_tokens / spec_verify_ct`` (the issue's and SGLang's reading: the prefill's token
  counts too) and ``(completion_tokens - 1) / spec_verify_ct`` (the tokens a verify step
  gained, what ``/get_server_info`` reports as ``avg_spec_accept_length``).
- identity: every engine's ``output_ids`` must equal A's token for token (greedy); every
  mismatch is printed with its prompt and first differing index. With ``--check-rows`` the
  engines also return routed experts (in the warm-up rounds only, not in the timed ones) and
  the rows must be equal too: the target's routing of the final sequence, with no rejected
  draft's row.

Prompts: openings of ``sgl_jax/assets/corpus.txt`` paragraphs (the bundled model's training
text) and chat prompts through the model's chat template.

    python benchmarks/bench_speculative.py              # ~2-3 minutes on 2 cores
    python benchmarks/bench_speculative.py --quick      # < 1 minute
    python benchmarks/bench_speculative.py --speculative-num-steps 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from bench_routed_experts import model_path_for  # noqa: E402
from bench_utils import machine_description, markdown_table, median  # noqa: E402

from sgl_jax import Engine  # noqa: E402
from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH, ModelConfig  # noqa: E402
from sgl_jax.srt.forward_batch_info import ForwardMode, ModelWorkerBatch  # noqa: E402
from sgl_jax.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info  # noqa: E402
from sgl_jax.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sgl_jax.srt.server_args import ServerArgs  # noqa: E402

CORPUS = os.path.join(os.path.dirname(BUNDLED_MODEL_PATH), "corpus.txt")
CHAT_QUESTIONS = (
    "Explain how mixture of experts models work.",
    "How do you bake a simple country loaf?",
    "What does the lighthouse keeper do in the morning?",
    "Tell me about the birds of the northern cliffs.",
    "How did letters reach the island before the road was built?",
    "Write a short letter to a friend about the sea.",
)
Prompt = tuple[str, list[int]]  # (a short label, token ids)


# -- prompts ------------------------------------------------------------------------------------
def corpus_prompts(tok: Any, n: int, tokens: int) -> list[Prompt]:
    """The first ``tokens`` tokens of ``n`` paragraphs spread over the corpus."""
    with open(CORPUS, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if len(p.strip()) >= 200]
    picked = [paragraphs[i * len(paragraphs) // n] for i in range(n)]
    return [(f"corpus: {p[:28]!r}", tok.encode(p)[:tokens]) for p in picked]


def chat_prompts(tok: Any, n: int) -> list[Prompt]:
    out = []
    for q in CHAT_QUESTIONS[:n]:
        text = tok.apply_chat_template([{"role": "user", "content": q}])
        out.append((f"chat: {q[:28]!r}", tok.encode(text, add_special_tokens=False)))
    return out


# -- measurement --------------------------------------------------------------------------------
def greedy(max_new: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}


def run(engine: Engine, prompts: Sequence[list[int]], max_new: int,
        rows: bool = False) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=list(prompts), sampling_params=greedy(max_new),
                           **({"return_routed_experts": True} if rows else {}))
    return time.perf_counter() - t0, outs


def interleaved(engines: dict[str, Engine], prompts: Sequence[list[int]], max_new: int,
                repeats: int, rows: bool = False) -> dict[str, tuple[list[float], list[dict]]]:
    """``repeats`` rounds of the same batch on every engine, the order alternating per round.
    Per engine: its wall times and its last outputs."""
    walls: dict[str, list[float]] = {name: [] for name in engines}
    last: dict[str, list[dict]] = {}
    names = list(engines)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, outs = run(engines[name], prompts, max_new, rows)
            walls[name].append(wall)
            last[name] = outs
    return {name: (walls[name], last[name]) for name in names}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Identity:
    """Every A/B pair of greedy outputs compared; mismatches kept for the report."""

    def __init__(self) -> None:
        self.compared = 0
        self.rows_compared = 0
        self.mismatches: list[str] = []

    def check_rows(self, where: str, labels: Sequence[str], a: list[dict],
                   b: list[dict]) -> None:
        """Routed experts: the same number of rows, and equal rows."""
        for label, oa, ob in zip(labels, a, b, strict=True):
            ra = extract_routed_experts_from_meta_info(oa)
            rb = extract_routed_experts_from_meta_info(ob)
            self.rows_compared += 1
            if ra.shape != rb.shape:
                self.mismatches.append(f"{where} {label}: rows {ra.shape} against {rb.shape}")
                continue
            bad = np.flatnonzero((ra != rb).reshape(len(ra), -1).any(axis=1))
            if len(bad):
                self.mismatches.append(f"{where} {label}: {len(bad)} of {len(ra)} routed-expert "
                                       f"rows differ, the first at row {bad[0]}")

    def check_all(self, where: str, labels: Sequence[str],
                  res: dict[str, tuple[list[float], list[dict]]], rows: bool) -> None:
        for n in res:
            if n != "A":
                self.check(f"{where} {n}", labels, res["A"][1], res[n][1])
                if rows:
                    self.check_rows(f"{where} {n}", labels, res["A"][1], res[n][1])

    def check(self, where: str, labels: Sequence[str], a: list[dict], b: list[dict]) -> None:
        for label, oa, ob in zip(labels, a, b, strict=True):
            self.compared += 1
            i = first_difference(oa["output_ids"], ob["output_ids"])
            if i is not None:
                self.mismatches.append(
                    f"{where} {label}: first difference at output index {i} "
                    f"(A {oa['output_ids'][i:i + 4]}, B {ob['output_ids'][i:i + 4]})")


def step_stats(engine: Engine) -> dict[str, dict[str, float]]:
    return engine.get_server_info()["step_stats"]


def step_ms(before: dict, after: dict, mode: str) -> float:
    steps = after[mode]["steps"] - before[mode]["steps"]
    secs = after[mode]["seconds"] - before[mode]["seconds"]
    return 1e3 * secs / steps if steps else float("nan")


def rss_mib(engine: Engine) -> float:
    """Resident memory of the engine's child processes (scheduler, detokenizer), MiB."""
    total = 0
    for pid in engine.child_pids().values():
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def accept_lengths(outs: Sequence[dict]) -> tuple[float, float]:
    """(completion / verify steps, (completion - 1) / verify steps) over ``outs``' totals."""
    comp = sum(o["meta_info"]["completion_tokens"] for o in outs)
    ct = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    if not ct:
        return float("nan"), float("nan")
    return comp / ct, (comp - len(outs)) / ct


# -- phases -------------------------------------------------------------------------------------
def single_phase(engines: dict[str, Engine], prompts: list[Prompt], args: argparse.Namespace,
                 identity: Identity) -> tuple[list[list[Any]], dict[str, list[float]], list,
                                              dict[str, float]]:
    """Per prompt: each engine's decode tokens/s, B's ratios and accepted length."""
    rows, rates, spec_outs = [], {n: [] for n in engines}, []
    before = {n: step_stats(e) for n, e in engines.items()}
    for label, ids in prompts:
        # Warm-up (every engine, each path); with --check-rows it returns routed experts.
        warm = interleaved(engines, [ids], args.output_len, 1, args.check_rows)
        identity.check_all("single (warm-up)", [label], warm, args.check_rows)
        pre = interleaved(engines, [ids], 1, args.prefill_repeats)
        res = interleaved(engines, [ids], args.output_len, args.repeats)
        identity.check_all("single", [label], res, False)
        rate = {n: (args.output_len - 1) / max(median(res[n][0]) - median(pre[n][0]), 1e-9)
                for n in engines}
        for n in engines:
            rates[n].append(rate[n])
        spec_outs += res["B"][1]
        rows.append([label, len(ids), *(rate[n] for n in engines), *ratios(rate),
                     *accept_lengths(res["B"][1])])
    after = {n: step_stats(e) for n, e in engines.items()}
    steps = {f"{n} {mode} step": step_ms(before[n], after[n], mode)
             for n in engines for mode in ("decode", "target_verify")
             if after[n][mode]["steps"] > before[n][mode]["steps"]}
    return rows, rates, spec_outs, steps


def ratios(rate: dict[str, float]) -> list[float]:
    """B against each engine without speculation."""
    return [rate["B"] / rate[n] for n in rate if n != "B"]


def batch_phase(engines: dict[str, Engine], prompts: list[Prompt], bs: int,
                args: argparse.Namespace, identity: Identity) -> list[Any]:
    batch = [prompts[i % len(prompts)] for i in range(bs)]
    ids = [p[1] for p in batch]
    labels = [f"#{i} {p[0]}" for i, p in enumerate(batch)]
    warm = interleaved(engines, ids, args.output_len, 1, args.check_rows)
    identity.check_all(f"batch {bs} (warm-up)", labels, warm, args.check_rows)
    before = {n: step_stats(e) for n, e in engines.items()}
    res = interleaved(engines, ids, args.output_len, args.batch_repeats)
    after = {n: step_stats(e) for n, e in engines.items()}
    identity.check_all(f"batch {bs}", labels, res, False)
    tokens = {n: sum(o["meta_info"]["completion_tokens"] for o in res[n][1]) for n in engines}
    rate = {n: tokens[n] / median(res[n][0]) for n in engines}
    step = [step_ms(before[n], after[n], "target_verify" if n == "B" else "decode")
            for n in engines]
    return [f"batch {bs}", *rate.values(), *ratios(rate), *accept_lengths(res["B"][1]), *step]


# -- the steps alone ----------------------------------------------------------------------------
def step_ceiling(server_kwargs: dict, batch_sizes: list[int], ctx: int,
                 repeats: int) -> list[list[Any]]:
    """A decode step against a verify step of ``verify_tokens`` per request, each the jitted
    forward + sampling alone (this process, no scheduler), on the engine's padded shapes."""
    sa = ServerArgs(**server_kwargs)
    runner = ModelRunner(sa, ModelConfig.from_hf(sa.model_path, sa.context_length))
    width = runner.verify_tokens
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    greedy_params = SamplingParams(temperature=0.0).normalize()
    rows = []
    for bs in batch_sizes:
        idx = [pool.alloc() for _ in range(bs)]
        for i in idx:
            pool.write(i, 0, alloc.alloc(ctx + width))
        times = {}
        for mode, n in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, width)):
            # EAGLE / NEXTN: the draft chain's scratch slots, as the scheduler gives them.
            out_cache_loc = alloc.alloc(bs * n)
            draft = {} if not runner.draft_steps or mode.is_decode else {
                "draft_next_ids": np.full(bs, -1, np.int32),
                "draft_scratch": alloc.alloc(bs * (runner.draft_steps - 1)).reshape(bs, -1)}
            if draft:  # the slots of each row's tokens, then its scratch (host input ids)
                slots = np.zeros((bs, runner.verify_slot_width), np.int32)
                slots[:, :n] = out_cache_loc.reshape(bs, n)
                slots[:, n : n + runner.draft_steps - 1] = draft["draft_scratch"]
                draft["verify_slots"] = slots
            mwb = ModelWorkerBatch(
                forward_mode=mode, req_pool_indices=np.array(idx, np.int32),
                prefix_lens=np.full(bs, ctx - 1, np.int32),
                extend_lens=np.full(bs, n, np.int32), input_ids=np.ones(bs * n, np.int32),
                out_cache_loc=out_cache_loc, sampling_params=[greedy_params] * bs,
                seeds=[0] * bs, steps=[0] * bs, **draft)
            walls = []
            for _ in range(repeats + 2):  # two warm-ups (the first compiles)
                t0 = time.perf_counter()
                _, out = runner.run_worker_batch(mwb)
                np.asarray(out.next_token_ids)
                walls.append(time.perf_counter() - t0)
            times[mode] = median(walls[2:])
        dec, ver = times[ForwardMode.DECODE], times[ForwardMode.TARGET_VERIFY]
        rows.append([bs, dec * 1e3, ver * 1e3, ver / dec, bs * width])
        for i in idx:
            pool.free(i)
    return rows


# -- main ---------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default=None, help="make_random_model preset (default: bundled)")
    p.add_argument("--speculative-algorithm", default="NGRAM")
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="B without overlap scheduling (EAGLE / NEXTN have it by default)")
    p.add_argument("--no-a0", action="store_true",
                   help="no A0 engine (no speculation, overlap scheduling off)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=48, help="corpus prompts' length")
    p.add_argument("--corpus-prompts", type=int, default=4)
    p.add_argument("--chat-prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7, help="single-request rounds per prompt")
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[8, 32])
    p.add_argument("--batch-repeats", type=int, default=5)
    p.add_argument("--check-rows", action="store_true",
                   help="return routed experts in the warm-up rounds and compare them too "
                        "(the engines start with --enable-return-routed-experts)")
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip timing the decode and verify steps alone (in this process)")
    p.add_argument("--quick", action="store_true",
                   help="2 + 1 prompts, 64 tokens, 3 repeats, batch 8 only, no step ceiling "
                        "(< 1 minute)")
    args = p.parse_args()
    if args.quick:
        args.output_len, args.corpus_prompts, args.chat_prompts = 64, 2, 1
        args.repeats, args.prefill_repeats, args.batch_repeats = 3, 2, 2
        args.batch_sizes, args.no_ceiling = [8], True
    return args


def engine_kwargs(args: argparse.Namespace) -> tuple[dict, dict]:
    """The engines' common ServerArgs fields, and B's speculative ones."""
    pads = sorted({1, *args.batch_sizes})
    common = dict(model_path=model_path_for(args.preset), max_running_requests=max(pads),
                  precompile_bs_paddings=pads, precompile_token_paddings=[64, 256, 1024],
                  chunked_prefill_size=1024, log_level="warning",
                  enable_return_routed_experts=args.check_rows)
    spec = dict(speculative_algorithm=args.speculative_algorithm,
                speculative_num_steps=args.speculative_num_steps,
                speculative_draft_model_path=args.speculative_draft_model_path,
                disable_overlap_schedule=args.disable_overlap_schedule)
    return common, spec


def start_engines(args: argparse.Namespace) -> dict[str, Engine]:
    common, spec = engine_kwargs(args)
    variants = {"A": {}, "A0": {"disable_overlap_schedule": True}, "B": spec}
    if args.no_a0:
        del variants["A0"]
    engines: dict[str, Engine] = {}
    try:
        for name, extra in variants.items():
            engines[name] = Engine(**common, **extra)
    except BaseException:
        for e in engines.values():
            e.shutdown()
        raise
    return engines


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    engines = start_engines(args)
    try:
        t_ready = time.perf_counter()
        tok = engines["A"].tokenizer_manager.tokenizer
        prompts = (corpus_prompts(tok, args.corpus_prompts, args.prompt_tokens)
                   + chat_prompts(tok, args.chat_prompts))
        identity = Identity()
        single_rows, rates, spec_outs, steps = single_phase(engines, prompts, args, identity)
        batch_rows = [batch_phase(engines, prompts, bs, args, identity)
                      for bs in args.batch_sizes]
        rss = {n: rss_mib(e) for n, e in engines.items()}
        server_accept = engines["B"].get_server_info().get("avg_spec_accept_length")
    finally:
        for e in engines.values():
            e.shutdown()
    ceiling = []
    if not args.no_ceiling:
        common, spec = engine_kwargs(args)
        ceiling = step_ceiling({**common, **spec}, sorted({1, *args.batch_sizes}),
                               args.prompt_tokens + args.output_len // 2, args.repeats * 10)

    names = list(engines)
    plain = [n for n in names if n != "B"]
    name = args.preset or "bundled tiny-qwen3-moe"
    b_overlap_off = args.disable_overlap_schedule or args.speculative_algorithm == "NGRAM"
    print(f"\n### Speculative decoding A/B: {name}; A = no speculation (overlap on)"
          + (", A0 = no speculation, overlap off" if "A0" in names else "")
          + f", B = {args.speculative_algorithm} with {args.speculative_num_steps} draft steps "
          f"(overlap {'off' if b_overlap_off else 'on'}); greedy, {args.output_len} output "
          "tokens (ignore_eos)\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(f"Start-up of the engines {t_ready - t_start:.1f} s, whole run "
          f"{time.perf_counter() - t_start:.1f} s; resident memory of each engine's child "
          "processes: " + ", ".join(f"{n} {v:.0f} MiB" for n, v in rss.items()) + ".\n")
    print(f"Single request, median of {args.repeats} (decode tokens/s, prefill subtracted):\n")
    med = {n: median(rates[n]) for n in names}
    single_rows.append(["**median / total**", "", *med.values(), *ratios(med),
                        *accept_lengths(spec_outs)])
    ratio_cols = [f"B/{n}" for n in plain]
    accept_cols = ["accept (completion/verify)", "gained per verify"]
    print(markdown_table(["prompt", "prompt tokens", *(f"{n} tok/s" for n in names),
                          *ratio_cols, *accept_cols], single_rows))
    print("\nMean step wall (ms) in the single-request phase: "
          + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()) + ".\n")
    if batch_rows:
        print(f"Concurrent requests, median of {args.batch_repeats} (aggregate output "
              "tokens/s over the wall, prefill included):\n")
        print(markdown_table(["workload", *(f"{n} tok/s" for n in names), *ratio_cols,
                              *accept_cols, *(f"{n} step ms" for n in names)], batch_rows))
    if ceiling:
        print(f"\nThe steps alone (jitted forward + sampling in this process, median of "
              f"{args.repeats * 10}, context {args.prompt_tokens + args.output_len // 2}):\n")
        print(markdown_table(["batch", "decode step ms", "verify step ms", "verify/decode",
                              "verify tokens"], ceiling))
    print(f"\nServer's avg_spec_accept_length (B, whole run): {server_accept:.3f}")
    print(f"Identity: {identity.compared} output pairs and {identity.rows_compared} "
          f"routed-experts pairs compared with A, {len(identity.mismatches)} differ.")
    for m in identity.mismatches:
        print(f"  MISMATCH {m}")


if __name__ == "__main__":
    main()
