"""The attention block's q, k and v projections at prefill, in a subprocess with 4 fake CPU
devices: on a 2-device "tensor" mesh, and with DP attention (2 ranks x tp 2, the tokens split
by rank), each against float64 ``x @ w (+ b)``, q and k then per-head RMS-normed and rotated
(a reference written from the definitions).

``GqaAttention._projections``, each path it takes:

- with the Pallas attention backend, heads of 128 (the norm/rotary kernel's layout) and no
  biases, one call of the token matmul kernel for all three that also norms and rotates q
  and k itself (no norm/rotary kernel traced), with and without DP attention;
- one fused XLA matmul (``_fused_qkv``, ``_qkv_part`` its parts, biases added in it) when
  the step (a rank's share of it) has more tokens than a device's fused columns, with heads
  of 128 the norm/rotary kernel reading q's and k's columns in place;
- with the Pallas backend below that, the token matmul kernel's products alone, then the
  biases, norms and rotation;
- otherwise (decode, the native backend) three XLA dots."""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from sgl_jax.testing import fake_devices_flags

REPO = Path(__file__).absolute().parents[1]
TOKENS = (16, 256)  # decode-sized (three matmuls) and prefill-sized (one)


def reference(y: np.ndarray, heads: int, norm: np.ndarray | None, eps: float,
              positions: np.ndarray, theta: float) -> np.ndarray:
    """float64 ``[T, heads, D]``: each head of ``y`` RMS-normed (if ``norm``), then rotated
    "rotate half" by ``positions``."""
    y = y.reshape(y.shape[0], heads, -1)
    if norm is not None:
        y = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + eps) * norm
    d = y.shape[-1]
    angle = positions[:, None, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))
    cos, sin = np.cos(angle), np.sin(angle)
    y1, y2 = y[..., :d // 2], y[..., d // 2:]
    return np.concatenate([y1 * cos - y2 * sin, y2 * cos + y1 * sin], axis=-1)


def worker(out_dir: str) -> None:
    """Runs in the 4-device subprocess: each case's q, k, v and the dots and kernels it traced."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.layers import token_matmul
    from sgl_jax.srt.layers.attention import create_attention_backend
    from sgl_jax.srt.layers.moe.experts import get_moe_backend
    from sgl_jax.srt.models.backends import ModelBackends
    from sgl_jax.srt.models.common import GqaAttention
    from sgl_jax.testing import TEST_MODEL_PATH

    base = ModelConfig.from_hf(TEST_MODEL_PATH)
    # The decode-sized TOKENS case (separate projections) takes the kernel here.
    token_matmul.MIN_TOKENS, token_matmul.ROW_TILES = 16, (16,)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("expert", "tensor"))
    dp_mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("expert", "tensor"))
    rng = np.random.default_rng(0)
    results = {}

    def randomize(attn: GqaAttention, prefix: str, scale: float = 1.0) -> None:
        names = ["q_proj", "k_proj", "v_proj", "q_norm.weight", "k_norm.weight"]
        if attn.has_bias:
            names += ["q_proj_bias", "k_proj_bias", "v_proj_bias"]
        for name in names:
            owner, _, leaf = name.rpartition(".")
            p = getattr(getattr(attn, owner) if owner else attn, leaf)
            p.value = jnp.asarray(rng.standard_normal(p.value.shape) * scale, jnp.float32)
            results[f"{prefix}/{name}"] = np.asarray(p.value)

    def project(a, x, positions, backends):
        return a._projections(x, positions, backends)

    def run(key, attn, x, positions, backends, layout_mesh):
        fn = jax.jit(functools.partial(project), static_argnums=3)  # traced anew
        with jax.set_mesh(layout_mesh):
            jaxpr = str(jax.make_jaxpr(fn, static_argnums=3)(attn, x, positions, backends))
            q, k, v = fn(attn, x, positions, backends)
        results[f"{key}/x"] = np.asarray(x)
        results[f"{key}/positions"] = np.asarray(positions)
        for n, a in zip("qkv", (q, k, v), strict=True):
            results[f"{key}/{n}"] = np.asarray(a)
        results[f"{key}/dots"] = np.asarray(jaxpr.count("dot_general"))
        results[f"{key}/kernels"] = np.asarray(jaxpr.count("name=token_matmul"))
        results[f"{key}/norm_rope"] = np.asarray(jaxpr.count("name=_norm_rope_local"))

    for bias in (False, True):
        config = base.__class__(**{**base.__dict__, "qkv_bias": bias})
        attn = GqaAttention(config, jnp.float32)
        randomize(attn, str(bias))
        # Tensor parallelism alone, and with DP attention (each rank's tokens: half of them);
        # XLA's dots, and (the Pallas attention backend) the token matmul kernel's.
        layouts = [(layout, layout_mesh, dp, attention)
                   for layout, layout_mesh, dp in (("tp", mesh, False), ("dp", dp_mesh, True))
                   for attention in ("native", "pallas")]
        for layout, layout_mesh, dp, attention in layouts:
            backends = ModelBackends(create_attention_backend(attention, "cpu", 128, 16),
                                     get_moe_backend("dense"), dp_attention=dp)
            for tokens in TOKENS:
                tokens *= 2 if dp else 1
                x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.float32)
                positions = jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32)
                if dp:
                    x = jax.device_put(x, NamedSharding(dp_mesh, P("expert")))
                run(f"{bias}/{layout}/{attention}/{tokens}", attn, x, positions, backends,
                    layout_mesh)
    # Heads of 128 (the norm/rotary kernel's layout), the Pallas attention backend: the token
    # matmul kernel norming and rotating q and k after its products (608 tokens: a multiple
    # of its 16-row tile); with the kernel out of reach, fused (more than a device's 4 + 2 x 2
    # heads of 128 columns at tp 2), the norm/rotary kernel reading q's and k's columns.
    config = base.__class__(**{**base.__dict__, "head_dim": 128})
    attn = GqaAttention(config, jnp.float32)
    randomize(attn, "rope", 1 / 8)
    tokens = 608
    x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32)
    for dp, layout_mesh in ((False, mesh), (True, dp_mesh)):
        backends = ModelBackends(create_attention_backend("pallas", "cpu", 128, 16),
                                 get_moe_backend("dense"), dp_attention=dp)
        if dp:  # each rank's tokens (x split by token over "expert")
            x = jax.device_put(jnp.concatenate([x, x[::-1]]), NamedSharding(dp_mesh, P("expert")))
            positions = jnp.concatenate([positions, positions[::-1]])
        for fuse in (True, False):  # fused: the token matmul kernel out of reach
            token_matmul.MIN_TOKENS = 10**9 if fuse else 16
            run(f"rope/{dp}/{fuse}", attn, x, positions, backends, layout_mesh)
    # With biases (Qwen2-MoE, GLM-4.5): never rotated in the token matmul kernel. Above a
    # device's fused columns, fused (its bias added in it); below, the kernel's products,
    # then the biases, then the norm/rotary kernel on q and on k.
    config = base.__class__(**{**base.__dict__, "head_dim": 128, "qkv_bias": True})
    attn = GqaAttention(config, jnp.float32)
    randomize(attn, "rope_bias", 1 / 8)
    token_matmul.MIN_TOKENS = 16
    backends = ModelBackends(create_attention_backend("pallas", "cpu", 128, 16),
                             get_moe_backend("dense"))
    for tokens in (64, 608):
        x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.float32)
        positions = jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32)
        run(f"rope_bias/{tokens}", attn, x, positions, backends, mesh)
    np.savez(os.path.join(out_dir, "qkv.npz"), **results)


def test_qkv_projections_with_and_without_dp_attention():
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": fake_devices_flags(4)}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.test_qkv_projection", json.dumps({"out": tmp})],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with np.load(os.path.join(tmp, "qkv.npz")) as z:
            got = dict(z)
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.testing import TEST_MODEL_PATH

    config = ModelConfig.from_hf(TEST_MODEL_PATH)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def check(key: str, prefix: str, bias: bool) -> None:
        x = got[f"{key}/x"].astype(np.float64)
        for n, h in zip("qkv", (heads, kv_heads, kv_heads), strict=True):
            want = x @ got[f"{prefix}/{n}_proj"].astype(np.float64)
            if bias:
                want = want + got[f"{prefix}/{n}_proj_bias"]
            if n != "v":
                want = reference(want, h, got[f"{prefix}/{n}_norm.weight"], config.rms_norm_eps,
                                 got[f"{key}/positions"], config.rope_theta)
            # float32 rotation angles: position x frequency rounded, as every implementation
            tol = 1e-4 if n == "v" else 2e-3
            np.testing.assert_allclose(got[f"{key}/{n}"], want, rtol=tol, atol=tol, err_msg=key)

    for bias in (False, True):
        for (layout, ranks), attention in itertools.product((("tp", 1), ("dp", 2)),
                                                           ("native", "pallas")):
            for tokens in TOKENS:
                key = f"{bias}/{layout}/{attention}/{tokens * ranks}"
                # The tiny model at tp 2: 4 heads + 2 x 2 KV heads of 16 = 64 columns a
                # device (with DP attention, compared with a rank's tokens), heads the
                # norm/rotary kernel does not cover: fused by XLA above that many tokens,
                # else with the Pallas backend the token matmul kernel's products in one call
                # (its MIN_TOKENS lowered to 16 here), else three XLA dots.
                one = tokens > 64
                kernels = 1 if attention == "pallas" and not one else 0
                assert int(got[f"{key}/kernels"]) == kernels, key
                if not kernels:  # (a kernel's dot is in its jaxpr, which JAX prints once)
                    assert int(got[f"{key}/dots"]) == (1 if one else 3), key
                check(key, str(bias), bias)
    for tokens, counts in ((64, (1, 2)), (608, (0, 1))):  # (token matmul, norm/rotary calls)
        key = f"rope_bias/{tokens}"
        check(key, "rope_bias", True)
        assert (int(got[f"{key}/kernels"]), int(got[f"{key}/norm_rope"])) == counts, key
    for dp in (False, True):
        fused, separate = f"rope/{dp}/True", f"rope/{dp}/False"
        for key in (fused, separate):
            check(key, "rope", False)
        # Fused: XLA's matmul, then the norm/rotary kernel; separate: the token matmul
        # kernel norming and rotating itself.
        assert (int(got[f"{fused}/kernels"]), int(got[f"{fused}/norm_rope"])) == (0, 1)
        assert (int(got[f"{separate}/kernels"]), int(got[f"{separate}/norm_rope"])) == (1, 0)
        for n in "qkv":
            assert got[f"{fused}/{n}"].shape == got[f"{separate}/{n}"].shape
            np.testing.assert_allclose(got[f"{fused}/{n}"], got[f"{separate}/{n}"],
                                       rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    worker(json.loads(sys.argv[1])["out"])
