"""MiniMax-M2 and gpt-oss against transformers itself: our float64 reference and the engine
(float32) give transformers' greedy tokens, 100% of its routers' rows and its logprobs.

Optional: skipped unless torch and transformers are installed (not project dependencies).
Checked with torch 2.13.0 (CPU) and transformers 5.23.0 in a side venv::

    python3 -m venv /work/venvs/hf
    /work/venvs/hf/bin/pip install torch==2.13.0 transformers==5.23.0
    /work/venvs/hf/bin/pip install -e '.[test]'
    /work/venvs/hf/bin/python -m pytest -q tests/test_hf_families_2026.py

transformers builds each tiny model from its own config class and ``save_pretrained`` writes
it (so the tensor names and layouts are its own: MiniMax-M2's ``block_sparse_moe.experts.E.w1``
and block-level ``e_score_correction_bias``, gpt-oss's fused ``gate_up_proj`` with interleaved
gate/up columns); weights are redrawn at unit scale (transformers' std-0.02 init leaves every
router logit near 0). A third checkpoint holds gpt-oss's experts as MXFP4 blocks and scales,
which transformers dequantises on CPU (``Mxfp4Config(dequantize=True)``) and we at load.

Every prompt is longer than the gpt-oss window (8 keys) and goes through the engine in prefill
chunks of 16 tokens; a second request shares the first one's prefix (a prefix-cache hit). The
random seed of each model is the first whose routers' selection gaps on these sequences (the
float64 reference's measure) clear float32 noise by far: a near-tie would make float32 and
float64 legitimately disagree, and says nothing of either.

Routed rows: gpt-oss's router returns its top-k sorted (``torch.topk``), compared in order;
MiniMax-M2's picks with ``sorted=False``, compared as sets (our order, descending biased score,
is the reference's).
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from sgl_jax.tools.make_random_model import BUNDLED_DIR  # noqa: E402
from sgl_jax.tools.reference_forward import ReferenceModel  # noqa: E402

VOCAB = 512  # the bundled tokenizer's (the engine loads tokenizer.json from the checkpoint)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=1)
GPT_OSS = dict(
    num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    swiglu_limit=2.0,  # (7 in the release) so the clamps act on these activations
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 128,
                     "rope_theta": 10000.0})
VARIANTS: dict[str, tuple[str, dict, bool]] = {
    "minimax_m2": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2,
                                      rotary_dim=8), False),
    "gpt_oss": ("gpt_oss", GPT_OSS, False),
    "gpt_oss_mxfp4": ("gpt_oss", GPT_OSS, True),
}
MIN_GAP = {"minimax_m2": 5e-5, "gpt_oss": 2e-4}  # selection scores: sigmoid / logits
NEW_TOKENS = 6
PROMPT = np.random.default_rng(3).integers(2, VOCAB, 40).tolist()
PREFIX_HIT = PROMPT[:32] + np.random.default_rng(4).integers(2, VOCAB, 6).tolist()
ENGINE = dict(enable_return_routed_experts=True, chunked_prefill_size=16,
              precompile_token_paddings=[16, 64], precompile_bs_paddings=[1, 4], page_size=4,
              log_level="warning")


def _randomize(model, seed: int, fused_in_out: bool) -> None:
    """Unit-scale weights (``fused_in_out``: gpt-oss's 3-D expert weights are [E, in, out])."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms around 1; biases and sinks around 0 / 1
                noise = 0.1 * torch.randn(p.shape, generator=gen)
                p.copy_(noise if name.endswith("bias") else 1.0 + noise)
            else:
                fan_in = p.shape[-2] if (p.ndim == 3 and fused_in_out) else p.shape[-1]
                router = name.endswith(("gate.weight", "router.weight"))
                p.copy_((3.0 if router else 1.0) * torch.randn(p.shape, generator=gen)
                        / fan_in**0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def _to_mxfp4(path, seed: int) -> None:
    """gpt-oss's expert weights replaced by random MXFP4 codes and exponents (the format's
    values ARE the weights now), ``quantization_config`` as the release writes it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{path}/model.safetensors")
    rng = np.random.default_rng(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, cols = tensors.pop(name).shape  # [E, in, out]
        tensors[name + "_blocks"] = torch.from_numpy(
            rng.integers(0, 256, (experts, cols, rows // 32, 16), dtype=np.uint8))
        exponent = 127 - int(round(np.log2(4.6 * rows**0.5)))  # rms ~1/sqrt(in)
        tensors[name + "_scales"] = torch.from_numpy(
            (exponent + rng.integers(0, 2, (experts, cols, rows // 32))).astype(np.uint8))
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f, indent=2)


def _load(path, mxfp4: bool):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), output_loading_info=True, attn_implementation="eager",
        dtype=torch.float32, **extra)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _write(model_type: str, kwargs: dict, mxfp4: bool, path, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**COMMON, **kwargs})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(model, seed, fused_in_out=model_type == "gpt_oss")
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(str(path))
    if mxfp4:
        _to_mxfp4(path, seed)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_DIR / name, path / name)


def _min_gap(path) -> float:
    """The smallest selection gap of the reference on both requests' full sequences."""
    ref = ReferenceModel(str(path))
    gaps = []
    for ids in (PROMPT, PREFIX_HIT):
        seq = ids + ref.greedy_generate(ids, NEW_TOKENS)
        gaps.append(ref.forward(seq[:-1]).selection_gap.min())
    return float(min(gaps))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    model_type, kwargs, mxfp4 = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    for seed in range(40):
        _write(model_type, kwargs, mxfp4, path, seed)
        gap = _min_gap(path)
        if gap >= MIN_GAP[model_type]:
            break
    else:
        pytest.fail(f"no seed gave {request.param} routers a margin of {MIN_GAP[model_type]}")
    return request.param, path, _load(path, mxfp4), seed, gap


def _hf_run(model, ids: list[int]):
    """transformers: greedy continuation (one full forward per token), then on the sequence
    but its last token the logits [T, V] and each layer's router choice ids [T, k]."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
    routed: dict[int, np.ndarray] = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        router = getattr(layer.mlp, "router", None) or layer.mlp.gate

        def hook(_module, _args, out, li=li):
            routed[li] = out[2].detach().numpy().astype(np.int64)

        hooks.append(router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([seq[:-1]])).logits[0].double().numpy()
    finally:
        for h in hooks:
            h.remove()
    return seq[len(ids):], logits, np.stack([routed[li] for li in sorted(routed)], axis=1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def _same_rows(got: np.ndarray, want: np.ndarray, ordered: bool) -> np.ndarray:
    """[T, L] whether each row (layer's top-k) agrees, in order or as a set."""
    if not ordered:
        got, want = np.sort(got, -1), np.sort(want, -1)
    return np.all(got == want, axis=-1)


def test_reference_and_engine_match_transformers(checkpoint):
    from sgl_jax import Engine
    from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info

    name, path, model, seed, gap = checkpoint
    ordered = not name.startswith("minimax")
    ref = ReferenceModel(str(path))
    start = time.perf_counter()
    engine = Engine(model_path=str(path), **ENGINE)
    try:
        # Input logprobs from 0 (the hit: from position 36, as the cache serves only positions
        # whose logits no input logprob needs, before logprob_start_len - 1).
        outs = [engine.generate(input_ids=ids, sampling_params={
                    "temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                    return_routed_experts=True, return_logprob=True, logprob_start_len=start)
                for ids, start in ((PROMPT, 0), (PREFIX_HIT, 36))]
    finally:
        engine.shutdown()
    engine_seconds = time.perf_counter() - start
    assert outs[1]["meta_info"]["cached_tokens"] >= 32
    layers, k = ref.num_layers, ref.top_k
    rows_total = rows_equal = 0
    worst_lp = worst_logit = 0.0
    for ids, start, out in zip((PROMPT, PREFIX_HIT), (0, 36), outs, strict=True):
        hf_tokens, hf_logits, hf_rows = _hf_run(model, ids)
        seq = ids + hf_tokens
        # Greedy tokens: transformers = reference = engine.
        assert ref.greedy_generate(ids, NEW_TOKENS) == hf_tokens
        assert out["output_ids"] == hf_tokens
        # The reference's logits and routing on the same sequence.
        r = ref.forward(seq[:-1])
        worst_logit = max(worst_logit,
                          float(np.max(np.abs(r.logits - hf_logits)) / np.max(np.abs(r.logits))))
        assert np.all(_same_rows(r.topk_ids.astype(np.int64), hf_rows, ordered))
        # The engine's rows: every one equal transformers' (and in the reference's order).
        rows = extract_routed_experts_from_meta_info(out).reshape(-1, layers, k).astype(np.int64)
        assert rows.shape[0] == len(seq) - 1
        same = _same_rows(rows, hf_rows, ordered)
        rows_total, rows_equal = rows_total + same.size, rows_equal + int(same.sum())
        np.testing.assert_array_equal(rows, r.topk_ids)
        # Logprobs of every prompt token from ``start`` (position 0 has none) and every
        # output token, against transformers' log-softmax.
        first = max(start, 1)
        want = _log_softmax(hf_logits)[np.arange(first - 1, len(seq) - 1), seq[first:]]
        meta = out["meta_info"]
        got = np.array([v for v, _, _ in meta["input_token_logprobs"][first - start:]]
                       + [v for v, _, _ in meta["output_token_logprobs"]])
        worst_lp = max(worst_lp, float(np.max(np.abs(got - want))))
    print(f"\n{name}: transformers {transformers.__version__}, seed {seed}, min selection gap "
          f"{gap:.2e}; rows equal {rows_equal}/{rows_total}; max |logprob - transformers| "
          f"{worst_lp:.2e}; reference max |logit err| / max |logit| {worst_logit:.2e}; "
          f"engine {engine_seconds:.1f} s")
    assert rows_equal == rows_total
    assert worst_lp < 1e-5
    assert worst_logit < 1e-5


@pytest.mark.parametrize("preset", ["tiny-minimax-m2", "tiny-gpt-oss"])
def test_tiny_preset_loads_in_transformers(preset, tmp_path):
    """``make_random_model``'s presets are read by transformers with no missing or unexpected
    tensor; its logits and routed sets equal the reference's on a prompt longer than the
    window."""
    from sgl_jax.tools.make_random_model import write_random_model

    write_random_model(str(tmp_path), preset, check_routing=False)
    model = _load(tmp_path, mxfp4=False)
    ids = np.random.default_rng(5).integers(0, VOCAB, 48).tolist()
    tokens, hf_logits, hf_rows = _hf_run(model, ids)
    ref = ReferenceModel(str(tmp_path)).forward((ids + tokens)[:-1])
    err = np.max(np.abs(hf_logits - ref.logits)) / np.max(np.abs(ref.logits))
    assert err < 1e-5
    same = _same_rows(ref.topk_ids.astype(np.int64), hf_rows, ordered=False)
    assert same.mean() > 0.99  # routers not searched (check_routing=False): a rare near-tie
