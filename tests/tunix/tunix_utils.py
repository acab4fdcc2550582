"""What the tunix tests share: the mesh, the rollout config and tunix's per-token logprobs
(the reference the engine is held to). Imported after ``pytest.importorskip("tunix")``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.qwen3 import params as qwen3_params
from tunix.rl import common
from tunix.rl.rollout import base_rollout

from sgl_jax.integrations.tunix_qwen3 import tunix_qwen3_config
from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH
from sgl_jax.testing import engine_args

MAX_NEW, TEMPERATURE = 10, 0.9
# Float32 engine against tunix's float32 model: another program, other rounding (measured
# up to 3e-6 on the bundled model); a different expert choice at a router near-tie would be
# far larger.
TOL = 5e-5


def make_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def load_actor() -> nnx.Module:
    """tunix's Qwen3-MoE with the bundled checkpoint's weights (tunix's own loader)."""
    return qwen3_params.create_model_from_safe_tensors(
        BUNDLED_MODEL_PATH, tunix_qwen3_config(), make_mesh())


def rollout_config(**overrides) -> base_rollout.RolloutConfig:
    return base_rollout.RolloutConfig(**{
        "max_tokens_to_generate": MAX_NEW, "temperature": TEMPERATURE, "max_prompt_length": 16,
        "rollout_sglang_jax_kwargs": engine_args(model_path=None), **overrides})


def tunix_logps(model, prompts: np.ndarray, completions: np.ndarray, pad: int, eos: int):
    graphdef, state = nnx.split(model)
    return np.asarray(common.compute_per_token_logps(
        graphdef, state, jnp.asarray(prompts), jnp.asarray(completions), pad, eos,
        temperature=TEMPERATURE))


def right_padded(rows: list[np.ndarray], width: int, value) -> np.ndarray:
    return np.array([np.pad(r, (0, width - len(r)), constant_values=value) for r in rows])
