"""Only the rows of requests that asked go to the host, gathered on the device (M9 item 2).

A real Scheduler is stepped in this process (``tests.test_scheduler_abort.SteppedScheduler``)
with batches that mix requests asking for routed experts and requests that do not. Per step,
the runner's device-to-host byte count (``ModelRunner.last_step_copy_bytes``) must equal the
askers' tokens x layers x k x itemsize when the askers' token count is a power of two (the
gather's index bucket), the askers' rows must equal the independent float64 reference, and the
non-askers' KV slots must be marked unknown (a later request that asks recomputes them and
still gets exact rows, never stale ones).
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.layers.moe.routed_experts_capturer import GatheredRows, index_bucket
from sgl_jax.testing import TEST_MODEL_PATH
from tests.engine_utils import expected_rows, prompt_ids, reference
from tests.test_scheduler_abort import SteppedScheduler

CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok


class MixedScheduler(SteppedScheduler):
    """SteppedScheduler with a prefill chunk that holds a whole mixed batch, and requests
    that may or may not ask."""

    def __init__(self, **overrides) -> None:
        super().__init__(chunked_prefill_size=64, precompile_token_paddings=[64],
                         precompile_bs_paddings=[4], **overrides)

    def run_to_end(self, rids: list[str]) -> dict[str, dict]:
        """Steps until the scheduler is idle; returns the requests' outputs."""
        s = self.scheduler
        while s.policy.has_work() or s.pending:
            self.step()
        return {rid: self.finished(rid) for rid in rids}

    @property
    def runner(self):
        return self.scheduler.runner

    def row_bytes(self) -> int:
        """Bytes of one token's copied row (ids, and routing weights when captured)."""
        host = self.runner.capturer.host_cache
        per = host.rows.dtype.itemsize + (0 if host.weights is None else 4)
        return L * K * per

    def step_copies(self) -> tuple[ForwardMode, int, int, object]:
        """Runs a step; returns (mode, tokens, bytes copied, routed rows) of the one launched."""
        self.step()
        batch, out = self.scheduler.pending
        return (batch.forward_mode, len(batch.out_cache_loc), self.runner.last_step_copy_bytes,
                out.routed_rows)


@pytest.fixture(scope="module", params=[False, True], ids=["ids", "ids+weights"])
def sched(request):
    s = MixedScheduler(enable_return_routed_expert_weights=request.param)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def leak_free(sched):
    yield
    sched.assert_idle_and_leak_free()


def check_rows(out: dict, ids: list[int]) -> None:
    assert out["finished_reason"]["type"] == "length"
    assert out["output_ids"] == reference().greedy_generate(ids, len(out["output_ids"]))
    np.testing.assert_array_equal(out["routed_experts"], expected_rows(ids, out["output_ids"]))


def test_mixed_batch_copies_only_the_askers_rows(sched):
    weights = sched.runner.capturer.host_cache.weights is not None
    prompts = {"a": prompt_ids(201, 5), "b": prompt_ids(202, 9), "c": prompt_ids(203, 11)}
    asks = {"a": True, "b": False, "c": True}
    for rid, ids in prompts.items():
        sched.submit(f"{rid}{weights}", ids, 6, asks[rid],
                        return_routed_expert_weights=weights and asks[rid])
    # The prefill: 25 tokens, 16 of them the askers' (5 + 11, a power of two).
    mode, tokens, copied, rows = sched.step_copies()
    assert mode == ForwardMode.EXTEND and tokens == 25
    assert isinstance(rows, GatheredRows)  # gathered on the device: row i is token i's
    np.testing.assert_array_equal(rows.at, np.arange(16))
    assert rows.rows.ids.shape[0] == index_bucket(16)
    assert copied == 16 * sched.row_bytes()
    slots = sched.scheduler.pending[0].out_cache_loc
    valid = sched.runner.capturer.host_cache.valid[slots]
    np.testing.assert_array_equal(valid, [True] * 5 + [False] * 9 + [True] * 11)
    # A decode step of the three: two askers' rows of a batch padded to 4.
    mode, tokens, copied, rows = sched.step_copies()
    assert mode == ForwardMode.DECODE and tokens == 3
    assert copied == 2 * sched.row_bytes()
    outs = sched.run_to_end([f"{rid}{weights}" for rid in prompts])
    for rid, ids in prompts.items():
        out = outs[f"{rid}{weights}"]
        if asks[rid]:
            check_rows(out, ids)
        else:
            assert out["routed_experts"] is None


def test_all_asking_copies_as_before_and_no_gather(sched):
    prompts = [prompt_ids(211 + i, 4 + i) for i in range(3)]
    for i, ids in enumerate(prompts):
        sched.submit(f"all{i}", ids, 3, True)
    mode, tokens, copied, rows = sched.step_copies()
    assert mode == ForwardMode.EXTEND and tokens == sum(map(len, prompts))
    assert not isinstance(rows, GatheredRows)  # the step's own rows, no extra gather
    # The whole padded step, as before.
    assert copied == sched.runner.padded_extend_tokens(tokens) * sched.row_bytes()
    outs = sched.run_to_end([f"all{i}" for i in range(3)])
    for i, ids in enumerate(prompts):
        check_rows(outs[f"all{i}"], ids)


def test_askers_not_fewer_than_the_step_copy_the_step_rows(sched):
    # Three of four ask in decode: the gather bucket (4) is no smaller than the step (4).
    prompts = [prompt_ids(221 + i, 6) for i in range(4)]
    asks = [True, True, False, True]
    for i, (ids, a) in enumerate(zip(prompts, asks, strict=True)):
        sched.submit(f"most{i}", ids, 4, a)
    mode, tokens, copied, rows = sched.step_copies()
    assert mode == ForwardMode.EXTEND and tokens == 24
    assert index_bucket(18) < sched.runner.padded_extend_tokens(tokens)
    assert copied == index_bucket(18) * sched.row_bytes()
    mode, _, copied, rows = sched.step_copies()
    assert mode == ForwardMode.DECODE
    assert isinstance(rows, GatheredRows)  # the step's own rows, the askers' written
    np.testing.assert_array_equal(rows.at, rows.tokens)
    assert rows.rows.ids.shape[0] == 4
    assert copied == 4 * sched.row_bytes()
    outs = sched.run_to_end([f"most{i}" for i in range(4)])
    for i, (ids, a) in enumerate(zip(prompts, asks, strict=True)):
        out = outs[f"most{i}"]
        if a:
            check_rows(out, ids)
        else:
            assert out["routed_experts"] is None


def test_a_non_askers_prefix_is_recomputed_for_an_asker(sched):
    shared = prompt_ids(231, 12)
    sched.submit("plain", shared + prompt_ids(232, 3), 2, False)
    sched.submit("asker", prompt_ids(233, 5), 2, True)
    mode, _, copied, _ = sched.step_copies()
    assert mode == ForwardMode.EXTEND and copied == 8 * sched.row_bytes()  # 5 -> bucket 8
    check_rows(sched.run_to_end(["plain", "asker"])["asker"], prompt_ids(233, 5))
    # The non-asker's KV is cached but its rows are unknown: an asker recomputes it...
    ids = shared + prompt_ids(234, 4)
    sched.submit("later", ids, 3, True)
    sched.step()
    (req,) = sched.scheduler.pending[0].reqs
    assert req.cached_tokens == 0
    check_rows(sched.run_to_end(["later"])["later"], ids)
    # ...while one that does not ask reuses it.
    sched.submit("plain-again", shared + prompt_ids(235, 2), 2, False)
    sched.step()
    (req,) = sched.scheduler.pending[0].reqs
    assert req.cached_tokens >= len(shared)
    sched.run_to_end(["plain-again"])
