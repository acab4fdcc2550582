"""Worker of tests/test_dp_features.py: engines with data-parallel attention (dp2 on a tp2 x ep2
layout of 4 fake CPU devices; ``XLA_FLAGS`` is set by the test before JAX starts) driven
through the features that must keep working with DP; what they returned is pickled to
``argv[-1]`` and the test compares it with the float64 reference.

``python -m tests.dp_features_worker MODE SECOND_CKPT OUT.pkl`` with MODE:

- ``multi``: a multi-process Engine with deterministic inference, routed experts and their
  weights and the expert distribution recorder (stat): requests on both ranks at once, a
  target request alone and inside batches, a recording window, then
  ``update_weights_from_disk`` to SECOND_CKPT and the same requests again, then updates while
  a request runs on each rank;
- ``single``: a single-process Engine on a caller's ("expert", "tensor") mesh of the 4
  devices: requests on both ranks, then ``update_weights_from_arrays`` with SECOND_CKPT's
  tensors as JAX arrays and the same requests again;
- ``eplb``: a multi-process Engine with EPLB: requests before and after a rebalance, two
  requests streamed at once, two paused and continued;
- ``mla``: DeepSeek-V3's tiny preset (the checkpoint given instead of SECOND_CKPT) with
  routed experts, their weights, logprobs and the stat recorder.
"""

from __future__ import annotations

import pickle
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors.numpy import load_file

from sgl_jax import Engine
from sgl_jax.testing import TEST_MODEL_PATH, engine_args, wait_until
from tests.engine_utils import prompt_ids

DP_ARGS: dict[str, Any] = {
    "tp_size": 2, "ep_size": 2, "enable_dp_attention": True, "dp_size": 2,
    "enable_return_routed_experts": True, "disable_precompile": True,
    "precompile_bs_paddings": [1, 2, 4], "precompile_token_paddings": [32, 64],
    "chunked_prefill_size": 64,
}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
# Four prompts: round robin puts them on ranks 0, 1, 0, 1 (one of them chunked).
PROMPTS = [prompt_ids(1100 + i, n) for i, n in enumerate([9, 23, 80, 14])]
MAX_NEW = [6, 4, 5, 7]
INPUT_LP_PROMPTS = PROMPTS[1:3]  # 23 tokens, and 80 prefilled in two chunks
RIDS = [f"p{i}" for i in range(len(PROMPTS))]
# The requests running while weights are updated or generation is paused: long enough that
# neither finishes between the poll that sees both running and the call that follows it.
RUNNING_NEW = 160
TARGET = prompt_ids(1200, 31)
TARGET_NEW = 10
SCORE_PROMPT = prompt_ids(1400, 13)
SCORE_COMPLETIONS = [prompt_ids(1401 + i, 3 + 2 * i) for i in range(4)]


def params(max_new: list[int]) -> list[dict]:
    return [{**GREEDY, "max_new_tokens": n} for n in max_new]


def generate(engine, prompts: list[list[int]], max_new: list[int], **kw) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=params(max_new),
                           return_routed_experts=True, **kw)


def target_batches() -> list[tuple[list[list[int]], list[int], int]]:
    """(prompts, max_new_tokens, index of TARGET): TARGET with mates of various lengths, so
    its rank, its rank's padding and the other rank's load differ between runs."""
    rng = np.random.default_rng(5)

    def mate(n: int) -> list[int]:
        return rng.integers(3, 500, n).tolist()

    return [
        ([mate(30), TARGET], [20, TARGET_NEW], 1),
        ([TARGET, mate(12), mate(70), mate(5)], [TARGET_NEW, 3, 12, 25], 0),
        ([mate(50), mate(9), TARGET], [4, 16, TARGET_NEW], 2),
    ]


def determinism_runs(eng, sampling: dict) -> dict[str, Any]:
    """TARGET (with ``sampling``) alone on each rank (cache flushed: no prefix hit) and in
    ``target_batches``; the mates are greedy."""
    out: dict[str, Any] = {"alone_ranks": [], "batched": []}
    target = {**sampling, "max_new_tokens": TARGET_NEW}
    for key in ("alone", "alone_other_rank"):  # round robin: one on each rank
        eng.flush_cache()
        out[key] = eng.generate(input_ids=[TARGET], sampling_params=[target],
                                return_routed_experts=True, return_logprob=True)[0]
        ranks = eng.get_server_info()["dp_ranks"]
        out["alone_ranks"].append([r["dp_rank"] for r in ranks if r["evictable_kv_slots"]])
    for prompts, max_new, where in target_batches():
        eng.flush_cache()
        sampling_params = params(max_new)
        sampling_params[where] = target
        res = eng.generate(input_ids=prompts, sampling_params=sampling_params,
                           return_routed_experts=True, return_logprob=True)
        out["batched"].append(res[where])
    return out


def recorded_batch(eng: Engine) -> dict[str, Any]:
    """PROMPTS with logprobs and routing weights, under the stat recorder: the outputs and
    the expert load it recorded."""
    eng.start_expert_distribution_record()
    outs = generate(eng, PROMPTS, MAX_NEW, return_logprob=True,
                    return_routed_expert_weights=True)
    eng.stop_expert_distribution_record()
    return {"outs": outs, "load": eng.get_expert_load()}


def multi_run(second: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Engine(**engine_args(**DP_ARGS, enable_deterministic_inference=True,
                              enable_return_routed_expert_weights=True,
                              expert_distribution_recorder_mode="stat",
                              expert_distribution_recorder_dir=tempfile.mkdtemp())) as eng:
        out.update(recorded_batch(eng))
        out["info_after_batch"] = eng.get_server_info()
        # Input logprobs (extra logits rows beyond the sampled ones) of two requests, one per
        # rank, with top-3 alternatives.
        out["input_lp"] = generate(eng, INPUT_LP_PROMPTS, [2, 3], return_logprob=True,
                                   logprob_start_len=0, top_logprobs_num=3)
        # A mixed batch: two of the four requests (one per rank) ask for routed experts; the
        # cache flushed first, so every prompt is prefilled again (one in two chunks).
        eng.flush_cache()
        out["mixed"] = eng.generate(input_ids=PROMPTS, sampling_params=params(MAX_NEW),
                                    return_routed_experts=[True, False, False, True])
        out["det"] = {name: determinism_runs(eng, sampling)
                      for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED))}
        # Scoring: a shared prompt (prefilled once) and completions spread over the ranks.
        eng.flush_cache()
        out["score"] = eng.score(SCORE_PROMPT, SCORE_COMPLETIONS, temperature=0.7,
                                 return_routed_experts=True)
        out["score_info"] = eng.get_server_info()
        out["update"] = eng.update_weights_from_disk(second)
        out["after_update"] = generate(eng, PROMPTS, MAX_NEW)
        # Back to the test checkpoint, its tensors sent as host arrays (SGLang's call).
        tensors = load_file(f"{TEST_MODEL_PATH}/model.safetensors")
        out["update_back"] = eng.update_weights_from_tensor(list(tensors.items()),
                                                            weight_version="back")
        out["after_update_back"] = generate(eng, PROMPTS, MAX_NEW)
        out.update(updates_while_running(eng, second))
        out["server_info"] = eng.get_server_info()
    return out


def start_two(eng, max_new: int) -> tuple[Any, dict, list[int]]:
    """Generates PROMPTS[:2] in a background thread (``box["outs"]`` when done); returns once
    both run, with the running requests per rank then."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault(
        "outs", generate(eng, PROMPTS[:2], [max_new, max_new])))
    thread.start()
    seen: dict[str, Any] = {}

    def both_running() -> bool:
        seen.update(eng.get_server_info())
        return seen["num_running_reqs"] == 2

    assert wait_until(both_running, timeout=120)
    # From the same snapshot: a second call could already see them finished.
    per_rank = [r["num_running_reqs"] for r in seen["dp_ranks"]]
    return thread, box, per_rank


def updates_while_running(eng, second: str) -> dict[str, Any]:
    """Weight updates while a request runs on each rank: without abort_all_requests they
    finish on the old weights first; with it they are aborted."""
    out: dict[str, Any] = {}

    def run_in_background(max_new: int) -> tuple[threading.Thread, dict]:
        thread, box, per_rank = start_two(eng, max_new)
        out.setdefault("running_per_rank", []).append(per_rank)
        return thread, box

    thread, box = run_in_background(RUNNING_NEW)
    out["update_running"] = eng.update_weights_from_disk(second, weight_version="second")
    thread.join()
    out["running"] = box["outs"]
    out["after_running"] = generate(eng, PROMPTS[:2], MAX_NEW[:2])
    thread, box = run_in_background(300)
    time.sleep(0.5)
    out["update_abort"] = eng.update_weights_from_disk(TEST_MODEL_PATH, abort_all_requests=True)
    thread.join()
    out["aborted"] = box["outs"]
    out["after_abort"] = generate(eng, PROMPTS[:2], MAX_NEW[:2])
    return out


def single_run(second: str) -> dict[str, Any]:
    devices = jax.devices()
    assert len(devices) == 4, devices
    # Not the order the engine would pick: rank 0 is devices 3, 2.
    mesh = Mesh(np.array(devices[::-1]).reshape(2, 2), ("expert", "tensor"))
    args = {k: v for k, v in DP_ARGS.items() if k not in ("tp_size", "ep_size")}
    out: dict[str, Any] = {}
    with Engine(**engine_args(**args, enable_single_process=True, mesh=mesh,
                              expert_distribution_recorder_mode="per_token",
                              expert_distribution_recorder_dir=tempfile.mkdtemp())) as eng:
        out["child_pids"] = eng.child_pids()
        eng.start_expert_distribution_record()
        out["outs"] = generate(eng, PROMPTS, MAX_NEW, rid=RIDS)
        eng.stop_expert_distribution_record()
        with np.load(eng.dump_expert_distribution_record()) as f:
            out["per_token"] = {k: f[k] for k in ("topk_ids", "rid", "position")}
        compiles = eng.get_server_info()["num_compiles"]
        tensors = {k: jnp.asarray(v) for k, v in load_file(f"{second}/model.safetensors").items()}
        res = eng.update_weights_from_arrays(tensors, weight_version="second")
        out["update"] = {k: v for k, v in res.items() if k in ("success", "host_bytes",
                                                             "weight_version")}
        out["after_update"] = generate(eng, PROMPTS, MAX_NEW)
        # Released (each rank's KV shard and the weights) and resumed: the same outputs.
        out["release"] = eng.release_memory_occupation()
        out["resume"] = eng.resume_memory_occupation()
        out["after_resume"] = generate(eng, PROMPTS, MAX_NEW)
        out["compiles"] = (compiles, eng.get_server_info()["num_compiles"])
        out["server_info"] = eng.get_server_info()
    return out


def stream_both_ranks(eng, prompts: list[list[int]], max_new: list[int]) -> list[list[dict]]:
    """Streams the prompts at once (one caller thread each, so they share steps): the chunks
    of each."""
    def one(i: int) -> list[dict]:
        return list(eng.generate(input_ids=prompts[i], sampling_params=params([max_new[i]])[0],
                                 return_routed_experts=True, stream=True))

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def eplb_run(second: str) -> dict[str, Any]:
    """EPLB (2 redundant experts: 9 physical per rank) with DP: outputs before and after a
    rebalance, streamed routed experts, a pause and continue."""
    out: dict[str, Any] = {}
    with Engine(**engine_args(**DP_ARGS, enable_eplb=True, ep_num_redundant_experts=2)) as eng:
        out["before"] = generate(eng, PROMPTS, MAX_NEW)
        compiles = eng.get_server_info()["num_compiles"]
        out["rebalance"] = eng.rebalance_experts()
        eng.flush_cache()
        out["after"] = generate(eng, PROMPTS, MAX_NEW)
        out["compiles"] = (compiles, eng.get_server_info()["num_compiles"])
        eng.flush_cache()  # then each rank's tree holds only what the streamed ones computed
        out["streamed"] = stream_both_ranks(eng, PROMPTS[:2], MAX_NEW[:2])
        out["stream_info"] = eng.get_server_info()
        # Paused while a request decodes on each rank, then continued.
        thread, box, out["paused_per_rank"] = start_two(eng, RUNNING_NEW)
        eng.pause_generation()
        out["paused_info"] = eng.get_server_info()
        time.sleep(0.3)
        out["paused_info_later"] = eng.get_server_info()
        eng.continue_generation()
        thread.join()
        out["paused"] = box["outs"]
        out["server_info"] = eng.get_server_info()
    return out


def mla_run(model_path: str) -> dict[str, Any]:
    """DeepSeek-V3's MLA (latent cache split over the ranks, dense first layer, shared
    expert): routed experts, their weights, logprobs and the stat recorder."""
    out: dict[str, Any] = {}
    with Engine(**engine_args(**DP_ARGS, model_path=model_path,
                              enable_return_routed_expert_weights=True,
                              expert_distribution_recorder_mode="stat",
                              expert_distribution_recorder_dir=tempfile.mkdtemp())) as eng:
        out.update(recorded_batch(eng))
        out["server_info"] = eng.get_server_info()
    return out


def main(mode: str, second: str, path: str) -> None:
    """``second``: the second checkpoint (``mla``: the DeepSeek-V3 checkpoint to serve)."""
    modes = {"multi": multi_run, "single": single_run, "eplb": eplb_run, "mla": mla_run}
    result = modes[mode](second)
    with open(path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
