"""Wall time of whole scheduler steps (schedule + run + process), per forward mode
(``/get_server_info``'s ``step_stats``)."""

from __future__ import annotations

from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.managers.schedule_batch import ScheduleBatch


class StepStats:
    def __init__(self) -> None:
        self.data = {mode.name.lower(): {"steps": 0, "seconds": 0.0, "tokens": 0}
                     for mode in ForwardMode}

    def record(self, batch: ScheduleBatch, seconds: float) -> None:
        entry = self.data[batch.forward_mode.name.lower()]
        entry["steps"] += 1
        entry["seconds"] += seconds
        entry["tokens"] += sum(batch.extend_lens)
