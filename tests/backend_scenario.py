"""One forward scenario that every backend and parallel layout must get right, and its
expected results from the independent float64 reference forward.

Prompt a (40 tokens) is prefilled in two chunks (24, then 16 on a cached prefix); b starts on
a's first 16 tokens (a prefix-cache hit: whole pages for page sizes up to 16) and adds 10 of
its own; c is a fresh 5-token prompt. a's second chunk, b and c run as one mixed extend batch,
then all three decode three tokens together.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FIRST_CHUNK = 24
SHARED = 16  # b's cached prefix: a's first SHARED tokens


def scenario_tokens() -> tuple[list[int], list[int], list[int], list[int]]:
    """a's prompt, b's own tokens after the shared prefix, c's prompt, the decoded tokens."""
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(0, 500, n).tolist() for n in (40, 10, 5))
    return a, b, c, [1, 2, 3]


def run_scenario(runner: Any) -> dict[str, np.ndarray]:
    """Logits and routed-experts rows of every step, driving ``runner`` directly."""
    from sgl_jax.srt.forward_batch_info import ForwardMode
    from tests.model_driver import ModelDriver

    driver = ModelDriver(runner, rng_seed=0)
    a_ids, b_new, c_ids, decoded = scenario_tokens()
    out: dict[str, np.ndarray] = {}
    a = driver.new_seq()
    out["logits_0"], (out["rows_0_a"],) = driver.step(
        ForwardMode.EXTEND, [a], [a_ids[:FIRST_CHUNK]]
    )
    # With DP attention: b on a's rank (its prefix is there), c on the last rank, which
    # is idle in the first step (and the middle ranks in every step, with dp > 2).
    b, c = driver.new_seq(rank=a.rank), driver.new_seq(rank=-1)
    driver.share_prefix(b, a, SHARED)
    logits, rows = driver.step(
        ForwardMode.EXTEND, [a, b, c], [a_ids[FIRST_CHUNK:], b_new, c_ids]
    )
    out["logits_1"] = logits
    out["rows_1_a"], out["rows_1_b"], out["rows_1_c"] = rows
    for step, token in enumerate(decoded):
        logits, rows = driver.step(ForwardMode.DECODE, [a, b, c], [[token]] * 3)
        out[f"logits_{step + 2}"] = logits
        out[f"rows_{step + 2}"] = np.stack(rows)
    for seq in (b, c, a):
        driver.release(seq)
    return out


def reference_scenario(model_path: str) -> dict[str, np.ndarray]:
    """The results ``run_scenario`` must produce, from the float64 reference forward."""
    from sgl_jax.tools.reference_forward import ReferenceModel

    ref = ReferenceModel(model_path)
    a_ids, b_new, c_ids, decoded = scenario_tokens()
    b_ids = a_ids[:SHARED] + b_new
    a, b, c = (ref.forward(seq + decoded) for seq in (a_ids, b_ids, c_ids))
    ends = [len(a_ids), len(b_ids), len(c_ids)]  # prompt lengths
    out = {
        "logits_0": a.logits[FIRST_CHUNK - 1 : FIRST_CHUNK],
        "rows_0_a": a.topk_ids[:FIRST_CHUNK],
        "logits_1": np.stack([o.logits[n - 1] for o, n in zip((a, b, c), ends, strict=True)]),
        "rows_1_a": a.topk_ids[FIRST_CHUNK : ends[0]],
        "rows_1_b": b.topk_ids[SHARED : ends[1]],
        "rows_1_c": c.topk_ids[: ends[2]],
    }
    for step in range(len(decoded)):
        out[f"logits_{step + 2}"] = np.stack(
            [o.logits[n + step] for o, n in zip((a, b, c), ends, strict=True)]
        )
        out[f"rows_{step + 2}"] = np.stack(
            [o.topk_ids[n + step : n + step + 1] for o, n in zip((a, b, c), ends, strict=True)]
        )
    return out


def assert_matches(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rel_tol: float) -> None:
    """Routed experts exactly (logical ids), logits within ``rel_tol`` of the largest logit."""
    assert set(got) == set(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        if key.startswith("rows"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            err = np.max(np.abs(got[key] - want[key])) / np.max(np.abs(want[key]))
            assert err < rel_tol, f"{key}: relative error {err}"
