"""Node-to-node trust (docs/security.md): the step channel unpickles nothing, verifies every
message with the job's secret before decoding it, and local ipc sockets are private.

- A real rank 0 (``launch_server --nnodes 2 --node-rank 0``) is sent a pickle whose
  ``__reduce__`` would create a marker file, in every framing a stranger could try: the file
  never appears, rank 0 logs a refusal, a follower given another secret is refused too, and
  rank 0 goes on waiting until the genuine follower joins and the job serves.
- In one process with real ZMQ sockets: altered, replayed and foreign messages are refused.
- The codec: every message kind the channel sends comes back equal (arrays bitwise), and
  what it does not write is a ValueError.
- The ipc directory of an Engine is mode 0700 and gone after shutdown.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import pickle
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import ml_dtypes
import msgpack
import numpy as np
import pytest
import requests
import zmq

from sgl_jax.srt.forward_batch_info import ForwardMode, LogprobRequest, ModelWorkerBatch
from sgl_jax.srt.managers import control, node_auth, node_wire
from sgl_jax.srt.managers.step_channel import (
    ASK,
    CHALLENGE,
    GOODBYE,
    HELLO,
    REFUSED,
    STEP,
    FollowerChannel,
    LeaderChannel,
)
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.utils import free_port
from sgl_jax.testing import (
    engine_args,
    fake_devices_flags,
    free_port_pair,
    server_flags,
    wait_until,
)

SECRET = "correct horse battery staple 0123456789"


class Marker:
    """Unpickling this creates ``path``: what an attacker's pickle would do (os.system)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# -- a real rank 0 against strangers ---------------------------------------------------------
def _node_cmd(addr: str, rank: int, http_port: int) -> list[str]:
    return [sys.executable, "-m", "sgl_jax.launch_server", "--host", "127.0.0.1",
            "--port", str(http_port),
            *server_flags(tp_size=2, ep_size=2, disable_precompile=True, dist_timeout=10,
                          startup_timeout=240),
            "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr]


def _start(cmd: list[str], secret: str, log_path: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SGL_JAX_NODE_SECRET": secret,
           "XLA_FLAGS": fake_devices_flags(2)}
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _answer(sock: zmq.Socket) -> list[bytes] | None:
    return sock.recv_multipart() if sock.poll(5000) else None


def test_rank_0_refuses_strangers_and_wrong_secrets_then_serves(tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps((1, {"x": Marker(str(marker))}))
    addr = f"127.0.0.1:{free_port_pair()}"
    channel_port = int(addr.rpartition(":")[2]) + 1
    http_port = free_port()
    logs = {name: str(tmp_path / f"{name}.log") for name in ("leader", "wrong", "follower")}
    leader = _start(_node_cmd(addr, 0, http_port), SECRET, logs["leader"])
    procs = [leader]
    ctx = zmq.Context()
    try:
        assert wait_until(lambda: "waiting for 1 follower" in _read(logs["leader"]),
                          timeout=120), _read(logs["leader"])
        # Every framing a stranger could try; each answer is a refusal, nothing unpickled.
        attempts = [
            [evil],  # the old protocol's hello: a bare pickle
            [HELLO, evil],  # a hello without a tag
            [HELLO, os.urandom(32) + evil],  # with a made-up tag
        ]
        for frames in attempts:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(f"tcp://127.0.0.1:{channel_port}")
            sock.send_multipart(frames)
            answer = _answer(sock)
            assert answer is not None and answer[0] == REFUSED, answer
            sock.close(linger=0)
        # A stranger that plays by the protocol but has another secret.
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{channel_port}")
        sock.send(ASK)
        kind, nonce = _answer(sock)
        assert kind == CHALLENGE and len(nonce) == 32
        forged = node_auth.seal(b"not the secret of this job", node_auth.HELLO, nonce, evil)
        sock.send_multipart([HELLO, forged])
        assert _answer(sock)[0] == REFUSED
        sock.close(linger=0)
        # A follower given another secret: refused, it says why and exits 1.
        wrong = _start(_node_cmd(addr, 1, free_port()), "another secret, 32 bytes long!!",
                       logs["wrong"])
        procs.append(wrong)
        assert wrong.wait(120) == 1
        assert "node 0 refused this node" in _read(logs["wrong"])
        assert "does not verify with this job's node secret" in _read(logs["leader"])
        time.sleep(1)
        assert not marker.exists()
        assert leader.poll() is None, _read(logs["leader"])
        log = _read(logs["leader"])
        assert log.count("step channel: refused connection") >= 5, log
        assert "from 127.0.0.1" in log  # the peer's address is logged
        # Rank 0 still waits: the genuine follower joins, and the job serves.
        procs.append(_start(_node_cmd(addr, 1, free_port()), SECRET, logs["follower"]))

        def healthy() -> bool:
            assert leader.poll() is None, _read(logs["leader"])
            try:
                return requests.get(f"http://127.0.0.1:{http_port}/health",
                                    timeout=1).status_code == 200
            except requests.RequestException:
                return False

        assert wait_until(healthy, timeout=300, interval=0.5), _read(logs["leader"])
        res = requests.post(f"http://127.0.0.1:{http_port}/generate", timeout=120, json={
            "text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert res.status_code == 200, res.text
        info = requests.get(f"http://127.0.0.1:{http_port}/get_server_info", timeout=30)
        assert info.status_code == 200
        assert SECRET not in info.text
        assert not marker.exists()
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(60) == 0
        assert procs[-1].wait(60) == 0  # rank 0's goodbye verified: the follower exits 0
        for name in logs:
            assert SECRET not in _read(logs[name])
    finally:
        ctx.term()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_multi_node_job_without_a_secret_does_not_start():
    env = {k: v for k, v in os.environ.items() if k != node_auth.SECRET_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "sgl_jax.launch_server", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", "127.0.0.1:1234"],
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "SGL_JAX_NODE_SECRET" in out.stderr and "--node-secret-file" in out.stderr


def test_secret_from_a_file_and_its_refusals(tmp_path, monkeypatch):
    monkeypatch.delenv(node_auth.SECRET_ENV, raising=False)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    assert node_auth.load_node_secret(str(path)) == SECRET.encode()
    with pytest.raises(ValueError, match="SGL_JAX_NODE_SECRET.*--node-secret-file"):
        node_auth.load_node_secret(None)
    with pytest.raises(ValueError, match="cannot read --node-secret-file"):
        node_auth.load_node_secret(str(tmp_path / "missing"))
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        node_auth.load_node_secret(str(path))
    monkeypatch.setenv(node_auth.SECRET_ENV, SECRET)
    assert node_auth.load_node_secret(None) == SECRET.encode()
    with pytest.raises(ValueError, match="given twice"):
        node_auth.load_node_secret(str(path))


def test_the_secret_is_in_no_fingerprint_nor_server_info(tmp_path):
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.managers.multi_node import node_fingerprint
    from sgl_jax.testing import TEST_MODEL_PATH, ensure_test_model

    ensure_test_model()
    path = tmp_path / "secret"
    path.write_text(SECRET)
    args = ServerArgs(model_path=TEST_MODEL_PATH, nnodes=2, dist_init_addr="127.0.0.1:1",
                      node_secret_file=str(path))
    fingerprint = node_fingerprint(args, ModelConfig.from_hf(TEST_MODEL_PATH))
    assert SECRET not in repr(fingerprint)
    assert "--node-secret-file" not in fingerprint  # each host may keep it elsewhere
    assert SECRET not in repr(args.redacted())


# -- the channel itself: real ZMQ sockets in one process ---------------------------------------
def _describe(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    return [] if ours == theirs else ["fingerprints differ"]


def _channel_pair(secret: bytes = SECRET.encode()):
    addr = f"127.0.0.1:{free_port_pair()}"
    fatal: list[str] = []
    out: dict[str, LeaderChannel] = {}
    thread = threading.Thread(target=lambda: out.setdefault("leader", LeaderChannel(
        addr, 2, {"k": "v"}, 10, 30, fatal.append, _describe, secret)))
    thread.start()
    follower = FollowerChannel(addr, 1, {"k": "v"}, 10, 30, fatal.append, secret)
    thread.join(30)
    return out["leader"], follower, fatal


def test_altered_replayed_and_foreign_messages_are_refused():
    leader, follower, fatal = _channel_pair()
    try:
        batch = _batch()
        leader.publish("batch", (batch, []), "digest")
        op, payload, digest = follower.receive()
        assert (op, digest) == ("batch", "digest") and _equal(payload, (batch, []))
        # The next message, sealed as rank 0 would, then altered / replayed / foreign.
        leader.seq += 1
        good = leader._seal("expert_recorder", "start", "")
        send = leader.io.main_end.send_multipart
        for i in (0, 40, len(good) - 1):  # a byte of the tag, of the seq, of the payload
            bad = bytearray(good)
            bad[i] ^= 1
            send([STEP, bytes(bad)])
            with pytest.raises(ValueError, match="does not verify"):
                follower.receive()
        other_job = node_auth.seal(SECRET.encode(), node_auth.STEP, os.urandom(32),
                                   good[node_auth.TAG_BYTES:])
        send([STEP, other_job])
        with pytest.raises(ValueError, match="does not verify"):
            follower.receive()
        send([STEP, good])
        assert follower.receive() == ("expert_recorder", "start", "")
        send([STEP, good])  # replayed
        with pytest.raises(RuntimeError, match="got message 2 from rank 0, expected 3"):
            follower.receive()
        leader.close()
        assert follower.receive() is None
        assert fatal == []
    finally:
        leader.ctx.destroy(linger=0)
        follower.ctx.destroy(linger=0)


def test_a_stranger_after_start_up_does_not_disturb_the_job(tmp_path):
    leader, follower, fatal = _channel_pair()
    ctx = zmq.Context()
    try:
        marker = tmp_path / "pwned"
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://{leader.io.sock.getsockopt_string(zmq.LAST_ENDPOINT)[6:]}")
        sock.send_multipart([HELLO, pickle.dumps(Marker(str(marker)))])
        sock.send(GOODBYE)  # a stranger cannot stop rank 0's channel
        time.sleep(0.5)
        sock.close(linger=0)  # nor does its leaving look like a follower's
        time.sleep(1.0)
        leader.publish("expert_recorder", "stop")
        assert follower.receive() == ("expert_recorder", "stop", "")
        assert fatal == [] and not marker.exists()
    finally:
        ctx.destroy(linger=0)
        leader.close()
        leader.ctx.destroy(linger=0)
        follower.ctx.destroy(linger=0)


def test_mac_is_checked_before_decoding():
    body = pickle.dumps(Marker("/nonexistent/never"))
    with pytest.raises(ValueError, match="does not verify"):
        node_auth.open_sealed(b"k" * 32, node_auth.STEP, b"n" * 32, b"\0" * 32 + body)
    with pytest.raises(ValueError, match="shorter than its tag"):
        node_auth.open_sealed(b"k" * 32, node_auth.STEP, b"n" * 32, b"short")
    # The tag covers the label: a hello does not verify as a step, nor the reverse.
    sealed = node_auth.seal(b"k" * 32, node_auth.HELLO, b"n" * 32, b"body")
    with pytest.raises(ValueError):
        node_auth.open_sealed(b"k" * 32, node_auth.STEP, b"n" * 32, sealed)
    expected = hmac.new(b"k" * 32, node_auth.HELLO + b"n" * 32 + b"body",
                        hashlib.sha256).digest()
    assert sealed == expected + b"body"


# -- the codec ---------------------------------------------------------------------------------
def _batch(rows: int = 3, logprobs: bool = True) -> ModelWorkerBatch:
    rng = np.random.default_rng(0)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=20, stop=["x", "yz"],
                             stop_token_ids=[1, 2], seed=7).normalize()]
    params += [SamplingParams().normalize() for _ in range(rows - 1)]
    return ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND,
        req_pool_indices=np.arange(rows, dtype=np.int32),
        prefix_lens=rng.integers(0, 100, rows).astype(np.int32),
        extend_lens=np.full(rows, 5, np.int32),
        input_ids=rng.integers(-1, 1000, rows * 5).astype(np.int32),
        out_cache_loc=rng.integers(0, 4096, rows * 5).astype(np.int32),
        sampling_params=params, seeds=[2**64 - 1, 0, 2**63][:rows] + [1] * (rows - 3),
        steps=list(range(rows)), return_routed_experts=True,
        routed_reqs=np.array([True, False, True][:rows] + [False] * (rows - 3)),
        logprobs=LogprobRequest(token_ids=[[1, 2], None, [3]], extra_tokens=[0, 4],
                                extra_targets=[9, 8], extra_temperatures=[0.5, 1.0],
                                extra_token_ids=[None, [5]]) if logprobs else None,
    )


def _equal(a, b) -> bool:
    """Equal, arrays bitwise with the same dtype and shape, types alike throughout."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if dataclasses.is_dataclass(a):
        return all(_equal(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _messages() -> dict[str, object]:
    """Every message the channel sends, as (seq, op, payload, digest) or the hello's."""
    rng = np.random.default_rng(1)
    decode = dataclasses.replace(_batch(logprobs=False), forward_mode=ForwardMode.DECODE,
                                 routed_reqs=None, return_routed_experts=False)
    weights = {
        "model.layers.0.mlp.gate.weight": rng.standard_normal((8, 16)).astype(
            ml_dtypes.bfloat16),
        "model.embed_tokens.weight": np.array([[np.nan, -0.0, np.inf]], np.float32),
        "lm_head.weight": rng.standard_normal((3, 2)).astype(ml_dtypes.float8_e4m3fn),
        "scale": np.array(1.5, np.float16),  # 0-d
        "fortran": np.asfortranarray(rng.standard_normal((3, 4))),
        "big_endian": np.arange(4, dtype=">i4"),
    }
    pages = [(0, np.arange(0, 40, 8, dtype=np.int32)), (2, np.zeros(0, np.int32))]
    return {
        "prefill with prefix rows": [1, "batch", (_batch(), pages), "ab" * 16],
        "decode": [2, "batch", (decode, []), "cd" * 16],
        "weights from disk": [3, "control", control.UpdateWeightsFromDisk(
            model_path="/models/step-100", weight_version="v1", abort_all_requests=True), ""],
        "weights from arrays": [4, "control", control.UpdateWeightsFromArrays(arrays=weights), ""],
        "rebalance with load": [5, "control", control.RebalanceExperts(
            load=rng.integers(0, 1 << 40, (4, 8)).astype(np.int64)), ""],
        "rebalance without load": [6, "control", control.RebalanceExperts(), ""],
        "recorder start": [7, "control", control.StartExpertRecord(), ""],
        "recorder stop": [8, "control", control.StopExpertRecord(), ""],
        "outcome ok": [9, "outcome", None, ""],
        "outcome failed": [10, "outcome", "no such file", ""],
        "goodbye": [11, "goodbye", None, ""],
        "hello": {"rank": 1, "fingerprint": {"--tp-size": "2", "model weights": "ab12"},
                  "nonce": os.urandom(32)},
        "welcome": {"nonce": os.urandom(32), "errors": ["--tp-size: node 0 has 2, this 4"]},
    }


@pytest.mark.parametrize("name", list(_messages()))
def test_codec_round_trip_is_exact(name):
    message = _messages()[name]
    back = node_wire.decode(node_wire.encode(message))
    if name == "weights from arrays":  # big-endian arrays arrive little-endian, equal values
        sent = message[2].arrays["big_endian"]
        got = back[2].arrays.pop("big_endian")
        assert got.dtype == np.dtype("<i4") and np.array_equal(got, sent)
        message[2].arrays.pop("big_endian")
    assert _equal(back, message), (back, message)


def _control_ops(cls: type = control.ControlOp) -> list[type]:
    subclasses = cls.__subclasses__()
    return subclasses + [c for sub in subclasses for c in _control_ops(sub)]


def test_exactly_the_mirrored_control_operations_cross_to_the_followers():
    """An operation every node applies is on the codec's list (else a multi-node job fails
    when it is first used); one that only rank 0 applies is not (it cannot be sent)."""
    ops = {c for c in _control_ops() if dataclasses.is_dataclass(c)}
    mirrored = {c for c in ops if c.mirrored}
    assert {c.__name__ for c in mirrored} == {"UpdateWeightsFromDisk", "UpdateWeightsFromArrays",
                                              "RebalanceExperts", "StartExpertRecord",
                                              "StopExpertRecord", "ReleaseMemoryOccupation",
                                              "ResumeMemoryOccupation"}
    for cls in ops:
        assert (node_wire._DATACLASSES.get(cls.__name__) is cls) == cls.mirrored, cls
        assert cls.__name__ in node_wire.schema() or not cls.mirrored
    with pytest.raises(ValueError, match="FlushCache is not on the step channel's list"):
        node_wire.encode([1, "control", control.FlushCache(), ""])


def test_decoded_arrays_are_fresh_and_writable():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = node_wire.decode(node_wire.encode(a))
    b[0, 0] = 9
    assert b.flags.writeable and a[0, 0] == 0


def _ext(code: int, payload: object) -> bytes:
    data = payload if isinstance(payload, bytes) else msgpack.packb(payload)
    return msgpack.packb(msgpack.ExtType(code, data))


def _array_ext(dtype_name: str, shape: tuple[int, ...], raw: bytes) -> bytes:
    header = bytes([len(dtype_name)]) + dtype_name.encode() + bytes([len(shape)])
    header += b"".join(n.to_bytes(8, "little") for n in shape)
    return _ext(1, header + raw)


@pytest.mark.parametrize("data, error", [
    (_ext(3, ["Popen", {"args": "touch /tmp/x"}]), "unknown type 'Popen'"),
    (_ext(3, ["SamplingParams", {"temperature": 1.0, "evil": 1}]), "expected"),
    (_ext(3, ["SamplingParams", [1.0, 2.0]]),
     f"of 2 values, expected its {len(dataclasses.fields(SamplingParams))} fields"),
    (_ext(5, ["Popen", [["touch /tmp/x"]]]), "unknown type 'Popen'"),
    (_ext(5, ["LogprobRequest", [[1], [2], [3], [4]]]), "not 5 columns"),
    (_ext(5, ["LogprobRequest", [[1], [2], [3], [4], []]]), "of equal length"),
    (_ext(4, ["Signals", 9]), "unknown enum"),
    (_ext(4, ["ForwardMode", 99]), "not a valid ForwardMode"),
    (_ext(9, b"x"), "unknown extension type 9"),
    (_array_ext("object", (1,), b"\0" * 8), "dtype 'object'"),
    (_array_ext("O", (1,), b"\0" * 8), "dtype 'O'"),
    (_array_ext("int32", (2, 3), b"\0" * 20), "needs 24 bytes, got 20"),
    (_array_ext("int32", (2**40, 2**40), b""), "needs"),
    (_array_ext("int32", (2,), b"\0" * 12), "needs 8 bytes, got 12"),
    (_ext(1, b""), "truncated header"),
    (pickle.dumps(Marker("/nonexistent/never")), "malformed"),
    (msgpack.packb(1) + b"\x01", "malformed"),
    (msgpack.packb({1: "int keys"}), "malformed"),
])
def test_decoding_refuses_what_the_codec_does_not_write(data, error):
    with pytest.raises(ValueError, match=error):
        node_wire.decode(data)


def test_every_truncation_of_a_message_is_refused():
    data = node_wire.encode(_messages()["prefill with prefix rows"])
    for n in range(len(data)):
        with pytest.raises(ValueError):
            node_wire.decode(data[:n])


@pytest.mark.parametrize("value", [
    np.array([object()]), np.array(["text"]), {"x": object()}, Marker("/x"), {1, 2},
    np.datetime64("2024-01-01"), signal.SIGTERM,
])
def test_encoding_refuses_what_the_channel_does_not_carry(value):
    with pytest.raises(ValueError, match="cannot send this over the step channel"):
        node_wire.encode(value)


# -- ipc sockets ------------------------------------------------------------------------------
def test_port_args_live_in_a_private_directory():
    ports = PortArgs.new()
    try:
        assert stat.S_IMODE(os.stat(ports.ipc_dir).st_mode) == 0o700
        assert os.path.dirname(ports.ipc_dir) == tempfile.gettempdir()
        for endpoint in (ports.tokenizer_ipc, ports.scheduler_ipc, ports.detokenizer_ipc):
            assert os.path.dirname(endpoint.removeprefix("ipc://")) == ports.ipc_dir
    finally:
        ports.remove()
    assert not os.path.exists(ports.ipc_dir)


def test_engine_ipc_directory_is_private_and_removed_at_shutdown():
    from sgl_jax import Engine

    eng = Engine(**engine_args(precompile_bs_paddings=[1]))
    try:
        ipc_dir = eng._procs.port_args.ipc_dir
        assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
        # tokenizer_side: the side channel of large routed-experts arrays (transport.py).
        assert sorted(os.listdir(ipc_dir)) == ["detokenizer", "scheduler", "tokenizer",
                                               "tokenizer_side"]
        out = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2
    finally:
        eng.shutdown()
    assert not os.path.exists(ipc_dir)
