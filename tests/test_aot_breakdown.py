"""aot_report --breakdown: the compiled step's bytes and FLOPs per op class.

On CPU (every venv): the engine's own step, built abstract (no weights) for a small
Qwen3-MoE-shaped model and compiled by XLA:CPU, is split by ``aot.hlo.breakdown``; the classes
must sum exactly to XLA's totals, and the expert matmuls must be where a prefill's FLOPs go.
With libtpu (the TPU venv of .ci/run): ``aot_report --breakdown --extend-tokens`` end to end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sgl_jax.tools.aot.compile_step import Compiled
from sgl_jax.tools.aot.depth import extrapolate
from sgl_jax.tools.aot.hlo import breakdown as hb
from sgl_jax.tools.aot.hlo import op_classes, op_costs
from sgl_jax.tools.aot.hlo import parse as hlo_parse

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "sgl_jax" / "assets" / "configs"

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='needs libtpu for compile-only TPU devices: pip install "sgl_jax[tpu]"',
)


def small_qwen3(path: Path, layers: int, **widths: int) -> Path:
    config = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    config.update(num_hidden_layers=layers, max_window_layers=layers, **widths)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))  # config only: no weights
    return path


# -- the parser on a hand-written module -------------------------------------------------------
# A fusion holding a dot (a projection), a custom call with a kernel cost estimate (ragged_dot
# on TPU), a collective, a layout copy and the sampler's two conditionals: greedy or sampled
# rows, and inside the sampled rows the sort fallback (source function full_sort) or not.
HLO = """HloModule m

FileNames
1 "/x/sgl_jax/srt/layers/sampler.py"
2 "/x/sgl_jax/srt/models/common.py"
3 "/x/sgl_jax/srt/layers/norm_rope.py"

FunctionNames
1 "sample"
2 "sample.<locals>.sampled_rows.<locals>.full_sort"
3 "GqaAttention._project"
4 "norm_rope"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=1}
2 {file_name_id=1 function_name_id=2 line=2 end_line=2 column=1 end_column=1}
3 {file_name_id=2 function_name_id=3 line=3 end_line=3 column=1 end_column=1}
4 {file_name_id=3 function_name_id=4 line=4 end_line=4 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=0}
4 {file_location_id=4 parent_frame_id=0}

%fused_dot (p0: bf16[16,64], p1: bf16[64,32]) -> bf16[16,32] {
  %p0 = bf16[16,64]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[16,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="dot_general" stack_frame_id=3}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cheap (t: (f32[16,32])) -> s32[16] {
  %t = (f32[16,32]{1,0}) parameter(0)
  ROOT %z = s32[16]{0} broadcast(%t), dimensions={}, metadata={op_name="broadcast" stack_frame_id=1}
}

%fallback (t: (f32[16,32])) -> s32[16] {
  %t = (f32[16,32]{1,0}) parameter(0)
  %g = f32[16,32]{1,0} get-tuple-element(%t), index=0
  %sorted = f32[16,32]{1,0} sort(%g), dimensions={1}, to_apply=%add, metadata={op_name="cond/sort" stack_frame_id=2}
  ROOT %r = s32[16]{0} reduce(%sorted, %g), dimensions={1}, to_apply=%add, metadata={op_name="cond/reduce" stack_frame_id=2}
}

%sampled (t: (f32[16,32])) -> s32[16] {
  %t = (f32[16,32]{1,0}) parameter(0)
  %g = f32[16,32]{1,0} get-tuple-element(%t), index=0
  %neg = f32[16,32]{1,0} negate(%g), metadata={op_name="neg" stack_frame_id=1}
  %tup2 = (f32[16,32]{1,0}) tuple(%neg)
  %p2 = pred[] constant(false)
  ROOT %inner = s32[16]{0} conditional(%p2, %tup2, %tup2), branch_computations={%cheap, %fallback}, metadata={op_name="cond/cond" stack_frame_id=1}
}

ENTRY %main (x: bf16[16,64], w: bf16[64,32], e: bf16[8,64,32], p: pred[]) -> s32[16] {
  %x = bf16[16,64]{1,0} parameter(0)
  %w = bf16[64,32]{1,0} parameter(1)
  %e = bf16[8,64,32]{1,0,2} parameter(2)
  %p = pred[] parameter(3)
  %proj = bf16[16,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot, metadata={op_name="dot_general" stack_frame_id=3}
  %copy.1 = bf16[8,64,32]{2,1,0} copy(%e)
  %ragged-dot-none = f32[16,32]{1,0} custom-call(%x, %copy.1), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/ragged_dot_general/ragged-dot-none"}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"65536","transcendentals":"0","bytes_accessed":"34816"}}}
  %ar = f32[16,32]{1,0} all-reduce(%ragged-dot-none), replica_groups={{0,1}}, to_apply=%add
  %rsf = bf16[8,32]{1,0} fusion(%proj), kind=kCustom, calls=%fused_dot, metadata={op_name="dot_general" stack_frame_id=3}, backend_config={"collective_algorithm_config":{"emitter":"SingleInputAllReduceScatterFusion"}}
  %tup = (f32[16,32]{1,0}) tuple(%ar)
  %ss = ((bf16[16,64]{1,0}), bf16[8,64]{1,0:S(1)}, s32[]) slice-start(%x), slice={[0:8], [0:64]}
  %sd = bf16[8,64]{1,0:S(1)} slice-done(%ss)
  %gu = bf16[16,32]{1,0} custom-call(%x, %e), custom_call_target="tpu_custom_call", metadata={op_name="jit(_step_impl)/shard_map/jit(gate_up_act)/pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"1000","transcendentals":"0","bytes_accessed":"2000"}}}
  %nr = bf16[16,32]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", metadata={op_name="jit(_step_impl)/shard_map/jit(_norm_rope_local)/pallas_call" stack_frame_id=4}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"100","transcendentals":"0","bytes_accessed":"512"}}}
  ROOT %cond = s32[16]{0} conditional(%p, %tup, %tup), branch_computations={%cheap, %sampled}, metadata={op_name="cond" stack_frame_id=1}
}
"""


def test_classes_of_a_hand_written_module() -> None:
    b = hb.breakdown(HLO, 1e6, 1e6)
    assert tuple(b.flops) == op_classes.CLASSES and tuple(b.bytes) == op_classes.CLASSES
    assert sum(b.flops.values()) == pytest.approx(1e6, rel=1e-12)
    assert sum(b.bytes.values()) == pytest.approx(1e6, rel=1e-12)
    m = hlo_parse.parse_module(HLO)
    entry = {i.name: i for i in m.computations[m.entry]}
    types = m.types(m.entry)
    # The projection: 2 * 16 * 32 * 64 FLOPs; operands + result bytes.
    assert op_costs.op_flops(m, entry["proj"], types) == 2 * 16 * 32 * 64
    assert op_costs.op_bytes(m, entry["proj"], types) == (16 * 64 + 64 * 32 + 16 * 32) * 2
    assert op_classes.classify(m, entry["proj"]) == "projections"
    # The kernel's own estimate, not its operands.
    assert op_costs.op_flops(m, entry["ragged-dot-none"], types) == 65536
    assert op_costs.op_bytes(m, entry["ragged-dot-none"], types) == 34816
    assert op_classes.classify(m, entry["ragged-dot-none"]) == "expert_matmuls"
    assert op_classes.classify(m, entry["ar"]) == "collectives"
    # The gmm backend's fused kernels are expert matmuls, at their own estimate.
    assert op_classes.classify(m, entry["gu"]) == "expert_matmuls"
    assert op_costs.op_bytes(m, entry["gu"], types) == 2000
    # The q/k norm and rotary kernel is attention's, at its own estimate.
    assert op_classes.classify(m, entry["nr"]) == "attention"
    assert op_costs.op_bytes(m, entry["nr"], types) == 512
    # An async slice counts the slice it reads and writes, not its whole operand.
    assert op_costs.op_bytes(m, entry["ss"], types) == 2 * 8 * 64 * 2
    assert op_costs.op_bytes(m, entry["sd"], types) == 0
    assert op_classes.classify(m, entry["copy.1"]) == "copies"
    # The conditionals: the outer one counts its costlier branch, the sampled rows, whose own
    # op (negate) is the sampler's; in the inner one the cheap branch keeps its class
    # (sampler) and the fallback's excess up to the counted maximum is sampler_full_sort.
    costs = hb.computation_costs(m, m.entry)
    sort_bytes = 2 * 16 * 32 * 4 + (2 * 16 * 32 * 4 + 16 * 4)  # sort in/out, reduce in/out
    cheap_bytes = 16 * 32 * 4 + 16 * 4  # the broadcast's tuple operand and result
    negate_bytes = 2 * 16 * 32 * 4
    assert costs["sampler"][1] == negate_bytes + cheap_bytes
    assert costs["sampler_full_sort"][1] == sort_bytes - cheap_bytes
    # Kernels at their own estimates and the all-reduce at its operand and result (XLA's
    # total holds exactly those), XLA's other ops scaled to the rest of XLA's total.
    all_reduce = op_costs.op_bytes(m, entry["ar"], types)
    assert all_reduce == 2 * 16 * 32 * 4 and op_costs.counted_exactly(entry["ar"])
    exact = 34816 + 2000 + 512 + all_reduce
    assert sum(v[3] for v in costs.values()) == exact
    est = sum(v[1] for v in costs.values())
    scale = (1e6 - exact) / (est - exact)
    assert b.bytes_scale == pytest.approx(scale)
    assert b.bytes["attention"] == pytest.approx(512)  # the norm/rotary kernel alone
    # XLA:TPU's collective fusion (a reduce-scatter's pieces) is a collective, scaled.
    assert op_classes.classify(m, entry["rsf"]) == "collectives"
    rsf = op_costs.op_bytes(m, entry["rsf"], types)
    assert b.bytes["collectives"] == pytest.approx(all_reduce + rsf * scale)
    assert b.bytes["projections"] == pytest.approx(
        op_costs.op_bytes(m, entry["proj"], types) * scale)
    expert = sum(op_costs.op_bytes(m, entry[n], types) for n in ("ragged-dot-none", "gu"))
    assert costs["expert_matmuls"][3] == expert
    assert b.bytes["expert_matmuls"] == pytest.approx(
        expert + (costs["expert_matmuls"][1] - expert) * scale)


def test_parse_instruction_types_and_operands() -> None:
    ins = hlo_parse.parse_instruction(
        "  %cp = (f32[64,3]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) collective-permute-start(%d), "
        "source_target_pairs={{0,1}}")
    assert ins is not None
    assert (ins.opcode, ins.operands) == ("collective-permute-start", ["d"])
    # Padded to the (8, 128) tile as stored: 3 columns take 128.
    assert hlo_parse.type_bytes(ins.type) == 64 * 128 * 4 + 4
    assert hlo_parse.type_bytes("bf16[128,2048,192]{1,2,0:T(8,128)(2,1)}") == 128 * 2048 * 192 * 2
    assert hlo_parse.type_bytes("bf16[128,2048,192]{2,1,0:T(8,128)(2,1)}") == 128 * 2048 * 256 * 2


def test_a_gather_reads_a_whole_tile_per_row() -> None:
    """XLA:TPU counts a gather at a whole tile of its operand for each row it takes: 8 rows
    of a ``T(8,128)`` matrix, 1,024 elements of a 1-D ``T(1024)`` array (compile-only v5p:
    20,480 int32 gathered from as many, 84 MB)."""
    text = """HloModule m

ENTRY %main (v: s32[20480], i: s32[20480,1], x: bf16[64,128], j: s32[16,1]) -> s32[20480] {
  %v = s32[20480]{0:T(1024)} parameter(0)
  %i = s32[20480,1]{1,0:T(8,128)} parameter(1)
  %x = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(2)
  %j = s32[16,1]{1,0:T(8,128)} parameter(3)
  %g = s32[20480]{0:T(1024)} gather(%v, %i), offset_dims={}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1}
  %rows = bf16[16,128]{1,0:T(8,128)(2,1)} gather(%x, %j), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,128}
  ROOT %n = s32[20480]{0:T(1024)} negate(%g)
}
"""
    assert [hlo_parse.tile_rows(t) for t in (
        "s32[20480]{0:T(1024)}", "f32[65536]{0:T(1024)S(1)}", "s32[71]{0:T(128)}",
        "bf16[64,128]{1,0:T(8,128)(2,1)}", "s32[2,3]{1,0:T(2,128)}", "f32[16]")] == [
        1024, 1024, 128, 8, 2, 1]
    m = hlo_parse.parse_module(text)
    entry = {i.name: i for i in m.computations[m.entry]}
    types = m.types(m.entry)
    indices = hlo_parse.type_bytes(types["i"])
    assert op_costs.op_bytes(m, entry["g"], types) == (1 + 1024) * 20480 * 4 + indices
    assert op_costs.op_bytes(m, entry["rows"], types) == (
        (1 + 8) * 16 * 128 * 2 + hlo_parse.type_bytes(types["j"]))


def test_an_instruction_over_several_lines_is_one_instruction() -> None:
    """XLA:TPU prints a Pallas call with side effects (a remote-DMA kernel) with a newline in
    its ``kernel_metadata``: the rest of the instruction, with its cost estimate, is on the
    next line, which starts with ``}`` and must neither end the computation nor be lost."""
    text = """HloModule m

ENTRY %main (x: bf16[64,128]) -> bf16[64,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %q = bf16[64,128]{1,0} negate(%x), metadata={op_name="jit(f)/odd{name"}
  %k = bf16[64,128]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", custom_call_has_side_effect=true, frontend_attributes={kernel_metadata={
}}, metadata={op_name="jit(f)/shard_map/pallas_call"}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"0","transcendentals":"0","bytes_accessed":"4096"}}}
  ROOT %n = bf16[64,128]{1,0} negate(%k)
}
"""
    m = hlo_parse.parse_module(text)
    entry = {i.name: i for i in m.computations[m.entry]}
    assert list(entry) == ["x", "q", "k", "n"]  # a brace in a string opens nothing
    assert op_costs.op_bytes(m, entry["k"], m.types(m.entry)) == 4096
    assert op_costs.counted_exactly(entry["k"])


# -- the engine's step compiled by XLA:CPU ----------------------------------------------------
def compile_cpu_step(config_dir: Path, mode: str, tokens: int, rows: int) -> tuple[str, Any]:
    import jax

    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.forward_batch_info import ForwardMode
    from sgl_jax.srt.model_executor.model_runner import ModelRunner
    from sgl_jax.srt.server_args import ServerArgs

    hf = json.loads((config_dir / "config.json").read_text())
    cfg = ModelConfig.from_dict(hf, str(config_dir), 512)
    args = ServerArgs(model_path=str(config_dir), context_length=512, max_running_requests=8,
                      max_total_tokens=8 * 512, chunked_prefill_size=256,
                      precompile_bs_paddings=[8], precompile_token_paddings=[256],
                      dtype="bfloat16", moe_backend="ragged", attention_backend="native",
                      page_size=16, disable_precompile=True)
    runner = ModelRunner(args, cfg, devices=jax.devices()[:1], abstract=True)
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    compiled = runner.lower_bucket(fm, tokens, rows).compile()
    cost = compiled.cost_analysis()
    return compiled.as_text(), cost[0] if isinstance(cost, list) else cost


@pytest.fixture(scope="module")
def cpu_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_qwen3(tmp_path_factory.mktemp("qwen3-small"), 2, hidden_size=512,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                       moe_intermediate_size=256, num_experts=32, vocab_size=2048)


@pytest.mark.parametrize("mode,tokens,rows", [("prefill", 256, 8), ("decode", 8, 8)])
def test_cpu_step_breakdown_sums_to_xla(cpu_config: Path, mode: str, tokens: int,
                                        rows: int) -> None:
    hlo, cost = compile_cpu_step(cpu_config, mode, tokens, rows)
    flops, bytes_ = float(cost["flops"]), float(cost["bytes accessed"])
    b = hb.breakdown(hlo, flops, bytes_)
    assert set(b.flops) == set(op_classes.CLASSES) == set(b.bytes)
    assert sum(b.flops.values()) == pytest.approx(flops, rel=1e-9)
    assert sum(b.bytes.values()) == pytest.approx(bytes_, rel=1e-9)
    assert min(b.flops.values()) >= 0 and min(b.bytes.values()) >= -1e-6 * bytes_
    # The per-op estimate is close to XLA's own count of FLOPs (dots dominate).
    assert 0.8 < b.flops_scale < 1.25, b.flops_scale
    # The step's own parts are found by their source: the sampler and its sort fallback (a
    # cond XLA counts at its costliest branch), the routers, the KV write of each layer.
    for cls in ("sampler", "sampler_full_sort", "router", "kv_cache_write", "projections"):
        assert b.bytes[cls] > 0, (cls, b.bytes)
    if mode == "prefill":
        # 256 tokens x 8 experts x 3 matrices of 512 x 256 per layer: the largest FLOPs.
        top = max(b.flops, key=lambda k: b.flops[k])
        assert top == "expert_matmuls", b.flops
        assert b.flops["expert_matmuls"] > 0.4 * flops, b.flops


def _compiled_with_classes(moe_layers: int, scale: float) -> Any:
    """A compiled step of ``moe_layers`` MoE layers: per-op estimates of 10 GB per layer of
    expert matmuls, 6 GB of which kernels (counted exactly by XLA), and a depth-independent
    3 GB sampler; XLA's total = the kernels + scale x the rest."""
    est = {k: 0.0 for k in op_classes.CLASSES}
    est.update(expert_matmuls=10e9 * moe_layers, sampler=3e9)
    exact = {k: 0.0 for k in op_classes.CLASSES}
    exact.update(expert_matmuls=6e9 * moe_layers)
    scaled, _ = hb.scale_classes(est, exact, sum(exact.values())
                                 + scale * (sum(est.values()) - sum(exact.values())))
    breakdown = {"scale.flops": 1.0, "scale.bytes": scale}
    for k, v in est.items():
        breakdown.update({f"flops.{k}": 0.0, f"bytes.{k}": scaled[k],
                          f"estimate.flops.{k}": 0.0, f"estimate.bytes.{k}": v,
                          f"exact.flops.{k}": 0.0, f"exact.bytes.{k}": exact[k]})
    return Compiled(flops=0.0, bytes=sum(scaled.values()), arguments=0, outputs=0, aliased=0,
                    temporaries=0, code=0, kernel_calls=0, seconds=0, breakdown=breakdown)


def test_extrapolated_breakdown_keeps_a_depth_independent_class() -> None:
    """--scale-from-layers: the scale differs a little between the 2- and 4-layer compiles;
    the sampler (the same ops at every depth) must stay its estimate times the scale at 48
    layers, not be extrapolated through the scales' difference (with the scales the other
    way round it could go below zero), the kernels' exact part must stay unscaled, and the
    classes must still sum to the extrapolated total."""
    two, four = _compiled_with_classes(2, 1.10), _compiled_with_classes(4, 1.14)
    target = extrapolate([((True,) * 2, two), ((True,) * 4, four)], (True,) * 48)
    classes = {k: target.breakdown[f"bytes.{k}"] for k in op_classes.CLASSES}
    assert sum(classes.values()) == pytest.approx(target.bytes, rel=1e-12)
    assert target.bytes == pytest.approx(two.bytes + 23 * (four.bytes - two.bytes))
    scale = target.breakdown["scale.bytes"]
    assert classes["sampler"] == pytest.approx(3e9 * scale, rel=1e-12)
    assert classes["expert_matmuls"] == pytest.approx(48 * 6e9 + 48 * 4e9 * scale, rel=1e-12)
    assert 1.10 < scale < 1.2
    assert min(classes.values()) >= 0


# -- end to end on compile-only TPU devices ---------------------------------------------------
@needs_libtpu
def test_report_breakdown_and_extend(tmp_path: Path) -> None:
    config = small_qwen3(tmp_path / "qwen3-1l", 1, vocab_size=2048)
    proc = subprocess.run(
        [sys.executable, "-m", "sgl_jax.tools.aot_report", "--model-config", str(config),
         "--topology", "v6e:2x2", "--tp-size", "4", "--decode-bs", "8", "--context-len",
         "512", "--prefill-tokens", "256", "--prefill-requests", "2", "--extend-tokens", "1",
         "--breakdown", "--top-ops", "4", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout)
    assert [r["mode"] for r in records] == ["decode", "prefill", "extend"]
    # --top-ops 4: four ops per compiled step, each "<MB> MB <GFLOP> GFLOP <class> <name> ...".
    top = re.findall(r"^\S+ aot_report:\s+([\d.]+) MB\s+([\d.]+) GFLOP\s+(\w+) ",
                     proc.stderr, flags=re.M)
    assert len(top) == 4 * len(records), proc.stderr[-3000:]
    assert {cls for _, _, cls in top} <= set(op_classes.CLASSES)
    assert max(float(mb) for mb, _, _ in top) > 0
    for r in records:
        for prop in ("flops", "bytes"):
            classes = r[f"breakdown_{prop}_per_device"]
            assert tuple(classes) == op_classes.CLASSES
            assert sum(classes.values()) == pytest.approx(r[f"xla_{prop}_per_device"],
                                                          rel=1e-9)
        # XLA's count + the attention kernel's analytic work = the report's figure.
        assert (r["xla_bytes_per_device"] + r["attention_kernel_analytic_bytes_per_device"]
                == pytest.approx(r["bytes_accessed_per_device"], rel=1e-9))
        assert 0.8 < r["breakdown_flops_scale"] < 1.25, r["breakdown_flops_scale"]
    decode, prefill, extend = records
    flops = prefill["breakdown_flops_per_device"]
    assert max(flops, key=lambda k: flops[k]) == "expert_matmuls", flops
    # ragged_dot on TPU is a Mosaic kernel whose own estimate XLA sums: all experts' weights.
    assert decode["breakdown_bytes_per_device"]["expert_matmuls"] > 0
    # One new token over 511 cached positions: compiled at the engine's 64-token bucket, it
    # reads the same weights as a decode step of 8 requests.
    assert (extend["tokens"], extend["batch_size"], extend["context_len"]) == (1, 1, 512)
    assert extend["compiled_tokens"] == 64
    ratio = extend["bytes_accessed_per_device"] / decode["bytes_accessed_per_device"]
    assert 0.7 < ratio < 1.5, ratio
