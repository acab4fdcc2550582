"""Qwen3.5-MoE's float64 reference (sgl_jax.tools.reference_qwen35) against transformers
itself, in both config forms, and sgl_jax's ModelConfig on transformers' own config.json.

Optional: skipped unless torch and transformers are installed (not project dependencies).
Checked with torch 2.13.0 (CPU) and transformers 5.23.0 (see test_hf_families_2026.py).

transformers builds each tiny model from its own config classes and ``save_pretrained`` writes
it (its tensor names and fused expert layouts); weights are redrawn at unit scale so routers
and gates are far from their init. The prompt (80 tokens) is longer than transformers' linear-
attention chunk (64). transformers runs in float64 here (eager attention and experts), except
the delta rule, its q/k norms and g, which it computes in float32 whatever the model dtype:
that float32 core alone leaves ~1e-5 relative error in the logits (measured 9.4e-6 flat,
2.0e-5 nested), so the bound is 5e-5 (the engine's float32 forward is held to the float64
reference, not to this); routed rows (top-k sorted by
``torch.topk``, compared in order) must all match, on a seed whose selection gaps clear float32
noise. Greedy decoding with transformers' cache (its one-token recurrence and conv update)
must give the reference's tokens.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.tools.reference_qwen35 import Qwen35Reference  # noqa: E402

VOCAB = 256
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-6,
    # not the default "every 4th": the reader must follow the list
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 2]},
)
PROMPT = np.random.default_rng(5).integers(2, VOCAB, 80).tolist()
MIN_GAP = 1e-4


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                noise = 0.3 * torch.randn(p.shape, generator=gen)
                p.copy_(noise if name.endswith(("layernorm.weight", "norm.weight", "dt_bias"))
                        else 1.0 + noise)
            else:
                fan_in = p.shape[-1]
                scale = 3.0 if name.endswith("gate.weight") else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / fan_in**0.5)


def _build(tmp_path, nested: bool, seed: int):
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    torch.manual_seed(seed)
    if nested:
        cfg = Qwen3_5MoeConfig(text_config=TEXT, vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64))
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TEXT))
    _randomize(model, seed)
    model = model.double().eval()
    for c in (model.config, getattr(model.config, "text_config", None)):
        if c is not None:  # eager: plain matmuls, the only ones that run in float64
            c._attn_implementation, c._experts_implementation = "eager", "eager"
    path = tmp_path / ("nested" if nested else "flat")
    model.save_pretrained(str(path))
    return model, str(path)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "conditional_generation"])
def test_reference_matches_transformers(tmp_path, nested):
    for seed in range(20):
        model, path = _build(tmp_path, nested, seed)
        ref = Qwen35Reference(path)
        out = ref.forward(PROMPT)
        if out.selection_gap.min() > MIN_GAP:
            break
    else:
        pytest.fail("no seed with routers clear of float32 near-ties")
    cfg = ModelConfig.from_hf(path)
    assert cfg.linear_layers == (True, False, True, True) and cfg.rotary_dim == 8
    assert cfg.architecture == type(model).__name__
    if nested:
        assert ref.skipped and all(n.startswith("model.visual.") for n in ref.skipped)

    captured: list = []
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    hooks = [g.register_forward_hook(lambda _m, _i, o: captured.append(o[2].numpy().copy()))
             for g in gates]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].double().numpy()
    for h in hooks:
        h.remove()
    rel = np.abs(logits - out.logits).max() / np.abs(out.logits).max()
    print(f"\n{'nested' if nested else 'flat'} seed {seed}: logits rel err {rel:.2e}, "
          f"min selection gap {out.selection_gap.min():.2e}")
    assert rel < 5e-5
    hf_ids = np.stack(captured, axis=1)  # [T, L, k]
    assert hf_ids.shape == out.topk_ids.shape
    assert (hf_ids == out.topk_ids).all(), f"{(hf_ids != out.topk_ids).any(-1).mean():.3f} rows differ"

    # transformers' cached decode (one-token recurrence, conv state update) vs full forwards
    with torch.no_grad():
        gen = model.generate(torch.tensor([PROMPT[:40]]), max_new_tokens=6, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    seq = PROMPT[:40]
    for _ in range(6):
        seq = seq + [int(np.argmax(ref.forward(seq).logits[-1]))]
    assert seq[40:] == gen


def test_tiny_preset_loads_in_transformers(tmp_path):
    """make_random_model's tiny-qwen3.5-moe is a checkpoint transformers loads without missing
    or unexpected tensors, and its logits and routed rows are the reference's."""
    from transformers import AutoModelForCausalLM

    from sgl_jax.tools.make_random_model import write_random_model_report

    path = str(tmp_path / "tiny")
    write_random_model_report(path, "tiny-qwen3.5-moe", check_routing=False)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager", dtype=torch.float64)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.config._experts_implementation = "eager"
    ids = PROMPT[:70]
    captured: list = []
    for n, m in model.named_modules():
        if n.endswith("mlp.gate"):
            m.register_forward_hook(lambda _m, _i, o: captured.append(o[2].numpy().copy()))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    out = Qwen35Reference(path).forward(ids)
    rel = np.abs(logits - out.logits).max() / np.abs(out.logits).max()
    print(f"\ntiny-qwen3.5-moe: logits rel err {rel:.2e}, min selection gap "
          f"{out.selection_gap.min():.2e}")
    assert rel < 5e-5
    assert (np.stack(captured, axis=1) == out.topk_ids).all()
