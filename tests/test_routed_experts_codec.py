"""The routed-experts wire codec: JAX-free, and decoding whatever shape of response it is given.

The ``openai`` client's objects are covered against the real server in test_openai_api.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from sgl_jax.srt.routed_experts_codec import (
    ROUTED_EXPERTS_DTYPES,
    encode_routed_expert_weights,
    encode_routed_experts,
    encoded_num_bytes,
    extract_routed_expert_weights_from_meta_info,
    extract_routed_experts_from_meta_info,
    max_num_experts,
    no_router_marker,
    to_wire_dtype,
)

ROWS = np.arange(5 * 4 * 2, dtype=np.int32).reshape(5, 4, 2) - 1  # includes -1 (no router)


def test_codec_and_detokenizer_do_not_import_jax():
    code = (
        "import sys\n"
        "import sgl_jax.srt.routed_experts_codec\n"
        "import sgl_jax.srt.managers.detokenizer_manager\n"
        "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib')))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_round_trip_is_little_endian_int32():
    encoded = encode_routed_experts(ROWS)
    flat = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": encoded}})
    assert flat.dtype == np.int32
    np.testing.assert_array_equal(flat.reshape(ROWS.shape), ROWS)
    import pybase64

    raw = pybase64.b64decode(encoded)
    assert raw == ROWS.astype("<i4").tobytes()


def test_accepts_response_meta_info_and_openai_shapes():
    meta = {"prompt_tokens": 3, "routed_experts": encode_routed_experts(ROWS)}
    choice = {"index": 0, "text": "x", "meta_info": meta}
    for data in (
        {"text": "x", "meta_info": meta},  # Engine / /generate response
        meta,  # its meta_info
        choice,  # an OpenAI choice (or stream chunk choice)
        {"id": "cmpl-1", "choices": [choice]},  # an OpenAI response with one choice
    ):
        np.testing.assert_array_equal(
            extract_routed_experts_from_meta_info(data).reshape(ROWS.shape), ROWS)


def test_absent_is_none_and_several_choices_need_one():
    assert extract_routed_experts_from_meta_info({"meta_info": {"prompt_tokens": 3}}) is None
    assert extract_routed_experts_from_meta_info({"prompt_tokens": 3}) is None
    assert extract_routed_experts_from_meta_info({"choices": [{"index": 0}]}) is None
    two = {"choices": [{"meta_info": {}}, {"meta_info": {}}]}
    with pytest.raises(ValueError, match="2 choices; pass one of them"):
        extract_routed_experts_from_meta_info(two)


@pytest.mark.parametrize("dtype,marker", [("int32", -1), ("int16", -1), ("uint16", 65535),
                                          ("uint8", 255)])
def test_every_wire_dtype_describes_itself(dtype, marker):
    import pybase64

    rows = ROWS.copy()
    meta = {"routed_experts": encode_routed_experts(to_wire_dtype(rows, dtype)),
            "routed_experts_dtype": dtype, "routed_experts_shape": list(rows.shape)}
    got = extract_routed_experts_from_meta_info({"meta_info": meta})
    assert got.dtype == np.dtype(dtype) and got.shape == rows.shape
    want = np.where(rows < 0, marker, rows)
    np.testing.assert_array_equal(got.astype(np.int64), want)
    # Little-endian on the wire, whatever the host.
    raw = pybase64.b64decode(meta["routed_experts"])
    assert raw == want.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert encoded_num_bytes(meta["routed_experts"]) == len(raw)
    assert no_router_marker(dtype) == marker


def test_narrow_host_rows_keep_the_no_router_marker():
    """Rows stored unsigned (the marker is the dtype's maximum) convert to every wire dtype."""
    stored = np.array([[[3, 255]]], dtype=np.uint8)
    assert to_wire_dtype(stored, "int32").tolist() == [[[3, -1]]]
    assert to_wire_dtype(stored, "uint16").tolist() == [[[3, 65535]]]
    assert to_wire_dtype(stored, "uint8").tolist() == [[[3, 255]]]


def test_max_num_experts_and_server_args_names():
    from sgl_jax.srt.server_args import ROUTED_EXPERTS_DTYPES as CLI_DTYPES

    assert tuple(ROUTED_EXPERTS_DTYPES) == CLI_DTYPES
    assert [max_num_experts(d) for d in ("uint8", "int16", "uint16", "int32")] == [
        255, 32768, 65535, 2**31]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_routing_weights_round_trip(dtype):
    import pybase64

    weights = np.random.default_rng(0).random((5, 4, 2)).astype(np.float32)
    meta = {"routed_expert_weights": encode_routed_expert_weights(weights, dtype),
            "routed_expert_weights_dtype": dtype, "routed_expert_weights_shape": [5, 4, 2]}
    got = extract_routed_expert_weights_from_meta_info({"choices": [{"meta_info": meta}]})
    assert got.dtype == np.dtype(dtype) and got.shape == weights.shape
    np.testing.assert_array_equal(got, weights.astype(dtype))
    raw = pybase64.b64decode(meta["routed_expert_weights"])
    assert raw == weights.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert extract_routed_expert_weights_from_meta_info({"meta_info": {}}) is None


def test_an_empty_chunk_decodes_to_zero_rows():
    meta = {"routed_experts": encode_routed_experts(np.zeros((0, 4, 2), np.uint8)),
            "routed_experts_dtype": "uint8", "routed_experts_shape": [0, 4, 2]}
    got = extract_routed_experts_from_meta_info(meta)
    assert meta["routed_experts"] == "" and got.shape == (0, 4, 2) and got.dtype == np.uint8
