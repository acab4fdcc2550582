"""Host-to-device bytes of a decode step, against batch size and context length.

The device page table means a decode step sends only per-token and per-row arrays; before it,
every step shipped the rows' whole page-table rows (``[B, context]`` int32). This prints the
bytes the runner measured for one decode step (``ModelRunner.last_step_host_bytes``) next to
what the old layout sent (the same arrays plus a ``[B, context]`` int32 table, minus the
arrays the step now derives on the device), for a random tiny-shape checkpoint whose context
length is set per row.

    python benchmarks/bench_step_inputs.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from bench_utils import machine_description, markdown_table  # noqa: E402

from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.srt.forward_batch_info import ForwardMode, ModelWorkerBatch  # noqa: E402
from sgl_jax.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_jax.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sgl_jax.srt.server_args import ServerArgs  # noqa: E402
from sgl_jax.tools.make_random_model import write_random_model  # noqa: E402


def decode_step_bytes(path: str, batch_size: int, context: int) -> int:
    args = ServerArgs(
        model_path=path, context_length=context, max_running_requests=batch_size,
        precompile_bs_paddings=[batch_size], precompile_token_paddings=[64],
        chunked_prefill_size=64, max_total_tokens=4 * batch_size + 64, disable_precompile=True,
    )
    runner = ModelRunner(args, ModelConfig.from_hf(path, context))
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    idx = [pool.alloc() for _ in range(batch_size)]
    for i in idx:
        pool.write(i, 0, alloc.alloc(1))
        pool.device_len[i] = 1  # as after the request's prefill step
    greedy = SamplingParams(temperature=0.0).normalize()
    mwb = ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=np.array(idx, np.int32),
        prefix_lens=np.ones(batch_size, np.int32), extend_lens=np.ones(batch_size, np.int32),
        input_ids=np.full(batch_size, -1, np.int32), out_cache_loc=alloc.alloc(batch_size),
        sampling_params=[greedy] * batch_size, seeds=[0] * batch_size, steps=[0] * batch_size,
    )
    _, out = runner.run_worker_batch(mwb)
    np.asarray(out.next_token_ids)
    return runner.last_step_host_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 32768])
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_random_model(tmp, "tiny", {"max_position_embeddings": max(args.contexts)},
                           check_routing=False)
        for bs in args.batch_sizes:
            for ctx in args.contexts:
                now = decode_step_bytes(tmp, bs, ctx)
                # The old step also sent positions, token_to_req, logits_indices (int32 each)
                # and the [B, context rounded to 128] page table, but not extend_lens.
                old = now + bs * 4 * 2 + bs * -(-ctx // 128) * 128 * 4
                rows.append([bs, ctx, now, old, old / now])
    print("\n### Host-to-device bytes of one decode step\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(markdown_table(
        ["batch", "context length", "bytes now", "bytes with a host page table", "ratio"], rows))


if __name__ == "__main__":
    main()
