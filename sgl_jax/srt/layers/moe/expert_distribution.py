"""Expert distribution recorder: which logical experts the routers pick, across traffic.

``--expert-distribution-recorder-mode`` chooses what is kept (docs/expert_load.md):

- ``stat``: counts ``[moe_layers, num_experts]`` accumulated ON THE DEVICE inside the jitted
  step (a small int32 buffer donated into the step and replaced by its output, like the KV
  cache), plus the number of tokens. Nothing is copied to the host per step: only when the
  counts are read (stop, dump, ``/expert_load``).
- ``per_pass``: the step outputs its own counts ``[moe_layers, num_experts]``; while recording,
  each is copied to the host with the pass's forward mode and token count. The last
  ``--expert-distribution-recorder-buffer-size`` passes are kept (oldest dropped).
- ``per_token``: the step outputs every token's top-k ids ``[tokens, num_hidden_layers, k]``
  (-1 for layers without a router); while recording they are copied to the host with each
  token's request id and position. The last buffer-size tokens are kept (oldest dropped).

Only real tokens count: padding tokens of a bucket are masked with the batch's real-token
mask. The buffers' shapes never depend on whether recording is on, so starting and stopping
never recompile the step: ``stat`` restarts from a fresh zero buffer of the same shape and
sharding; ``per_pass`` / ``per_token`` only decide on the host whether a launched step's
output is copied. A step is recorded when it is LAUNCHED between start and stop.

The model knows nothing of this: the recorder is a consumer of the step's routing output
(``layers/moe/routing.py``), as the routed-experts capturer is; with a mode set the runner
asks the step to output the layers' top-k ids (``routing_spec``) and hands them to
``record_step`` inside the step.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt import private_files
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.layers.moe.routing import RoutingSpec

MODES = ("stat", "per_pass", "per_token")
DEFAULT_BUFFER_SIZE = 1000
# ``forward_mode`` codes in the per_pass dump.
FORWARD_MODE_CODES = {ForwardMode.EXTEND: 0, ForwardMode.DECODE: 1,
                      ForwardMode.TARGET_VERIFY: 2}


class ExpertDistributionRecorder:
    """One runner's recorder: the traced hooks and the host-side window of records."""

    def __init__(self, mode: str, model_config: ModelConfig, buffer_size: int = DEFAULT_BUFFER_SIZE,
                 dump_dir: str | None = None, sharding: Any = None, abstract: bool = False,
                 one_hot_counts: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"expert distribution recorder mode {mode!r}; use one of {MODES}")
        self.mode = mode
        self.config = model_config
        self.moe_layer_ids = list(model_config.moe_layer_ids)
        self.num_layers = model_config.num_hidden_layers
        self.num_experts = model_config.num_experts
        self.top_k = model_config.num_experts_per_tok
        self.buffer_size = int(buffer_size)
        self.dump_dir = dump_dir  # None: private_files.dump_dir's private default
        self.sharding = sharding
        self.abstract = abstract
        # Compiled for TPU: the counts by one-hot compares, not a scatter-add (_pass_counts).
        self.one_hot_counts = one_hot_counts
        self.recording = False
        self.started = False  # a window was started at least once (something to dump)
        self._zeros = None
        self.state: Any = self.initial_state() if mode == "stat" else None
        self._stat: tuple[np.ndarray, int] | None = None  # stat counts frozen at stop
        # per_pass / per_token: launched steps' outputs (copies started), then host records.
        self._inflight: list[tuple[Any, dict[str, Any]]] = []
        self._passes: collections.deque = collections.deque(maxlen=self.buffer_size)
        self._tokens: collections.deque = collections.deque()
        self._num_tokens_kept = 0
        self.dropped = 0  # passes / tokens dropped from the buffer's front

    # -- device state -----------------------------------------------------------------------
    def initial_state(self) -> Any:
        """stat: (counts [moe_layers, E] int32, tokens int32), zeros, replicated."""
        shapes = ((len(self.moe_layer_ids), self.num_experts), ())
        if self.abstract:
            return tuple(jax.ShapeDtypeStruct(s, jnp.int32, sharding=self.sharding)
                         for s in shapes)
        if self._zeros is None:
            self._zeros = jax.jit(
                lambda: tuple(jnp.zeros(s, jnp.int32) for s in shapes),
                out_shardings=(self.sharding, self.sharding) if self.sharding else None,
            )
        return self._zeros()

    # -- inside the traced step -------------------------------------------------------------
    routing_spec = RoutingSpec(ids=True)  # what the step must output for the recorder

    def record_step(self, state: Any, ids: jax.Array, real: jax.Array) -> tuple[Any, Any]:
        """Traced (pure): ``ids`` the step's routing ``[T, num_hidden_layers, k]`` int32 (-1
        for layers without a router), ``real`` [T] bool marks the batch's real tokens. Returns
        (the new stat state or None, this pass's output: counts for per_pass, ids for
        per_token, or None)."""
        if self.mode == "per_token":
            return None, ids
        counts = self._pass_counts(ids, real)
        if self.mode == "per_pass":
            return None, counts
        total, tokens = state
        new = (total + counts, tokens + jnp.sum(real, dtype=jnp.int32))
        if self.sharding is not None:
            new = tuple(jax.lax.with_sharding_constraint(x, self.sharding) for x in new)
        return new, None

    def _pass_counts(self, ids: jax.Array, real: jax.Array) -> jax.Array:
        """[moe_layers, E] int32: how many real tokens picked each expert in each layer.

        Compiled for TPU (``one_hot_counts``) by summing the one-hot compares of every
        assignment (XLA fuses them into one reduction reading the ids once): XLA:TPU counts
        each element of the scatter-add at a whole tile, 567 MB a MoE layer at 8,192 tokens
        (compiled alone for v5p; the compares 0.3 MB). On CPU the scatter is the cheaper
        (2.8 against 220 ms at 2,048 tokens of 48 layers)."""
        num_moe = len(self.moe_layer_ids)
        layers = self.moe_layer_ids
        if layers == list(range(layers[0], layers[-1] + 1)):  # contiguous (dense ones first)
            moe_ids = ids[:, layers[0] : layers[-1] + 1]  # [T, Lm, k]
        else:
            moe_ids = jnp.take(ids, np.asarray(layers), axis=1)
        if self.one_hot_counts:
            hit = moe_ids[..., None] == jnp.arange(self.num_experts, dtype=moe_ids.dtype)
            return jnp.sum(hit & real[:, None, None, None], axis=(0, 2), dtype=jnp.int32)
        counts = jnp.zeros((num_moe, self.num_experts), jnp.int32)
        weight = jnp.broadcast_to(real.astype(jnp.int32)[:, None, None], moe_ids.shape)
        rows = jnp.broadcast_to(jnp.arange(num_moe, dtype=jnp.int32)[None, :, None], moe_ids.shape)
        return counts.at[rows.reshape(-1), moe_ids.reshape(-1)].add(weight.reshape(-1))

    # -- on the host, per launched step -----------------------------------------------------
    def on_launch(self, output: Any, mode: ForwardMode, num_tokens: int,
                  rids: list[str] | None, prefix_lens: np.ndarray,
                  extend_lens: np.ndarray) -> None:
        """After dispatch: keep this step's output if recording (its host copy started)."""
        if not self.recording or output is None or self.mode == "stat":
            return
        output.copy_to_host_async()
        info: dict[str, Any] = {"forward_mode": FORWARD_MODE_CODES[mode], "num_tokens": num_tokens}
        if self.mode == "per_token":
            info["rid"] = np.repeat(np.asarray([_caller_rid(r) for r in rids or
                                                [""] * len(extend_lens)], dtype=str), extend_lens)
            info["position"] = np.concatenate(
                [np.arange(p, p + n, dtype=np.int64) for p, n in zip(prefix_lens, extend_lens,
                                                                    strict=True)]
                or [np.zeros(0, np.int64)])
        self._inflight.append((output, info))

    def collect(self, through: Any = None) -> None:
        """Moves launched steps' outputs to the host records (waits for their copies): all of
        them, or (``through``: a step's ``expert_pass``) those launched up to that step only,
        so that processing step N never waits for step N+1, already dispatched (overlap)."""
        if through is None:
            inflight, self._inflight = self._inflight, []
        else:
            ends = [i for i, (output, _) in enumerate(self._inflight) if output is through]
            if not ends:  # that step was not recorded
                return
            inflight, self._inflight = self._inflight[: ends[0] + 1], self._inflight[ends[0] + 1:]
        for output, info in inflight:
            host = np.asarray(output)
            if self.mode == "per_pass":
                if len(self._passes) == self.buffer_size:
                    self.dropped += 1
                self._passes.append((host.astype(np.int64), info["forward_mode"],
                                     info["num_tokens"]))
            else:
                n = info["num_tokens"]
                self._tokens.append((host[:n].copy(), info["rid"], info["position"]))
                self._num_tokens_kept += n
                self._trim_tokens()

    def _trim_tokens(self) -> None:
        while self._num_tokens_kept > self.buffer_size:
            ids, rid, pos = self._tokens[0]
            extra = self._num_tokens_kept - self.buffer_size
            if extra >= len(ids):
                self._tokens.popleft()
                cut = len(ids)
            else:
                self._tokens[0] = (ids[extra:], rid[extra:], pos[extra:])
                cut = extra
            self._num_tokens_kept -= cut
            self.dropped += cut

    # -- control ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.recording:
            raise ValueError("the expert distribution recorder is already recording; "
                             "stop_expert_distribution_record first")
        self.collect()
        if self.mode == "stat":
            self.state = self.initial_state()  # same shape and sharding: no recompilation
            self._stat = None
        self._passes.clear()
        self._tokens.clear()
        self._num_tokens_kept = 0
        self.dropped = 0
        self.recording = self.started = True

    def stop(self) -> None:
        if not self.recording:
            raise ValueError("the expert distribution recorder is not recording; "
                             "start_expert_distribution_record first")
        if self.mode == "stat":
            self._stat = self._read_state()
        self.collect()
        self.recording = False

    def _read_state(self) -> tuple[np.ndarray, int]:
        counts, tokens = self.state
        # Copies: on the CPU a device buffer may back the array, and the next step donates it.
        return np.array(counts, dtype=np.int64, copy=True), int(np.asarray(tokens))

    def stat_counts(self) -> tuple[np.ndarray, int]:
        """stat: (counts [moe_layers, E] int64, tokens) of the current window (live while
        recording, as at stop after it)."""
        if self.mode != "stat":
            raise ValueError(f"expert load counts need --expert-distribution-recorder-mode stat "
                             f"(this server records {self.mode!r})")
        if not self.started:
            raise ValueError("nothing recorded yet: start_expert_distribution_record first")
        return self._read_state() if self.recording else self._stat

    def load(self) -> dict[str, Any]:
        """What ``GET /expert_load`` serves (JSON-able)."""
        counts, tokens = self.stat_counts()
        return {"counts": counts.tolist(), "num_tokens": tokens,
                "moe_layers": self.moe_layer_ids, "num_experts": self.num_experts,
                "num_experts_per_tok": self.top_k, "num_hidden_layers": self.num_layers,
                "recording": self.recording,
                "architecture": self.config.architecture}

    def arrays(self) -> dict[str, np.ndarray]:
        """The dump's arrays (docs/expert_load.md: layouts)."""
        if not self.started:
            raise ValueError("nothing recorded yet: start_expert_distribution_record first")
        self.collect()
        out: dict[str, np.ndarray] = {
            "mode": np.array(self.mode),
            "moe_layers": np.array(self.moe_layer_ids, np.int64),
            "num_hidden_layers": np.array(self.num_layers, np.int64),
            "num_experts": np.array(self.num_experts, np.int64),
            "num_experts_per_tok": np.array(self.top_k, np.int64),
            "architecture": np.array(self.config.architecture),
            "recording": np.array(self.recording),
            "buffer_size": np.array(self.buffer_size, np.int64),
            "dropped": np.array(self.dropped, np.int64),
        }
        if self.mode == "stat":
            counts, tokens = self.stat_counts()
            out["counts"] = counts
            out["num_tokens"] = np.array(tokens, np.int64)
        elif self.mode == "per_pass":
            shape = (len(self.moe_layer_ids), self.num_experts)
            out["counts"] = np.stack([p[0] for p in self._passes]) if self._passes else \
                np.zeros((0, *shape), np.int64)
            out["forward_mode"] = np.array([p[1] for p in self._passes], np.int8)
            out["num_tokens"] = np.array([p[2] for p in self._passes], np.int64)
        else:
            parts = list(self._tokens)
            out["topk_ids"] = np.concatenate([p[0] for p in parts]) if parts else \
                np.zeros((0, self.num_layers, self.top_k), np.int32)
            out["rid"] = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, str)
            out["position"] = np.concatenate([p[2] for p in parts]) if parts else \
                np.zeros(0, np.int64)
        return out

    def dump(self, dump_dir: str | None = None) -> str:
        """Writes the window so far as ``.npz``; returns its path. Recording goes on if it was
        on (a dump does not stop or reset the window)."""
        arrays = self.arrays()
        # Per-token dumps hold request ids and their routing: files are 0600 wherever they go,
        # in a 0700 directory of the user's cache unless a directory is configured.
        folder = private_files.dump_dir(dump_dir or self.dump_dir, "expert_distribution")
        path = os.path.join(folder, f"expert_distribution_{self.mode}_{time.time_ns()}.npz")
        with private_files.create_private(path) as f:
            np.savez(f, **arrays)
        return path


def _caller_rid(key: str) -> str:
    """The caller's request id from the scheduler's per-submission key ``rid#n``."""
    return key.rsplit("#", 1)[0] if "#" in key else key


def create_recorder(server_args: Any, model_config: ModelConfig, sharding: Any = None,
                    abstract: bool = False, one_hot_counts: bool = False
                    ) -> ExpertDistributionRecorder | None:
    """The recorder of ``--expert-distribution-recorder-mode`` (None: off); ``one_hot_counts``
    for steps compiled for TPU (``ModelBackends.one_hot_lookups``)."""
    mode = server_args.expert_distribution_recorder_mode
    if mode is None:
        return None
    return ExpertDistributionRecorder(
        mode, model_config, server_args.expert_distribution_recorder_buffer_size,
        server_args.expert_distribution_recorder_dir, sharding, abstract,
        one_hot_counts=one_hot_counts)
