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
    # The first read sends the request. On a loaded machine the receiver thread can queue
    # BACKLOG outputs before the event loop hands the first one over, so that read may
    # already be the one that says the stream fell behind; either way it is dropped.
    state = None
    try:
        next(chunks)
        state = tm.states["slow-reader"]
    except StreamBehindError:
        pass
    # Dropped: no longer a running request of the manager.
    assert wait_until(lambda: "slow-reader" not in tm.states, timeout=60)
    # The scheduler aborted it: the engine is idle again, long before 400 tokens.
    assert wait_until(lambda: engine.get_server_info().get("num_running_reqs", 0) == 0, 30)
    if state is not None:
        assert state.behind
        assert len(state.pending) <= BACKLOG  # the queue stopped at the bound
        with pytest.raises(StreamBehindError, match="outputs were unread"):
            next(chunks)
    # The engine serves the next caller.
    out = engine.generate(input_ids=[5, 17, 99, 3],
                          sampling_params={"max_new_tokens": 4, "temperature": 0.0})
    assert len(out["output_ids"]) == 4
