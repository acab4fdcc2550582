"""Logprob error against the float64 reference (M10): 12 prompts of 5-200 random tokens, greedy
and sampled (T 0.7, 1.0), 16 new tokens each, input logprobs from position 0 and the top 5.
Prints the worst absolute error per kind, the share within 1e-5 and the worst relative error.

    python benchmarks/bench_logprob_error.py
"""
import numpy as np

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import resolve_model_path
from sgl_jax.testing import engine_args
from sgl_jax.tools.reference_forward import ReferenceModel

ref = ReferenceModel(resolve_model_path(None))
eng = Engine(**engine_args())
rng = np.random.default_rng(0)
worst = {"output": 0.0, "input": 0.0, "top": 0.0}
n = 0
errs = []
for i in range(12):
    prompt = rng.integers(0, 512, int(rng.integers(5, 200))).tolist()
    temp = [0.0, 0.7, 1.0][i % 3]
    out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 16, "temperature": temp, "seed": i},
                       return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
    m, o = out["meta_info"], out["output_ids"]
    logits = ref.forward(prompt + o).logits / (temp if temp > 0 else 1.0)
    lp = logits - logits.max(1, keepdims=True); lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
    L = len(prompt)
    for j, (v, t, _) in enumerate(m["output_token_logprobs"]):
        worst["output"] = max(worst["output"], abs(v - lp[L - 1 + j, t])); n += 1; errs.append((abs(v - lp[L - 1 + j, t]), abs(lp[L - 1 + j, t])))
        for (tv, tt, _) in m["output_top_logprobs"][j]:
            worst["top"] = max(worst["top"], abs(tv - lp[L - 1 + j, tt]))
    for p, (v, t, _) in enumerate(m["input_token_logprobs"][1:], start=1):
        worst["input"] = max(worst["input"], abs(v - lp[p - 1, t])); n += 1; errs.append((abs(v - lp[p - 1, t]), abs(lp[p - 1, t])))
print(f"{n} positions; max abs error vs float64 reference: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
eng.shutdown()
e = np.array(errs)
print(f"within 1e-5: {np.mean(e[:,0] < 1e-5):.4f}; max relative err {np.max(e[:,0] / np.maximum(e[:,1], 1)):.2e}; p99 abs {np.percentile(e[:,0], 99):.2e}")
big = e[e[:,0] >= 1e-5]
print("magnitudes of |logprob| where err>=1e-5:", np.round(big[:, 1], 2)[:10])
