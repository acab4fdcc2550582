"""The finish path's one cast (M21 item 3): a request's rows gathered raw from the host table
(the storage dtype's signed twin when every id fits it) and cast once to the wire dtype by the
OutputSender (``to_wire_dtype``) equal, bit for bit, the table's int32 rows converted by the codec, for every table
dtype and every wire dtype that holds the experts; and the gather is the only copy for a wire
dtype of the table's width."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache
from sgl_jax.srt.routed_experts_codec import (
    ROUTED_EXPERTS_DTYPES,
    max_num_experts,
    to_wire_dtype,
)

LAYERS, TOP_K = 3, 4


@pytest.mark.parametrize("num_experts", [2, 16, 127, 128, 129, 255, 256, 300, 32768, 32769,
                                         65535])
def test_one_cast_equals_the_codec_on_int32_rows(num_experts: int) -> None:
    table = RoutedExpertsHostCache(64, LAYERS, TOP_K, num_experts)
    rng = np.random.default_rng(num_experts)
    slots = rng.permutation(64)[:40]
    rows = rng.integers(0, num_experts, (40, LAYERS, TOP_K)).astype(np.int32)
    rows[:5] = num_experts - 1  # the largest id, next to the marker
    rows[:, 1] = -1  # a layer without a router
    table.write(slots, rows)
    raw = table.gather(slots, raw=True)
    assert raw.dtype.itemsize == table.dtype.itemsize  # narrow: never widened before the wire
    np.testing.assert_array_equal(table.gather(slots), rows)
    for name in ROUTED_EXPERTS_DTYPES:
        if num_experts > max_num_experts(name):
            continue  # refused at the request (too narrow)
        got = to_wire_dtype(raw, name)
        want = to_wire_dtype(rows, name)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
        if got.dtype.itemsize == raw.dtype.itemsize:
            assert np.shares_memory(got, raw), name  # no copy besides the gather


def test_signed_view_only_when_every_id_fits() -> None:
    assert RoutedExpertsHostCache(8, 2, 2, 128).gather(np.arange(2), raw=True).dtype == np.int8
    assert RoutedExpertsHostCache(8, 2, 2, 129).gather(np.arange(2), raw=True).dtype == np.uint8
    assert RoutedExpertsHostCache(8, 2, 2, 32768).gather(np.arange(2), raw=True).dtype == \
        np.int16
    assert RoutedExpertsHostCache(8, 2, 2, 32769).gather(np.arange(2), raw=True).dtype == \
        np.uint16
