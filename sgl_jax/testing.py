"""What tests and benchmarks share: the test checkpoint, the fast settings, and one launcher
of a real server.

``TEST_MODEL_PATH`` is the checkpoint the exactness tests run (not the bundled model): the
bundled model's shape with random weights, ``make_random_model --preset tiny --seed 0``,
whose k-th / (k+1)-th router gaps on the tool's sample prompts are >= 1e-3, far above float32
rounding. The bundled model is trained (``tools/train_tiny``) and a trained router has
near-ties (smallest gap ~1e-6 over the corpus, below float32 error), so a float32 engine and
the float64 reference may legitimately pick different experts there. The checkpoint is
written on first use (about a second) into a cache directory and checked against a pinned
SHA-256, so it is the same bytes everywhere, without a second binary copy in the repository.

``FAST_SETTINGS`` are the ServerArgs that keep a start-up short on a CPU (few, small compile
buckets; the persistent compilation cache makes restarts cheap) and select the test
checkpoint. ``engine_args`` gives them as ``Engine(**kwargs)``, ``server_flags`` as
command-line flags, both with overrides (``model_path=None``: the bundled model).

``ServerProcess`` starts ``python -m sgl_jax.launch_server`` on a free loopback port, its log in
a temp file, and waits until ``/health`` answers; a server that fails to start raises with the
log's tail. Needs the ``test`` extra (``requests``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.utils import free_port

TEST_MODEL_PRESET, TEST_MODEL_SEED = "tiny", 0
# model.safetensors of that checkpoint (the bundled model's bytes before it was trained). A
# change means make_random_model writes other weights: measure the new routing margin (its
# CLI prints it) and the tests before updating this.
TEST_MODEL_SHA256 = "6523dbd17cf4883e413621d2104a644918245dab19a1c3b2c8d8dee1373457e9"
_TEST_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json")


# Beside the persistent compilation cache (ServerArgs.compilation_cache_dir).
TEST_MODEL_PATH = os.path.join(os.path.expanduser("~"), ".cache", "sgl_jax",
                               f"tiny-qwen3-moe-random-s{TEST_MODEL_SEED}-{TEST_MODEL_SHA256[:12]}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_test_model(path: Path) -> bool:
    return (all((path / name).is_file() for name in _TEST_MODEL_FILES)
            and _sha256(path / "model.safetensors") == TEST_MODEL_SHA256)


def ensure_test_model() -> str:
    """Writes the test checkpoint at ``TEST_MODEL_PATH`` unless it is already there, intact;
    returns the path. Safe to call from several processes at once (a lock, then an atomic
    rename of a complete directory)."""
    target = Path(TEST_MODEL_PATH)
    if _is_test_model(target):
        return TEST_MODEL_PATH
    from sgl_jax.tools.make_random_model import write_random_model  # numpy + the reference

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_test_model(target):  # written by another process while we waited
            return TEST_MODEL_PATH
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            write_random_model(str(staging), TEST_MODEL_PRESET, seed=TEST_MODEL_SEED)
            got = _sha256(staging / "model.safetensors")
            if got != TEST_MODEL_SHA256:
                raise RuntimeError(
                    f"make_random_model --preset {TEST_MODEL_PRESET} --seed {TEST_MODEL_SEED} "
                    f"wrote model.safetensors {got}, not the pinned test checkpoint "
                    f"{TEST_MODEL_SHA256} (sgl_jax/testing.py)")
            staging.chmod(0o755)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return TEST_MODEL_PATH


FAST_SETTINGS: dict[str, Any] = {
    "model_path": TEST_MODEL_PATH,
    "precompile_bs_paddings": [1, 4],  # max_running_requests follows: 4
    "precompile_token_paddings": [64, 256],
    "chunked_prefill_size": 256,
}


def _settings(overrides: dict[str, Any]) -> dict[str, Any]:
    settings = {**FAST_SETTINGS, **overrides}
    if settings.get("model_path") == TEST_MODEL_PATH:
        ensure_test_model()
    return settings


def engine_args(**overrides: Any) -> dict[str, Any]:
    """``Engine(**engine_args(...))``: the fast settings (the test checkpoint), quiet logs,
    then ``overrides``."""
    return {**_settings(overrides), "log_level": "warning", **overrides}


def server_flags(**overrides: Any) -> list[str]:
    """The fast settings and ``overrides`` (ServerArgs fields) as launch_server flags."""
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    flags: list[str] = []
    for name, value in _settings(overrides).items():
        if name not in names:
            raise TypeError(f"{name!r} is not a ServerArgs field")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:  # boolean flags are off unless given
                flags.append(flag)
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0,
               interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def fake_devices_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a process of ``devices`` fake CPU devices. XLA:CPU aborts the process
    when a collective's device threads have not all arrived within 40 s; on a loaded 2-core
    machine one thread can be starved that long (a CI run did), so the limit is raised."""
    return (f"--xla_force_host_platform_device_count={devices} "
            "--xla_cpu_collective_call_terminate_timeout_seconds=600")


class ServerProcess:
    """A real server process on ``127.0.0.1:<free port>`` (``url``), ready when constructed."""

    def __init__(self, args: list[str], api_key: str | None = None,
                 startup_timeout: float = 180.0, env: dict[str, str] | None = None,
                 log_prefix: str = "sgl_jax_server_") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        fd, self.log_path = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
        self._log = os.fdopen(fd, "w")
        cmd = [sys.executable, "-m", "sgl_jax.launch_server", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} at "
                                   f"start-up; log:\n{self.log()[-5000:]}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not healthy within {timeout}s; log:\n"
                           f"{self.log()[-5000:]}")

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers, timeout=60, **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        kw.setdefault("timeout", 60)
        return requests.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})},
                             **kw)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Sends ``sig`` and returns the exit code (kills after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def free_port_pair() -> int:
    """A free loopback port whose successor is free too (a multi-node job's coordinator and
    step channel: ``--dist-init-addr`` host:port and port + 1)."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


class MultiNodeJob:
    """A multi-node job on loopback: ``nnodes`` processes with ``devices_per_node`` fake CPU
    devices each, joined by ``jax.distributed`` (gloo collectives). The followers start first
    (they wait for node 0), then node 0's ``ServerProcess`` (``leader``), ready when it is.
    ``follower_args`` replaces ``args`` on the followers (to start a mismatched node). Every
    node gets the job's random secret in ``SGL_JAX_NODE_SECRET`` (``follower_env`` adds to
    or overrides the followers' environment: to give one a wrong secret)."""

    def __init__(self, args: list[str], nnodes: int = 2, devices_per_node: int = 2,
                 follower_args: list[str] | None = None, startup_timeout: float = 240.0,
                 wait: bool = True, follower_env: dict[str, str] | None = None) -> None:
        self.addr = f"127.0.0.1:{free_port_pair()}"
        self.env = {"JAX_PLATFORMS": "cpu",
                    "XLA_FLAGS": fake_devices_flags(devices_per_node),
                    "SGL_JAX_NODE_SECRET": secrets.token_hex(32)}
        self.followers: list[subprocess.Popen] = []
        self.follower_logs: list[str] = []
        for rank in range(1, nnodes):
            fd, path = tempfile.mkstemp(prefix=f"sgl_jax_node{rank}_", suffix=".log")
            with os.fdopen(fd, "w") as log:
                cmd = [sys.executable, "-m", "sgl_jax.launch_server",
                       *self._flags(follower_args or args, nnodes, rank)]
                self.followers.append(subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env, **(follower_env or {})}))
            self.follower_logs.append(path)
        self.leader_args = self._flags(args, nnodes, 0)
        self.leader: ServerProcess | None = None
        if wait:
            self.start_leader(startup_timeout)

    def _flags(self, args: list[str], nnodes: int, rank: int) -> list[str]:
        return [*args, "--nnodes", str(nnodes), "--node-rank", str(rank),
                "--dist-init-addr", self.addr]

    def start_leader(self, startup_timeout: float = 240.0) -> ServerProcess:
        try:
            self.leader = ServerProcess(self.leader_args, env=self.env,
                                        startup_timeout=startup_timeout)
        except BaseException:
            self.kill()
            raise
        return self.leader

    def follower_log(self, index: int = 0) -> str:
        with open(self.follower_logs[index], encoding="utf-8", errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        for proc in self.followers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if self.leader is not None:
            self.leader.kill()

    def stop(self, timeout: float = 30.0) -> tuple[int | None, list[int | None]]:
        """SIGTERM to node 0 (which stops the followers); the exit codes, after killing any
        process still alive at ``timeout``."""
        code = self.leader.stop(timeout=timeout) if self.leader is not None else None
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in self.followers:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:  # None: it had to be killed
                proc.kill()
                proc.wait(10)
                codes.append(None)
        return code, codes
