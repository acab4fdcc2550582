"""Train the bundled tiny Qwen3-MoE on the project's English text, in JAX.

    pip install -e ".[train]"     # optax
    python -m sgl_jax.tools.train_tiny OUT_DIR [--steps N] [--seed S] ...

The shape is the ``tiny`` preset of ``make_random_model`` (4 layers, hidden 64, 16 experts,
top-4, vocab 512), the tokenizer and chat template are the bundled ones, unchanged. Training
starts from that tool's random checkpoint of the same seed (its routing search off), loaded by
the engine's own loader into the engine's own ``nnx`` model; ``train_forward`` runs those
modules as a plain causal LM. The loss is next-token cross-entropy plus ``aux_coef`` times a
load-balancing term, so that every expert keeps receiving tokens. The result is written in the
same Hugging Face layout (per-expert tensors, ``[out, in]`` linear weights) under the names the
loader reads, so the engine, the float64 reference and transformers load it unchanged.

The text is ``assets/corpus.txt`` (the tokenizer's training text) and
``assets/corpus_extra.txt``, both written for this project, cut into random windows, plus
ChatML exchanges made from its headings and Q/A pairs, so a chat request gets an answer that
ends with ``<|im_end|>``. 18k tokens are very few for half a million parameters: unregularised,
the model memorises its windows and garbles words as soon as a prompt leaves the corpus. Two
regularisers keep it to corpus words: a share of the input tokens is replaced by random ones
(the targets stay clean) and residual dropout (docs/trained_model.md has the measurements).

Deterministic from ``--seed``: the initial weights come from per-tensor seeded generators, the
windows and noise from one seeded generator, dropout from a key folded with the step; XLA's
CPU kernels are deterministic for a fixed build and thread count, so the same command on the
same machine writes the same bytes.

After training the tool prints the loss over every corpus window and how close the trained
routers come to ties there: the smallest selection gap of the float64 reference (the margin
that decides a token's top-k ids and their order, see ``random_model_routing``) next to the
float32 rounding error of the router logits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from sgl_jax.srt.distributed import make_mesh
from sgl_jax.srt.model_loader.loader import hf_sources, load_model
from sgl_jax.srt.models.common import MoeForCausalLM
from sgl_jax.tools import train_forward as tf
from sgl_jax.tools.make_random_model import write_random_model
from sgl_jax.tools.train_tokenizer import CORPUS_PATH, IM_END, IM_START, SPECIAL_TOKENS

try:
    import optax
except ImportError as e:  # the runtime does not need it: only this tool does
    raise ImportError('train_tiny needs optax: pip install -e ".[train]"') from e


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    aux_coef: float = 0.01  # weight of the load-balancing loss (1 at uniform routing)
    chat_share: float = 0.15  # fraction of windows that are ChatML exchanges
    input_noise: float = 0.3  # share of input tokens replaced by random ones (not targets)
    dropout: float = 0.1  # residual dropout (train_forward.forward)
    seed: int = 0
    # Initial scales (make_random_model generation knobs): moderate router and head logits.
    router_std: float = 1.0
    logit_std: float = 1.0


# ---- data --------------------------------------------------------------------------------------


# The tokenizer's training text, then more English text written for training the model (kept
# apart so that the tokenizer, and every checkpoint that shares it, stays as it is).
EXTRA_CORPUS_PATH = CORPUS_PATH.with_name("corpus_extra.txt")
TRAINING_TEXTS = (CORPUS_PATH, EXTRA_CORPUS_PATH)


def corpus_text(paths: tuple[Path, ...] = TRAINING_TEXTS) -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in paths)


def _chat(question: str, answer: str) -> str:
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


def chat_exchanges(text: str) -> list[str]:
    """ChatML exchanges made from the text: a heading (a short line ending in '.' or ':',
    followed by a blank line) asks and the paragraph after it answers; a "Q: ...\nA: ..."
    pair is a question and its answer."""
    blocks = [b.strip("\n") for b in re.split(r"\n\s*\n", text)]
    out = []
    for head, body in zip(blocks[:-1], blocks[1:], strict=True):
        if "\n" in head or len(head) > 60 or not head.endswith((".", ":")):
            continue
        if len(body) < 80 or body.startswith((" ", "$", ">>>", "{", "def ", "import ")):
            continue
        out.append(_chat(head.rstrip(".:"), body))
    for block in blocks:
        q, sep, a = block.partition("\nA: ")
        if q.startswith("Q: ") and sep and "\n" not in q and "\n" not in a:
            out.append(_chat(q[3:], a))
    return out


@dataclass
class Corpus:
    stream: np.ndarray  # the corpus's token ids, in order
    chats: list[np.ndarray]  # token ids of each ChatML exchange

    @staticmethod
    def build(tokenizer: Tokenizer, text: str) -> Corpus:
        stream = np.asarray(tokenizer.encode(text).ids, dtype=np.int32)
        chats = [np.asarray(tokenizer.encode(c).ids, dtype=np.int32) for c in chat_exchanges(text)]
        return Corpus(stream, chats)

    def sample(self, rng: np.random.Generator, batch: int, seq: int,
               chat_share: float) -> np.ndarray:
        """[batch, seq] windows: most are random slices of the stream; a ``chat_share`` of
        them are an exchange from its start, continued by the stream (never padding: every
        position is a real target)."""
        out = np.empty((batch, seq), dtype=np.int32)
        for i in range(batch):
            if self.chats and rng.random() < chat_share:
                chat = self.chats[rng.integers(len(self.chats))][:seq]
                start = rng.integers(len(self.stream) - seq)
                out[i] = np.concatenate([chat, self.stream[start:start + seq - len(chat)]])
            else:
                start = rng.integers(len(self.stream) - seq + 1)
                out[i] = self.stream[start:start + seq]
        return out

    def eval_windows(self, seq: int) -> np.ndarray:
        """Every non-overlapping window of the stream (the tail that does not fill one is
        dropped): the data the final loss is reported on."""
        n = len(self.stream) // seq
        return self.stream[: n * seq].reshape(n, seq)


# ---- model -------------------------------------------------------------------------------------


def init_checkpoint(out_dir: str, cfg: TrainConfig) -> ModelConfig:
    """The tiny preset's random checkpoint of ``cfg.seed`` in out_dir (config, tokenizer,
    chat template, generation config and initial weights)."""
    write_random_model(out_dir, "tiny", {"router_std": cfg.router_std,
                                         "logit_std": cfg.logit_std},
                       seed=cfg.seed, check_routing=False)
    config = ModelConfig.from_hf(out_dir)
    tf.check_trainable(config)
    return config


def load_trainable(config: ModelConfig) -> MoeForCausalLM:
    """The engine's model with the checkpoint's weights, float32, on one device."""
    mesh = make_mesh(jax.devices()[:1], 1, 1)
    return load_model(config, mesh, jnp.float32)


def hf_tensors(model: MoeForCausalLM) -> dict[str, np.ndarray]:
    """Every parameter under its Hugging Face name(s): the loader's mapping inverted
    (``hf_sources``): stacked experts split per expert, linear weights back to ``[out, in]``."""
    experts = model.config.num_experts
    out: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names, transpose = hf_sources(path, var, experts)
        value = np.asarray(jax.device_get(var.get_value()), dtype=np.float32)
        parts = list(value) if len(names) > 1 or ".experts." in names[0] else [value]
        for name, part in zip(names, parts, strict=True):
            out[name] = np.ascontiguousarray(part.T if transpose else part)
    return out


def save_weights(model: MoeForCausalLM, out_dir: str) -> None:
    path = os.path.join(out_dir, "model.safetensors")
    save_file(dict(sorted(hf_tensors(model).items())), path, metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors writes 0600; a checkpoint (and the asset) is readable


# ---- training ----------------------------------------------------------------------------------


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                                  end_value=cfg.lr * 0.05)
    # No decay of norm weights (1-D): they scale, they do not memorise.
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def noisy(rng: np.random.Generator, ids: np.ndarray, rate: float, vocab: int) -> np.ndarray:
    """ids with a ``rate`` share of positions replaced by random ids below ``vocab``.

    The targets stay the clean ids, so the model learns to continue plausibly from a context
    it never saw verbatim; without it, a model this small memorises its few thousand windows
    and garbles words as soon as a prompt leaves the corpus."""
    if rate <= 0:
        return ids
    replace = rng.random(ids.shape) < rate
    return np.where(replace, rng.integers(0, vocab, ids.shape), ids).astype(ids.dtype)


@dataclass
class TrainResult:
    seconds: float
    final_train_loss: float  # mean cross-entropy of the last 50 steps
    corpus_loss: float  # mean cross-entropy over every corpus window, after training
    balance: float  # the load-balancing term over the corpus (1 = uniform)
    # every 50 steps: (step, cross-entropy, balance, held-out cross-entropy or nan)
    history: list[tuple[int, float, float, float]]


def train(model: MoeForCausalLM, corpus: Corpus, cfg: TrainConfig, progress: bool = True,
          heldout: np.ndarray | None = None) -> TrainResult:
    """Trains ``model`` in place. ``heldout`` [n, seq] windows (text left out of ``corpus``):
    their loss is added to the history every 50 steps (for tuning; not used to stop)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optimizer(cfg)
    opt_state = tx.init(params)

    def losses(params, inputs, targets, key=None):
        out = tf.forward(nnx.merge(graphdef, params, rest), inputs, cfg.dropout, key)
        ce = tf.next_token_loss(out.logits, targets)
        balance = tf.load_balance_loss(out.router_probs, out.topk_ids)
        return ce + cfg.aux_coef * balance, (ce, balance)

    @jax.jit
    def step(params, opt_state, inputs, targets, key):
        grads, (ce, balance) = jax.grad(losses, has_aux=True)(params, inputs, targets, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce, balance

    @jax.jit
    def evaluate(params, ids):
        return losses(params, ids, ids)[1]

    rng = np.random.default_rng(cfg.seed)
    key = jax.random.key(cfg.seed)
    num_text_tokens = model.config.vocab_size - len(SPECIAL_TOKENS)  # the specials are last
    history: list[tuple[int, float, float, float]] = []
    recent: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="train_tiny", unit="step", disable=not progress)
    for i in bar:
        ids = corpus.sample(rng, cfg.batch_size, cfg.seq_len, cfg.chat_share)
        inputs = noisy(rng, ids, cfg.input_noise, num_text_tokens)
        params, opt_state, ce, balance = step(params, opt_state, jnp.asarray(inputs),
                                              jnp.asarray(ids), jax.random.fold_in(key, i))
        if i % 50 == 49 or i == cfg.steps - 1:
            ce_f, bal_f = float(ce), float(balance)  # a sync every 50 steps only
            held = float(evaluate(params, heldout)[0]) if heldout is not None else float("nan")
            history.append((i + 1, ce_f, bal_f, held))
            bar.set_postfix(loss=f"{ce_f:.3f}", balance=f"{bal_f:.3f}")
        if i >= cfg.steps - 50:
            recent.append(ce)
    seconds = time.perf_counter() - start
    nnx.update(model, params)
    ce, balance = evaluate(params, jnp.asarray(corpus.eval_windows(cfg.seq_len)))
    return TrainResult(seconds, float(np.mean([float(x) for x in recent])), float(ce),
                       float(balance), history)


# ---- report ------------------------------------------------------------------------------------


@dataclass
class RoutingMargin:
    tokens: int
    min_gap: float  # smallest selection gap of the float64 reference (random_model_routing)
    share_below: dict[str, float]  # threshold -> share of (token, layer) gaps below it
    float32_error: float  # largest |float32 - float64| centred router logit (the forward's)


def routing_margin(model: MoeForCausalLM, path: str, windows: np.ndarray) -> RoutingMargin:
    """How close the trained routers come to ties on ``windows`` [n, seq], and how large the
    float32 rounding of the router logits is there: where a gap is below that error, a
    float32 engine and the float64 reference may pick different experts."""
    from sgl_jax.tools.reference_forward import ReferenceModel

    ref = ReferenceModel(path)
    gaps, error = [], 0.0
    for chunk in np.array_split(windows, max(1, len(windows) // 16)):
        probs = np.asarray(tf.forward(model, jnp.asarray(chunk)).router_probs, np.float64)
        logits32 = np.log(probs).reshape(probs.shape[0], len(chunk), chunk.shape[1], -1)
        for b, ids in enumerate(chunk):
            out = ref.forward(ids.tolist())
            gaps.append(out.selection_gap.ravel())
            want = out.router_logits - out.router_logits.max(-1, keepdims=True)  # [T, L, E]
            got = logits32[:, b].transpose(1, 0, 2)
            got = got - got.max(-1, keepdims=True)
            error = max(error, float(np.abs(got - want).max()))
    flat = np.concatenate(gaps)
    below = {f"{t:g}": float(np.mean(flat < t)) for t in (1e-5, 1e-4, 1e-3)}
    return RoutingMargin(int(windows.size), float(flat.min()), below, error)


def main(argv: list[str] | None = None) -> None:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="checkpoint directory (the bundled one: "
                   "sgl_jax/assets/tiny-qwen3-moe)")
    for name, default in asdict(d).items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--no-progress", action="store_true")
    args = vars(p.parse_args(argv))
    out_dir, progress = args.pop("out_dir"), not args.pop("no_progress")
    cfg = TrainConfig(**args)

    config = init_checkpoint(out_dir, cfg)
    tokenizer = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    corpus = Corpus.build(tokenizer, corpus_text())
    model = load_trainable(config)
    result = train(model, corpus, cfg, progress)
    save_weights(model, out_dir)
    margin = routing_margin(model, out_dir, corpus.eval_windows(cfg.seq_len))
    summary = {
        "train_config": asdict(cfg),
        "corpus_tokens": int(len(corpus.stream)),
        "chat_exchanges": len(corpus.chats),
        "train_seconds": round(result.seconds, 1),
        "final_train_loss": round(result.final_train_loss, 4),
        "corpus_loss": round(result.corpus_loss, 4),
        "corpus_balance": round(result.balance, 4),
        "routing_margin": asdict(margin),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
