"""Write a randomly initialised Qwen3-MoE checkpoint in Hugging Face's exact layout.

    python -m sgl_jax.tools.make_random_model OUT [--preset tiny|qwen3-30b-a3b-routing]
        [--set key=value ...] [--seed N]

The output directory holds ``config.json``, ``model.safetensors`` (HF tensor names; Linear
weights are ``[out_features, in_features]``), ``tokenizer.json``, ``tokenizer_config.json``
(ChatML chat template) and ``generation_config.json``; ``transformers`` loads it as it is.
Every checkpoint shares the bundled byte-level BPE tokenizer (512 tokens).

Weights are not trained, but scaled so the model behaves like one numerically: norm weights
are ``1 + 0.1 * N(0, 1)`` (so they matter), projections are ``N(0, 1/fan_in)`` (activations
stay O(1) through any number of layers), the LM head gives logits of std ~``logit_std``
(non-degenerate sampling distributions) and routers give router logits of std ~``router_std``.

Routing margin. The engine's float32 routing must equal a float64 reference's exactly: the
same top-k ids in the same order (descending weight). That can only fail where two of a token's
top k+1 router logits nearly tie. After writing, the tool runs
:mod:`sgl_jax.tools.reference_forward` on sample prompts from ``assets/corpus.txt`` (the first
200 corpus tokens, a ChatML chat, code and non-ASCII passages: ~520 tokens) and measures per
MoE layer the *order gap*: the smallest difference between consecutive router logits among
each token's top k+1 (it bounds the reference's ``topk_gap``, the k-th minus (k+1)-th, from
below). Layers are then fixed in order: while layer l's smallest order gap is below the
preset's ``min_router_gap``, layer l's router alone is redrawn with its next sub-seed
(attempt 1, 2, ...) and the check repeats. A router only changes the gaps of its own and later
layers, so fixed layers stay fixed; a layer that never clears within ``max_router_attempts``
keeps its best draw. The search is deterministic, so a (preset, overrides, seed) triple always
yields the same file. The margin holds on the sample prompts only; elsewhere it is likely,
not guaranteed. ``--no-check-routing`` (``check_routing=False``) skips the measurement and the
search (every router at sub-seed 0).

Determinism: each tensor is drawn from its own ``numpy.random.default_rng`` seeded by
(seed, crc32(tensor name)[, router attempt]), so tensors do not depend on generation order and
e.g. a 6-layer model shares its first 4 layers with the 4-layer one of the same seed.

``--set`` values are parsed as JSON when possible (``--set mlp_only_layers=[0,2]``). Keys are
config.json fields, plus generation knobs that are not written to config.json:
``router_std``, ``logit_std``, ``min_router_gap``, ``max_router_attempts``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from sgl_jax.tools.train_tokenizer import (
    CORPUS_PATH,
    ENDOFTEXT,
    IM_END,
    IM_START,
    VOCAB_SIZE,
    special_token_ids,
    train_tokenizer,
)

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
BUNDLED_DIR = ASSETS_DIR / "tiny-qwen3-moe"

# Shape of each preset. Everything not listed comes from _BASE_CONFIG.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "num_hidden_layers": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
    },
    # Qwen3-30B-A3B's routing shape (48 layers, 128 experts, top-8) with a tiny hidden size,
    # so routing-heavy benchmarks run on a CPU.
    "qwen3-30b-a3b-routing": {
        "num_hidden_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
    },
}

# Generation knobs per preset (not config.json fields). The tiny model (4 layers, 16 experts,
# top-4; float32-vs-float64 router logit error ~2e-5) reaches an order gap of 1e-3 (50x that
# error) in ~15 draws of ~0.15 s; 2e-3 would take ~50. The 48-layer, 128-expert, top-8 preset
# cannot be made exact: the 9 consecutive gaps among the top order statistics of 128 logits are
# ~0.3 apart on average, so a few hundred tokens x 48 layers always hold gaps ~1e-5, while its
# float32 router error grows to ~3e-4 by the last layer. Its search is off (threshold 0): it
# only measures (one ~4 s reference forward).
_GEN_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {
        "router_std": 5.0,
        "logit_std": 3.0,
        "min_router_gap": 1e-3,
        "max_router_attempts": 64,
    },
    "qwen3-30b-a3b-routing": {
        "router_std": 5.0,
        "logit_std": 3.0,
        "min_router_gap": 0.0,
        "max_router_attempts": 1,
    },
}

_BASE_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
}

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
class Measurement:
    """Routing margins of one checkpoint on the sample prompts (P prompts, L layers).

    Gap arrays are per (prompt, layer) minima over the prompt's tokens; inf on dense layers.
    """

    prompt_lengths: list[int]
    topk_gap: np.ndarray  # [P, L] k-th minus (k+1)-th router logit
    order_gap: np.ndarray  # [P, L] min consecutive difference among the top k+1 logits
    logits_std: float


@dataclass
class WriteReport:
    """What one write produced, for the CLI to print."""

    config: dict[str, Any]
    num_params: int
    num_bytes: int
    router_draws: int  # checkpoints written (and measured, when checked) during the search
    router_attempts: dict[int, int]  # layer -> router sub-seed, for layers not at 0
    measurement: Measurement | None  # None when the routing check was skipped


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


def is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    """Qwen3-MoE's rule: a layer has a router unless listed dense or off the sparse step."""
    return (
        layer not in set(config["mlp_only_layers"])
        and config["num_experts"] > 0
        and (layer + 1) % config["decoder_sparse_step"] == 0
    )


def build_config(
    preset: str, overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json dict, generation knobs) for a preset with overrides applied and checked."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    config = {**copy.deepcopy(_BASE_CONFIG), **copy.deepcopy(PRESETS[preset])}
    gen = dict(_GEN_DEFAULTS[preset])
    for key, value in (overrides or {}).items():
        (gen if key in gen else config)[key] = value

    tok_ids = special_token_ids(load_tokenizer())
    config.setdefault("bos_token_id", tok_ids[ENDOFTEXT])
    config.setdefault("eos_token_id", tok_ids[IM_END])
    config["max_window_layers"] = min(config["max_window_layers"], config["num_hidden_layers"])
    config["mlp_only_layers"] = sorted(int(i) for i in config["mlp_only_layers"] or [])

    n_layers = config["num_hidden_layers"]
    if config["vocab_size"] < VOCAB_SIZE:
        raise ValueError(f"vocab_size={config['vocab_size']} < tokenizer size {VOCAB_SIZE}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if not 1 <= config["num_experts_per_tok"] <= max(config["num_experts"], 1):
        raise ValueError("num_experts_per_tok must be in [1, num_experts]")
    if config["decoder_sparse_step"] < 1:
        raise ValueError("decoder_sparse_step must be >= 1")
    if any(not 0 <= i < n_layers for i in config["mlp_only_layers"]):
        raise ValueError(f"mlp_only_layers {config['mlp_only_layers']} outside [0, {n_layers})")
    if config["torch_dtype"] not in _NP_DTYPES:
        raise ValueError(f"torch_dtype must be one of {_NP_DTYPES}")
    if config["head_dim"] % 2:
        raise ValueError("head_dim must be even (RoPE rotates pairs)")
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


def _rng(seed: int, name: str, attempt: int | None = None) -> np.random.Generator:
    key = [seed, zlib.crc32(name.encode())]
    return np.random.default_rng(key if attempt is None else key + [attempt])


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (_rng(seed, name).standard_normal(shape) * std).astype(np.float32)


def _norm_weight(seed: int, name: str, size: int) -> np.ndarray:
    return (1.0 + 0.1 * _rng(seed, name).standard_normal(size)).astype(np.float32)


def router_weights(
    config: dict[str, Any], gen: dict[str, Any], seed: int, attempts: dict[int, int]
) -> dict[str, np.ndarray]:
    """Router ([E, H]) of every MoE layer; layer i uses router sub-seed attempts.get(i, 0).

    Its input is RMS-normalised (entries ~N(0, 1)), so std router_std/sqrt(H) gives router
    logits of std ~router_std.
    """
    hidden, experts = config["hidden_size"], config["num_experts"]
    out = {}
    for i in range(config["num_hidden_layers"]):
        if is_moe_layer(config, i):
            name = f"model.layers.{i}.mlp.gate.weight"
            w = _rng(seed, name, attempts.get(i, 0)).standard_normal((experts, hidden))
            out[name] = (w * gen["router_std"] / np.sqrt(hidden)).astype(np.float32)
    return out


def base_weights(config: dict[str, Any], gen: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Every tensor except the routers, float32, HF names and orientation."""
    h, v = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["head_dim"]
    w: dict[str, np.ndarray] = {}

    def normal(name: str, shape: tuple[int, ...], std: float) -> None:
        w[name] = _normal(seed, name, shape, std)

    def norm(name: str, size: int) -> None:
        w[name] = _norm_weight(seed, name, size)

    tied = bool(config["tie_word_embeddings"])
    # Tied, the embedding doubles as the LM head, so it takes the head's scale; the first
    # input_layernorm makes the embedding scale irrelevant to layer 0.
    normal("model.embed_tokens.weight", (v, h), gen["logit_std"] / np.sqrt(h) if tied else 1.0)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", h)
        norm(p + "post_attention_layernorm.weight", h)
        normal(p + "self_attn.q_proj.weight", (heads * hd, h), 1 / np.sqrt(h))
        normal(p + "self_attn.k_proj.weight", (kv_heads * hd, h), 1 / np.sqrt(h))
        normal(p + "self_attn.v_proj.weight", (kv_heads * hd, h), 1 / np.sqrt(h))
        normal(p + "self_attn.o_proj.weight", (h, heads * hd), 1 / np.sqrt(heads * hd))
        norm(p + "self_attn.q_norm.weight", hd)
        norm(p + "self_attn.k_norm.weight", hd)
        if is_moe_layer(config, i):
            inter = config["moe_intermediate_size"]
            for e in range(config["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                normal(q + "gate_proj.weight", (inter, h), 1 / np.sqrt(h))
                normal(q + "up_proj.weight", (inter, h), 1 / np.sqrt(h))
                normal(q + "down_proj.weight", (h, inter), 1 / np.sqrt(inter))
        else:
            inter = config["intermediate_size"]
            normal(p + "mlp.gate_proj.weight", (inter, h), 1 / np.sqrt(h))
            normal(p + "mlp.up_proj.weight", (inter, h), 1 / np.sqrt(h))
            normal(p + "mlp.down_proj.weight", (h, inter), 1 / np.sqrt(inter))
    norm("model.norm.weight", h)
    if not tied:
        # Final-normed hidden entries are ~N(0, 1): logits get std ~logit_std.
        normal("lm_head.weight", (v, h), gen["logit_std"] / np.sqrt(h))
    return w


def _cast(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    if dtype == "float32":
        return tensors
    if dtype == "bfloat16":
        import ml_dtypes  # ships with jax; only needed here

        np_dtype: Any = ml_dtypes.bfloat16
    else:
        np_dtype = np.float16
    return {k: t.astype(np_dtype) for k, t in tensors.items()}


def sample_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of the prompts the routing margin is measured on (several hundred tokens).

    The first is the first 200 tokens of corpus.txt; then a ChatML conversation; then slices
    of the corpus's code and non-ASCII passages.
    """
    text = CORPUS_PATH.read_text(encoding="utf-8")
    ids = tokenizer.encode(text).ids
    chat = (
        f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
        f"{IM_START}user\nWhat does the lighthouse keeper record each morning?{IM_END}\n"
        f"{IM_START}assistant\n"
    )
    prompts = [ids[:200], tokenizer.encode(chat).ids]
    for marker in ("def summarise", "In Kyoto"):
        start = text.find(marker)
        piece = text[start:] if start >= 0 else text
        prompts.append(tokenizer.encode(piece).ids[:128])
    return prompts


def order_gaps(router_logits: np.ndarray, k: int) -> np.ndarray:
    """[..., E] router logits -> [...] min difference of consecutive logits among the top k+1.

    Where it is clearly above float32 rounding noise, both the top-k set and its order are
    unambiguous. NaN rows (dense layers) give inf.
    """
    m = min(k + 1, router_logits.shape[-1])
    if m < 2:
        return np.full(router_logits.shape[:-1], np.inf)
    top = -np.sort(-router_logits, axis=-1)[..., :m]
    gaps = np.min(top[..., :-1] - top[..., 1:], axis=-1)
    return np.where(np.isnan(gaps), np.inf, gaps)


def measure(path: str, prompts: list[list[int]]) -> Measurement:
    """Run the float64 reference on each prompt and collect the routing margins."""
    from sgl_jax.tools.reference_forward import ReferenceModel

    ref = ReferenceModel(path)
    topk, order, stds = [], [], []
    for ids in prompts:
        out = ref.forward(ids)
        topk.append(np.min(out.topk_gap, axis=0))
        order.append(np.min(order_gaps(out.router_logits, ref.top_k), axis=0))
        stds.append(float(np.std(out.logits)))
    return Measurement(
        prompt_lengths=[len(p) for p in prompts],
        topk_gap=np.stack(topk),
        order_gap=np.stack(order),
        logits_std=float(np.mean(stds)),
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save(tensors: dict[str, np.ndarray], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates the file 0600; a checkpoint (and the packaged asset) is world-readable.
    os.chmod(path, 0o644)


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
        for layer in range(config["num_hidden_layers"]):
            if not is_moe_layer(config, layer):
                continue
            tried = [(float(result.order_gap[:, layer].min()), 0)]  # (gap, sub-seed)
            while tried[-1][0] < threshold and len(tried) < max_attempts:
                attempts[layer] = len(tried)
                tensors = write()
                result = measure(str(out), prompts)
                draws += 1
                tried.append((float(result.order_gap[:, layer].min()), attempts[layer]))
            if tried[-1][0] < threshold:
                best = max(tried, key=lambda t: (t[0], -t[1]))[1]
                if verbose:
                    print(f"layer {layer}: no router draw reached {threshold}; keeping {best}")
                if best != attempts.get(layer, 0):
                    attempts[layer] = best
                    tensors = write()
                    result = measure(str(out), prompts)
                    draws += 1

    return WriteReport(
        config=config,
        num_params=sum(int(t.size) for t in tensors.values()),
        num_bytes=sum(int(t.nbytes) for t in tensors.values()),
        router_draws=draws,
        router_attempts=dict(sorted((k, v) for k, v in attempts.items() if v)),
        measurement=result,
    )


def write_random_model(
    out_dir: str,
    preset: str = "tiny",
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    check_routing: bool = True,
) -> dict[str, Any]:
    """Write a random Qwen3-MoE checkpoint to out_dir; returns its config.json dict.

    check_routing=False skips the reference forward (and so the router sub-seed search):
    faster, but then the routing margin is unmeasured and routers are attempt 0's.
    """
    return write_random_model_report(out_dir, preset, overrides, seed, check_routing).config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write a random Qwen3-MoE checkpoint in Hugging Face layout."
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
    moe = sum(is_moe_layer(cfg, i) for i in range(cfg["num_hidden_layers"]))
    print(
        f"wrote {args.out_dir}: preset {args.preset}, seed {args.seed}, "
        f"{cfg['num_hidden_layers']} layers ({moe} MoE), {cfg['num_experts']} experts, "
        f"top-{cfg['num_experts_per_tok']}"
    )
    print(
        f"parameters: {report.num_params:,} ({report.num_bytes / 2**20:.2f} MiB {cfg['torch_dtype']})"
    )
    m = report.measurement
    if m is not None:
        per_prompt = ", ".join(
            f"{n} tok: {t:.3e} / {o:.3e}"
            for n, t, o in zip(
                m.prompt_lengths, m.topk_gap.min(axis=1), m.order_gap.min(axis=1), strict=True
            )
        )
        print(
            f"min router gap (k-th minus (k+1)-th logit / top-(k+1) order): "
            f"{m.topk_gap.min():.3e} / {m.order_gap.min():.3e}  [per prompt: {per_prompt}]"
        )
        print(
            f"router draws: {report.router_draws}, sub-seeds {report.router_attempts or 'all 0'}; "
            f"reference logits std {m.logits_std:.2f}"
        )


if __name__ == "__main__":
    main()
