"""The engine as tunix's rollout: ``ClusterConfig(rollout_engine=SglJaxRollout)``.

tunix (``google-tunix==0.1.7``, the ``tunix`` extra) builds the rollout itself, with
``rollout_actor=``, ``tokenizer=``, ``mesh=`` and ``rollout_config=`` keywords. Engine settings
come from ``rollout_config.rollout_sglang_jax_kwargs`` and from keywords bound with
``functools.partial(SglJaxRollout, **engine_kwargs)`` (the partial's win); the model directory
is ``model_path`` there, else ``rollout_config.rollout_sglang_jax_model_version``, else the
bundled model. Nothing here picks the engine's mode or placement: ``enable_single_process=
True`` among the engine settings (where the Engine offers it) runs the engine in the trainer's
process, placed by the ``mesh`` / ``device_indexes`` given there (tunix's rollout mesh has the
trainer's axis names, not the engine's, so it is not passed on).

What tunix gets, per ``BaseRollout``:

- ``generate``: our tokenization of each prompt (also returned, left-padded with ``pad_id``
  to ``max_prompt_length``, or to the next power of two above the longest prompt, as tunix's
  samplers do), the sampled tokens (a stop token included, as vLLM's rollout keeps it), their
  text and the engine's per-token logprobs at the rollout temperature (what tunix recomputes:
  ``log_softmax(logits / T)``).
- ``get_per_token_logps``: the engine's logprobs of given completions (``Engine.score``: a
  shared prompt computed once; an aborted score raises), at the temperature of
  the rollout config the rollout was built with; the padding (a prompt's leading pads, a
  completion's trailing ones) is left out of the sequence, as tunix's masks leave it out, and
  its positions hold 0.
- ``update_params``: tunix's Qwen3(-MoE) parameters, renamed to Hugging Face names on device
  (``tunix_qwen3.hf_arrays_from_tunix_qwen3``), into ``Engine.update_weights_from_arrays``.

Routed experts (for routing replay), two ways:

- each ``generate`` returns them aligned with the batch tunix builds from its output
  (``routing_replay.align_routed_experts``): int32 ``[B, prompt_width + max_tokens_to_generate,
  num_hidden_layers, k]``, ``prompt_width`` the width of ``left_padded_prompt_tokens``, -1 where
  no row applies (padding, the last generated token). In ``RolloutOutput.routed_experts`` when
  the installed tunix has that field, else as an attribute of the same name of the returned
  object (tunix 0.1.7 has no such field);
- tunix 0.1.7's ``RLCluster.generate`` rebuilds ``RolloutOutput`` from its five fields, which
  drops them, so the rollout also keeps them until taken: ``take_routed_experts()`` returns one
  array per sample ``[prompt + completion - 1, num_hidden_layers, k]`` (docs/routed_experts.md)
  and ``take_aligned_routed_experts()`` the aligned arrays of those calls concatenated, both in
  the order of every ``generate`` since the last take (either take forgets both); called right
  after ``rl_cluster.generate(...)`` they line up with that call's ``tokens``
  (``tunix_grpo.ReplayGRPOLearner`` does this).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

try:
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "sgl_jax.integrations.tunix.SglJaxRollout needs tunix: pip install 'sgl_jax[tunix]' "
        "(google-tunix==0.1.7)") from e

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sgl_jax.integrations.routing_replay import align_routed_experts
from sgl_jax.integrations.tunix_qwen3 import hf_arrays_from_tunix_qwen3
from sgl_jax.srt.configs.model_config import resolve_model_path
from sgl_jax.srt.entrypoints.engine import Engine
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.srt.tokenizer import Tokenizer


class SglJaxRollout(base_rollout.BaseRollout):
    """tunix's rollout worker backed by an sgl_jax ``Engine`` (see the module's docstring)."""

    def __init__(
        self,
        rollout_actor: nnx.Module | None = None,
        tokenizer: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        rollout_config: base_rollout.RolloutConfig | None = None,
        **engine_kwargs: Any,
    ) -> None:
        # Prompts are tokenized with the served model's tokenizer; the engine is placed by its
        # own settings (the module's docstring).
        del tokenizer, mesh
        config = rollout_config or base_rollout.RolloutConfig()
        kwargs = {**config.rollout_sglang_jax_kwargs, **engine_kwargs}
        kwargs.setdefault("model_path", config.rollout_sglang_jax_model_version or None)
        # Routing replay is what a MoE rollout is for; a caller can still turn it off.
        kwargs.setdefault("enable_return_routed_experts", True)
        self._temperature = config.temperature  # the TRAIN config: the loss's temperature
        self._engine = Engine(**kwargs)
        args = self._engine.server_args
        self._in_process = bool(getattr(args, "enable_single_process", False))
        self._with_experts = bool(args.enable_return_routed_experts)
        self._tokenizer = Tokenizer.from_pretrained(
            resolve_model_path(args.tokenizer_path or args.model_path))
        # What each generate since the last take returned: per-sample rows, aligned batch.
        self._routed_experts: list[np.ndarray] = []
        self._aligned_routed_experts: list[np.ndarray] = []
        self._syncs = 0
        if rollout_actor is not None:  # serve exactly the trainer's weights from the start
            self.update_params(nnx.state(rollout_actor, nnx.Param))

    # -- BaseRollout ---------------------------------------------------------------------------
    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs: Any) -> base_rollout.RolloutOutput:
        if kwargs:
            raise TypeError(f"SglJaxRollout.generate got unknown keyword(s) {sorted(kwargs)}")
        if not prompts:
            raise ValueError("no prompts to generate from")
        ids = [self._tokenizer.encode(p) for p in prompts]
        outs = self._engine.generate(
            input_ids=ids, sampling_params=_sampling_params(rollout_config, len(ids)),
            return_logprob=True, return_routed_experts=self._with_experts or None,
            # The rows as numpy arrays: no base64 round trip inside the process.
            **({"routed_experts_format": "numpy"} if self._with_experts else {}))
        tokens = [np.asarray(o["output_ids"], np.int32) for o in outs]
        left_padded = self._left_padded(ids, rollout_config.max_prompt_length)
        fields: dict[str, Any] = {}
        if self._with_experts:
            rows = [extract_routed_experts_from_meta_info(o) for o in outs]
            aligned = align_routed_experts(rows, [len(t) for t in tokens],
                                           left_padded.shape[1],
                                           rollout_config.max_tokens_to_generate)
            self._routed_experts.extend(rows)
            self._aligned_routed_experts.append(aligned)
            fields["routed_experts"] = aligned
        out = base_rollout.RolloutOutput(
            text=[o["text"] for o in outs],
            logits=None,
            tokens=tokens,
            left_padded_prompt_tokens=left_padded,
            logprobs=[np.asarray([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                                 np.float32) for o in outs],
            **{k: v for k, v in fields.items() if k in _OUTPUT_FIELDS},
        )
        for name, value in fields.items():
            if name not in _OUTPUT_FIELDS:  # tunix without the field: an attribute instead
                setattr(out, name, value)
        return out

    def get_per_token_logps(self, prompt_tokens: jax.Array,
                            completion_tokens: jax.Array) -> jax.Array:
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        if prompts.ndim != 2 or completions.ndim != 2 or len(prompts) != len(completions):
            raise ValueError(f"prompt_tokens {prompts.shape} and completion_tokens "
                             f"{completions.shape} must be [batch, length] of one batch")
        pad = self.pad_id()
        # Only the padding goes: prompts are left-padded, completions right-padded, and a pad
        # id inside either is a token of the sequence.
        kept = np.arange(completions.shape[1])[None, :] < _unpadded_length(completions, pad)
        rows = [i for i in range(len(completions)) if kept[i].any()]
        seqs = [(_strip_left_padding(prompts[i], pad), completions[i][kept[i]].tolist())
                for i in rows]
        if any(not prompt for prompt, _ in seqs):
            raise ValueError("a prompt holds only pad tokens: nothing to condition on")
        out = np.zeros(completions.shape, np.float32)
        if rows:
            scored = self._engine.score([p for p, _ in seqs], [c for _, c in seqs],
                                        temperature=self._temperature)
            for i, record in zip(rows, scored, strict=True):
                out[i, kept[i]] = record["logprobs"]
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        if filter_types and any(issubclass(t, nnx.LoRAParam) for t in filter_types):
            raise ValueError("SglJaxRollout takes full weights, not LoRA adapters: merge them "
                             "into the base weights before syncing")
        if filter_types and isinstance(params, nnx.State):
            params = params.filter(*filter_types)
        arrays = hf_arrays_from_tunix_qwen3(params)
        self._syncs += 1
        # A child-process engine copies the arrays to the host (tunix forbids transfers during
        # its sync on CPU); an in-process one takes them on device, under tunix's guard.
        with contextlib.nullcontext() if self._in_process else _host_copies_allowed():
            self._engine.update_weights_from_arrays(
                arrays, weight_version=f"tunix-sync-{self._syncs}")

    def pad_id(self) -> int:
        pad = self._tokenizer.pad_token_id
        return self.eos_id() if pad is None else pad

    def eos_id(self) -> int:
        if self._tokenizer.eos_token_id is None:
            raise ValueError("the served model's tokenizer has no end-of-sequence token")
        return self._tokenizer.eos_token_id

    def model(self) -> None:
        """None: the served model lives in the engine (not an ``nnx.Module`` tunix could
        share or offload; keep ``ClusterConfig.offload_to_cpu`` False). tunix then sees that
        the actor and the rollout do not share weights and syncs after every step."""
        return None

    def model_state(self) -> None:
        return None

    # -- beyond BaseRollout --------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self._engine

    def take_routed_experts(self) -> list[np.ndarray]:
        """The routed experts of every sample generated since the last take, in order, one
        ``[prompt + completion - 1, L, k]`` array each (empty when the engine runs without
        ``enable_return_routed_experts``); forgets them (and their aligned form)."""
        taken, self._routed_experts, self._aligned_routed_experts = (
            self._routed_experts, [], [])
        return taken

    def take_aligned_routed_experts(self) -> np.ndarray | None:
        """The aligned routed experts every ``generate`` since the last take returned,
        concatenated over the batch: int32 ``[B, prompt_width + max_tokens_to_generate, L,
        k]`` (None when there are none); forgets them (and the per-sample rows). ValueError if
        the calls' widths differ (they cannot form one batch)."""
        aligned, self._aligned_routed_experts, self._routed_experts = (
            self._aligned_routed_experts, [], [])
        if not aligned:
            return None
        if len({a.shape[1:] for a in aligned}) != 1:
            raise ValueError("the generate calls since the last take have different prompt or "
                             f"completion widths: {[a.shape for a in aligned]}")
        return np.concatenate(aligned, axis=0)

    def shutdown(self) -> None:
        self._engine.shutdown()

    def _left_padded(self, ids: list[list[int]], max_prompt_length: int) -> np.ndarray:
        longest = max(len(i) for i in ids)
        width = max_prompt_length if longest <= max_prompt_length else 1 << (longest - 1).bit_length()
        out = np.full((len(ids), width), self.pad_id(), np.int32)
        for row, seq in zip(out, ids, strict=True):
            row[width - len(seq):] = seq
        return out


# RolloutOutput's fields in the installed tunix (0.1.7 has no ``routed_experts``).
_OUTPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(base_rollout.RolloutOutput))


def _unpadded_length(right_padded: np.ndarray, pad: int) -> np.ndarray:
    """``[batch, 1]``: each row's length without its trailing run of ``pad``."""
    real = right_padded != pad
    last = right_padded.shape[1] - np.argmax(real[:, ::-1], axis=1)
    return np.where(real.any(axis=1), last, 0)[:, None]


def _strip_left_padding(row: np.ndarray, pad: int) -> list[int]:
    real = np.flatnonzero(row != pad)
    return row[real[0]:].tolist() if real.size else []


def _sampling_params(config: base_rollout.RolloutConfig, n: int) -> list[dict[str, Any]]:
    """One dict per prompt; with a seed, prompt i gets seed + i so that the repeated prompts
    of a GRPO group still draw different samples."""
    params: dict[str, Any] = {
        "max_new_tokens": config.max_tokens_to_generate,
        "temperature": config.temperature,
        "top_p": 1.0 if config.top_p is None else config.top_p,
        "top_k": -1 if config.top_k in (None, 0) else config.top_k,
    }
    if config.eos_tokens:
        params["stop_token_ids"] = list(config.eos_tokens)
    if config.seed is None:
        return [dict(params) for _ in range(n)]
    base = _seed_int(config.seed)
    return [{**params, "seed": base + i} for i in range(n)]


def _seed_int(seed: Any) -> int:
    """An int in [0, 2**62) from tunix's seed: an int, an integer array or a JAX PRNG key
    (the engine's seeds are below 2**63, so seed + i stays valid for any batch)."""
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    words = np.asarray(seed).astype(np.uint64).ravel()
    value = 0
    for w in words:
        value = (value * 0x9E3779B1 + int(w)) % (2**62)
    return value


@contextlib.contextmanager
def _host_copies_allowed() -> Iterator[None]:
    with jax.transfer_guard_device_to_host("allow"), jax.transfer_guard_host_to_device("allow"):
        yield
