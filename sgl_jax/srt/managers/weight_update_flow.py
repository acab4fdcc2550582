"""When new weights take effect: a weight update waits for the requests that started on the
old weights (new requests wait meanwhile), then runs on every node between two steps, and
the prefix cache is dropped (its KV and routed-experts rows were computed with the old
weights). Owns the update in waiting and the served ``weight_version``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sgl_jax.srt.bounded_text import bound_message
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.managers.batch_policy import BatchPolicy
from sgl_jax.srt.managers.control import UpdateWeights, UpdateWeightsReqOutput
from sgl_jax.srt.model_executor.weight_updater import check_compatible

logger = logging.getLogger(__name__)


class WeightUpdateFlow:
    def __init__(self, model_config: ModelConfig, policy: BatchPolicy,
                 run_on_every_node: Callable[[UpdateWeights], Any]) -> None:
        self.model_config = model_config
        self.policy = policy
        self.run_on_every_node = run_on_every_node
        self.waiting: UpdateWeights | None = None  # waiting for the started requests
        self.num_updates = 0
        self.version = "0"

    def _refusal(self, message: str) -> UpdateWeightsReqOutput:
        logger.warning("weight update refused: %s", message)
        return UpdateWeightsReqOutput(success=False, message=message, weight_version=self.version)

    def request(self, msg: UpdateWeights, checkpoint: str | None, *, paused: bool,
                abort: Callable[[str, str], None]) -> UpdateWeightsReqOutput | None:
        """Takes an update: at once if nothing started on the old weights (after aborting
        everything with ``abort_all_requests``), else once the started requests have
        finished; answered then. While paused, started requests cannot finish: that is an
        error unless they are aborted. Returns a refusal, or None."""
        if self.waiting is not None:
            return self._refusal("another weight update is in progress")
        try:
            if checkpoint is not None:
                check_compatible(self.model_config, checkpoint)
        except Exception as e:  # noqa: BLE001 - a bad update never stops the scheduler
            if not isinstance(e, ValueError):
                logger.exception("checking the weight update from %r failed", checkpoint)
            return self._refusal(bound_message(str(e) or type(e).__name__))
        policy = self.policy
        if msg.abort_all_requests:
            for req in [*policy.waiting, *policy.started()]:
                if not req.finished:
                    abort(req.rid, "aborted for a weight update")
        elif paused and policy.computed_on_current_weights():
            return self._refusal(
                f"{len(policy.computed_on_current_weights())} request(s) are paused part-way; "
                "continue generation first, or pass abort_all_requests=true"
            )
        self.waiting = msg
        logger.info("weight update requested; waiting for %d started request(s)",
                    len(policy.computed_on_current_weights()))
        return None

    def ready(self) -> bool:
        """An update waits, and no request computed on the old weights is left."""
        return self.waiting is not None and not self.policy.computed_on_current_weights()

    def apply(self) -> tuple[UpdateWeights, UpdateWeightsReqOutput]:
        """Runs the waiting update on every node (the step in flight processed first by the
        caller); its answer. A failed update leaves the old weights serving."""
        msg, self.waiting = self.waiting, None
        try:
            result = self.run_on_every_node(msg)  # WeightUpdater.report
        except Exception as e:  # noqa: BLE001 - the old weights serve on (see weight_updater)
            # WeightUpdateError (a ValueError, its traceback logged where it was raised if the
            # error was unexpected) is what the updater raises; anything else is a bug.
            if isinstance(e, ValueError):
                logger.warning("weight update failed: %s", bound_message(str(e)))
            else:
                logger.exception("weight update failed")
            return msg, UpdateWeightsReqOutput(
                success=False, message=bound_message(str(e) or type(e).__name__),
                weight_version=self.version)
        self.policy.memory.flush()
        self.num_updates += 1
        self.version = msg.weight_version or str(self.num_updates)
        logger.info("weights updated (%d parameters in %.2fs); weight_version %s",
                    result["num_parameters"], result["seconds"], self.version)
        return msg, UpdateWeightsReqOutput(
            success=True, message="weights updated", weight_version=self.version, **result)
