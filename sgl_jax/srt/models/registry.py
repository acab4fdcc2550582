"""Maps a Hugging Face architecture name to our model class."""

from __future__ import annotations

from flax import nnx

from sgl_jax.srt.configs.model_config import SUPPORTED_ARCHITECTURES
from sgl_jax.srt.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[nnx.Module]] = {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}
assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type[nnx.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(_MODELS)}"
        ) from None
