"""Expert-compute backends of the sparse MoE block: one interface, an object chosen once.

A backend computes, on one device, the experts that device holds for every token routed to
them. Its signature (:class:`ExpertCompute`)::

    backend(x [T, H], local_ids [T, k], topk_weights [T, k],
            w_gate [E_l, H, I], w_up [E_l, H, I], w_down [E_l, I, H]) -> float32 [T, H]

``local_ids`` are rows of the device's stacked weights (its local expert index); an expert held
by another device has the sentinel row ``E_l``, which a backend must ignore. The result is the
device's float32 partial sum; ``ep_moe.ep_moe_forward`` adds the partial sums of all devices
(one psum) and casts to the activation dtype. Routing is not part of a backend: every backend
consumes the same (topk_ids, topk_weights), so the routed experts never depend on the backend.

- ``dense`` (``dense.py``): every expert on every token, combined with ``[T, E_l]`` weights.
- ``ragged`` (``ragged.py``): each token-expert assignment once, grouped by expert,
  ``jax.lax.ragged_dot``.
- ``gmm`` (``gmm.py``): the same grouping, with JAX's Megablox grouped-matmul TPU kernel
  (tiles chosen per shape; Pallas interpret mode off TPU, for tests).

The runner builds the :class:`MoEBackend` once at start-up (:func:`create_moe_backend`:
``--moe-backend auto`` resolved for the platform, the dense reference in batch-invariant mode)
and the model's forward calls it, as it calls the attention backend.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Protocol

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.moe import gmm_gate_up, vmem_rows
from sgl_jax.srt.layers.moe.activation import SILU, ExpertActivation
from sgl_jax.srt.layers.moe.dense import combine_weights, dense_experts, experts_forward
from sgl_jax.srt.layers.moe.gmm import GmmExperts
from sgl_jax.srt.layers.moe.ragged import ragged_experts

__all__ = [
    "MOE_BACKENDS", "MOE_BACKEND_CHOICES", "ExpertCompute", "MoEBackend", "combine_weights",
    "create_moe_backend", "experts_forward", "get_moe_backend", "resolve_moe_backend",
]


class ExpertCompute(Protocol):
    def __call__(
        self, x: jax.Array, local_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array,
        w_up: jax.Array, w_down: jax.Array,
    ) -> jax.Array: ...


MOE_BACKENDS: dict[str, ExpertCompute] = {
    "dense": dense_experts, "ragged": ragged_experts, "gmm": GmmExperts(),  # platform: default
}
MOE_BACKEND_CHOICES: tuple[str, ...] = ("auto", *MOE_BACKENDS)  # the --moe-backend choices

# What "auto" means per JAX platform (jax.default_backend(); "cuda"/"rocm" are GPUs too).
_AUTO = {"tpu": "gmm", "cpu": "dense", "gpu": "dense", "cuda": "dense", "rocm": "dense"}


def resolve_moe_backend(name: str, platform: str) -> str:
    """``--moe-backend`` -> the backend that runs: "dense", "ragged" or "gmm".

    "dense", "ragged" and "gmm" are taken as given, on any platform (gmm off TPU: the Pallas
    kernel in interpret mode, far slower, for tests). "auto" picks:

    - TPU: ``gmm``. Both grouped backends cost ``2*3*T*k*H*I`` expert FLOPs instead of
      dense's ``2*3*T*E*H*I`` (E/k = 16x for Qwen3-30B-A3B's 128/8); gmm moves fewer bytes by
      XLA's and the kernel's estimates at every shape measured (``benchmarks/
      bench_gmm_tiles.py``, v6e, one MoE layer per device, ragged -> gmm: Qwen3-30B-A3B tp 4
      decode 64 / 256 / prefill 8192 tokens 0.86 -> 0.38, 1.12 -> 0.57, 12.2 -> 8.5 GB;
      Qwen3-235B-A22B tp 4 x ep 4 0.48 -> 0.46, 1.00 -> 0.86, 22.7 -> 16.7 GB; table in
      ``docs/moe_backends.md``). Where the expert width per device is not a multiple of 128
      (30B at tp 4: 192) XLA relayouts the gate/up weights before every ``ragged_dot``; gmm
      reads them in place.
    - CPU: ``dense``. XLA:CPU has no grouped matmul: JAX lowers ``ragged_dot`` to a dense dot
      over a group-masked ``[E, T*k, H]`` copy of the rows, ``k`` times the dense backend's
      FLOPs (measured in ``docs/moe_backends.md``).
    - GPU: ``dense``. XLA:GPU's ``RaggedDotRewriter`` by default rewrites ``ragged_dot`` the
      same way (dense dot over an E-fold, group-masked LHS: k times the dense FLOPs and an
      ``[T*k, E, H]`` temporary). A grouped GEMM is used only behind opt-in flags (cuDNN
      ragged-dot fusion ``--xla_gpu_experimental_use_ragged_dot_fusion``, hipBLASLt grouped
      GEMM on MI300, or JAX's ``jax_ragged_dot_use_gpu_pallas_triton_lowering``); whoever
      sets one should also pass ``--moe-backend ragged``.
    - any other platform: ``dense``, the reference that runs everywhere.
    """
    if name == "auto":
        return _AUTO.get(platform.lower(), "dense")
    if name in MOE_BACKENDS:
        return name
    raise ValueError(
        f"unknown MoE backend {name!r}; valid choices: {', '.join(MOE_BACKEND_CHOICES)}"
    )


@dataclass(frozen=True)
class MoEBackend:
    """A resolved expert backend: its name ("dense", "ragged" or "gmm") and its per-device
    compute. Part of the compiled program (a static of the step), like the attention
    backend."""

    name: str
    compute: ExpertCompute

    def __call__(
        self, x: jax.Array, local_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array,
        w_up: jax.Array, w_down: jax.Array, out_dtype: jnp.dtype = jnp.float32,
        words: jax.Array | None = None,
    ) -> jax.Array:
        """The device's partial sums, rounded once to ``out_dtype`` (a caller that moves them
        in the activation dtype asks for it: gmm's combine kernel then writes them so
        itself, in one pass, instead of a float32 array XLA reads back to cast). ``words``:
        x as gmm's row DMAs read it (:meth:`gather_tokens`), used if gmm fetches its rows."""
        if isinstance(self.compute, GmmExperts):
            return self.compute(x, local_ids, topk_weights, w_gate, w_up, w_down, out_dtype,
                                words)
        return self.compute(x, local_ids, topk_weights, w_gate, w_up, w_down).astype(out_dtype)

    def gather_tokens(self, x: jax.Array,
                      axis: str | tuple[str, ...]) -> tuple[jax.Array, jax.Array | None]:
        """Inside ``shard_map``: every device's tokens of ``x`` [T_l, H], all-gathered over
        ``axis``, and for gmm the same rows packed for its row DMAs
        (``gmm_gate_up.fetch_source``), packed here on the device's own tokens before they
        are gathered (packing the gathered rows would read and write them all once more).
        Whichever of the two the backend does not read, XLA drops with its collective."""
        gathered = jax.lax.all_gather(x, axis, axis=0, tiled=True)
        if not (isinstance(self.compute, GmmExperts) and gmm_gate_up.packs(x.dtype, x.shape[1])):
            return gathered, None
        words = jax.lax.all_gather(gmm_gate_up.fetch_source(x), axis, axis=0, tiled=True)
        return gathered, words

    def with_activation(self, activation: ExpertActivation) -> MoEBackend:
        """The same backend computing ``activation`` between gate/up and down (a model's
        expert block asks for it while its step is traced; silu: the backend itself)."""
        if activation == SILU:
            return self
        if isinstance(self.compute, GmmExperts):
            return MoEBackend(self.name, replace(self.compute, activation=activation))
        return MoEBackend(self.name, functools.partial(self.compute, activation=activation))

    def sharded(self, shards: int) -> MoEBackend:
        """The backend on one of ``shards`` devices the experts are split over. ``gmm`` sizes
        its passes by the device's share of the assignments (``gmm.gmm_experts``, "Passes");
        ``dense`` and ``ragged`` compute every assignment slot whatever the split."""
        if isinstance(self.compute, GmmExperts) and shards != self.compute.shards:
            return MoEBackend(self.name, replace(self.compute, shards=shards))
        return self


def get_moe_backend(name: str, platform: str | None = None,
                    device_kind: str | None = None) -> MoEBackend:
    """The backend of a resolved name ("dense", "ragged" or "gmm") for programs compiled for
    ``platform`` (None: JAX's default backend) on chips of ``device_kind``. Only ``gmm``
    depends on them: its Pallas kernels run in interpret mode off TPU, and its combine
    kernel sizes its blocks to the chip's VMEM (``vmem_rows.vmem_limit``)."""
    if name == "gmm":
        return MoEBackend(name, GmmExperts(platform,
                                           vmem_limit=vmem_rows.vmem_limit(device_kind)))
    try:
        return MoEBackend(name, MOE_BACKENDS[name])
    except KeyError:
        hint = " (resolve 'auto' with resolve_moe_backend first)" if name == "auto" else ""
        raise ValueError(
            f"unknown MoE backend {name!r}{hint}; valid: {', '.join(MOE_BACKENDS)}"
        ) from None


def create_moe_backend(name: str, platform: str, batch_invariant: bool = False,
                       device_kind: str | None = None) -> MoEBackend:
    """The backend ``--moe-backend name`` runs on ``platform`` (chips of ``device_kind``:
    :func:`get_moe_backend`). ``batch_invariant``
    (``--enable-deterministic-inference``): the dense reference, whose rows never depend on
    the batch (ragged and gmm groups do; ``ServerArgs`` refuses an explicit ``ragged``
    there)."""
    resolved = "dense" if batch_invariant else resolve_moe_backend(name, platform)
    return get_moe_backend(resolved, platform, device_kind)
