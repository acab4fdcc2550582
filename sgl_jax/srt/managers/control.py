"""Control operations: one class each, carrying its reply type and its own ``apply``.

The Engine's methods and the admin HTTP routes build an operation and hand it to
``TokenizerManager.control(op)``, which checks it (``op.checked()``) and sends it to the
scheduler. Between steps the scheduler runs ``op.apply(scheduler)`` with itself as the
``ControlTarget`` (the only scheduler methods an operation uses) and sends the reply back,
paired with the call by its id. ``apply`` returns None when the reply comes later (a weight
update waits for the requests that started on the old weights).

An operation that changes the model's device state declares ``mirrored = True`` and puts
that change in ``apply_on_node(node)``, against a ``NodeControl`` (one node's runner). Its
``apply`` calls ``target.on_every_node(self)``: on a multi-node job rank 0 publishes the
operation over the step channel (``node_wire`` carries the mirrored classes, by their
fields), every node runs the same ``apply_on_node`` on its own runner, and a node whose
outcome differs from rank 0's stops (``multi_node``). So that nothing else can cross to the
followers, ``apply_on_node`` of a class that is not mirrored is never called.

Adding an operation: a dataclass here (its fields, ``reply_type``, ``apply``; if it changes
device state, ``mirrored = True``, ``apply_on_node`` and its entry in ``node_wire``'s list)
and its Engine method or HTTP route. This module is imported by the main process: numpy
only, no JAX.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import numpy as np

from sgl_jax.srt.bounded_text import bound_message
from sgl_jax.srt.managers import array_handoff
from sgl_jax.srt.managers.request_options import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_WEIGHT_VERSION_CHARS = 128
# What release_memory_occupation frees, by SGLang's tag names. SGLang's third tag,
# "cuda_graph", is accepted and ignored: XLA's compiled programs are never freed (which is why
# a resume recompiles nothing).
MEMORY_TAGS = ("kv_cache", "weights")
_IGNORED_MEMORY_TAGS = ("cuda_graph",)
_RECORDER_OFF = ("the expert distribution recorder is off; start the server with "
                 "--expert-distribution-recorder-mode stat, per_pass or per_token")


# -- what an operation may use ------------------------------------------------------------------
class ExpertRecorder(Protocol):
    """The expert distribution recorder (``layers/moe/expert_distribution.py``)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def dump(self) -> str: ...
    def load(self) -> dict[str, Any]: ...
    def stat_counts(self) -> tuple[np.ndarray, int]: ...


class NodeControl(Protocol):
    """One node's runner, as mirrored operations change it (the same calls on every node).
    Failures are ValueError or OSError: the nodes compare them (``multi_node``)."""

    # Both return the ``UpdateWeightsReqOutput`` figures (num_parameters, seconds, ...).
    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]: ...
    def update_weights_from_arrays(self, arrays: dict[str, Any],
                                   measure_memory: bool = False) -> dict[str, Any]: ...
    def rebalance_experts(self, load: np.ndarray | None) -> dict[str, Any]: ...
    def expert_recorder(self) -> ExpertRecorder: ...  # ValueError when off

    def release_memory_occupation(self, tags: list[str]) -> dict[str, Any]:
        """Frees the device memory of ``tags``; this process's live device bytes before and
        after (``device_bytes_before`` / ``_after``) and the ``seconds`` it took."""

    def resume_memory_occupation(self, tags: list[str]) -> dict[str, Any]: ...  # the same


class ControlTarget(Protocol):
    """Rank 0's scheduler, as control operations use it."""

    def on_every_node(self, op: ControlOp) -> Any:
        """``op.apply_on_node`` on every node's runner; its result on rank 0."""

    def expert_recorder(self) -> ExpertRecorder | None: ...  # None when off
    def set_paused(self, paused: bool) -> None: ...
    def flush_cache(self) -> None: ...  # ValueError while requests run
    def server_info(self) -> dict[str, Any]: ...
    def released_memory(self) -> frozenset[str]: ...  # the MEMORY_TAGS released now

    def quiesce(self) -> None:
        """ValueError while requests run or wait (or a weight update waits for them); else
        the step in flight, if any, is processed: nothing uses the device state any more."""

    def request_weight_update(self, op: UpdateWeights,
                              checkpoint: str | None = None) -> UpdateWeightsReqOutput | None:
        """Takes ``op`` (at once, or once the started requests finished: then None, and the
        scheduler answers it); a refusal is returned at once. ``checkpoint``: a directory
        to check for compatibility first."""


class ControlOp:
    """Base of every control operation (the subclasses are dataclasses)."""

    reply_type: ClassVar[type]
    mirrored: ClassVar[bool] = False  # changes the model's device state, on every node
    timeout: ClassVar[float | None] = 30.0  # seconds the caller waits for the reply
    # Set by the tokenizer manager on its copy; the reply carries it back. Not a dataclass
    # field: it never crosses to the other nodes.
    call_id: int = 0

    def checked(self) -> ControlOp:
        """The operation as sent: validated (InvalidRequestError: the caller's mistake) and
        in a form that crosses processes. Done in the caller's process, before sending."""
        return self

    def apply(self, target: ControlTarget) -> Any:
        """Does the operation on rank 0's scheduler, between steps: its reply (a
        ``reply_type``), or None when the scheduler answers it later. Never raises for a
        refusal (the reply says it): an exception here is a bug, and stops the scheduler."""
        raise NotImplementedError

    def apply_on_node(self, node: NodeControl) -> Any:
        """Mirrored operations: the change of one node's runner, run on every node."""
        raise NotImplementedError(f"{type(self).__name__} changes no device state")


@dataclass
class ControlReply:
    """Scheduler -> tokenizer manager: the reply to the call ``call_id``."""

    call_id: int
    reply: Any


class MemoryReleasedError(RuntimeError):
    """Generation while the engine's memory is released (``release_memory_occupation``)."""


def memory_released_message(tags: Any) -> str:
    return (f"the engine's memory is released ({', '.join(tags)}: release_memory_occupation); "
            "call resume_memory_occupation before generating")


# -- replies ------------------------------------------------------------------------------------
def check_reply(reply: Any) -> Any:
    """``reply``; ValueError with its message if it is a refusal (``success`` False: the
    caller's problem, e.g. a recorder that is off or a checkpoint that does not fit)."""
    if not getattr(reply, "success", True):
        raise ValueError(reply.message)
    return reply


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetServerInfoReqOutput:
    info: dict[str, Any]


@dataclass
class UpdateWeightsReqOutput:
    success: bool
    message: str
    weight_version: str
    num_parameters: int = 0  # parameters replaced (a stacked expert tensor counts once)
    seconds: float = 0.0  # reading and placing the new weights (not the wait for requests)
    # Bytes of the update that crossed between host and devices in the scheduler's process:
    # JAX arrays in single-process mode only the finiteness verdict (1), numpy arrays their
    # size; -1 from disk (not counted).
    host_bytes: int = -1
    # Single-process JAX arrays with measure_memory: the process's live device bytes at the
    # update's point of maximal residency (the largest new parameter made, its old one not yet
    # freed); 0 where not measured.
    peak_device_bytes: int = 0


@dataclass
class PauseGenerationReqOutput:
    paused: bool


@dataclass
class ExpertDistributionReqOutput:
    success: bool
    message: str = ""
    path: str | None = None  # dump: the file written
    load: dict[str, Any] | None = None  # load: counts, num_tokens, moe_layer_ids, ...; rebalance


@dataclass
class MemoryOccupationReqOutput:
    success: bool
    message: str = ""
    released: list[str] = field(default_factory=list)  # the tags released after the call
    # Rank 0's live device bytes (``jax.live_arrays()`` in the scheduler's process) before
    # and after the change, and its time.
    device_bytes_before: int = 0
    device_bytes_after: int = 0
    seconds: float = 0.0


# -- the operations -----------------------------------------------------------------------------
@dataclass
class FlushCache(ControlOp):
    """Empties the prefix cache; refused while requests run."""

    reply_type = FlushCacheReqOutput

    def apply(self, target: ControlTarget) -> FlushCacheReqOutput:
        try:
            target.flush_cache()
        except ValueError as e:
            return FlushCacheReqOutput(success=False, message=str(e))
        return FlushCacheReqOutput(success=True)


@dataclass
class GetServerInfo(ControlOp):
    """The scheduler's state and counters."""

    reply_type = GetServerInfoReqOutput

    def apply(self, target: ControlTarget) -> GetServerInfoReqOutput:
        return GetServerInfoReqOutput(info=target.server_info())


@dataclass
class PauseGeneration(ControlOp):
    """Stop launching steps (``pause=True``) or resume (False); every request keeps its
    state."""

    pause: bool = True
    reply_type = PauseGenerationReqOutput

    def apply(self, target: ControlTarget) -> PauseGenerationReqOutput:
        target.set_paused(self.pause)
        return PauseGenerationReqOutput(paused=self.pause)


def check_weight_version(version: str | None) -> None:
    """A weight version is echoed in every response: a short printable label, or None."""
    if version is None:
        return
    if not isinstance(version, str) or not 0 < len(version) <= MAX_WEIGHT_VERSION_CHARS \
            or not version.isprintable():
        raise InvalidRequestError(
            f"weight_version must be a printable string of 1 to {MAX_WEIGHT_VERSION_CHARS} "
            f"characters (got {_describe_version(version)})",
            "weight_version")


def _describe_version(version: object) -> str:
    if isinstance(version, str):
        return f"{len(version)} characters" if version.isprintable() else "control characters"
    return type(version).__name__


class UpdateWeights(ControlOp):
    """New weights, in place (``model_executor/weight_updater.py``). Running requests finish
    on the old weights first (new ones wait), or with ``abort_all_requests`` are aborted.
    ``weight_version`` defaults to the previous version + 1."""

    weight_version: str | None
    abort_all_requests: bool
    reply_type = UpdateWeightsReqOutput
    mirrored = True
    timeout = None  # by default it waits for the running requests

    def checked(self) -> UpdateWeights:
        check_weight_version(self.weight_version)
        return self


@dataclass
class UpdateWeightsFromDisk(UpdateWeights):
    """Every parameter from a checkpoint directory of the served architecture and shapes."""

    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False

    def apply(self, target: ControlTarget) -> UpdateWeightsReqOutput | None:
        return target.request_weight_update(self, checkpoint=self.model_path)

    def apply_on_node(self, node: NodeControl) -> dict[str, Any]:
        return node.update_weights_from_disk(self.model_path)


@dataclass
class UpdateWeightsFromArrays(UpdateWeights):
    """The parameters made of tensors given by Hugging Face name (a subset is fine, but all
    experts of a stacked projection together)."""

    arrays: dict[str, Any]
    weight_version: str | None = None
    abort_all_requests: bool = False

    def checked(self) -> UpdateWeightsFromArrays:
        super().checked()
        # The scheduler is another process: arrays go as host bytes (device arrays are
        # fetched here).
        return replace(self, arrays={name: np.asarray(a) for name, a in self.arrays.items()})

    def apply(self, target: ControlTarget) -> UpdateWeightsReqOutput | None:
        return target.request_weight_update(self)

    def apply_on_node(self, node: NodeControl) -> dict[str, Any]:
        return node.update_weights_from_arrays(self.arrays)


@dataclass
class UpdateWeightsInProcess(UpdateWeights):
    """Single-process mode: the parameters made of JAX arrays the caller handed over by
    reference (``array_handoff``, under ``handle``), converted on the devices. Only the token
    crosses the socket; a scheduler in another process finds no arrays under it (refused).
    Not mirrored, not in ``node_wire``: single-process mode runs on one node."""

    mirrored = False
    handle: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    measure_memory: bool = False  # the reply's peak_device_bytes (a scan of the live arrays)

    def apply(self, target: ControlTarget) -> UpdateWeightsReqOutput | None:
        if not array_handoff.holds(self.handle):
            return UpdateWeightsReqOutput(
                success=False, weight_version=target.server_info()["weight_version"],
                message="arrays handed over by reference reach only an engine in the "
                        "caller's process (enable_single_process)")
        return target.request_weight_update(self)

    def apply_on_node(self, node: NodeControl) -> dict[str, Any]:
        return node.update_weights_from_arrays(array_handoff.take(self.handle),
                                               self.measure_memory)


class _RecorderOp(ControlOp):
    """An operation of the expert distribution recorder (docs/expert_load.md); a refusal (off,
    wrong order) is a reply with success=False, never an exception in the scheduler."""

    reply_type = ExpertDistributionReqOutput

    def apply(self, target: ControlTarget) -> ExpertDistributionReqOutput:
        recorder = target.expert_recorder()
        if recorder is None:
            return ExpertDistributionReqOutput(success=False, message=_RECORDER_OFF)
        try:
            return self.run(target, recorder)
        except (ValueError, OSError) as e:
            return ExpertDistributionReqOutput(success=False, message=str(e))

    def run(self, target: ControlTarget, recorder: ExpertRecorder) -> ExpertDistributionReqOutput:
        raise NotImplementedError


class _RecordingWindowOp(_RecorderOp):
    """Starts or ends the recording window on every node (each records its own steps)."""

    mirrored = True
    done: ClassVar[str]

    def run(self, target: ControlTarget, recorder: ExpertRecorder) -> ExpertDistributionReqOutput:
        target.on_every_node(self)
        return ExpertDistributionReqOutput(success=True, message=self.done)


@dataclass
class StartExpertRecord(_RecordingWindowOp):
    """Starts a recording window."""

    done = "recording started"

    def apply_on_node(self, node: NodeControl) -> None:
        node.expert_recorder().start()


@dataclass
class StopExpertRecord(_RecordingWindowOp):
    """Ends the window; it can still be dumped or read."""

    done = "recording stopped"

    def apply_on_node(self, node: NodeControl) -> None:
        node.expert_recorder().stop()


@dataclass
class DumpExpertRecord(_RecorderOp):
    """Writes the window so far as .npz (rank 0's recorder) and returns its path."""

    def run(self, target: ControlTarget, recorder: ExpertRecorder) -> ExpertDistributionReqOutput:
        path = recorder.dump()
        logger.info("expert distribution dumped to %s", path)
        return ExpertDistributionReqOutput(success=True, message="dumped", path=path)


@dataclass
class GetExpertLoad(_RecorderOp):
    """``stat`` mode: the current window's counts, as ``GET /expert_load`` serves them."""

    def run(self, target: ControlTarget, recorder: ExpertRecorder) -> ExpertDistributionReqOutput:
        return ExpertDistributionReqOutput(success=True, load=recorder.load())


@dataclass
class RebalanceExperts(ControlOp):
    """EPLB (docs/expert_load.md): a new expert placement from ``load`` ``[moe_layers, E]``,
    applied between steps without a recompilation. The caller leaves ``load`` out: rank 0
    fills in its recorder's ``stat`` counts, so every node places by the same counts."""

    load: np.ndarray | None = None
    reply_type = ExpertDistributionReqOutput
    mirrored = True

    def apply(self, target: ControlTarget) -> ExpertDistributionReqOutput:
        recorder = target.expert_recorder()
        try:
            load = self.load if self.load is not None or recorder is None \
                else recorder.stat_counts()[0]
            result = target.on_every_node(replace(self, load=load))
        except ValueError as e:
            return ExpertDistributionReqOutput(success=False, message=str(e))
        return ExpertDistributionReqOutput(success=True, message="rebalanced", load=result)

    def apply_on_node(self, node: NodeControl) -> dict[str, Any]:
        return node.rebalance_experts(self.load)


class _MemoryOccupationOp(ControlOp):
    """SGLang's release / resume of the engine's device memory, by tags (``MEMORY_TAGS``; None
    or [] = every tag in the right state). A tag given explicitly must be in the right state
    (release: held; resume: released), else the call is refused and nothing changes. Mirrored:
    every node frees and restores its own shards (``model_executor/memory_occupation.py``)."""

    tags: list[str] | None
    reply_type = MemoryOccupationReqOutput
    mirrored = True
    timeout = None  # the weights go to host memory and back: large models take a while
    verb: ClassVar[str]

    def checked(self) -> _MemoryOccupationOp:
        return replace(self, tags=check_memory_tags(self.tags))

    def apply(self, target: ControlTarget) -> MemoryOccupationReqOutput:
        try:
            tags = self.chosen(target.released_memory())
            result = self.change(target, tags) if tags else {}
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: a reply, never a crash
            message = str(e) if isinstance(e, ValueError) else (
                f"{self.verb} failed ({type(e).__name__}: {bound_message(str(e), 500)}); "
                "what was released stays released and can be resumed again")
            return MemoryOccupationReqOutput(success=False, message=message,
                                             released=_ordered(target.released_memory()))
        done = f"{self.verb}d {', '.join(tags)}" if tags else f"nothing to {self.verb}"
        return MemoryOccupationReqOutput(success=True, message=done,
                                         released=_ordered(target.released_memory()), **result)

    def chosen(self, released: frozenset[str]) -> list[str]:
        """The tags this call changes (ValueError: a tag in the wrong state)."""
        raise NotImplementedError

    def change(self, target: ControlTarget, tags: list[str]) -> dict[str, Any]:
        return target.on_every_node(replace(self, tags=tags))


def check_memory_tags(tags: Any) -> list[str] | None:
    """The tags of a release / resume call, validated (InvalidRequestError); None: every tag.
    SGLang's "cuda_graph" is dropped (nothing to free); an empty list means every tag."""
    if tags is None or (isinstance(tags, list | tuple) and not tags):
        return None
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise InvalidRequestError("tags must be a list of strings", "tags")
    known = MEMORY_TAGS + _IGNORED_MEMORY_TAGS
    bad = [t for t in tags if t not in known]
    if bad:
        raise InvalidRequestError(
            f"unknown memory tag {bad[0][:64]!r}; the tags are {', '.join(known)}", "tags")
    return [t for t in MEMORY_TAGS if t in tags]


def _ordered(tags: frozenset[str]) -> list[str]:
    return [t for t in MEMORY_TAGS if t in tags]


@dataclass
class ReleaseMemoryOccupation(_MemoryOccupationOp):
    """Frees the KV cache ("kv_cache": the prefix cache is flushed) and the weights
    ("weights": kept in host memory until resumed). Only on an idle engine: refused while
    requests run or wait (paused ones included: they hold KV); until every tag is resumed,
    generation fails fast (``MemoryReleasedError``)."""

    tags: list[str] | None = None
    verb = "release"

    def chosen(self, released: frozenset[str]) -> list[str]:
        if self.tags is None:
            tags = [t for t in MEMORY_TAGS if t not in released]
            if not tags:
                raise ValueError("everything is released already; call "
                                 "resume_memory_occupation first")
            return tags
        again = [t for t in self.tags if t in released]
        if again:
            raise ValueError(f"{', '.join(again)} is released already; call "
                             "resume_memory_occupation first")
        return self.tags

    def change(self, target: ControlTarget, tags: list[str]) -> dict[str, Any]:
        target.quiesce()
        if "kv_cache" in tags:
            target.flush_cache()  # the cached prefixes' KV is about to go
        return super().change(target, tags)

    def apply_on_node(self, node: NodeControl) -> dict[str, Any]:
        return node.release_memory_occupation(self.tags)


@dataclass
class ResumeMemoryOccupation(_MemoryOccupationOp):
    """Puts released memory back with the same shapes and shardings (no recompilation): the
    weights as they were, the KV cache empty."""

    tags: list[str] | None = None
    verb = "resume"

    def chosen(self, released: frozenset[str]) -> list[str]:
        if self.tags is None:
            if not released:
                raise ValueError("nothing is released; call release_memory_occupation first")
            return _ordered(released)
        held = [t for t in self.tags if t not in released]
        if held:
            raise ValueError(f"{', '.join(held)} is not released; call "
                             "release_memory_occupation first")
        return self.tags

    def apply_on_node(self, node: NodeControl) -> dict[str, Any]:
        return node.resume_memory_occupation(self.tags)
