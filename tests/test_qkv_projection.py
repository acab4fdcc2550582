"""The attention block's q, k and v projections as one matmul at prefill
(``GqaAttention._fused_qkv``, its parts ``_qkv_part``), in a subprocess with 4 fake CPU
devices: on a 2-device "tensor" mesh, and with DP attention (2 ranks x tp 2, the tokens split
by rank). With and without q/k/v biases, the fused path is the one traced when the step (a
rank's share of it) has more tokens than a device's fused columns, never at decode, and both
give the float64 products ``x @ w (+ b)``; with the Pallas attention backend the norm/rotary
kernel reads q's and k's columns of the fused array in place, with the result it has on
separate projections, in one kernel call for both, with and without DP attention
(``tests/test_norm_rope.py`` checks the single projection against float64)."""

from __future__ import annotations

import dataclasses
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
    for bias in (False, True):
        config = base.__class__(**{**base.__dict__, "qkv_bias": bias})
        attn = GqaAttention(config, jnp.float32)
        for name in ("q_proj", "k_proj", "v_proj"):
            for suffix in ("", "_bias") if bias else ("",):
                p = getattr(attn, name + suffix)
                p.value = jnp.asarray(rng.standard_normal(p.value.shape), jnp.float32)
                results[f"{bias}/{name}{suffix}"] = np.asarray(p.value)
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
                if dp:
                    x = jax.device_put(x, NamedSharding(dp_mesh, P("expert")))

                def project(a, x, backends=backends):
                    fused = a._fused_qkv(x, backends)
                    if fused is None:
                        return a._projections(x, backends)
                    return tuple(a._qkv_part(fused, part) for part in range(3))

                fn = jax.jit(project)
                with jax.set_mesh(layout_mesh):
                    jaxpr = str(jax.make_jaxpr(fn)(attn, x))
                    q, k, v = fn(attn, x)
                key = f"{bias}/{layout}/{attention}/{tokens}"
                results[f"{key}/x"] = np.asarray(x)
                for n, a in zip("qkv", (q, k, v), strict=True):
                    results[f"{key}/{n}"] = np.asarray(a)
                results[f"{key}/dots"] = np.asarray(jaxpr.count("dot_general"))
                results[f"{key}/kernels"] = np.asarray(jaxpr.count("name=token_matmul"))
    # With the Pallas attention backend, q and k normed and rotated by the kernel reading
    # their columns of the fused array in place: as from three separate projections.
    config = base.__class__(**{**base.__dict__, "head_dim": 128})
    attn = GqaAttention(config, jnp.float32)
    for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.q_norm.weight, attn.k_norm.weight):
        p.value = jnp.asarray(rng.standard_normal(p.value.shape) / 8, jnp.float32)
    backends = ModelBackends(create_attention_backend("pallas", "cpu", 128, 16),
                             get_moe_backend("dense"))
    # More than a device's 4 + 2 x 2 heads of 128 columns at tp 2 (fused: XLA's dot); not
    # fused, the kernel's projections (a multiple of its 16-row tile).
    tokens = 608
    x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32)

    def rotated(a, x, fuse):
        fused = a._fused_qkv(x, backends) if fuse else None
        heads = (a.num_heads, a.num_kv_heads)
        norms = (a.q_norm, a.k_norm)
        if fused is None:
            return tuple(a._norm_and_rotate(y, norm, h, positions, backends, query=n == "q")
                         for n, y, norm, h in zip("qk", a._projections(x, backends), norms, heads,
                                                  strict=False))
        return a._rotate_fused(fused, positions, backends)

    with jax.set_mesh(mesh):
        for fuse in (True, False):
            for n, a in zip("qk", jax.jit(rotated, static_argnums=2)(attn, x, fuse), strict=True):
                results[f"rope/{fuse}/{n}"] = np.asarray(a)
    # With DP attention: each rank's tokens (x split by token over "expert").
    backends = dataclasses.replace(backends, dp_attention=True)
    x = jax.device_put(jnp.concatenate([x, x[::-1]]), NamedSharding(dp_mesh, P("expert")))
    positions = jnp.concatenate([positions, positions[::-1]])
    with jax.set_mesh(dp_mesh):
        for fuse in (True, False):
            for n, a in zip("qk", jax.jit(rotated, static_argnums=2)(attn, x, fuse), strict=True):
                results[f"rope_dp/{fuse}/{n}"] = np.asarray(a)
    np.savez(os.path.join(out_dir, "qkv.npz"), **results)


def test_fused_qkv_projection_with_and_without_dp_attention():
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": fake_devices_flags(4)}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.test_qkv_projection", json.dumps({"out": tmp})],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with np.load(os.path.join(tmp, "qkv.npz")) as z:
            got = dict(z)
    for bias in (False, True):
        for (layout, ranks), attention in itertools.product((("tp", 1), ("dp", 2)),
                                                           ("native", "pallas")):
            for tokens in TOKENS:
                key = f"{bias}/{layout}/{attention}/{tokens * ranks}"
                x = got[f"{key}/x"].astype(np.float64)
                # The tiny model at tp 2: 4 heads + 2 x 2 KV heads of 16 = 64 columns a
                # device; with DP attention, compared with a rank's tokens. With the Pallas
                # backend the three separate ones are the token matmul kernel's (its
                # MIN_TOKENS lowered to 16 here), in one call, the one fused matmul XLA's.
                one = tokens > 64
                kernels = 1 if attention == "pallas" and not one else 0
                assert int(got[f"{key}/kernels"]) == kernels, key
                if not kernels:  # (a kernel's dot is in its jaxpr, which JAX prints once)
                    assert int(got[f"{key}/dots"]) == (1 if one else 3), key
                for n in "qkv":
                    want = x @ got[f"{bias}/{n}_proj"].astype(np.float64)
                    if bias:
                        want = want + got[f"{bias}/{n}_proj_bias"]
                    np.testing.assert_allclose(got[f"{key}/{n}"], want, rtol=1e-4, atol=1e-4)
    for rope in ("rope", "rope_dp"):
        for n in "qk":
            assert got[f"{rope}/True/{n}"].shape == got[f"{rope}/False/{n}"].shape
            np.testing.assert_allclose(got[f"{rope}/True/{n}"], got[f"{rope}/False/{n}"],
                                       rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    worker(json.loads(sys.argv[1])["out"])
