"""The report as text: the table of buckets, the notes under it (interconnect, fit, verify
and extend against decode) and the per-class breakdown."""

from __future__ import annotations

import argparse

from sgl_jax.tools.aot.hlo.op_classes import CLASSES
from sgl_jax.tools.aot.topology import GiB


def format_breakdown(records: list[dict]) -> str:
    """Per class and bucket: GB and GFLOP per device and the share of the bucket's total
    (XLA's count + the attention kernel's analytic work, i.e. the table's GB/dev)."""
    names = [f"{r['mode']} {r['tokens']}" + (f" x{r['batch_size']}" if r["mode"] == "prefill"
                                             else "") for r in records]
    lines = []
    for prop, unit, scale in (("bytes", "GB", 1e9), ("flops", "GFLOP", 1e9)):
        lines += [f"breakdown: {unit} per device (share of the step)",
                  "| class | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(records)]
        rows = [(k, [r[f"breakdown_{prop}_per_device"][k] for r in records]) for k in CLASSES]
        rows.append(("attention kernel (analytic, not in XLA's count)",
                     [r[f"attention_kernel_analytic_{prop}_per_device"] for r in records]))
        totals = [sum(v for _, vs in rows for v in [vs[i]]) for i in range(len(records))]
        rows.append(("total", totals))
        for k, vs in rows:
            cells = [f"{v / scale:.2f} ({100 * v / t:.0f}%)" if t else "0"
                     for v, t in zip(vs, totals, strict=True)]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("(kernels and all-gathers/-reduces, reduce-scatters, all-to-alls as "
                     "estimated, the other ops' estimates scaled by (XLA total - those) / "
                     "(estimate - those): "
                     + ", ".join(f"{r[f'breakdown_{prop}_scale']:.3f}" for r in records) + ")")
    return "\n".join(lines)


# (column, format, value) of the table output; sizes per device.
COLUMNS = [
    ("mode", "{}", lambda r: r["mode"]),
    ("tokens", "{}", lambda r: r["tokens"]),
    ("bs", "{}", lambda r: r["batch_size"]),
    ("ctx", "{}", lambda r: r["context_len"]),
    ("TFLOP", "{:.2f}", lambda r: r["compiled_flops"] / 1e12),
    ("ideal", "{:.2f}", lambda r: r["ideal_flops"] / 1e12),
    ("ratio", "{:.2f}", lambda r: r["flops_ratio"]),
    ("GB/dev", "{:.1f}", lambda r: r["bytes_accessed_per_device"] / 1e9),
    ("peak GiB/dev", "{:.2f}", lambda r: r["peak_hbm_bytes_per_device"] / GiB),
    ("params", "{:.2f}", lambda r: r["parameters_bytes_per_device"] / GiB),
    ("KV", "{:.2f}", lambda r: r["kv_cache_bytes_per_device"] / GiB),
    ("temp", "{:.2f}", lambda r: r["temporaries_bytes_per_device"] / GiB),
    ("roofline ms", "{:.2f}", lambda r: r["roofline_ms"]),
    ("bound", "{}", lambda r: r["bound"]),
    ("tok/s", "{:,.0f}", lambda r: r["tokens_per_s"]),
]
SAMPLER_COLUMN = ("ms w/o sampler", "{:.2f}", lambda r: r["roofline_ms_without_sampler"])


def format_table(records: list[dict], header: str) -> str:
    cols = list(COLUMNS)
    if records and records[0]["roofline_ms_without_sampler"] is not None:
        cols.insert(-2, SAMPLER_COLUMN)
    lines = [header, "| " + " | ".join(name for name, _, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt.format(get(r)) for _, fmt, get in cols) + " |"
              for r in records]
    return "\n".join(lines)


def format_notes(records: list[dict], context_len: int) -> str:
    """Lines under the table: per bucket the ratio without the static ragged_dot excess and
    the interconnect bytes, then the largest batch that fits."""
    lines = []
    for r in records:
        lines.append(
            f"{r['mode']} {r['tokens']}: flops_ratio_local_rows {r['flops_ratio_local_rows']:.2f};"
            f" interconnect per device: MoE dispatch {r['moe_collective_bytes_per_layer'] / 1e6:.2f}"
            f" MB per MoE layer (formula {r['dispatch_bytes_per_moe_layer_formula'] / 1e6:.2f}),"
            f" all collectives {r['collective_bytes_per_device'] / 1e9:.3f} GB per step")
    r = records[0]
    lines.append(
        f"largest global batch at {context_len} positions: {r['max_requests_fit']} requests "
        f"(KV next to the parameters), {min(x['max_requests_fit_with_step'] for x in records)} "
        "next to every bucket's compiled step")
    return "\n".join(lines)


# With NGRAM the report compiles the target model's verify step only.
DRAFT_NOT_INCLUDED = (
    "the draft model's work (an EAGLE head, DeepSeek-V3's / GLM-4.5's NEXTN layer) is not "
    "included: the runner is built with NGRAM, whose drafts cost no device work "
    "(--speculative-algorithm EAGLE / NEXTN compiles the draft into the step)")


def format_verify_notes(records: list[dict]) -> str:
    """Lines under the table: each verify bucket against the decode bucket of its batch."""
    lines = []
    for r in records:
        if r["mode"] != "verify":
            continue
        lines.append(
            f"verify {r['batch_size']} x {r['verify_tokens']} vs decode {r['batch_size']}: "
            f"bytes {r['bytes_vs_decode']:.3f}x ({r['bytes_per_token_vs_decode']:.3f}x per "
            f"verified token), FLOPs {r['flops_vs_decode']:.2f}x "
            f"({r['flops_per_token_vs_decode']:.3f}x per verified token), roofline "
            f"{r['roofline_vs_decode']:.3f}x, peak HBM {r['peak_hbm_vs_decode']:.3f}x"
            + (f"; without the sampler: bytes {r['bytes_without_sampler_vs_decode']:.3f}x, "
               f"roofline {r['roofline_without_sampler_vs_decode']:.3f}x"
               if "bytes_without_sampler_vs_decode" in r else ""))
    algorithms = {r.get("speculative_algorithm", "NGRAM") for r in records
                  if r["mode"] == "verify"}
    if lines and algorithms == {"NGRAM"}:
        lines.append(f"verify: target model only; {DRAFT_NOT_INCLUDED}")
    elif lines:
        lines.append(f"verify: with the {', '.join(sorted(algorithms))} draft's work in the "
                     "step (draft extend over every token, then the chain)")
    return "\n".join(lines)


def format_extend_notes(records: list[dict]) -> str:
    """Each extend bucket against the decode bucket of the fewest requests."""
    decode = min((r for r in records if r["mode"] == "decode"), key=lambda r: r["tokens"],
                 default=None)
    lines = []
    for r in records:
        if r["mode"] != "extend":
            continue
        line = (f"extend {r['tokens']} token(s) of 1 request at {r['context_len']} positions "
                f"(compiled as {r['compiled_tokens']} tokens, {r['padded_rows']} rows): "
                f"{r['bytes_accessed_per_device'] / 1e9:.1f} GB, {r['roofline_ms']:.2f} ms")
        if decode:
            line += (f"; vs decode {decode['tokens']}: bytes "
                     f"{r['bytes_accessed_per_device'] / decode['bytes_accessed_per_device']:.2f}x,"
                     f" roofline {r['roofline_ms'] / decode['roofline_ms']:.2f}x")
        lines.append(line)
    return "\n".join(lines)


def print_report(records: list[dict], args: argparse.Namespace) -> None:
    """The report as text on stdout: a header line, the table, the notes under it and
    what --verify-tokens, --extend-tokens and --breakdown add."""
    r = records[0]
    depth = ("full depth" if not args.scale_from_layers else
             "extrapolated from " + ", ".join(r["compiled_slices"]))
    dp = f" dp={r['dp_size']}" if r["dp_size"] > 1 else ""
    header = (
        f"{args.model_config} on {r['topology']} ({r['devices']} x {r['chip']}), "
        f"tp={r['tp_size']} ep={r['ep_size']}{dp}, {r['attention_backend']} attention, "
        f"{depth}; TFLOP summed over devices, "
        f"GB and GiB per device"
    )
    print(format_table(records, header))
    print(format_notes(records, args.context_len))
    if args.verify_tokens:
        print(format_verify_notes(records))
    if args.extend_tokens:
        print(format_extend_notes(records))
    if args.breakdown:
        print(format_breakdown(records))
