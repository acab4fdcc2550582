"""The attention block's q, k and v projections as one matmul at prefill
(``GqaAttention._fused_qkv``, its parts ``_qkv_part``): on a 2-device "tensor" mesh (a subprocess with 2 fake CPU
devices), with and without q/k/v biases, the fused path is the one traced when the step has
more tokens than a device's fused columns, never at decode, and both give the float64
products ``x @ w (+ b)``; with the Pallas attention backend the norm/rotary kernel reads q's
and k's columns of the fused array in place, with the result it has on separate
projections, in one kernel call for both (``tests/test_norm_rope.py`` checks the single
projection against float64)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from sgl_jax.testing import fake_devices_flags

REPO = Path(__file__).absolute().parents[1]
TOKENS = (16, 200)  # decode-sized (three matmuls) and prefill-sized (one)


def worker(out_dir: str) -> None:
    """Runs in the 2-device subprocess: each case's q, k, v and the dots it traced."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.models.common import GqaAttention
    from sgl_jax.testing import TEST_MODEL_PATH

    base = ModelConfig.from_hf(TEST_MODEL_PATH)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("expert", "tensor"))
    rng = np.random.default_rng(0)
    results = {}
    for bias in (False, True):
        config = base.__class__(**{**base.__dict__, "qkv_bias": bias})
        attn = GqaAttention(config, jnp.float32)
        for name in ("q_proj", "k_proj", "v_proj"):
            for suffix in ("", "_bias") if bias else ("",):
                p = getattr(attn, name + suffix)
                p.value = jnp.asarray(rng.standard_normal(p.value.shape), jnp.float32)
                results[f"{bias}/{name}{suffix}"] = np.asarray(p.value)
        for tokens in TOKENS:
            x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.float32)
            def project(a, x):
                fused = a._fused_qkv(x, False)
                if fused is None:
                    return tuple(a._project(x, n) for n in ("q_proj", "k_proj", "v_proj"))
                return tuple(a._qkv_part(fused, part) for part in range(3))

            fn = jax.jit(project)
            with jax.set_mesh(mesh):
                jaxpr = str(jax.make_jaxpr(fn)(attn, x))
                q, k, v = fn(attn, x)
            results[f"{bias}/{tokens}/x"] = np.asarray(x)
            for n, a in zip("qkv", (q, k, v), strict=True):
                results[f"{bias}/{tokens}/{n}"] = np.asarray(a)
            results[f"{bias}/{tokens}/dots"] = np.asarray(jaxpr.count("dot_general"))
    # With the Pallas attention backend, q and k normed and rotated by the kernel reading
    # their columns of the fused array in place: as from three separate projections.
    from sgl_jax.srt.layers.attention import create_attention_backend
    from sgl_jax.srt.layers.moe.experts import get_moe_backend
    from sgl_jax.srt.models.backends import ModelBackends

    config = base.__class__(**{**base.__dict__, "head_dim": 128})
    attn = GqaAttention(config, jnp.float32)
    for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.q_norm.weight, attn.k_norm.weight):
        p.value = jnp.asarray(rng.standard_normal(p.value.shape) / 8, jnp.float32)
    backends = ModelBackends(create_attention_backend("pallas", "cpu", 128, 16),
                             get_moe_backend("dense"))
    tokens = 600  # more than a device's 4 + 2 x 2 heads of 128 columns at tp 2
    x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32)

    def rotated(a, x, fuse):
        fused = a._fused_qkv(x, False) if fuse else None
        heads = (a.num_heads, a.num_kv_heads)
        norms = (a.q_norm, a.k_norm)
        if fused is None:
            return tuple(a._norm_and_rotate(a._project(x, n), norm, h, positions, backends,
                                            query=n == "q_proj")
                         for n, norm, h in zip(("q_proj", "k_proj"), norms, heads, strict=True))
        return a._rotate_fused(fused, positions, backends)

    with jax.set_mesh(mesh):
        for fuse in (True, False):
            for n, a in zip("qk", jax.jit(rotated, static_argnums=2)(attn, x, fuse), strict=True):
                results[f"rope/{fuse}/{n}"] = np.asarray(a)
    np.savez(os.path.join(out_dir, "qkv.npz"), **results)


def test_fused_qkv_projection_on_two_devices():
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": fake_devices_flags(2)}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.test_qkv_projection", json.dumps({"out": tmp})],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with np.load(os.path.join(tmp, "qkv.npz")) as z:
            got = dict(z)
    for bias in (False, True):
        for tokens in TOKENS:
            x = got[f"{bias}/{tokens}/x"].astype(np.float64)
            # The tiny model at tp 2: 4 heads + 2 x 2 KV heads of 16 = 64 columns a device.
            assert int(got[f"{bias}/{tokens}/dots"]) == (1 if tokens > 64 else 3)
            for n in "qkv":
                want = x @ got[f"{bias}/{n}_proj"].astype(np.float64)
                if bias:
                    want = want + got[f"{bias}/{n}_proj_bias"]
                np.testing.assert_allclose(got[f"{bias}/{tokens}/{n}"], want, rtol=1e-4,
                                           atol=1e-4)
    for n in "qk":
        assert got[f"rope/True/{n}"].shape == got[f"rope/False/{n}"].shape
        np.testing.assert_allclose(got[f"rope/True/{n}"], got[f"rope/False/{n}"], rtol=1e-5,
                                   atol=1e-5)


if __name__ == "__main__":
    worker(json.loads(sys.argv[1])["out"])
