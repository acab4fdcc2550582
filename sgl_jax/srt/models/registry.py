"""Maps a Hugging Face architecture name to our model class."""

from __future__ import annotations

from flax import nnx

from sgl_jax.srt.configs.model_config import CONFIG_ONLY_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from sgl_jax.srt.models.deepseek_v3 import DeepseekV3ForCausalLM
from sgl_jax.srt.models.glm4_moe import Glm4MoeForCausalLM
from sgl_jax.srt.models.gpt_oss import GptOssForCausalLM
from sgl_jax.srt.models.minimax_m2 import MiniMaxM2ForCausalLM
from sgl_jax.srt.models.mixtral import MixtralForCausalLM
from sgl_jax.srt.models.qwen2_moe import Qwen2MoeForCausalLM
from sgl_jax.srt.models.qwen3_5_moe import (
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from sgl_jax.srt.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[nnx.Module]] = {
    cls.__name__: cls
    for cls in (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM,
                DeepseekV3ForCausalLM, Glm4MoeForCausalLM, MiniMaxM2ForCausalLM,
                GptOssForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration)
}
assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type[nnx.Module]:
    if architecture in CONFIG_ONLY_ARCHITECTURES:
        raise ValueError(f"{architecture} is read by ModelConfig but not served yet")
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(_MODELS)}"
        ) from None
