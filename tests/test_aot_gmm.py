"""The model step with ``--moe-backend gmm`` compiles for TPU (compile-only devices) and moves
fewer bytes than with ``ragged``, by XLA's and the Megablox kernel's own estimates.

Needs libtpu (``pip install "sgl_jax[tpu]"``; skipped without it): run in the TPU venv, like
``tests/test_aot_report.py``. The model is Qwen3-30B-A3B's widths with 2 layers and a small
vocabulary on v6e:2x2 at tp 4 (per device: 128 experts of width 192, the layout where
``ragged_dot`` relayouts its gate/up weights every step and gmm reads them in place).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.test_aot_report import run_tool

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='needs libtpu for compile-only TPU devices: pip install "sgl_jax[tpu]"',
)

CONFIGS = Path(__file__).resolve().parents[1] / "sgl_jax" / "assets" / "configs"


@pytest.fixture(scope="module")
def small_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    config.update(num_hidden_layers=2, max_window_layers=2, vocab_size=8192)
    path = tmp_path_factory.mktemp("qwen3-30b-a3b-2l")
    (path / "config.json").write_text(json.dumps(config))  # config only: no weights
    return path


def report(config: Path, backend: str, *flags: str) -> list[dict]:
    """``aot_report --json`` on v6e:2x2 at tp 4; ``flags`` override (argparse: the last
    occurrence of an option wins)."""
    proc = run_tool(
        "--model-config", str(config), "--topology", "v6e:2x2", "--tp-size", "4",
        "--decode-bs", "64", "--prefill-tokens", "256", "--prefill-requests", "2",
        "--context-len", "512", "--moe-backend", backend, "--json", *flags,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@needs_libtpu
def test_gmm_step_compiles_and_moves_fewer_bytes_than_ragged(small_config: Path) -> None:
    gmm, ragged = report(small_config, "gmm"), report(small_config, "ragged")
    assert [r["mode"] for r in gmm] == [r["mode"] for r in ragged] == ["decode", "prefill"]
    for g, r in zip(gmm, ragged, strict=True):
        # The same work (gmm pads the rows to its row tile: a few percent at most)...
        assert 0.9 <= g["flops_ratio"] <= 1.2, g
        assert g["compiled_flops"] == pytest.approx(r["compiled_flops"], rel=0.05)
        # ... with fewer bytes: no relayout copy of the gate/up weights, tile-shaped gathers.
        assert g["bytes_accessed"] < 0.9 * r["bytes_accessed"], (g["mode"], g, r)


@needs_libtpu
def test_gmm_under_dp_attention_compiles_one_window_per_device(small_config: Path) -> None:
    """DP attention with EP (4 ranks, experts split 4 ways): each device's gmm calls are
    compiled for one pass window (1.25 times its share of the assignments), not for every rank's
    assignments as ragged's are, and the step still compiles with the pass loop inside the
    MoE ``shard_map``."""
    # One prefill request per rank: no idle rank's padding in the local-rows ratio.
    args = ("--ep-size", "4", "--dp-size", "4", "--tp-size", "1", "--prefill-requests", "4")
    gmm, ragged = report(small_config, "gmm", *args), report(small_config, "ragged", *args)
    for g, r in zip(gmm, ragged, strict=True):
        # ragged: every device computes all ranks' T*k rows (ep x the expert FLOPs); gmm: a
        # window of 1.25 x T*k / ep rows, whose excess over the device's share is a quarter of
        # the ideal.
        assert g["compiled_flops"] < 0.75 * r["compiled_flops"], (g["mode"], g, r)
        assert 0.9 <= g["flops_ratio_local_rows"] <= 1.2, g
        assert g["bytes_accessed"] < r["bytes_accessed"], g["mode"]
