"""Short extends over a long cached context (native attention's query-block groups).

An Engine with 64 request slots caches a 4,000-token prompt, then times one-token extends over
it (median of 6) and a group of 8 copies of it with 4 new tokens each (the ``n > 1`` path: one
shared prefill, then one-token extends).

    python benchmarks/bench_short_extend.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from sgl_jax import Engine


def main() -> None:
    engine = Engine(precompile_bs_paddings=[1, 2, 4, 8, 16, 32, 64],
                    precompile_token_paddings=[64, 256, 1024], chunked_prefill_size=1024,
                    log_level="warning")
    prompt = np.random.default_rng(0).integers(0, 512, 4000).tolist()
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})  # cache it
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=[prompt] * 8, sampling_params={"max_new_tokens": 4})
    group = time.perf_counter() - t0
    engine.shutdown()
    print(f"one-token extend over a cached 4,000-token prompt: median "
          f"{1e3 * statistics.median(times):.0f} ms; 8 copies x 4 new tokens {1e3 * group:.0f} ms "
          f"(cached_tokens {outs[1]['meta_info']['cached_tokens']})")


if __name__ == "__main__":
    main()
