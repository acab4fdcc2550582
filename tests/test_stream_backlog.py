"""M26: a stream whose caller does not read is aborted once ``max_stream_backlog`` outputs
wait for it (the tokenizer manager's per-request queue is bounded).

A real engine; the caller takes the first chunk of a 400-token greedy stream and then reads
nothing. The request must be dropped (aborted in the scheduler, its queue freed) and the
caller's next read says why; the old, unbounded queue kept every output until the end.
"""

from __future__ import annotations

import pytest

from sgl_jax import Engine
from sgl_jax.srt.managers.tokenizer_manager import StreamBehindError
from sgl_jax.testing import engine_args, wait_until

BACKLOG = 8


@pytest.fixture(scope="module")
def engine():
    e = Engine(**engine_args())
    yield e
    e.shutdown()


def test_a_caller_that_never_reads_is_dropped(engine):
    tm = engine.tokenizer_manager
    tm.max_stream_backlog = BACKLOG  # --max-stream-backlog, small for this one request
    chunks = engine.generate(input_ids=[5, 17, 99, 3], stream=True, rid="slow-reader",
                             sampling_params={"max_new_tokens": 400, "temperature": 0.0,
                                              "ignore_eos": True})
    next(chunks)
    state = tm.states["slow-reader"]
    # Dropped: no longer a running request of the manager, its queue at the bound.
    assert wait_until(lambda: "slow-reader" not in tm.states, timeout=60)
    assert getattr(state, "behind", False)
    assert len(state.pending) <= BACKLOG
    # The scheduler aborted it: the engine is idle again, long before 400 tokens.
    assert wait_until(lambda: engine.get_server_info().get("num_running_reqs", 0) == 0, 30)
    with pytest.raises(StreamBehindError, match="outputs were unread"):
        next(chunks)
    # The engine serves the next caller.
    out = engine.generate(input_ids=[5, 17, 99, 3],
                          sampling_params={"max_new_tokens": 4, "temperature": 0.0})
    assert len(out["output_ids"]) == 4
