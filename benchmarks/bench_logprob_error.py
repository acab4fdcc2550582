"""Logprob error against the float64 reference (M10): 12 prompts of 5-200 random tokens, greedy
and sampled (T 0.7, 1.0), 16 new tokens each, input logprobs from position 0 and the top 5.
Prints the worst absolute error per kind, the share within 1e-5 and the worst error relative to
``max(1, |logprob|)``.

    python benchmarks/bench_logprob_error.py
"""

from __future__ import annotations

import numpy as np

from sgl_jax import Engine
from sgl_jax.testing import TEST_MODEL_PATH, engine_args
from sgl_jax.tools.reference_forward import ReferenceModel


def reference_logprobs(ref: ReferenceModel, ids: list[int], temperature: float) -> np.ndarray:
    logits = ref.forward(ids).logits / (temperature if temperature > 0 else 1.0)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def main() -> None:
    ref = ReferenceModel(TEST_MODEL_PATH)
    engine = Engine(**engine_args())
    rng = np.random.default_rng(0)
    worst = {"output": 0.0, "input": 0.0, "top": 0.0}
    errors: list[tuple[float, float]] = []  # (abs error, |reference logprob|)

    def check(kind: str, value: float, want: float) -> None:
        worst[kind] = max(worst[kind], abs(value - want))
        if kind != "top":
            errors.append((abs(value - want), abs(want)))

    for i in range(12):
        prompt = rng.integers(0, 512, int(rng.integers(5, 200))).tolist()
        temperature = [0.0, 0.7, 1.0][i % 3]
        out = engine.generate(
            input_ids=prompt, return_logprob=True, logprob_start_len=0, top_logprobs_num=5,
            sampling_params={"max_new_tokens": 16, "temperature": temperature, "seed": i})
        meta, n = out["meta_info"], len(prompt)
        lp = reference_logprobs(ref, prompt + out["output_ids"], temperature)
        for j, (value, token, _) in enumerate(meta["output_token_logprobs"]):
            check("output", value, lp[n - 1 + j, token])
            for top_value, top_token, _ in meta["output_top_logprobs"][j]:
                check("top", top_value, lp[n - 1 + j, top_token])
        for p, (value, token, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
            check("input", value, lp[p - 1, token])
    engine.shutdown()
    e = np.array(errors)
    print(f"{len(e)} positions; worst abs error: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    print(f"within 1e-5: {np.mean(e[:, 0] < 1e-5):.4f}; worst relative to max(1, |lp|): "
          f"{np.max(e[:, 0] / np.maximum(e[:, 1], 1)):.2e}")


if __name__ == "__main__":
    main()
