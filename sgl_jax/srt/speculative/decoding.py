"""The scheduler's side of speculative decoding: drafts for a verify step, and the running
accepted length (what a user reads as completion tokens / verify steps)."""

from __future__ import annotations

import logging

from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.speculative.ngram import NgramProposer
from sgl_jax.srt.speculative.requests import SpecRequest

logger = logging.getLogger(__name__)

LOG_EVERY_STEPS = 200  # verify steps between two log lines of the accepted length


class SpeculativeDecoding:
    def __init__(self, server_args: ServerArgs) -> None:
        self.algorithm = server_args.speculative_algorithm
        self.num_steps = int(server_args.speculative_num_steps)
        # NGRAM proposes on the host; EAGLE and NEXTN draft inside the target's step
        # (speculative/eagle.py), whose chain writes draft KV past a row's tokens: slots held
        # during a step only.
        self.proposer = None if self.algorithm != "NGRAM" else NgramProposer(
            server_args.speculative_ngram_min_match_window_size,
            server_args.speculative_ngram_max_match_window_size)
        self.scratch = 0 if self.proposer is not None else self.num_steps - 1
        # Per request and verify step: one count, and the tokens it gained (>= 1 each).
        self.verify_ct = 0
        self.accepted = 0
        self.overlapped_steps = 0  # verify steps launched while their predecessor was in flight
        self._steps = 0
        self._window = (0, 0)  # (verify_ct, accepted) at the last log line
        source = {"EAGLE": f"draft head {server_args.speculative_draft_model_path}",
                  "NEXTN": "the checkpoint's MTP layer", "NGRAM": "prompt lookup"}
        overlap = "off" if server_args.disable_overlap_schedule else "on"
        logger.info("speculative decoding: %s (%s), %d draft tokens per step; overlap "
                    "scheduling %s", self.algorithm, source[self.algorithm], self.num_steps,
                    overlap)

    @staticmethod
    def create(server_args: ServerArgs) -> SpeculativeDecoding | None:
        return SpeculativeDecoding(server_args) if server_args.speculative_algorithm else None

    @property
    def drafts_in_step(self) -> bool:
        """EAGLE / NEXTN: the step that computes a request's last token drafts its next ones,
        and the next verify step reads them on the device (speculative/device_inputs.py)."""
        return self.proposer is None

    def room(self, req: SpecRequest, context_len: int, in_flight: int = 1) -> int:
        """Draft tokens ``req``'s next verify step may feed: never more than it may still
        generate after the target's own token, nor past the context. ``in_flight``: the most
        tokens its step in flight (if any, ``req.inflight``) may still add."""
        ahead = req.inflight * in_flight
        return max(min(self.num_steps,
                       req.sampling_params.max_new_tokens - len(req.output_ids) - ahead - 1,
                       context_len - req.seq_len - ahead - 1), 0)

    def drafts(self, req: SpecRequest, context_len: int) -> list[int]:
        """NGRAM's draft tokens for ``req``'s next verify step (up to ``room``)."""
        assert self.proposer is not None, "EAGLE / NEXTN drafts stay on the device"
        room = self.room(req, context_len)
        return self.proposer.propose(req.fill_ids, room) if room else []

    def record(self, gained: list[int]) -> None:
        """One verify step: the tokens each of its requests gained."""
        self.verify_ct += len(gained)
        self.accepted += sum(gained)
        self._steps += 1
        if self._steps % LOG_EVERY_STEPS == 0:
            ct, acc = self.verify_ct - self._window[0], self.accepted - self._window[1]
            self._window = (self.verify_ct, self.accepted)
            logger.info("speculative decoding (%s): accept length %.2f over the last %d "
                        "verify steps, %.2f overall", self.algorithm, acc / max(ct, 1),
                        LOG_EVERY_STEPS, self.accept_length)

    @property
    def accept_length(self) -> float:
        """Tokens gained per request per verify step, since start (1.0 before any)."""
        return self.accepted / self.verify_ct if self.verify_ct else 1.0
