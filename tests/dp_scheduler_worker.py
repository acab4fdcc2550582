"""Worker of tests/test_dp_scheduler.py: a real Scheduler with data-parallel attention (dp2 on a
tp2 x ep2 mesh of 4 fake CPU devices; ``XLA_FLAGS`` is set by the test before JAX starts),
stepped in this process through its own ZMQ sockets (tests/test_scheduler_abort.py's
SteppedScheduler). It runs the scenarios and pickles what happened to ``argv[1]``: every
request's outputs, rank and cached tokens, and what every launched step held (per rank: rows
and tokens; any KV slot outside its request's rank range). The test compares the outputs with
the float64 reference.

``python -m tests.dp_scheduler_worker OUT.pkl``; with ``engine`` first, an Engine (its scheduler in
a child process) with the same parallel layout serves a batch of concurrent requests instead.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import numpy as np

from sgl_jax.srt.managers.dp_balancer import DPBalancer
from sgl_jax.srt.managers.io_struct import AbortReq, BatchTokenIDOut
from sgl_jax.srt.managers.schedule_batch import ScheduleBatch
from sgl_jax.srt.managers.transport import recv_obj
from tests.engine_utils import prompt_ids
from tests.test_scheduler_abort import SteppedScheduler

CHUNK = 16
PAGE = 4
# 48 tokens (12 pages) per rank: room for two short requests per rank, not for two long ones.
MAX_TOTAL_TOKENS = 96
DP_ARGS = {
    "tp_size": 2, "ep_size": 2, "enable_dp_attention": True, "dp_size": 2,
    "page_size": PAGE, "max_total_tokens": MAX_TOTAL_TOKENS, "schedule_conservativeness": 0.0,
    "chunked_prefill_size": CHUNK,
    "precompile_token_paddings": [CHUNK, 2 * CHUNK], "precompile_bs_paddings": [1, 2, 4],
    "disable_precompile": True,
}


class Driver:
    """Submits requests and steps the scheduler until they end, recording every step."""

    def __init__(self) -> None:
        self.s = SteppedScheduler(**DP_ARGS)
        self.sched = self.s.scheduler
        self.steps: list[dict[str, Any]] = []
        self.rank_of: dict[str, set[int]] = {}  # rid -> the ranks it was ever scheduled on
        self.records: dict[str, dict[str, Any]] = {}
        launch = self.sched.launch_batch

        def observed_launch(batch: ScheduleBatch):
            self.steps.append(self._observe(batch))
            return launch(batch)

        self.sched.launch_batch = observed_launch
        self.retracted: list[tuple[str, int, bool]] = []  # (rid, rank, a part-way prompt)
        policy = self.sched.policy
        retract = policy.retract_one

        def observed_retract(rank: int = 0) -> None:
            chunked = policy.chunked.get(rank)
            holders = [*policy.running, *policy.chunked.values()]
            newest = max((r for r in holders if r.dp_rank == rank), key=lambda r: r.arrival_time)
            self.retracted.append((newest.rid, rank, newest is chunked))
            retract(rank)

        policy.retract_one = observed_retract

    def _rank_range(self, rank: int) -> tuple[int, int]:
        alloc = self.sched.memory[rank].allocator
        return alloc.first_page + 1, alloc.first_page + alloc.num_pages  # usable pages

    def _observe(self, batch: ScheduleBatch) -> dict[str, Any]:
        """The step's rows and tokens per rank, and the KV slots outside their rank's range."""
        table = self.sched.memory.req_to_token_pool.req_to_token
        rows, tokens, bad = [0, 0], [0, 0], []
        start = 0
        ranks = batch.dp_ranks.tolist()
        for req, n, rank in zip(batch.reqs, batch.extend_lens, ranks, strict=True):
            assert rank == req.dp_rank
            self.rank_of.setdefault(req.rid, set()).add(rank)
            rows[rank] += 1
            tokens[rank] += n
            lo, hi = self._rank_range(rank)
            new = batch.out_cache_loc[start : start + n]
            held = table[req.req_pool_idx, : req.kv_len + n]  # prefix, own, and the new ones
            pages = np.concatenate([new, held]) // PAGE
            if pages.min() < lo or pages.max() > hi:
                bad.append(req.rid)
            start += n
        return {"mode": batch.forward_mode.name, "rows": rows, "tokens": tokens, "bad": bad,
                "rids": [r.rid for r in batch.reqs]}

    def submit(self, rid: str, ids: list[int], max_new_tokens: int) -> int:
        self.s.submit(rid, ids, max_new_tokens)
        req = next((r for r in self.sched.policy.waiting if r.rid == rid), None)
        return -1 if req is None else req.dp_rank  # -1: refused at once

    def read_outputs(self) -> None:
        while self.s.outputs.poll(0):
            msg = recv_obj(self.s.outputs)
            assert isinstance(msg, BatchTokenIDOut)
            for rec in msg.outputs:
                out = self.records.setdefault(rec.rid, {"output_ids": [], "routed": None})
                out["output_ids"] += rec.new_ids
                out["finished_reason"] = rec.finish_reason
                out["cached_tokens"] = rec.cached_tokens
                if rec.routed is not None:
                    out["routed"] = rec.routed.ids

    def done(self, rid: str) -> bool:
        return self.records.get(rid, {}).get("finished_reason") is not None

    def run(self, rids: list[str], max_steps: int = 300) -> None:
        for _ in range(max_steps):
            self.read_outputs()
            if all(self.done(r) for r in rids):
                return
            self.s.step()
        raise AssertionError(f"not finished: {[r for r in rids if not self.done(r)]}")

    def leak_free(self) -> bool:
        s = self.sched
        s.drain()
        if s.policy.has_work() or s.memory.states.available() != s.memory.states.num_slots:
            return False
        return all(
            st["locked_kv_slots"] == 0
            and st["available_kv_slots"] + st["evictable_kv_slots"] == st["total_kv_slots"]
            for st in (s.memory[r].stats() for r in range(s.dp_size))
        )


def scenarios(d: Driver) -> dict[str, Any]:
    out: dict[str, Any] = {"prompts": {}, "ranks": {}, "marks": {}}

    def submit(rid: str, ids: list[int], max_new: int) -> None:
        out["prompts"][rid] = ids
        out["ranks"][rid] = d.submit(rid, ids, max_new)

    def mark(name: str) -> None:
        out["marks"][name] = len(d.steps)

    # 1. Concurrent requests on both ranks (round robin: 0, 1, 0, 1).
    mark("concurrent")
    for i, n in enumerate([10, 12, 14, 9]):
        submit(f"c{i}", prompt_ids(100 + i, n), 6)
    d.run([f"c{i}" for i in range(4)])
    out["leak_free_concurrent"] = d.leak_free()

    # 2. Two long prompts on the two ranks: prefilled in chunks, one per rank in each step.
    mark("chunked")
    submit("long0", prompt_ids(200, 40), 4)
    submit("long1", prompt_ids(201, 40), 4)
    d.run(["long0", "long1"])

    # 3. One request: the other rank is idle in every step.
    mark("idle")
    submit("alone", prompt_ids(300, 11), 5)
    d.run(["alone"])

    # 4. Abort mid-generation while the other rank goes on.
    mark("abort")
    submit("keep", prompt_ids(400, 10), 8)
    submit("abort", prompt_ids(401, 10), 30)
    for _ in range(6):
        d.s.step()
    d.s.send(AbortReq(rid="abort"))
    d.run(["keep", "abort"])

    # 5. Prefix hit: the same prompt again goes to the rank that caches it (round robin alone
    # would give it the other rank).
    mark("prefix")
    prompt = prompt_ids(500, 21)
    submit("first", prompt, 3)
    d.run(["first"])
    submit("again", prompt, 3)
    d.run(["again"])

    # 6. Retraction: two requests per rank that cannot all grow to 42 tokens in 48 per rank.
    mark("retract")
    before = d.sched.policy.num_retractions
    for i in range(4):
        submit(f"r{i}", prompt_ids(600 + i, 12), 30)
    d.run([f"r{i}" for i in range(4)])
    out["retractions"] = d.sched.policy.num_retractions - before

    # 7. A request that cannot fit its rank even alone is aborted; the other rank serves on.
    mark("unfittable")
    submit("huge", prompt_ids(700, 30), 40)
    submit("small", prompt_ids(701, 8), 4)
    d.run(["huge", "small"])

    # 8. shortest_queue: requests arriving together are spread by queue length.
    mark("shortest_queue")
    d.sched.balancer = DPBalancer("shortest_queue", 2)
    for i in range(3):
        submit(f"q{i}", prompt_ids(800 + i, 6), 2)
    d.run([f"q{i}" for i in range(3)])

    # 9. minimum_tokens: a long prompt's rank holds more tokens, so the short ones go elsewhere.
    mark("minimum_tokens")
    d.sched.balancer = DPBalancer("minimum_tokens", 2)
    submit("m0", prompt_ids(900, 30), 2)
    submit("m1", prompt_ids(901, 6), 2)
    submit("m2", prompt_ids(902, 6), 2)
    d.run(["m0", "m1", "m2"])

    mark("end")
    out["retracted"] = d.retracted
    out["leak_free"] = d.leak_free()
    out["records"] = d.records
    out["steps"] = d.steps
    out["rank_of"] = d.rank_of
    out["server_info"] = d.sched.server_info()
    return out


def engine_run() -> dict[str, Any]:
    """Concurrent requests through a whole Engine (tokenizer, scheduler process, detokenizer)."""
    from sgl_jax import Engine
    from sgl_jax.testing import engine_args

    eng = Engine(**engine_args(**{**DP_ARGS, "max_total_tokens": 512,
                                  "enable_return_routed_experts": True,
                                  "schedule_conservativeness": 1.0}))
    try:
        prompts = [prompt_ids(900 + i, 6 + 5 * i) for i in range(6)]
        params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 4 + i}
                  for i in range(6)]
        outs = eng.generate(input_ids=prompts, sampling_params=params,
                            return_routed_experts=True)
        again = eng.generate(input_ids=prompts[5], sampling_params=params[5],
                             return_routed_experts=True)
        return {"prompts": prompts, "outs": outs, "again": again,
                "server_info": eng.get_server_info()}
    finally:
        eng.shutdown()


def main(path: str, mode: str = "scheduler") -> None:
    if mode == "engine":
        with open(path, "wb") as f:
            pickle.dump(engine_run(), f)
        return
    d = Driver()
    try:
        result = scenarios(d)
    finally:
        d.s.close()
    with open(path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[-1], "engine" if sys.argv[1] == "engine" else "scheduler")
