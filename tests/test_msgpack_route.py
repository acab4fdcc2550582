"""The binary route (M21): ``Accept: application/msgpack`` through a real server.

Every test asks the same server the same greedy request on both routes, JSON (base64 arrays)
and MessagePack (raw bytes), and checks that the decoded arrays, dtypes and shapes, the tokens
and the logprobs are identical; rows are also checked against the float64 reference.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import h11
import httpx
import msgpack
import numpy as np
import pytest

from sgl_jax.srt.entrypoints.http_connections import _UnjoinedConnection
from sgl_jax.srt.entrypoints.wire import (
    JSON_WIRE,
    MSGPACK_WIRE,
    SLICE_BYTES,
    negotiate,
    payload_slices,
)
from sgl_jax.srt.routed_experts_codec import (
    extract_prompt_routed_experts_from_meta_info,
    extract_routed_expert_weights_from_meta_info,
    extract_routed_experts_from_meta_info,
)
from sgl_jax.testing import server_flags
from sgl_jax.tools.reference_forward import ReferenceModel, routed_experts_rows
from tests.server_utils import server_fixture, sse_events

ARGS = server_flags(enable_return_routed_experts=True, enable_return_routed_expert_weights=True)
MSGPACK = {"Accept": "application/msgpack"}
GREEDY = {"temperature": 0}
# Keys that may differ between two runs of the same request whatever the route (the second
# run may hit the prefix cache).
_RUN_KEYS = ("e2e_latency", "id", "cached_tokens")


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, ARGS)


@pytest.fixture(scope="module")
def reference(server):
    return ReferenceModel(server.get("/get_model_info").json()["model_path"])


def _msgpack_values(content: bytes) -> list[Any]:
    unpacker = msgpack.Unpacker()
    unpacker.feed(content)
    return list(unpacker)


def _without_arrays(meta: dict[str, Any]) -> dict[str, Any]:
    """meta_info without the array payloads, the logprobs and the per-run keys; tuples as
    lists (MessagePack has no tuples)."""
    plain = {k: v for k, v in meta.items()
             if k not in _RUN_KEYS and "logprobs" not in k and k not in {"routed_experts", "routed_expert_weights",
                                                  "prompt_routed_experts",
                                                  "prompt_routed_expert_weights"}}
    return msgpack.unpackb(msgpack.packb(plain))


def _assert_same_arrays(a: Any, b: Any) -> None:
    """Ids exact; routing weights within float32 noise (two runs of a request may sum in
    other batch shapes, e.g. over the prefix cache)."""
    for extract in (extract_routed_experts_from_meta_info,
                    extract_routed_expert_weights_from_meta_info,
                    extract_prompt_routed_experts_from_meta_info):
        x, y = extract(a), extract(b)
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape
            if x.dtype.kind == "f":
                np.testing.assert_allclose(x, y, rtol=1e-3 if x.dtype == np.float16 else 1e-5,
                                           atol=1e-6)
            else:
                np.testing.assert_array_equal(x, y)


def _assert_same_logprobs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Every logprob list of two meta_infos: the same token ids, values within 1e-5."""
    keys = [k for k in a if "logprobs" in k]
    assert keys and keys == [k for k in b if "logprobs" in k]
    for key in keys:
        flat_a, flat_b = _flatten(a[key]), _flatten(b[key])
        assert [type(v) for v in flat_a] == [type(v) for v in flat_b], key
        for x, y in zip(flat_a, flat_b, strict=True):
            if isinstance(x, float):
                assert abs(x - y) <= 1e-5, key
            else:
                assert x == y, key


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [v for item in value for v in _flatten(item)]
    return [value]


@pytest.mark.parametrize("ids_dtype,weights_dtype", [
    ("int32", "float32"), ("int16", "float16"), ("uint16", "float32"), ("uint8", "float16")])
def test_generate_msgpack_equals_json(server, reference, ids_dtype, weights_dtype) -> None:
    ids = [31, 32, 33, 34, 35, 36]
    body = {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 5},
            "return_routed_experts": True, "routed_experts_dtype": ids_dtype,
            "return_routed_expert_weights": True, "routed_expert_weights_dtype": weights_dtype,
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "routed_experts_start_len": 1}
    as_json = server.post("/generate", json=body)
    as_msgpack = server.post("/generate", json=body, headers=MSGPACK)
    assert as_json.status_code == as_msgpack.status_code == 200, as_msgpack.text
    assert as_json.headers["content-type"] == "application/json"
    assert as_msgpack.headers["content-type"] == "application/msgpack"
    j, m = as_json.json(), msgpack.unpackb(as_msgpack.content)
    meta = m["meta_info"]
    # Raw little-endian bytes with their dtype and shape beside them: no base64 text.
    assert isinstance(meta["routed_experts"], bytes)
    assert isinstance(meta["routed_expert_weights"], bytes)
    assert meta["routed_experts_dtype"] == ids_dtype
    assert meta["routed_expert_weights_dtype"] == weights_dtype
    itemsize = np.dtype(ids_dtype).itemsize
    assert len(meta["routed_experts"]) == itemsize * int(np.prod(meta["routed_experts_shape"]))
    assert isinstance(j["meta_info"]["routed_experts"], str)  # JSON stays base64
    _assert_same_arrays(j, m)
    assert m["output_ids"] == j["output_ids"] and m["text"] == j["text"]
    assert _without_arrays(meta) == _without_arrays(j["meta_info"])
    _assert_same_logprobs(meta, j["meta_info"])
    rows = extract_routed_experts_from_meta_info(m)
    want = routed_experts_rows(reference, ids, m["output_ids"], start_len=1)
    if ids_dtype.startswith("u"):  # no router-less layers here, but keep the rule visible
        want = np.where(want < 0, np.iinfo(ids_dtype).max, want)
    np.testing.assert_array_equal(rows, want.astype(ids_dtype))


def test_generate_msgpack_stream_joins_to_the_whole(server) -> None:
    """A stream is MessagePack values back to back, one per chunk; the chunks' rows and
    logprobs join to the non-streamed result, and equal the event stream's."""
    body = {"input_ids": [[7, 8, 9, 10], [50, 51, 52]],
            "sampling_params": {**GREEDY, "max_new_tokens": 6}, "stream": True,
            "return_routed_experts": True, "return_routed_expert_weights": True,
            "return_logprob": True}
    whole = msgpack.unpackb(server.post("/generate", json={**body, "stream": False},
                                        headers=MSGPACK).content)
    res = server.post("/generate", json=body, headers=MSGPACK, stream=True)
    assert res.status_code == 200
    assert res.headers["content-type"] == "application/msgpack"
    unpacker = msgpack.Unpacker()
    chunks = []
    for data in res.iter_content(chunk_size=None):
        unpacker.feed(data)
        chunks.extend(unpacker)
    events = [e for e in sse_events(server.post("/generate", json=body, stream=True))
              if e != "[DONE]"]
    for i, expected in enumerate(whole):
        mine = [c for c in chunks if c["index"] == i]
        theirs = [e for e in events if e["index"] == i]
        assert sum((c["output_ids"] for c in mine), []) == expected["output_ids"]
        starts = [c["meta_info"]["routed_experts_start"] for c in mine]
        parts = [extract_routed_experts_from_meta_info(c) for c in mine]
        assert starts == [sum(len(p) for p in parts[:j]) for j in range(len(parts))]
        # Ids are exact across runs; weights within float32 noise (another run sums in
        # another batch shape, e.g. over the prefix cache).
        for extract, compare in ((extract_routed_experts_from_meta_info,
                                  np.testing.assert_array_equal),
                                 (extract_routed_expert_weights_from_meta_info,
                                  lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                                          atol=1e-6))):
            joined = np.concatenate([extract(c) for c in mine])
            compare(joined, extract(expected))
            compare(joined, np.concatenate([extract(e) for e in theirs]))
        logprobs = sum((c["meta_info"]["output_token_logprobs"] for c in mine), [])
        want = expected["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in logprobs] == [e[1] for e in want]
        np.testing.assert_allclose([e[0] for e in logprobs], [e[0] for e in want], atol=1e-5)


def test_split_prompt_rows_and_a_batch(server) -> None:
    body = {"input_ids": [[60, 61, 62, 63], [60, 61, 62, 63]],
            "sampling_params": {**GREEDY, "max_new_tokens": 3},
            "return_routed_experts": True, "routed_experts_split": True}
    j = server.post("/generate", json=body).json()
    m = msgpack.unpackb(server.post("/generate", json=body, headers=MSGPACK).content)
    assert isinstance(m[0]["meta_info"]["prompt_routed_experts"], bytes)
    assert "prompt_routed_experts" not in m[1]["meta_info"]
    for a, b in zip(j, m, strict=True):
        _assert_same_arrays(a, b)


def test_openai_routes_carry_raw_arrays(server) -> None:
    """The OpenAI routes' extension fields (``choices[i].meta_info``) on both routes; n = 2
    choices and a chat stream."""
    body = {"prompt": "The lighthouse", "max_tokens": 4, "n": 2, "seed": 3,
            "return_routed_experts": True, "return_routed_expert_weights": True}
    j = server.post("/v1/completions", json=body).json()
    res = server.post("/v1/completions", json=body, headers=MSGPACK)
    assert res.headers["content-type"] == "application/msgpack"
    m = msgpack.unpackb(res.content)
    assert [c["text"] for c in m["choices"]] == [c["text"] for c in j["choices"]]
    assert m["usage"]["completion_tokens"] == j["usage"]["completion_tokens"]
    for a, b in zip(j["choices"], m["choices"], strict=True):
        assert isinstance(b["meta_info"]["routed_experts"], bytes)
        _assert_same_arrays(a, b)

    chat = {"messages": [{"role": "user", "content": "Tell me of the sea"}], "max_tokens": 5,
            "temperature": 0, "stream": True, "return_routed_experts": True,
            "stream_options": {"include_usage": True}}
    events = [e for e in sse_events(server.post("/v1/chat/completions", json=chat, stream=True))
              if e != "[DONE]"]
    frames = _msgpack_values(server.post("/v1/chat/completions", json=chat,
                                         headers=MSGPACK).content)
    assert len(frames) == len(events)
    # The usage chunk, then the body ends (the second run hits the prefix cache).
    assert frames[-1]["usage"]["completion_tokens"] == events[-1]["usage"]["completion_tokens"]

    def rows(chunks: list[dict[str, Any]]) -> np.ndarray:
        return np.concatenate([extract_routed_experts_from_meta_info(c) for c in chunks
                               if c["choices"] and c["choices"][0].get("meta_info")])

    np.testing.assert_array_equal(rows(frames), rows(events))


def test_httpx_client_as_in_the_docs(server) -> None:
    """The client of docs/routed_experts.md: httpx + msgpack -> numpy, whole and streamed."""
    url = server.url
    res = httpx.post(url + "/generate", headers={"Accept": "application/msgpack"}, timeout=60,
                     json={"text": "Waves", "sampling_params": {"max_new_tokens": 3,
                                                                "temperature": 0},
                           "return_routed_experts": True})
    res.raise_for_status()
    out = msgpack.unpackb(res.content)
    meta = out["meta_info"]
    rows = np.frombuffer(meta["routed_experts"],
                         dtype=np.dtype(meta["routed_experts_dtype"]).newbyteorder("<"))
    rows = rows.reshape(meta["routed_experts_shape"])
    np.testing.assert_array_equal(rows, extract_routed_experts_from_meta_info(out))
    assert rows.shape[0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1

    parts = []
    with httpx.stream("POST", url + "/generate", headers={"Accept": "application/msgpack"},
                      timeout=60,
                      json={"text": "Waves", "stream": True, "return_routed_experts": True,
                            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}) as r:
        unpacker = msgpack.Unpacker()
        for data in r.iter_bytes():
            unpacker.feed(data)
            for chunk in unpacker:
                parts.append(extract_routed_experts_from_meta_info(chunk))
    np.testing.assert_array_equal(np.concatenate(parts), rows)

    # The read for long bodies: http.client straight into one numpy buffer (the docs'
    # post_msgpack), over one kept-alive connection, and its error path.
    def post_msgpack(conn: http.client.HTTPConnection, path: str, body: dict) -> dict:
        for attempt in range(2):
            try:
                conn.request("POST", path, body=json.dumps(body),
                             headers={"Content-Type": "application/json",
                                      "Accept": "application/msgpack"})
                res = conn.getresponse()
                break
            except ConnectionError:  # kept alive, then closed by the server: once more
                conn.close()
                if attempt:
                    raise
        buf = np.empty(int(res.getheader("Content-Length")), np.uint8)
        view, pos = memoryview(buf), 0
        while pos < len(buf):
            n = res.readinto(view[pos:])
            if not n:
                raise ConnectionError("the body ended early")
            pos += n
        if res.status != 200:
            raise RuntimeError(json.loads(bytes(view)))
        return msgpack.unpackb(view)

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        body = {"text": "Waves", "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        for _ in range(2):  # the second over the same connection
            read = post_msgpack(conn, "/generate", body)
            assert read["output_ids"] == out["output_ids"]
            np.testing.assert_array_equal(extract_routed_experts_from_meta_info(read), rows)
        with pytest.raises(RuntimeError, match="max_new_tokens"):
            post_msgpack(conn, "/generate", {**body, "sampling_params": {"max_new_tokens": -1}})
        assert post_msgpack(conn, "/generate", body)["output_ids"] == out["output_ids"]
        time.sleep(5.5)  # past uvicorn's keep-alive timeout: the server closes the connection
        assert post_msgpack(conn, "/generate", body)["output_ids"] == out["output_ids"]
    finally:
        conn.close()


def test_bad_format_is_a_400_and_the_server_keeps_serving(server) -> None:
    base = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2},
            "return_routed_experts": True}
    res = server.post("/generate", json={**base, "routed_experts_format": "numpy"})
    assert res.status_code == 400
    error = res.json()["error"]
    assert error["param"] == "routed_experts_format" and "msgpack" in error["message"]
    res = server.post("/generate", json={**base, "routed_experts_format": "hex"},
                      headers=MSGPACK)
    assert res.status_code == 400 and res.headers["content-type"] == "application/json"
    assert res.json()["error"]["param"] == "routed_experts_format"
    # base64 asked for explicitly inside a MessagePack body is honoured.
    m = msgpack.unpackb(server.post("/generate", json={**base, "routed_experts_format": "base64"},
                                    headers=MSGPACK).content)
    assert isinstance(m["meta_info"]["routed_experts"], str)
    # Per prompt: a prompt without the field follows the Accept header.
    both = msgpack.unpackb(server.post("/generate", headers=MSGPACK, json={
        **base, "input_ids": [[1, 2, 3], [4, 5, 6]],
        "routed_experts_format": [None, "base64"]}).content)
    assert isinstance(both[0]["meta_info"]["routed_experts"], bytes)
    assert isinstance(both[1]["meta_info"]["routed_experts"], str)
    assert server.post("/generate", json={**base, "input_ids": [[1, 2], [3, 4]],
                                          "routed_experts_format": ["base64", "numpy"]}
                       ).status_code == 400
    assert server.post("/generate", json=base).status_code == 200
    info = server.get("/get_server_info").json()
    assert info["num_running_reqs"] == 0 and info["free_req_slots"] == info["total_req_slots"]


def test_accept_negotiation(server) -> None:
    cases = {
        None: JSON_WIRE,
        "*/*": JSON_WIRE,
        "application/json": JSON_WIRE,
        "application/msgpack": MSGPACK_WIRE,
        "application/x-msgpack": MSGPACK_WIRE,
        "application/vnd.msgpack;q=0.9, text/plain": MSGPACK_WIRE,
        "application/json, application/msgpack;q=0.5": JSON_WIRE,
        "application/msgpack;q=0": JSON_WIRE,
        "application/msgpack;q=bad": JSON_WIRE,
        "application/json;q=0.2, application/msgpack": MSGPACK_WIRE,
    }
    for accept, wire in cases.items():
        assert negotiate(accept) is wire, accept
    res = server.post("/generate", headers={"Accept": "application/msgpack;q=0"}, json={
        "input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1},
        "return_routed_experts": True})
    assert res.headers["content-type"] == "application/json"
    assert isinstance(res.json()["meta_info"]["routed_experts"], str)


@pytest.mark.parametrize("n", [0, 1, 255, 256, 65535, 65536, 3 * (1 << 20) + 5])
def test_spliced_body_equals_the_packers_own(n) -> None:
    """The spliced MessagePack body (arrays' buffers spliced in, not packed) is byte for byte
    what msgpack writes for the same value with the arrays as bytes, at every bin size
    (bin8 / bin16 / bin32) and across slices; numpy scalars become numbers."""
    rng = np.random.default_rng(n)
    ids = rng.integers(0, 255, n, dtype=np.uint8)
    weights = rng.random((3, 2), dtype=np.float32)
    value = {"text": "x", "meta_info": {"routed_experts": ids, "w": weights, "again": ids,
                                        "n": np.int64(7), "nested": [{"a": weights[:1]}]}}
    as_bytes = {"text": "x", "meta_info": {
        "routed_experts": ids.tobytes(), "w": weights.tobytes(), "again": ids.tobytes(),
        "n": 7, "nested": [{"a": weights[:1].tobytes()}]}}
    spliced = MSGPACK_WIRE.dumps(value)
    slices = list(payload_slices(spliced))
    assert all(len(s) <= SLICE_BYTES for s in slices)
    assert b"".join(slices) == msgpack.packb(as_bytes, use_bin_type=True)
    assert spliced.nbytes == sum(len(s) for s in slices)


def test_a_value_that_msgpack_cannot_write_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cannot write a object"):
        MSGPACK_WIRE.dumps({"x": object()})


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_slice_reaches_the_transport_unjoined(chunked: bool) -> None:
    """The server's h11 connection hands a Content-Length body's slice to the transport as the
    buffer it is (no copy into a fresh bytes); a chunked body is still framed; a real h11
    client reads either back."""
    server, client = _UnjoinedConnection(h11.SERVER), h11.Connection(h11.CLIENT)
    server.receive_data(client.send(h11.Request(method="POST", target="/generate",
                                                headers=[("Host", "x"), ("Content-Length", "0")]))
                        + client.send(h11.EndOfMessage()))
    assert type(server.next_event()) is h11.Request
    assert type(server.next_event()) is h11.EndOfMessage
    body = memoryview(bytearray(b"0123456789"))
    framing = ("Transfer-Encoding", "chunked") if chunked else ("Content-Length", "10")
    sent = [server.send(h11.Response(status_code=200, headers=[framing]))]
    for piece in (body[:6], body[6:]):
        out = server.send(h11.Data(data=piece))
        assert (out is piece) is not chunked
        sent.append(out)
    sent.append(server.send(h11.EndOfMessage()))
    client.receive_data(b"".join(bytes(s) for s in sent))
    got, event = b"", client.next_event()
    assert type(event) is h11.Response and event.status_code == 200
    while type(event := client.next_event()) is h11.Data:
        got += bytes(event.data)
    assert type(event) is h11.EndOfMessage and got == b"0123456789"
