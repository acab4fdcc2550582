"""aot_report: TPU ahead-of-time compilation of the engine's step on compile-only devices.

The compile tests need libtpu (``pip install "sgl_jax[tpu]"``) and are skipped without it; the
analytic figures are checked everywhere. The compiled models are Qwen3-30B-A3B's widths with 2
layers and a small vocabulary (XLA:TPU's compile time is dominated by the sampler's
full-vocabulary sort: ~20 s per bucket here instead of ~80 s), and a DeepSeek-V3-shaped model
(MLA, grouped sigmoid router, shared expert, a dense first layer) at small widths.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.tools.aot.accounting import (
    active_params_per_token,
    attention_flops_per_pair,
    dispatch_bytes_per_moe_layer,
    ideal_flops,
    kernel_cost_per_call,
    kv_bytes_per_token_per_device,
    linear_state_bytes_per_request,
)
from sgl_jax.tools.aot.buckets import Bucket, dp_buckets
from sgl_jax.tools.aot.cli import parse_args
from sgl_jax.tools.aot.depth import slice_patterns, with_pattern
from sgl_jax.tools.aot.hlo.collectives import collective_bytes
from sgl_jax.tools.aot.memory_fit import max_requests_that_fit
from sgl_jax.tools.aot.tables import format_verify_notes

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='needs libtpu for compile-only TPU devices: pip install "sgl_jax[tpu]"',
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


@needs_libtpu
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


@needs_libtpu
def test_verify_report_json(small_config: Path) -> None:
    # --verify-tokens 4: after the decode bucket, the speculative TARGET_VERIFY step of the
    # same 8 requests x 4 tokens, ending at the decode bucket's 512 positions (no prefill
    # bucket: --prefill-tokens 0).
    proc = run_tool(
        "--model-config", str(small_config), "--topology", "v5e:2x2", "--tp-size", "4",
        "--decode-bs", "8", "--prefill-tokens", "0", "--context-len", "512",
        "--verify-tokens", "4", "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout)
    assert [r["mode"] for r in records] == ["decode", "verify"]
    decode, verify = records
    assert KEYS <= verify.keys(), KEYS - verify.keys()
    assert (verify["tokens"], verify["batch_size"], verify["context_len"]) == (32, 8, 512)
    assert verify["verify_tokens"] == 4 and verify["draft_cost_included"] is False
    # The ideal counts the LM head at every verified token (each one is sampled), and causal
    # attention of 4 queries over 508 cached positions and each other.
    cfg = ModelConfig.from_dict(json.loads((small_config / "config.json").read_text()),
                                str(small_config), 512)
    assert verify["ideal_flops"] == ideal_flops(cfg, Bucket("verify", 32, 8, 8, 4, 508))
    assert 0.9 <= verify["flops_ratio"] <= 1.2, verify
    assert verify["kernel_flops"] > 3.9 * decode["kernel_flops"]
    # The ratios against the decode step of the same batch, per step and per verified token.
    ratio = verify["bytes_accessed_per_device"] / decode["bytes_accessed_per_device"]
    assert verify["bytes_vs_decode"] == pytest.approx(ratio, rel=1e-12)
    assert verify["bytes_per_token_vs_decode"] == pytest.approx(ratio / 4, rel=1e-12)
    assert verify["roofline_vs_decode"] == pytest.approx(
        verify["roofline_ms"] / decode["roofline_ms"], rel=1e-12)
    # 4x the tokens, one read of the weights: more bytes than decode, far below 4x; the
    # FLOPs per verified token are decode's per token (same layers, LM head per token).
    assert 1.0 < verify["bytes_vs_decode"] < 2.0, verify["bytes_vs_decode"]
    assert 3.5 < verify["flops_vs_decode"] < 4.5, verify["flops_vs_decode"]
    notes = format_verify_notes(records)
    assert f"verify 8 x 4 vs decode 8: bytes {ratio:.3f}x" in notes
    assert "not included" in notes and "EAGLE" in notes


@needs_libtpu
def test_verify_with_an_eagle_draft_costs_more_than_without(small_config: Path,
                                                            tmp_path: Path) -> None:
    # The same verify bucket with an EAGLE head compiled into the step: its draft extend and
    # chain add FLOPs to the target's verify step.
    target = json.loads((small_config / "config.json").read_text())
    draft = tmp_path / "eagle"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({
        "architectures": ["SglJaxEagleDraft"], "model_type": "sgl_jax_eagle",
        **{k: target[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "vocab_size", "rms_norm_eps", "rope_theta")},
        "intermediate_size": 1024}))
    common = ("--model-config", str(small_config), "--topology", "v5e:2x2", "--tp-size", "4",
              "--decode-bs", "8", "--prefill-tokens", "0", "--context-len", "512",
              "--verify-tokens", "4", "--json")
    records = {}
    for algorithm, extra in (("NGRAM", ()),
                             ("EAGLE", ("--speculative-draft-model-path", str(draft)))):
        proc = run_tool(*common, "--speculative-algorithm", algorithm, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[algorithm] = json.loads(proc.stdout)[1]
    ngram, eagle = records["NGRAM"], records["EAGLE"]
    assert eagle["draft_cost_included"] and not ngram["draft_cost_included"]
    # (XLA's bytes estimate is not monotonic in added work: other fusions, other counts.)
    assert eagle["compiled_flops"] > ngram["compiled_flops"]


@needs_libtpu
def test_placement_and_routing_add_no_gather_or_scatter(small_config: Path,
                                                         tmp_path: Path) -> None:
    """Compiled for TPU with DP attention, EPLB (its replica choice and the recorder's
    counts) and routed-experts capture add no gather or scatter to the step: XLA:TPU runs
    each element of one from a small table at a whole tile. Their lookups are one-hot
    compares there, and the host puts the routed rows in the scheduler's order."""
    common = ["--model-config", str(small_config), "--topology", "v5e:2x2", "--tp-size", "2",
              "--ep-size", "2", "--dp-size", "2", "--decode-bs", "8", "--prefill-tokens", "64",
              "--prefill-requests", "2", "--context-len", "512", "--json"]
    counts = {}
    for name, extra in (("plain", []), ("features", ["--ep-num-redundant-experts", "2",
                                                     "--enable-return-routed-experts"])):
        proc = run_tool(*common, *extra, "--dump-hlo", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts[name] = {
            path.name: [path.read_text().count(f" {op}(") for op in ("gather", "scatter")]
            for path in sorted((tmp_path / name).glob("*.hlo"))}
    assert set(counts["plain"]) == {"decode-8x8-2moe2.hlo", "prefill-64x8-2moe2.hlo"}
    assert counts["features"] == counts["plain"]


@needs_libtpu
def test_all_heads_on_one_device_compile(tmp_path: Path) -> None:
    """The 235B's attention (64 query heads of 4 KV heads) whole on each device (tp 1, DP
    attention over 4 v5p chips): the Pallas kernel's tuned blocks hold all 64 heads, whose
    scores outgrow XLA's default scoped VMEM (16 MiB on v5p), and XLA:TPU refused to
    compile the prefill. The kernel asks for the chip's limit (48 MiB on v5p)."""
    config = json.loads((CONFIGS / "qwen3-235b-a22b" / "config.json").read_text())
    config.update(num_hidden_layers=1, max_window_layers=1, vocab_size=2048, hidden_size=1024,
                  moe_intermediate_size=256, num_experts=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run_tool("--model-config", str(tmp_path), "--topology", "v5p:2x2x1",
                    "--tp-size", "1", "--ep-size", "4", "--dp-size", "4", "--decode-bs", "8",
                    "--prefill-tokens", "2048", "--prefill-requests", "4",
                    "--context-len", "1024", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["mode"] for r in json.loads(proc.stdout)] == ["decode", "prefill"]


@needs_libtpu
def test_long_context_pages_compile(small_config: Path) -> None:
    """The 30B's decode of 64 requests over a 32k context in pages of 64 on v5e: 8 heads a
    block of the Pallas kernel, but 128 pages of 64 positions, outgrow XLA's default scoped
    VMEM (16 MiB) as well (8 requests fit: fewer queries a block). A rule asking for the
    chip's limit by heads alone missed this one."""
    proc = run_tool("--model-config", str(small_config), "--topology", "v5e:2x2",
                    "--tp-size", "4", "--page-size", "64", "--context-len", "32768",
                    "--decode-bs", "64", "--prefill-tokens", "0", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["mode"] for r in json.loads(proc.stdout)] == ["decode"]


def test_verify_buckets_and_flags() -> None:
    # No compile: the buckets --verify-tokens adds, and the flags it refuses.
    rows = dp_buckets([64, 256], 2048, 8, 4096, 1, lambda t: min(t, 256), 4)
    assert [(b.mode, b.tokens, b.requests) for b in rows] == [
        ("decode", 64, 64), ("verify", 256, 64), ("decode", 256, 256), ("verify", 1024, 256),
        ("prefill", 2048, 8)]
    verify = rows[1]
    assert (verify.context_len, verify.sampled, verify.compiled_sampled) == (4096, 256, 256)
    assert verify.pairs_per_request == 4093 + 4094 + 4095 + 4096
    assert rows[0].sampled == 64 and rows[-1].sampled == 8
    assert [b.mode for b in dp_buckets([8], 0, 8, 512, 1, min, 4)] == [
        "decode", "verify"]  # --prefill-tokens 0: no prefill bucket
    base = ["--model-config", "qwen3-30b-a3b", "--topology", "v5e:2x4"]
    assert parse_args(base).verify_tokens is None
    for bad in (["--verify-tokens", "1"], ["--verify-tokens", "4", "--context-len", "4"],
                ["--verify-tokens", "4", "--ep-size", "2", "--dp-size", "2"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)


@needs_libtpu
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


@needs_libtpu
def test_bundled_config_name_and_bad_layout() -> None:
    # A bundled config by name; tp_size=8 does not divide num_key_value_heads=4: exit 1.
    proc = run_tool(
        "--model-config", "qwen3-30b-a3b", "--topology", "v5e:2x4", "--tp-size", "8",
        "--json",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "num_key_value_heads" in proc.stderr


def bundled(name: str) -> ModelConfig:
    path = CONFIGS / name
    return ModelConfig.from_dict(json.loads((path / "config.json").read_text()), str(path))


def test_analytic_figures_of_the_families() -> None:
    # DeepSeek-V3: 671B parameters of which 36.6B active per token including the 0.9B
    # output head (DeepSeek's README_WEIGHTS.md); MLA: 128 heads over one 576-wide latent row.
    ds = bundled("deepseek-v3")
    layers, head = active_params_per_token(ds)
    assert abs((layers + head) / 1e9 - 36.6) < 0.05 and abs(head / 1e9 - 0.93) < 0.01
    assert ds.moe_layers[:4] == (False, False, False, True) and sum(ds.moe_layers) == 58
    assert attention_flops_per_pair(ds) == 2 * (512 + 64) + 2 * 512
    # The latent cache is replicated: tp does not divide it (61 layers x 576 x 2 bytes).
    assert kv_bytes_per_token_per_device(ds, 8, 2) == 61 * 576 * 2
    # Mixtral-8x7B: 12.9B active of 46.7B (Mistral's announcement, which counts the input
    # embeddings too: a lookup, not FLOPs, left out of the active figure); GQA KV split over tp.
    mx = bundled("mixtral-8x7b")
    embeddings = mx.hidden_size * mx.vocab_size
    assert abs((sum(active_params_per_token(mx)) + embeddings) / 1e9 - 12.9) < 0.05
    assert kv_bytes_per_token_per_device(mx, 4, 2) == 32 * 2 * 8 * 128 * 2 / 4
    # Qwen2-57B-A14B: 14B active (its name; embeddings not counted here, the LM head is).
    qw = bundled("qwen2-57b-a14b")
    assert 13.0 < sum(active_params_per_token(qw)) / 1e9 < 14.5
    # GLM-4.5-Air: 12B active (Zhipu's figure, without the 0.6B LM head counted here).
    glm = bundled("glm-4.5-air")
    assert 12.0 < sum(active_params_per_token(glm)) / 1e9 < 13.0
    # Truncation for --scale-from-layers keeps MoE layers when the model starts dense.
    assert slice_patterns(ds, 1, 2) == [(True,), (True, True), (False, True)]
    assert slice_patterns(mx, 2, 4) == [(True,) * 2, (True,) * 4]


@pytest.fixture(scope="module")
def small_mla_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3's structure at small widths, 2 layers: 1 dense + 1 MoE."""
    config = json.loads((CONFIGS / "deepseek-v3" / "config.json").read_text())
    config.update(
        num_hidden_layers=2, first_k_dense_replace=1, vocab_size=2048, hidden_size=512,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=1024,
        moe_intermediate_size=256, n_routed_experts=16, n_group=4, topk_group=2,
    )
    path = tmp_path_factory.mktemp("deepseek-v3-small-2l")
    (path / "config.json").write_text(json.dumps(config))
    return path


@needs_libtpu
def test_mla_report_json(small_mla_config: Path) -> None:
    args = ("--model-config", str(small_mla_config), "--topology", "v5e:2x2", "--tp-size", "4",
            "--decode-bs", "8", "--prefill-tokens", "64", "--prefill-requests", "2",
            "--context-len", "512", "--json")
    # pallas cannot run MLA: a usage error naming the way out, before any compile.
    proc = run_tool(*args, "--attention-backend", "pallas")
    assert proc.returncode == 1 and "--attention-backend native" in proc.stderr, proc.stderr
    proc = run_tool(*args)  # MLA defaults to the native backend
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout)
    assert [r["mode"] for r in records] == ["decode", "prefill"]
    for r in records:
        assert KEYS <= r.keys(), KEYS - r.keys()
        assert (r["attention"], r["attention_backend"], r["family"]) == (
            "mla", "native", "deepseek_v3")
        # XLA's once-counted native attention loop is replaced by the analytic attention;
        # the rest (sampler, padded rows' LM head) keeps the ratio near 1 on a tp layout.
        assert r["kernel_flops"] > 0 and r["native_attention_xla_flops"] > 0
        assert 0.9 <= r["flops_ratio"] <= 1.4, r
        # The latent KV cache is replicated over tp: 2 layers x (kv_lora + rope) x 2 bytes.
        assert r["kv_bytes_per_token_per_device"] == 2 * (128 + 32) * 2
        assert r["peak_hbm_bytes_per_device"] >= (
            r["parameters_bytes_per_device"] + r["kv_cache_bytes_per_device"]
        )


# A compiled module's text as XLA:TPU prints it (abridged): the source tables and four
# collectives, in each printed form of replica_groups; the first all-reduce's stack frame (2)
# has a caller (frame 1) in layers/moe/, so it is the MoE dispatch, and so is the
# reduce-scatter XLA emits as an all-reduce in an ``all-reduce-scatter`` computation (no
# frame of its own: its reduction's ROOT has frame 1).
HLO = """HloModule jit__step_impl

FileNames
1 "/x/sgl_jax/srt/layers/moe/ep_moe.py"
2 "/x/sgl_jax/srt/models/common.py"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=1}
2 {file_name_id=2 function_name_id=2 line=2 end_line=2 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=2}

%region_1 (a: f32[], b: f32[]) -> f32[] {
  ROOT %add.1 = f32[] add(%a, %b), metadata={op_name="add" stack_frame_id=1}
}

%all-reduce-scatter (input: f32[64,2048]) -> f32[16,2048] {
  %ar.5 = f32[64,2048]{1,0:T(8,128)} all-reduce(%input), channel_id=5, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%region_1, backend_config={}
}

ENTRY %main {
  %psum.1 = bf16[64,2048]{1,0:T(8,128)(2,1)S(1)} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add, metadata={op_name="shard_map/psum" stack_frame_id=2}
  %ar.2 = bf16[64,2048]{1,0:T(8,128)(2,1)S(1)} all-reduce(%b), channel_id=2, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, to_apply=%add, metadata={op_name="dot_general"}
  %ag.3 = (f32[4,64]{1,0}, f32[16,64]{1,0}) all-gather-start(%c), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
  %cp.4 = (f32[64,3]{1,0:T(8,128)S(1)}, f32[64,3]{1,0:T(8,128)S(1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%d), source_target_pairs={{0,1}}
}
"""


def test_dp_accounting() -> None:
    # Pure arithmetic of --dp-size (no compile): global buckets split over the ranks, the
    # per-device attention work and KV, the largest batch that fits, the dispatch bytes.
    rows = dp_buckets([64], 2048, 8, 4096, 1, lambda t: min(t, 64))
    assert rows == [Bucket("decode", 64, 64, 64, 1, 4095),  # dp 1: as before
                    Bucket("prefill", 2048, 8, 64, 256, 0)]
    [decode, odd, prefill] = dp_buckets([256, 100], 2048, 8, 4096, 16, lambda t: t // 256)
    assert (decode.rows, decode.compiled_tokens, decode.rank_requests) == (256, 256, 16)
    assert decode.rank_load == 1.0
    assert (odd.rows, odd.compiled_tokens, odd.rank_requests) == (112, 112, 7)
    # 8 requests of 256 on 16 ranks: 8 ranks idle, every rank compiled with 256 tokens.
    assert (prefill.compiled_tokens, prefill.rows, prefill.rank_requests) == (4096, 16, 1)
    assert prefill.rank_load == 0.5 and prefill.q_kv_pairs == 8 * 256 * 257 // 2

    # GQA (Qwen3-30B-A3B: 32 heads of 128, 4 KV heads): a device attends for its rank only.
    qw = bundled("qwen3-30b-a3b")
    one = Bucket("decode", 256, 256, 256, 1, 4095)
    two = Bucket("decode", 256, 256, 256, 1, 4095, dp=2)
    f1, b1 = kernel_cost_per_call(qw, one, 4, 2)
    f2, b2 = kernel_cost_per_call(qw, two, 4, 2)
    assert f1 == 32 / 4 * 4 * 128 * 256 * 4096 and f2 == f1 / 2 and b2 == b1 / 2
    # Summed over the 8 devices (tp 4 x dp 2): exactly the model's attention, no replica.
    assert f2 * 8 * two.rank_load == 32 * 4 * 128 * two.q_kv_pairs
    # KV per token per device is tp's split; with dp 2 each rank holds its own requests:
    # 16 GB free / (48 layers x 2 x 4 / 4 heads x 128 x 2 B x 4096) = 158 per rank.
    kv_tok = kv_bytes_per_token_per_device(qw, 4, 2)
    assert kv_tok == 48 * 2 * 4 * 128 * 2 / 4
    assert max_requests_that_fit(16e9, kv_tok, 4096, 1) == 158
    assert max_requests_that_fit(16e9, kv_tok, 4096, 2) == 316
    assert max_requests_that_fit(-1.0, kv_tok, 4096, 2) == 0
    # DeepSeek-V3's latent row is not split by tp: 20 GiB / (70,272 B x 4096) = 74 per rank.
    ds = bundled("deepseek-v3")
    kv_ds = kv_bytes_per_token_per_device(ds, 4, 2)
    assert max_requests_that_fit(20 * 2**30, kv_ds, 4096, 16) == 16 * 74

    # Dispatch per MoE layer and device. dp 1: psum of [64, 2048] bf16 over 8 devices, the
    # figure the compiled HLO of Qwen3-30B-A3B (v5e:2x4, tp 4 x ep 2) gives. dp 2, 256
    # tokens: all-gather of x (bf16) and of the 8 ids + weights per token over the 2 ranks,
    # reduce-scatter of the bf16 partials, all-reduce of a rank's 128 rows over tp 4; the
    # ragged all-to-all: a rank's 128 x 8 assignments, half leaving, row + ids out, f32 back.
    assert (dispatch_bytes_per_moe_layer(64, 2048, 8, 2, 4, 2, 1)
            == 2 * 64 * 2048 * 2 * 7 / 8)
    tensor = 2 * 128 * 2048 * 2 * 3 / 4
    assert dispatch_bytes_per_moe_layer(256, 2048, 8, 2, 4, 2, 2) == (
        256 * 2048 * 2 / 2 + 256 * 8 * 8 / 2 + 256 * 2048 * 2 / 2 + tensor)
    assert dispatch_bytes_per_moe_layer(
        256, 2048, 8, 2, 4, 2, 2, "ragged_all_to_all") == (
        128 * 8 / 2 * (2048 * 2 + 8 + 2048 * 4) + tensor)

    total, moe, per_op = collective_bytes(HLO, 8)
    psum = 2 * 64 * 2048 * 2 * 7 / 8  # all 8 devices
    tensor = 2 * 64 * 2048 * 2 * 3 / 4  # mesh form, axis_1 = 4 devices
    gather = 16 * 64 * 4 * 3 / 4  # iota form [2,4]: groups of 4; the result, not the operand
    permute = 64 * 3 * 4
    scatter = 64 * 2048 * 4 / 2  # its input over groups of 2
    assert moe == psum + scatter
    assert per_op == {"all-reduce": psum + tensor, "all-gather": gather,
                      "collective-permute": permute, "reduce-scatter": scatter}
    assert total == psum + tensor + gather + permute + scatter


def test_qwen35_accounting() -> None:
    # Qwen3.5-35B-A3B: 40 layers, 3 Gated DeltaNet then 1 full attention, 10 times. Figures
    # written out from the config's widths, independently of accounting.py's formulas.
    q = bundled("qwen3.5-35b-a3b")
    assert q.linear_layers == (True, True, True, False) * 10
    h, conv = 2048, 2 * 16 * 128 + 32 * 128
    linear = h * conv + h * 4096 + 2 * h * 32 + conv * 4 + 4096 * h
    full = h * (2 * 16 * 256 + 2 * 2 * 256) + 16 * 256 * h  # q_proj gives [query | gate]
    moe = h * 256 + 8 * 3 * h * 512 + 3 * h * 512 + h
    layers, head = active_params_per_token(q)
    assert layers == 30 * linear + 10 * full + 40 * moe and head == h * 248320
    assert 2.9e9 < layers + head < 3.0e9  # "A3B" (the input embeddings are not counted)
    # KV only in the 10 full-attention layers (2 KV heads of 256, K and V, bf16, split over
    # tp 2); the states: float32 [32, 128, 128] + conv [8192, 3] bf16 in each of 30 layers.
    assert kv_bytes_per_token_per_device(q, 2, 2) == 10 * 2 * 2 * 256 * 2 / 2
    assert linear_state_bytes_per_request(q, 2) == 30 * (32 * 128 * 128 * 4 + conv * 3 * 2)
    # Ideal decode FLOPs: projections, LM head, attention in full layers over the context,
    # the delta rule's 6 * Hv * dk * dv per token in linear layers.
    b = Bucket("decode", 64, 64, 64, 1, 4095)
    attention = 16 * 4 * 256 * b.q_kv_pairs * 10
    recurrence = 6 * 32 * 128 * 128 * 64 * 30
    assert ideal_flops(q, b) == 2 * layers * 64 + 2 * head * 64 + attention + recurrence
    # Truncated slices keep the 3 : 1 mix (A, B multiples of 4).
    cut = with_pattern(q, (True,) * 8)
    assert cut.linear_layers == (True, True, True, False) * 2
    assert kv_bytes_per_token_per_device(cut, 2, 2) == 2 * 2 * 2 * 256 * 2 / 2
    # A request's states count against the batch that fits: 16 GB free at 4096 tokens.
    per_request = 4096 * kv_bytes_per_token_per_device(q, 2, 2) + linear_state_bytes_per_request(q, 2)
    assert max_requests_that_fit(16e9, kv_bytes_per_token_per_device(q, 2, 2), 4096, 1,
                                 linear_state_bytes_per_request(q, 2)) == int(16e9 // per_request)


@needs_libtpu
def test_qwen35_report_json(tmp_path: Path) -> None:
    # Qwen3.5-MoE at small widths, 4 layers (3 linear, 1 full): compiles with the state
    # tables in the caches; KV per token counts the one full-attention layer only.
    config = json.loads((CONFIGS / "qwen3.5-35b-a3b" / "config.json").read_text())
    config.update(num_hidden_layers=4, layer_types=config["layer_types"][:4], hidden_size=512,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                  shared_expert_intermediate_size=256, num_attention_heads=4, head_dim=128,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                  linear_value_head_dim=64, vocab_size=8192)
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run_tool(
        "--model-config", str(tmp_path), "--topology", "v5e:2x2", "--tp-size", "2",
        "--decode-bs", "8", "--prefill-tokens", "0", "--context-len", "512", "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [r] = json.loads(proc.stdout)
    assert r["family"] == "qwen3_5_moe" and r["linear_layers"] == 3
    assert r["kv_bytes_per_token_per_device"] == 1 * 2 * 2 * 128 * 2 / 2
    state = 3 * (4 * 64 * 64 * 4 + (2 * 2 * 64 + 4 * 64) * 3 * 2)
    assert r["linear_state_bytes_per_request"] == state
    assert r["linear_state_bytes_per_step_per_device"] == 2 * 8 * state // 2  # (tp 2: split)
    # The kernel ran in the one full-attention layer; the states are in the cache bytes.
    assert r["kernel_flops"] > 0
    assert r["kv_cache_bytes_per_device"] > 9 * state // 2  # (the tables split over tp 2)
    assert r["compiled_flops"] > 0 and r["ideal_flops"] > 0
