"""The routed-experts seed example, as a user would write it (no __main__ guard needed).

Run: python docs/examples/routed_experts_engine.py
"""

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info

model_path = None  # the bundled tiny Qwen3-MoE; point at any local Qwen3-MoE checkpoint
config = ModelConfig.from_hf(model_path)
num_layers, num_experts_per_tok = config.num_hidden_layers, config.num_experts_per_tok

engine = Engine(model_path=model_path, enable_return_routed_experts=True,
                precompile_bs_paddings=[1], log_level="warning")
response = engine.generate(prompt="Explain how mixture of experts models work",
                           return_routed_experts=True, max_new_tokens=100)
expert_ids = extract_routed_experts_from_meta_info(response)
print(f"Expert IDs shape (flattened): {expert_ids.shape}")
expert_ids = expert_ids.reshape(-1, num_layers, num_experts_per_tok)
print(f"Expert IDs shape (reshaped): {expert_ids.shape}")
print(f"Token 0, layer 0 experts: {expert_ids[0, 0, :]}")
print(f"Token 0, layer {num_layers - 1} experts: {expert_ids[0, num_layers - 1, :]}")
engine.shutdown()
