"""Train an EAGLE draft head for the bundled model on the same text, in JAX.

    pip install -e ".[train]"     # optax
    python -m sgl_jax.tools.train_eagle OUT_DIR [--steps N] [--seed S] ...

The draft (``SglJaxEagleDraft``; its forward and format are in
:mod:`sgl_jax.tools.reference_eagle`) is one Qwen3 decoder layer with a dense SwiGLU MLP that
reads ``fc(concat([embed[x_{p+1}], f_p]))``, where f_p is the target's last decoder layer
output at position p, and predicts x_{p+2} through the target's final-norm-free features and
its (shared, frozen) ``lm_head``. The target stays frozen: it is the bundled checkpoint loaded
by the engine's loader into the engine's ``nnx`` model and run by ``train_forward``'s dense
attention and MoE helpers on the same random corpus windows as ``train_tiny``.

Loss, per draft step k = 0, 1, ... ``levels - 1`` ("training-time test"): step 0 reads the
target's features at every position; step k >= 1 reads, at position p, the draft's own output
of step k - 1 at position p - 1 and attends to the target-feature keys of positions <= p - k
and to its own chain's keys at positions p - k + 1 .. p, exactly the keys a chain draft sees
at its (k + 1)-th step. Each step pays a cross-entropy of its logits against the target's
distribution of x_{p+2} (distillation: the draft must guess what the target will say, not
the text) plus ``reg_coef`` times a smooth-L1 regression of its output g_p onto the target's
f_{p+1} (the feature the next step reads in place of the real one).

Deterministic from ``--seed`` (seeded initial weights, one seeded window generator; XLA's CPU
kernels are deterministic for a fixed build and thread count). After training the tool
prints the offline measure: greedy target continuations (float64 reference) of held-out
prompts and the mean accepted length of a ``num_steps``-step chain draft simulated on them
with :mod:`sgl_jax.tools.reference_eagle`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.rotary import apply_rotary
from sgl_jax.srt.models.common import MoeForCausalLM
from sgl_jax.tools import train_forward as tf
from sgl_jax.tools.reference_eagle import ARCHITECTURE, EagleReference, accept_length
from sgl_jax.tools.reference_forward import ReferenceModel
from sgl_jax.tools.train_tiny import Corpus, corpus_text, load_trainable
from sgl_jax.tools.train_tokenizer import IM_END, IM_START

try:
    import optax
except ImportError as e:  # the runtime does not need it: only this tool does
    raise ImportError('train_eagle needs optax: pip install -e ".[train]"') from e

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TARGET_PATH = ASSETS / "tiny-qwen3-moe"
DRAFT_PATH = ASSETS / "tiny-qwen3-moe-eagle"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1200
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    intermediate_size: int = 128
    levels: int = 3  # chain steps trained (step k reads the draft's own features of step k-1)
    reg_coef: float = 0.5  # weight of the smooth-L1 feature regression
    chat_share: float = 0.15  # as train_tiny
    init_std: float = 0.05
    seed: int = 0
    num_steps: int = 3  # chain length of the offline measure
    eval_tokens: int = 64  # greedy target tokens per prompt of the offline measure


# ---- target (frozen) ---------------------------------------------------------------------------


def target_pass(model: MoeForCausalLM, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The target over ids [batch, seq] -> (hidden [batch, seq, H]: its last decoder layer's
    output before the final norm, logits [batch, seq, vocab]). ``train_forward``'s layer walk
    without dropout, stopping before the final norm for the features."""
    batch, seq = ids.shape
    inner = model.model
    positions = jnp.tile(jnp.arange(seq, dtype=jnp.int32), batch)
    h = jnp.take(inner.embed_tokens[...], ids.reshape(-1), axis=0)
    for layer in inner.layers:
        h = h + tf.causal_attention(layer.self_attn, layer.input_layernorm(h), positions,
                                    batch, seq)
        h = h + tf.moe(getattr(layer, layer.ffn_name), layer.post_attention_layernorm(h))[0]
    logits = (inner.norm(h) @ model.lm_head[...]).astype(jnp.float32)
    return h.reshape(batch, seq, -1), logits.reshape(batch, seq, -1)


@dataclass(frozen=True)
class Shared:
    """What the draft borrows from the target (frozen)."""

    embed: jax.Array  # [vocab, H]
    lm_head: jax.Array  # [H, vocab] (the engine's [in, out] orientation)


# ---- draft -------------------------------------------------------------------------------------


def draft_config(target_path: str, cfg: TrainConfig) -> dict:
    """The draft's config.json: attention shape, RoPE and eps copied from the target's."""
    with open(os.path.join(target_path, "config.json")) as f:
        t = json.load(f)
    copied = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    out = {"architectures": [ARCHITECTURE], "model_type": "sgl_jax_eagle"}
    out.update({k: t[k] for k in copied})
    out["intermediate_size"] = cfg.intermediate_size
    out.update({k: t[k] for k in ("rms_norm_eps", "rope_theta", "vocab_size",
                                  "max_position_embeddings")})
    out.update({"hidden_act": "silu", "torch_dtype": "float32"})
    return out


def init_params(dcfg: dict, cfg: TrainConfig) -> dict[str, jax.Array]:
    """Initial draft weights under their checkpoint names ([out, in]); per-tensor seeded.
    ``fc`` starts as the identity on the feature half (z = f + small), so the untrained
    layer begins from the target's own features."""
    from sgl_jax.tools.reference_eagle import tensor_shapes

    params = {}
    for i, (name, shape) in enumerate(sorted(tensor_shapes(dcfg).items())):
        rng = np.random.default_rng([cfg.seed, i])
        if len(shape) == 1:
            value = np.ones(shape, np.float32)
        else:
            value = (rng.standard_normal(shape) * cfg.init_std).astype(np.float32)
        if name == "fc.weight":
            h = shape[0]
            value[:, h:] += np.eye(h, dtype=np.float32)
        params[name] = jnp.asarray(value)
    return params


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _level_mask(seq: int, level: int) -> jax.Array:
    """[seq, (level + 1) * seq] keys a query of chain step ``level`` at position p sees:
    step 0 (target-feature) keys at positions <= p - level, and step j's key at position
    p - level + j for 1 <= j <= level."""
    p = np.arange(seq)[:, None]
    s = np.arange(seq)[None, :]
    blocks = [s <= p - level] + [s == p - level + j for j in range(1, level + 1)]
    return jnp.asarray(np.concatenate(blocks, axis=1))


def draft_levels(params: dict[str, jax.Array], dcfg: dict, shared: Shared, next_ids: jax.Array,
                 features: jax.Array, levels: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """The draft's chain steps 0..levels-1 over positions 0..n-1 of each row.

    next_ids [B, n] (x_{p+1}), features [B, n, H] (the target's f_p). Returns per step the
    outputs g [B, n, H] and logits [B, n, vocab]; step k's rows p < k are meaningless (no
    chain of k steps ends there) and must be masked by the caller."""
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    eps, d = dcfg["rms_norm_eps"], dcfg["head_dim"]
    nq, nkv = dcfg["num_attention_heads"], dcfg["num_key_value_heads"]
    batch, n = next_ids.shape
    positions = jnp.tile(jnp.arange(n, dtype=jnp.int32), batch)
    e = jnp.take(shared.embed, next_ids, axis=0)
    keys, values, gs, logits = [], [], [], []
    feats = features
    for level in range(levels):
        z = jnp.concatenate([e, feats], axis=-1) @ params["fc.weight"].T  # [B, n, H]
        x = _rms_norm(z, params["layers.0.input_layernorm.weight"], eps).reshape(batch * n, -1)
        q = (x @ params[a + "q_proj.weight"].T).reshape(batch * n, nq, d)
        k = (x @ params[a + "k_proj.weight"].T).reshape(batch * n, nkv, d)
        v = (x @ params[a + "v_proj.weight"].T).reshape(batch, n, nkv, d)
        q = apply_rotary(_rms_norm(q, params[a + "q_norm.weight"], eps), positions,
                         dcfg["rope_theta"]).reshape(batch, n, nq, d)
        k = apply_rotary(_rms_norm(k, params[a + "k_norm.weight"], eps), positions,
                         dcfg["rope_theta"]).reshape(batch, n, nkv, d)
        keys.append(jnp.repeat(k, nq // nkv, axis=2))  # GQA: head h reads kv head h // group
        values.append(jnp.repeat(v, nq // nkv, axis=2))
        kk, vv = jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * d**-0.5
        scores = jnp.where(_level_mask(n, level), scores, -jnp.inf)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), vv)
        h = z + attn.reshape(batch, n, nq * d) @ params[a + "o_proj.weight"].T
        x = _rms_norm(h, params["layers.0.post_attention_layernorm.weight"], eps)
        mlp = jax.nn.silu(x @ params[m + "gate_proj.weight"].T) * (x @ params[m + "up_proj.weight"].T)
        g = h + mlp @ params[m + "down_proj.weight"].T
        gs.append(g)
        logits.append(_rms_norm(g, params["norm.weight"], eps) @ shared.lm_head)
        # The next step at position p reads this step's output at p - 1.
        feats = jnp.concatenate([jnp.zeros_like(g[:, :1]), g[:, :-1]], axis=1)
    return gs, logits


def draft_loss(params, dcfg: dict, shared: Shared, ids: jax.Array, hidden: jax.Array,
               target_logits: jax.Array, cfg: TrainConfig) -> tuple[jax.Array, jax.Array]:
    """ids [B, T], the target's hidden [B, T, H] and logits [B, T, vocab] -> (loss, per-step
    [levels, 3]: cross-entropy, regression, top-1 agreement with the target)."""
    n = ids.shape[1] - 1  # draft positions 0..T-2
    gs, logits = draft_levels(params, dcfg, shared, ids[:, 1:], hidden[:, :n], cfg.levels)
    want_probs = jax.nn.softmax(target_logits[:, 1:], axis=-1)  # the target's x_{p+2}
    want_feat = hidden[:, 1:]  # f_{p+1}
    total, stats = 0.0, []
    for level, (g, lg) in enumerate(zip(gs, logits, strict=True)):
        valid = (jnp.arange(n) >= level).astype(jnp.float32)[None, :]  # [1, n]
        count = valid.sum() * ids.shape[0]
        ce = -jnp.sum(want_probs * jax.nn.log_softmax(lg, axis=-1), axis=-1)
        reg = jnp.mean(optax.huber_loss(g, want_feat, delta=1.0), axis=-1)
        agree = (jnp.argmax(lg, -1) == jnp.argmax(target_logits[:, 1:], -1)).astype(jnp.float32)
        ce, reg, agree = ((t * valid).sum() / count for t in (ce, reg, agree))
        total = total + ce + cfg.reg_coef * reg
        stats.append(jnp.stack([ce, reg, agree]))
    return total / cfg.levels, jnp.stack(stats)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    warmup = min(cfg.warmup, max(1, cfg.steps // 10))  # short (test) runs warm up too
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                                  end_value=cfg.lr * 0.05)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )


@dataclass
class TrainResult:
    seconds: float
    final: list[list[float]]  # per chain step: [cross-entropy, regression, top-1 agreement],
    # mean of the last 50 steps
    history: list[tuple[int, list[list[float]]]]  # every 100 steps


def train(target: MoeForCausalLM, corpus: Corpus, dcfg: dict, cfg: TrainConfig,
          progress: bool = True) -> tuple[dict[str, jax.Array], TrainResult]:
    """Trains a draft from ``init_params`` against the frozen target; returns its weights."""
    graphdef, state = nnx.split(target)
    shared = Shared(target.model.embed_tokens[...], target.lm_head[...])
    params = init_params(dcfg, cfg)
    tx = optimizer(cfg)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, ids):
        hidden, target_logits = target_pass(nnx.merge(graphdef, state), ids)
        hidden, target_logits = jax.lax.stop_gradient((hidden, target_logits))
        def loss(p):
            return draft_loss(p, dcfg, shared, ids, hidden, target_logits, cfg)

        grads, stats = jax.grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    rng = np.random.default_rng(cfg.seed)
    history: list[tuple[int, list[list[float]]]] = []
    recent = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="train_eagle", unit="step", disable=not progress)
    for i in bar:
        ids = corpus.sample(rng, cfg.batch_size, cfg.seq_len, cfg.chat_share)
        params, opt_state, stats = step(params, opt_state, jnp.asarray(ids))
        if i >= cfg.steps - 50:
            recent.append(stats)
        if i % 100 == 99 or i == cfg.steps - 1:
            s = np.asarray(stats).round(4).tolist()  # a sync every 100 steps only
            history.append((i + 1, s))
            bar.set_postfix(ce=f"{s[0][0]:.3f}", agree=",".join(f"{x[2]:.2f}" for x in s))
    seconds = time.perf_counter() - start
    final = np.mean([np.asarray(s) for s in recent], axis=0).round(4).tolist()
    return params, TrainResult(seconds, final, history)


def save_draft(params: dict[str, jax.Array], dcfg: dict, out_dir: str) -> None:
    """config.json and model.safetensors (float32, sorted names) in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dcfg, f, indent=2)
        f.write("\n")
    path = os.path.join(out_dir, "model.safetensors")
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in params.items()}
    save_file(dict(sorted(tensors.items())), path, metadata={"format": "pt"})
    for name in ("config.json", "model.safetensors"):
        os.chmod(os.path.join(out_dir, name), 0o644)  # an asset is readable by all


# ---- offline measure ---------------------------------------------------------------------------

# Questions that are not in the corpus (its exchanges come from its headings and Q/A pairs).
CHAT_PROMPTS = (
    "Explain MoE models",
    "What does a lighthouse keeper do?",
    "Tell me about the sea",
    "How do I bake bread?",
    "Why is the sky blue?",
)
FREE_PROMPTS = ("Once upon a time", "My favourite food is", "The weather today")


def corpus_openings(text: str, count: int) -> list[str]:
    """The first five words of ``count`` paragraphs spread evenly over the text."""
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.split()) >= 12]
    picks = np.linspace(0, len(paragraphs) - 1, count).round().astype(int)
    return [" ".join(paragraphs[i].split()[:5]) for i in picks]


def eval_prompts(tokenizer: Tokenizer, text: str, openings: int = 8) -> dict[str, list[list[int]]]:
    chat = [f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n" for q in CHAT_PROMPTS]
    groups = {"corpus openings": corpus_openings(text, openings), "chat": chat,
              "free": list(FREE_PROMPTS)}
    return {k: [tokenizer.encode(s).ids for s in v] for k, v in groups.items()}


def offline_accept_length(draft_path: str, target_path: str, prompts: list[list[int]],
                          num_steps: int, new_tokens: int) -> tuple[float, int, int]:
    """(mean accepted length, emitted tokens, verify steps) of a ``num_steps`` chain over the
    greedy float64 continuations of ``prompts`` (stopping at the target's stop tokens)."""
    target = ReferenceModel(target_path)
    draft = EagleReference(draft_path, target)
    with open(os.path.join(target_path, "generation_config.json")) as f:
        stops = json.load(f).get("eos_token_id", [])
    stops = stops if isinstance(stops, list) else [stops]
    emitted = steps = 0
    for prompt in prompts:
        cont = target.greedy_generate(prompt, new_tokens, stop_token_ids=stops)
        e, s = accept_length(draft, prompt, cont, num_steps)
        emitted, steps = emitted + e, steps + s
    return emitted / max(steps, 1), emitted, steps


def main(argv: list[str] | None = None) -> None:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help=f"draft directory (the bundled one: {DRAFT_PATH})")
    p.add_argument("--target", default=str(TARGET_PATH), help="the target checkpoint")
    for name, default in asdict(d).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--no-progress", action="store_true")
    args = vars(p.parse_args(argv))
    out_dir, target_path = args.pop("out_dir"), args.pop("target")
    progress = not args.pop("no_progress")
    cfg = TrainConfig(**args)

    config = ModelConfig.from_hf(target_path)
    tf.check_trainable(config)
    tokenizer = Tokenizer.from_file(os.path.join(target_path, "tokenizer.json"))
    text = corpus_text()
    corpus = Corpus.build(tokenizer, text)
    dcfg = draft_config(target_path, cfg)
    params, result = train(load_trainable(config), corpus, dcfg, cfg, progress)
    save_draft(params, dcfg, out_dir)
    measure = {}
    for group, prompts in eval_prompts(tokenizer, text).items():
        mean, emitted, steps = offline_accept_length(out_dir, target_path, prompts,
                                                     cfg.num_steps, cfg.eval_tokens)
        measure[group] = {"prompts": len(prompts), "emitted": emitted, "verify_steps": steps,
                          "accept_length": round(mean, 3)}
    emitted = sum(m["emitted"] for m in measure.values())
    steps = sum(m["verify_steps"] for m in measure.values())
    measure["all"] = {"accept_length": round(emitted / steps, 3)}
    summary = {
        "train_config": asdict(cfg),
        "train_seconds": round(result.seconds, 1),
        "final_per_chain_step [ce, reg, top1]": result.final,
        "offline_accept_length": measure,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
