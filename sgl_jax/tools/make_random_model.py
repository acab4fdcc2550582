"""Write a randomly initialised MoE checkpoint in Hugging Face's exact layout.

    python -m sgl_jax.tools.make_random_model OUT [--preset NAME] [--set key=value ...]
        [--seed N] [--no-check-routing]

Presets (``PRESETS``): ``tiny`` (the bundled Qwen3-MoE), ``tiny-qwen2-moe``, ``tiny-mixtral``,
``tiny-deepseek-v3``, ``tiny-glm4-moe``, ``tiny-minimax-m2``, ``tiny-gpt-oss`` (4 layers,
hidden 64: fast CPU tests of each family; ``--set
'quantization_config={"quant_method":"mxfp4"}'`` writes gpt-oss's experts as MXFP4)
and routing-shaped ones with a released model's layer / expert / top-k / group / shared-expert
counts but tiny widths (``qwen3-30b-a3b-routing``, ``deepseek-v3-routing``,
``mixtral-8x7b-routing``, ``qwen2-57b-a14b-routing``, ``glm-4.5-air-routing``). The families and
their tensors are in :mod:`sgl_jax.tools.random_model_families`.

DeepSeek-V3 and GLM-4.5 presets (``tiny-deepseek-v3``, ``tiny-glm4-moe``,
``deepseek-v3-routing``, ``glm-4.5-air-routing``) also hold the released models' one
multi-token-prediction (MTP) layer, ``model.layers.{L}.*`` with L = num_hidden_layers
(config.json ``num_nextn_predict_layers: 1``; ``--set num_nextn_predict_layers=0`` writes none and
leaves the file byte-identical to the one without MTP support). The MTP layer is NEXTN
speculative decoding's draft (float64 reference: :mod:`sgl_jax.tools.reference_nextn`); the main
model ignores it, so every other tensor is the same with or without it. After the main layers,
the router search treats the (first) MTP layer's router the same way, measuring the selection
gap of the teacher-forced draft (``NextnReference.routing``: embeddings of the next tokens, the
target's hidden states) on the same sample prompts; redrawing it changes nothing of the main
model. (The margin holds for teacher-forced features; a chain's own features are likely, not
guaranteed, to keep it.)

The output directory holds ``config.json`` (the family's config class keys, architectures and
model_type), ``model.safetensors`` (HF tensor names; Linear weights are
``[out_features, in_features]``), ``tokenizer.json``, ``tokenizer_config.json`` (ChatML chat
template) and ``generation_config.json``; ``transformers`` loads it as it is. Every checkpoint
shares the bundled byte-level BPE tokenizer (512 tokens).

Weights are not trained, but scaled so the model behaves like one numerically: norm weights
are ``1 + 0.1 * N(0, 1)`` (so they matter), projections are ``N(0, 1/fan_in)`` (activations
stay O(1) through any number of layers), projection biases ``N(0, 0.1^2)``, the LM head gives
logits of std ~``logit_std`` (non-degenerate sampling distributions) and routers give router
logits of std ~``router_std``. Sigmoid routers (DeepSeek-V3, GLM-4.5) also get an
``e_score_correction_bias`` of ``N(0, score_bias_std^2)``: small next to the sigmoid scores, so
bias-corrected scores stay > 0, yet comparable to the gaps between them, so it changes
selections. Qwen2-MoE's ``shared_expert_gate`` [1, H] gives gate logits ~N(0, 1).

Routing margin. The engine's float32 routing must equal a float64 reference's exactly: the
same top-k ids in the same order. That can only fail where a token's *selection gap* is tiny:
the smallest margin deciding the selection, i.e. the smallest consecutive difference among
the top k+1 selection scores (logits for softmax routers, bias-corrected sigmoid scores for
sigmoid routers, within the kept groups) and, with expert groups, between the last kept and
the first dropped group score (see :mod:`sgl_jax.tools.random_model_routing`). After writing,
the tool runs :mod:`sgl_jax.tools.reference_forward` on sample prompts from
``assets/corpus.txt`` (the first 200 corpus tokens, a ChatML chat, code and non-ASCII
passages: ~520 tokens) and takes the reference's ``selection_gap`` per MoE layer. Layers are
then fixed in order: while layer l's smallest selection gap is below the preset's
``min_router_gap``, layer l's router alone is redrawn with its next sub-seed (attempt 1, 2,
...) and the check repeats. A router only changes the gaps of its own and later layers, so
fixed layers stay fixed; a layer that never clears within ``max_router_attempts`` keeps its
best draw. The search is deterministic, so a (preset, overrides, seed) triple always yields
the same file. The margin holds on the sample prompts only; elsewhere it is likely, not
guaranteed. ``--no-check-routing`` (``check_routing=False``) skips the measurement and the
search (every router at sub-seed 0).

Determinism: each tensor is drawn from its own ``numpy.random.default_rng`` seeded by
(seed, crc32(tensor name)[, router attempt]), so tensors do not depend on generation order and
e.g. a 6-layer model shares its first 4 layers with the 4-layer one of the same seed.

``--set`` values are parsed as JSON when possible (``--set mlp_only_layers=[0,2]``). Keys are
config.json fields, plus generation knobs that are not written to config.json:
``router_std``, ``logit_std``, ``min_router_gap``, ``max_router_attempts`` and (sigmoid
routers) ``score_bias_std``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from sgl_jax.tools.random_model_families import (
    FAMILIES,
    base_weights,
    check_config,
    family_of,
    mtp_layer_ids,
    router_weights,
)
from sgl_jax.tools.random_model_presets import GEN_DEFAULTS, PRESETS
from sgl_jax.tools.random_model_routing import (
    Measurement,
    measure,
    order_gaps,
    sample_prompts,
)
from sgl_jax.tools.reference_forward import ReferenceModel
from sgl_jax.tools.reference_nextn import NextnReference
from sgl_jax.tools.train_tokenizer import (
    CORPUS_PATH,
    ENDOFTEXT,
    IM_END,
    IM_START,
    VOCAB_SIZE,
    special_token_ids,
    train_tokenizer,
)

__all__ = [
    "BUNDLED_DIR",
    "PRESETS",
    "Measurement",
    "WriteReport",
    "build_config",
    "is_moe_layer",
    "load_tokenizer",
    "main",
    "measure",
    "order_gaps",
    "parse_set",
    "sample_prompts",
    "write_random_model",
    "write_random_model_report",
]

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
BUNDLED_DIR = ASSETS_DIR / "tiny-qwen3-moe"

_NP_DTYPES = ("float32", "float16", "bfloat16")

# ChatML. A message's content may also be a list of OpenAI-style parts; its text parts are
# concatenated. With add_generation_prompt the assistant turn is opened.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class WriteReport:
    """What one write produced, for the CLI to print."""

    config: dict[str, Any]
    num_params: int
    num_bytes: int
    router_draws: int  # checkpoints written (and measured, when checked) during the search
    router_attempts: dict[int, int]  # layer -> router sub-seed, for layers not at 0
    measurement: Measurement | None  # None when the routing check was skipped
    min_router_gap: float = 0.0  # the search's threshold


def load_tokenizer() -> Tokenizer:
    """The bundled tokenizer, trained from corpus.txt if the asset is absent."""
    path = BUNDLED_DIR / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    return train_tokenizer(CORPUS_PATH)


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for PreTrainedTokenizerFast (everything lives in tokenizer.json)."""
    tok = load_tokenizer()
    ids = special_token_ids(tok)
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in (ENDOFTEXT, IM_START, IM_END)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict; v as JSON when it parses, else the raw string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def mtp_note(config: dict[str, Any]) -> str:
    """" + N MTP layer(s)" for the CLI summary, or ""."""
    n = int(config.get("num_nextn_predict_layers") or 0)
    return f" + {n} MTP layer{'s' if n > 1 else ''}" if n else ""


def is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    """Whether a layer has a router, by its family's rule (config.json's model_type)."""
    return family_of(config).is_moe_layer(config, layer)


def build_config(
    preset: str, overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json dict, generation knobs) for a preset with overrides applied and checked."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    family = FAMILIES[PRESETS[preset].get("model_type", "qwen3_moe")]
    config = {**copy.deepcopy(family.base_config), **copy.deepcopy(PRESETS[preset])}
    gen = dict(GEN_DEFAULTS[preset])
    for key, value in (overrides or {}).items():
        (gen if key in gen else config)[key] = value
    if config["model_type"] != family.model_type:
        raise ValueError(f"preset {preset!r} is a {family.model_type} preset")

    tok_ids = special_token_ids(load_tokenizer())
    config.setdefault("bos_token_id", tok_ids[ENDOFTEXT])
    config.setdefault("eos_token_id", tok_ids[IM_END])
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], config["num_hidden_layers"])
    if "mlp_only_layers" in config:
        config["mlp_only_layers"] = sorted(int(i) for i in config["mlp_only_layers"] or [])
    check_config(config, VOCAB_SIZE, _NP_DTYPES)
    return config, gen


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: greedy by default; <|endoftext|> (the bos id) doubles as pad."""
    eos = config["eos_token_id"]
    pad = config["bos_token_id"]
    eos_list = eos if isinstance(eos, list) else [eos]
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos_list if len(eos_list) > 1 else eos_list[0],
        "pad_token_id": pad,
        "do_sample": False,
    }


def _cast(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    if dtype == "float32":
        return tensors
    if dtype == "bfloat16":
        import ml_dtypes  # ships with jax; only needed here

        np_dtype: Any = ml_dtypes.bfloat16
    else:
        np_dtype = np.float16
    # (MXFP4 codes and exponents stay uint8.)
    return {k: t.astype(np_dtype) if t.dtype.kind == "f" else t for k, t in tensors.items()}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save(tensors: dict[str, np.ndarray], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates the file 0600; a checkpoint (and the packaged asset) is world-readable.
    os.chmod(path, 0o644)


def _mtp_gap(target: ReferenceModel, prompts: list[list[int]], hidden: list[np.ndarray]) -> float:
    """The MTP layer's smallest selection gap of the teacher-forced NEXTN draft (reference
    float64; features: the target's hidden states) over the sample prompts. Re-reads the MTP
    layer from the checkpoint (``target`` itself does not change: its routers are fixed)."""
    draft = NextnReference(target)
    return min(
        float(draft.routing(ids, h).selection_gap.min())
        for ids, h in zip(prompts, hidden, strict=True)
    )


def _search_mtp_router(
    path: str,
    layer: int,
    prompts: list[list[int]],
    threshold: float,
    max_attempts: int,
    attempts: dict[int, int],
    write: Callable[[], dict[str, np.ndarray]],
    verbose: bool,
) -> tuple[int, dict[str, np.ndarray] | None]:
    """The main search's rule for the MTP layer's router, after the main routers are fixed
    (its input depends on them; it changes nothing of the main model). Returns (draws, the
    tensors last written or None when nothing was rewritten). Skipped at threshold 0."""
    if threshold <= 0:
        return 0, None
    target = ReferenceModel(path)
    hidden = [target.forward(ids).hidden for ids in prompts]
    written: list[dict[str, np.ndarray]] = []

    def redraw() -> None:
        written[:] = [write()]

    draws = _search_router(layer, threshold, max_attempts, attempts, redraw,
                           lambda: _mtp_gap(target, prompts, hidden), verbose, "MTP layer")
    return draws, (written[0] if written else None)


def _search_router(
    layer: int,
    threshold: float,
    max_attempts: int,
    attempts: dict[int, int],
    redraw: Callable[[], None],
    gap: Callable[[], float],
    verbose: bool,
    what: str = "layer",
) -> int:
    """Redraws ``layer``'s router (sub-seed ``attempts[layer]``; ``redraw`` writes the
    checkpoint and refreshes what ``gap`` reads) until its smallest selection gap reaches
    ``threshold`` or ``max_attempts`` draws were tried; then keeps the best draw (the lowest
    sub-seed among equals), rewriting it if it is not the last. Returns the rewrites made."""
    tried = [(gap(), 0)]  # (gap, sub-seed)
    while tried[-1][0] < threshold and len(tried) < max_attempts:
        attempts[layer] = len(tried)
        redraw()
        tried.append((gap(), attempts[layer]))
    draws = len(tried) - 1
    if tried[-1][0] < threshold:
        best = max(tried, key=lambda t: (t[0], -t[1]))[1]
        if verbose:
            print(f"{what} {layer}: no router draw reached {threshold}; keeping {best}")
        if best != attempts.get(layer, 0):
            attempts[layer] = best
            redraw()
            draws += 1
    return draws


def write_random_model_report(
    out_dir: str,
    preset: str = "tiny",
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    check_routing: bool = True,
    verbose: bool = False,
) -> WriteReport:
    """Write the checkpoint (see the module docstring) and report what was written."""
    config, gen = build_config(preset, overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = load_tokenizer()
    tok_src = BUNDLED_DIR / "tokenizer.json"
    tok_dst = out / "tokenizer.json"
    if tok_src.is_file():
        if not (tok_dst.exists() and os.path.samefile(tok_src, tok_dst)):
            shutil.copyfile(tok_src, tok_dst)
    else:
        tokenizer.save(str(tok_dst))
    _write_json(out / "tokenizer_config.json", tokenizer_config(config["max_position_embeddings"]))
    _write_json(out / "generation_config.json", generation_config(config))
    _write_json(out / "config.json", dict(sorted(config.items())))

    base = base_weights(config, gen, seed)
    path = out / "model.safetensors"
    attempts: dict[int, int] = {}

    def write() -> dict[str, np.ndarray]:
        tensors = _cast(
            {**base, **router_weights(config, gen, seed, attempts)}, config["torch_dtype"]
        )
        _save(tensors, path)
        return tensors

    tensors = write()
    draws = 1
    result: Measurement | None = None
    if check_routing:
        prompts = sample_prompts(tokenizer)
        result = measure(str(out), prompts)
        threshold, max_attempts = gen["min_router_gap"], max(1, int(gen["max_router_attempts"]))

        def layer_gap(layer: int) -> float:
            assert result is not None and result.selection_gap is not None
            return float(result.selection_gap[:, layer].min())

        def redraw() -> None:
            nonlocal tensors, result
            tensors = write()
            result = measure(str(out), prompts)

        for layer in range(config["num_hidden_layers"]):
            if is_moe_layer(config, layer):
                draws += _search_router(layer, threshold, max_attempts, attempts, redraw,
                                        lambda layer=layer: layer_gap(layer), verbose)

        for layer in mtp_layer_ids(config)[:1]:  # the draft reads the first MTP layer only
            n, written = _search_mtp_router(
                str(out), layer, prompts, threshold, max_attempts, attempts, write, verbose
            )
            draws += n
            tensors = written or tensors
    return WriteReport(
        config=config,
        num_params=sum(int(t.size) for t in tensors.values()),
        num_bytes=sum(int(t.nbytes) for t in tensors.values()),
        router_draws=draws,
        router_attempts=dict(sorted((k, v) for k, v in attempts.items() if v)),
        measurement=result,
        min_router_gap=float(gen["min_router_gap"]),
    )


def write_random_model(
    out_dir: str,
    preset: str = "tiny",
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    check_routing: bool = True,
) -> dict[str, Any]:
    """Write a random checkpoint of a preset to out_dir; returns its config.json dict.

    check_routing=False skips the reference forward (and so the router sub-seed search):
    faster, but then the routing margin is unmeasured and routers are attempt 0's.
    """
    return write_random_model_report(out_dir, preset, overrides, seed, check_routing).config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write a random MoE checkpoint in Hugging Face layout."
    )
    parser.add_argument("out_dir")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config.json field or generation knob; VALUE is JSON when it parses",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-check-routing", action="store_true", help="skip the reference-forward gap check"
    )
    args = parser.parse_args(argv)
    report = write_random_model_report(
        args.out_dir,
        args.preset,
        parse_set(args.overrides),
        args.seed,
        check_routing=not args.no_check_routing,
        verbose=True,
    )
    cfg = report.config
    family = family_of(cfg)
    moe = sum(is_moe_layer(cfg, i) for i in range(cfg["num_hidden_layers"]))
    groups = (
        f", {cfg['n_group']} groups (keep {cfg['topk_group']})"
        if family.router_rule == "sigmoid_grouped" and "n_group" in cfg
        else ""
    )
    print(
        f"wrote {args.out_dir}: preset {args.preset} ({cfg['architectures'][0]}), "
        f"seed {args.seed}, {cfg['num_hidden_layers']} layers ({moe} MoE)"
        f"{mtp_note(cfg)}, "
        f"{family.num_experts(cfg)} experts, top-{cfg['num_experts_per_tok']}{groups}, "
        f"router {family.router_rule}"
    )
    print(
        f"parameters: {report.num_params:,} ({report.num_bytes / 2**20:.2f} MiB {cfg['torch_dtype']})"
    )
    m = report.measurement
    if m is not None and m.selection_gap is not None:
        per_prompt = ", ".join(
            f"{n} tok: {g:.3e}"
            for n, g in zip(m.prompt_lengths, m.selection_gap.min(axis=1), strict=True)
        )
        score = "logits" if family.router_rule != "sigmoid_grouped" else "sigmoid+bias scores"
        print(
            f"min router selection gap (top-(k+1) {score}, incl. group scores): "
            f"{m.selection_gap.min():.3e}  [per prompt: {per_prompt}]"
        )
        print(
            f"min k-th minus (k+1)-th router gap (reference topk_gap): {m.topk_gap.min():.3e}; "
            f"threshold {report.min_router_gap:g}"
        )
        print(
            f"router draws: {report.router_draws}, sub-seeds {report.router_attempts or 'all 0'}; "
            f"reference logits std {m.logits_std:.2f}"
        )


if __name__ == "__main__":
    main()
