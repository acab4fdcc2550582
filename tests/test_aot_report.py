"""aot_report: TPU ahead-of-time compilation of the engine's step on compile-only devices.

Needs libtpu (``pip install "sgl_jax[tpu]"``); skipped without it. The model is Qwen3-30B-A3B's
widths with 2 layers and a small vocabulary (XLA:TPU's compile time is dominated by the
sampler's full-vocabulary sort: ~20 s per bucket here instead of ~80 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "libtpu", reason='needs libtpu for compile-only TPU devices: pip install "sgl_jax[tpu]"'
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "sgl_jax" / "assets" / "configs"
KEYS = {
    "mode", "tokens", "batch_size", "context_len", "compiled_flops", "ideal_flops",
    "bytes_accessed", "peak_hbm_bytes_per_device", "roofline_ms", "flops_ratio",
    "parameters_bytes_per_device", "kv_cache_bytes_per_device", "tokens_per_s",
}


def run_tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sgl_jax.tools.aot_report", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )


@pytest.fixture(scope="module")
def small_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    config.update(num_hidden_layers=2, max_window_layers=2, vocab_size=8192)
    path = tmp_path_factory.mktemp("qwen3-30b-a3b-2l")
    (path / "config.json").write_text(json.dumps(config))  # config only: no weights
    return path


def test_report_json(small_config: Path) -> None:
    proc = run_tool(
        "--model-config", str(small_config), "--topology", "v5e:2x2", "--tp-size", "4",
        "--decode-bs", "8", "--prefill-tokens", "64", "--prefill-requests", "2",
        "--context-len", "512", "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout)  # stdout is exactly one JSON list; logs go to stderr
    assert [r["mode"] for r in records] == ["decode", "prefill"]
    for r in records:
        assert KEYS <= r.keys(), KEYS - r.keys()
        assert r["compiled_flops"] > 0 and r["ideal_flops"] > 0
        # Sparse experts and the paged kernel: on a tp-only layout the compiled step does
        # about the ideal work (the dense expert backend would be ~10x here).
        assert 0.9 <= r["compiled_flops"] / r["ideal_flops"] <= 1.2, r
        assert r["kernel_flops"] > 0  # the Pallas attention kernel, added analytically
        assert r["bytes_accessed"] > 0 and r["roofline_ms"] > 0
        assert r["parameters_bytes_per_device"] > 0 and r["kv_cache_bytes_per_device"] > 0
        assert r["peak_hbm_bytes_per_device"] >= (
            r["parameters_bytes_per_device"] + r["kv_cache_bytes_per_device"]
        )
        assert r["peak_hbm_bytes_per_device"] < r["hbm_bytes_per_device"]
    decode, prefill = records
    assert (decode["tokens"], decode["batch_size"], decode["context_len"]) == (8, 8, 512)
    assert (prefill["tokens"], prefill["batch_size"], prefill["context_len"]) == (64, 2, 32)


def test_does_not_fit_exits_2() -> None:
    proc = run_tool(
        "--model-config", str(CONFIGS / "qwen3-235b-a22b"), "--topology", "v5e:2x2",
        "--tp-size", "4", "--decode-bs", "64", "--context-len", "4096", "--json",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == ""
    message = proc.stderr
    assert "does not fit" in message and "per device" in message
    assert "parameters" in message and "KV cache" in message and "--ep-size" in message


def test_bundled_config_name_and_bad_layout() -> None:
    # A bundled config by name; tp_size=8 does not divide num_key_value_heads=4: exit 1.
    proc = run_tool(
        "--model-config", "qwen3-30b-a3b", "--topology", "v5e:2x4", "--tp-size", "8",
        "--json",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "num_key_value_heads" in proc.stderr
