"""Attention backends behind one interface (``AttentionBackend.attend``, and
``attend_latent`` for multi-head latent attention), chosen at start-up.

- ``native``: pure JAX, blocked by request; the CPU default and the reference; GQA and MLA.
- ``pallas``: JAX's ragged paged attention TPU kernel (interpret mode on CPU, for tests); GQA
  only (``create_attention_backend`` refuses it for a MLA model: use native).
"""

from __future__ import annotations

from sgl_jax.srt.layers.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    kv_cache_shape,
    update_page_table,
    write_kv,
    write_latent,
)
from sgl_jax.srt.layers.attention.native import NativeAttention
from sgl_jax.srt.layers.attention.pallas import PallasAttention, check_pallas_shapes
from sgl_jax.srt.layers.moe.vmem_rows import chip_vmem_limit

ATTENTION_BACKENDS = ("native", "pallas")

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "NativeAttention",
    "PallasAttention",
    "create_attention_backend",
    "kv_cache_shape",
    "update_page_table",
    "write_kv",
    "write_latent",
]


def create_attention_backend(
    name: str, platform: str, head_dim: int, kv_block: int, *, latent: bool = False,
    batch_invariant: bool = False, device_kind: str | None = None,
) -> AttentionBackend:
    """The backend for ``--attention-backend`` on a device platform ("cpu", "tpu", "gpu").

    ``latent``: the model uses multi-head latent attention (DeepSeek-V3), which only
    ``native`` reads. ``batch_invariant`` (``--enable-deterministic-inference``, native only:
    ``ServerArgs`` refuses the others): no shortcut chosen by the batch-mates' positions.
    ``device_kind`` (``jax.Device.device_kind``): the TPU whose VMEM sizes pallas' scoped
    limit (``vmem_rows.chip_vmem_limit``, as for the gmm kernels)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {ATTENTION_BACKENDS}")
    if latent and name != "native":
        raise ValueError(
            f"the {name!r} attention backend has no multi-head latent attention (MLA, "
            "DeepSeek-V3): it reads separate K/V heads, not a latent cache; use "
            "--attention-backend native")
    if name == "native":
        return NativeAttention(kv_block, batch_invariant=batch_invariant)
    check_pallas_shapes(head_dim)
    if platform not in ("tpu", "cpu"):
        raise ValueError(
            f"--attention-backend pallas runs JAX's TPU kernel; on {platform} use native"
        )
    if platform == "cpu":
        return PallasAttention(interpret=True)
    return PallasAttention(vmem_limit=chip_vmem_limit(device_kind))
