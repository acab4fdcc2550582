"""One engine across hosts: rank 0 schedules, every node runs the same steps.

A multi-node job (``--nnodes N --node-rank R --dist-init-addr HOST:PORT``, the same command on
every host) is one JAX multi-controller program: ``jax.distributed`` joins the hosts' devices
into one global mesh, and every process must dispatch the same jitted computations in the same
order. Rank 0 runs the tokenizer manager, scheduler, detokenizer and HTTP server; the
followers run only a ``ModelRunner`` and this module's loop.

What changes a runner's device state goes through ``LeaderRunner`` on rank 0: it publishes
the step or operation over the step channel (``step_channel.py``), then applies it itself. A
step travels as the unpadded ``ModelWorkerBatch`` plus the prefix page rows read from rank 0's
pools; each follower pads it to the same bucket and checks the digest of what its devices
will receive against rank 0's before dispatching, so a follower can never run another batch.
A mirrored control operation (``control.py``: weight update, EPLB rebalance, recorder start /
stop, memory release / resume) travels as itself and every node runs its ``apply_on_node``; then rank 0 sends its own
outcome, and a follower whose outcome differs stops: nodes never go on with
different weights. Results (sampled tokens, routed-experts rows, logprobs) are replicated
outputs of the step, read by rank 0 from its own devices: no gather per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ModelWorkerBatch
from sgl_jax.srt.managers import node_wire
from sgl_jax.srt.managers.control import ControlOp, ExpertRecorder
from sgl_jax.srt.managers.node_auth import load_node_secret
from sgl_jax.srt.managers.step_channel import FollowerChannel, LeaderChannel
from sgl_jax.srt.model_executor.memory_occupation import measured
from sgl_jax.srt.model_executor.model_runner import ModelRunner, StepOutput
from sgl_jax.srt.model_executor.weight_updater import WeightUpdater
from sgl_jax.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Flags that may differ between nodes: where things are on each host, and what only rank 0
# uses (HTTP, logging). Every other flag shapes the compiled step and must be equal.
NODE_LOCAL_FLAGS = frozenset({
    "model_path", "tokenizer_path", "served_model_name", "host", "port", "api_key",
    "admin_api_key", "max_prompts_per_request", "http_header_timeout", "http_max_connections",
    "enable_metrics", "log_requests", "graceful_shutdown_timeout",
    "node_rank", "log_level", "startup_timeout", "compilation_cache_dir",
    "expert_distribution_recorder_dir", "init_expert_location", "node_secret_file",
    "max_weight_update_bytes", "max_safetensors_header_bytes", "max_stream_backlog",
    "tool_call_parser", "reasoning_parser", "return_input_ids", "return_output_ids",
})


def _file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def checkpoint_digest(model_path: str) -> str:
    """A hash of every safetensors header (names, dtypes, shapes, offsets) of a checkpoint:
    cheap, and it tells two checkpoints of one architecture apart."""
    h = hashlib.sha256()
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            h.update(path.name.encode())
            h.update(f.read(size))
    return h.hexdigest()[:16]


def node_fingerprint(server_args: ServerArgs, model_config: ModelConfig) -> dict[str, str]:
    """What must be equal on every node, as printable values by name."""
    fingerprint = {
        "--" + name.replace("_", "-"): repr(value)
        for name, value in dataclasses.asdict(server_args).items()
        if name not in NODE_LOCAL_FLAGS
    }
    for name, value in dataclasses.asdict(model_config).items():
        if name != "model_path":
            fingerprint[f"model {name}"] = repr(value)
    fingerprint["step channel types"] = node_wire.schema()  # what the codec sends by position
    fingerprint["model weights (safetensors headers)"] = checkpoint_digest(
        model_config.model_path)
    if server_args.init_expert_location:
        fingerprint["--init-expert-location contents"] = _file_digest(
            server_args.init_expert_location)
    return fingerprint


def fingerprint_differences(leader: dict[str, str], follower: dict[str, str]) -> list[str]:
    return [f"{key}: node 0 has {leader.get(key, '(none)')}, this node "
            f"{follower.get(key, '(none)')}"
            for key in sorted(set(leader) | set(follower))
            if leader.get(key) != follower.get(key)]


class RunnerControl:
    """One node's runner as mirrored control operations change it (``control.NodeControl``):
    the same calls on every node."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.weights = WeightUpdater(runner)

    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        self._check_weights_held()
        return self.weights.report(self.weights.update_from_disk(model_path))

    def update_weights_from_arrays(self, arrays: dict[str, Any],
                                   measure_memory: bool = False) -> dict[str, Any]:
        self._check_weights_held()
        return self.weights.report(self.weights.update_from_arrays(arrays, measure_memory))

    def rebalance_experts(self, load: np.ndarray | None) -> dict[str, Any]:
        self._check_weights_held()
        return self.runner.rebalance_experts(load)

    def release_memory_occupation(self, tags: list[str]) -> dict[str, Any]:
        return self._logged("released", tags, lambda: self.runner.release_memory(tags))

    def resume_memory_occupation(self, tags: list[str]) -> dict[str, Any]:
        return self._logged("resumed", tags, lambda: self.runner.resume_memory(tags))

    @staticmethod
    def _logged(done: str, tags: list[str], change: Callable[[], None]) -> dict[str, Any]:
        result = measured(change)
        logger.info("%s %s: live device bytes %d -> %d in %.3fs", done, ", ".join(tags),
                    result["device_bytes_before"], result["device_bytes_after"],
                    result["seconds"])
        return result

    def _check_weights_held(self) -> None:
        # Released weights are placeholders; their host copy comes back on resume.
        if "weights" in self.runner.released_memory():
            raise ValueError("the weights are released (release_memory_occupation); call "
                             "resume_memory_occupation with the weights first")

    def expert_recorder(self) -> ExpertRecorder:
        if self.runner.recorder() is None:
            raise ValueError("the expert distribution recorder is off on this node")
        return self.runner.recorder()


class LeaderRunner:
    """Rank 0's runner: every step and mirrored control operation also goes to the followers
    (none on a one-node job, where this is just the runner)."""

    def __init__(self, runner: ModelRunner, channel: LeaderChannel | None) -> None:
        self.runner = runner
        self.channel = channel
        self.node_control = RunnerControl(runner)

    def run_batch(self, mwb: ModelWorkerBatch, rids: list[str]) -> StepOutput:
        runner = self.runner
        plan = runner.plan_step(mwb, runner.prefix_page_rows(mwb))
        if self.channel is not None:
            self.channel.publish("batch", (mwb, plan.prefix_pages), plan.digest())
        return runner.launch_step(plan, rids)[1]

    def control(self, op: ControlOp) -> Any:
        """``op.apply_on_node`` on every node; an error here is raised after the followers
        learn it, so they can check theirs."""
        if self.channel is None:  # one node: every operation that changes it applies here
            return op.apply_on_node(self.node_control)
        assert op.mirrored, f"{type(op).__name__} is not applied on every node"
        self.channel.publish("control", op)
        try:
            result = op.apply_on_node(self.node_control)
        except Exception as e:
            self.channel.publish("outcome", str(e))
            raise
        self.channel.publish("outcome", None)
        return result

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def exit_on_fatal(message: str) -> None:
    """A multi-node job cannot go on without one of its nodes: stop this process now (from
    any thread; the main one may be blocked in a collective that will never complete)."""
    logger.error("multi-node job failed: %s; stopping this node", message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def open_leader_channel(server_args: ServerArgs, model_config: ModelConfig) -> LeaderChannel:
    """Rank 0: waits for every follower's hello (before any JAX work: a mismatched node never
    joins the JAX job) and checks its fingerprint."""
    return LeaderChannel(
        server_args.dist_init_addr, server_args.nnodes,
        node_fingerprint(server_args, model_config), server_args.dist_timeout,
        server_args.startup_timeout, exit_on_fatal, fingerprint_differences,
        load_node_secret(server_args.node_secret_file))


class Follower:
    """A follower node: a runner that applies rank 0's messages until rank 0 says goodbye."""

    def __init__(self, server_args: ServerArgs) -> None:
        model_config = ModelConfig.from_hf(server_args.model_path, server_args.context_length)
        self.channel = FollowerChannel(
            server_args.dist_init_addr, server_args.node_rank,
            node_fingerprint(server_args, model_config), server_args.dist_timeout,
            server_args.startup_timeout, exit_on_fatal,
            load_node_secret(server_args.node_secret_file))
        logger.info("node %d joined rank 0; loading the model", server_args.node_rank)
        self.runner = ModelRunner(server_args, model_config)  # joins the JAX job
        if not server_args.disable_precompile:
            self.runner.precompile()
        self.node_control = RunnerControl(self.runner)
        self.steps = 0

    def run(self) -> None:
        logger.info("node ready: running rank 0's steps")
        outcome: str | None = None  # this node's outcome of the last control operation
        while (message := self._receive()) is not None:
            op, payload, digest = message
            if op == "batch":
                self._run_batch(*payload, digest)
            elif op == "outcome":
                if (outcome is None) != (payload is None):
                    exit_on_fatal(
                        f"the last operation {'failed' if payload else 'succeeded'} on rank 0 "
                        f"({payload or 'ok'}) but {'failed' if outcome else 'succeeded'} here "
                        f"({outcome or 'ok'}): the nodes would diverge")
            elif op == "control" and isinstance(payload, ControlOp) and payload.mirrored:
                try:
                    payload.apply_on_node(self.node_control)
                    outcome = None
                except Exception as e:  # noqa: BLE001 - compared with rank 0's outcome
                    outcome = str(e)
            else:
                exit_on_fatal(f"rank 0 sent {op!r} with a {type(payload).__name__}, which "
                              "this node does not apply: the nodes' code differs")
        logger.info("rank 0 stopped the job after %d steps", self.steps)

    def _receive(self) -> tuple[str, Any, str] | None:
        """Rank 0's next message; a message this node cannot trust or missed one stops it
        (it would run other steps than rank 0)."""
        try:
            return self.channel.receive()
        except (ValueError, RuntimeError) as e:
            exit_on_fatal(f"refused a message from rank 0: {e}")
            raise  # exit_on_fatal does not return

    def _run_batch(self, mwb: ModelWorkerBatch, prefix_pages: list[tuple[int, np.ndarray]],
                   digest: str) -> None:
        plan = self.runner.plan_step(mwb, prefix_pages)
        if plan.digest() != digest:
            exit_on_fatal(
                f"step {self.steps + 1} padded here differs from rank 0's (digest "
                f"{plan.digest()} vs {digest}): the nodes' flags or code differ")
        self.runner.launch_step(plan)
        self.steps += 1


def run_follower(server_args: ServerArgs) -> int:
    """``launch_server`` on a node of rank > 0: serves rank 0's steps; returns the exit code
    (0 once rank 0 stops the job; a lost rank 0 exits 1 from the channel's thread)."""
    try:
        follower = Follower(server_args)
    except (ValueError, TimeoutError, OSError) as e:
        logger.error("node %d start-up failed: %s", server_args.node_rank, e)
        return 1
    follower.run()
    return 0
