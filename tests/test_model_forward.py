"""The jitted, paged forward against the independent float64 reference (M1).

Logits must agree to 1e-5 relative error and the routed top-k ids of every token and layer must
be exactly equal, for prefill, prefill on a cached prefix, chunked prefill, decode, mixed
batches and different padding buckets, with scattered KV slots.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.testing import TEST_MODEL_PATH
from sgl_jax.tools.reference_forward import ReferenceModel
from tests.model_driver import ModelDriver

REL_TOL = 1e-5


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    args = ServerArgs(
        max_running_requests=8,
        chunked_prefill_size=256,
        precompile_token_paddings=[16, 64, 256],
        precompile_bs_paddings=[1, 4, 8],
        enable_return_routed_experts=True,
        max_total_tokens=4096,
        attention_block_size=16,  # small blocks: the prefix loop runs several times
    )
    r = ModelRunner(args, ModelConfig.from_hf(TEST_MODEL_PATH))
    return r


@pytest.fixture(scope="module")
def ref() -> ReferenceModel:
    return ReferenceModel(TEST_MODEL_PATH)


@pytest.fixture
def driver(runner: ModelRunner):
    d = ModelDriver(runner, rng_seed=1)
    free_kv = runner.token_to_kv_pool_allocator.available_size()
    free_req = runner.req_to_token_pool.available_size()
    yield d
    assert runner.token_to_kv_pool_allocator.available_size() == free_kv
    assert runner.req_to_token_pool.available_size() == free_req


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def check(logits: np.ndarray, rows: np.ndarray, ref_logits: np.ndarray, ref_rows: np.ndarray):
    assert rel_err(logits, ref_logits) < REL_TOL
    np.testing.assert_array_equal(rows, ref_rows)


@pytest.mark.parametrize("length", [1, 5, 37, 200])
def test_prefill_matches_reference(driver, ref, length):
    ids = prompt(length, length)
    out = ref.forward(ids)
    seq = driver.new_seq()
    logits, rows = driver.step(ForwardMode.EXTEND, [seq], [ids])
    check(logits[0], rows[0], out.logits[-1], out.topk_ids)
    driver.release(seq)


def test_decode_matches_one_long_prefill(driver, ref):
    n, m = 30, 12
    ids = prompt(7, n + m)
    out = ref.forward(ids)
    seq = driver.new_seq()
    logits, rows = driver.step(ForwardMode.EXTEND, [seq], [ids[:n]])
    check(logits[0], rows[0], out.logits[n - 1], out.topk_ids[:n])
    for i in range(n, n + m):
        logits, rows = driver.step(ForwardMode.DECODE, [seq], [[ids[i]]])
        check(logits[0], rows[0], out.logits[i], out.topk_ids[i : i + 1])
    driver.release(seq)


def test_extend_on_cached_prefix_and_chunks(driver, ref):
    ids = prompt(11, 150)
    out = ref.forward(ids)
    seq = driver.new_seq()
    bounds = [0, 40, 41, 105, 150]  # chunks of 40, 1, 64 and 45 tokens on growing prefixes
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        logits, rows = driver.step(ForwardMode.EXTEND, [seq], [ids[lo:hi]])
        check(logits[0], rows[0], out.logits[hi - 1], out.topk_ids[lo:hi])
    driver.release(seq)


def test_mixed_batch_equals_alone(driver, ref):
    lengths = [3, 50, 17]
    prompts = [prompt(100 + i, n) for i, n in enumerate(lengths)]
    outs = [ref.forward(p) for p in prompts]
    seqs = [driver.new_seq() for _ in prompts]
    logits, rows = driver.step(ForwardMode.EXTEND, seqs, prompts)
    for i, o in enumerate(outs):
        check(logits[i], rows[i], o.logits[-1], o.topk_ids)
    # decode all three together for a few steps, with tokens of different continuations
    conts = [prompt(200 + i, 5) for i in range(3)]
    full = [ref.forward(p + c) for p, c in zip(prompts, conts, strict=True)]
    for step in range(5):
        logits, rows = driver.step(ForwardMode.DECODE, seqs, [[c[step]] for c in conts])
        for i, o in enumerate(full):
            pos = lengths[i] + step
            check(logits[i], rows[i], o.logits[pos], o.topk_ids[pos : pos + 1])
    for s in seqs:
        driver.release(s)


def test_same_sequence_in_different_buckets(driver, runner):
    ids = prompt(5, 12)
    results = []
    for companions in (0, 3):  # alone (bucket 16) and with batch-mates (bucket 64)
        seqs = [driver.new_seq() for _ in range(1 + companions)]
        batch = [ids] + [prompt(300 + j, 15) for j in range(companions)]
        logits, rows = driver.step(ForwardMode.EXTEND, seqs, batch)
        results.append((logits[0], rows[0], driver.last_batch.num_tokens))
        for s in seqs:
            driver.release(s)
    (l0, r0, t0), (l1, r1, t1) = results
    assert t0 != t1  # really two different padded shapes
    np.testing.assert_array_equal(r0, r1)
    assert rel_err(l1, l0) < REL_TOL


def test_greedy_next_token_is_argmax(driver):
    seqs = [driver.new_seq() for _ in range(2)]
    logits, _ = driver.step(ForwardMode.EXTEND, seqs, [prompt(1, 9), prompt(2, 4)])
    np.testing.assert_array_equal(driver.last_next_ids, logits.argmax(-1))
    for s in seqs:
        driver.release(s)


def test_no_recompile_inside_buckets(driver, runner):
    before = runner.num_compiles
    seqs = [driver.new_seq() for _ in range(3)]
    driver.step(ForwardMode.EXTEND, seqs, [prompt(i, 20 + i) for i in range(3)])
    for _ in range(3):
        driver.step(ForwardMode.DECODE, seqs, [[1], [2], [3]])
    for s in seqs:
        driver.release(s)
    runner.precompile()  # every bucket is compiled now; serving must not add any
    compiled = runner.num_compiles
    seqs = [driver.new_seq() for _ in range(5)]
    driver.step(ForwardMode.EXTEND, seqs, [prompt(i, 7 * i + 1) for i in range(5)])
    driver.step(ForwardMode.DECODE, seqs, [[1]] * 5)
    for s in seqs:
        driver.release(s)
    assert runner.num_compiles == compiled >= before


def test_decode_sends_no_page_rows(driver, runner):
    """A decode step's host-to-device bytes depend on the batch, not on its context: the page
    table lives on the device, and a request's page row is sent only when it starts on a
    cached prefix."""
    sent = {}
    for length in (5, 200):
        seqs = [driver.new_seq() for _ in range(2)]
        driver.step(ForwardMode.EXTEND, seqs, [prompt(length, length), prompt(length + 1, 3)])
        driver.step(ForwardMode.DECODE, seqs, [[1], [2]])
        sent[length] = runner.last_step_host_bytes
        for s in seqs:
            driver.release(s)
    assert sent[5] == sent[200] > 0
    a, b = driver.new_seq(), driver.new_seq()
    driver.step(ForwardMode.EXTEND, [a], [prompt(3, 40)])
    assert runner.last_step_host_bytes == batch_bytes(driver.last_batch)
    driver.share_prefix(b, a, 32)
    driver.step(ForwardMode.EXTEND, [b], [prompt(4, 8)])  # starts on a's first 32 tokens
    row_bytes = runner.req_to_page.shape[1] * 4
    assert runner.last_step_host_bytes == batch_bytes(driver.last_batch) + row_bytes
    for s in (b, a):
        driver.release(s)


def batch_bytes(batch) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(batch))


def test_each_runner_traces_with_its_own_capturer():
    """A runner built later in the same process (here with capture off) must not take over the
    capture of an earlier one: each traces its forward with its own capturer."""
    from tests.backend_scenario import assert_matches, reference_scenario, run_scenario

    common = dict(max_running_requests=4, chunked_prefill_size=32,
                  precompile_token_paddings=[32], precompile_bs_paddings=[4],
                  max_total_tokens=512, attention_block_size=16, context_length=256)
    cfg = ModelConfig.from_hf(TEST_MODEL_PATH, 256)
    first = ModelRunner(ServerArgs(**common, enable_return_routed_experts=True), cfg)
    second = ModelRunner(ServerArgs(**common), cfg)
    assert second.capturer.host_cache is None
    # first's step is traced only now, after second exists.
    assert_matches(run_scenario(first), reference_scenario(TEST_MODEL_PATH), REL_TOL)

