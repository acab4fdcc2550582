"""The ``gmm`` expert backend (Megablox grouped matmul; Pallas interpret mode on CPU).

Against the float64 per-token reference (``tests/test_moe_backends.reference_moe``) for random
routing, EP-like local ids with the sentinel, uneven and empty groups, ``T * k`` not a multiple
of the row tile, garbage in the rows no group holds, bfloat16; under ``shard_map`` with expert
and tensor parallelism (a 4-fake-device subprocess); and the whole model forward with
``--moe-backend gmm`` against the independent float64 reference forward (routed experts
exactly, logits to 1e-5). The tile rule is checked against the constraints of Mosaic and the
table of ``docs/moe_backends.md``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.layers.moe import gmm, gmm_combine, gmm_gate_up, vmem_rows
from sgl_jax.srt.layers.moe.ep_moe import ep_moe_forward
from sgl_jax.srt.layers.moe.experts import (
    MOE_BACKEND_CHOICES,
    MOE_BACKENDS,
    create_moe_backend,
    get_moe_backend,
    resolve_moe_backend,
)
from sgl_jax.testing import fake_devices_flags
from tests.test_moe_backends import (
    BF16_TOL,
    IDENTITY,
    REL_TOL,
    SHUFFLED,
    make_case,
    physical,
    reference_moe,
    rel_err,
    run_layer,
)

REPO = Path(__file__).absolute().parents[1]
LOCAL_ROWS = 6  # an EP-like device holding logical experts 0..5 as rows 0..5 (of 16)


def local_case(seed: int, tokens: int, routing: str = "random", experts: int = 16,
               **shape: int) -> dict[str, np.ndarray]:
    """A device's view of a case: rows 0..LOCAL_ROWS-1 are its experts (``w_*`` sliced),
    every other assignment has the sentinel row LOCAL_ROWS (``ep_moe``'s convention; with
    ``experts`` = LOCAL_ROWS the device holds every assignment). ``full`` keeps the whole
    case for the reference."""
    case = make_case(seed, tokens, routing, experts=experts, **shape)
    ids = case["topk_ids"]
    out: dict[str, Any] = {k: case[k] for k in ("x", "topk_weights")}
    out["local_ids"] = np.where(ids < LOCAL_ROWS, ids, LOCAL_ROWS).astype(np.int32)
    for k in ("w_gate", "w_up", "w_down"):
        out[k] = case[k][:LOCAL_ROWS]
    out["full"] = case
    return out


def local_reference(case: dict[str, Any]) -> np.ndarray:
    """float64: only the device's own experts contribute (the others with weight 0)."""
    full = case["full"]
    held = full["topk_ids"] < LOCAL_ROWS
    return reference_moe({**full, "topk_weights": np.where(held, full["topk_weights"], 0.0)})


@functools.cache
def _local_fn() -> Any:
    return jax.jit(get_moe_backend("gmm"))


def run_local(case: dict[str, np.ndarray]) -> np.ndarray:
    args = [case[k] for k in ("x", "local_ids", "topk_weights", "w_gate", "w_up", "w_down")]
    return np.asarray(_local_fn()(*args))


# -- single device ------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,routing,order", [
    (1, "random", IDENTITY),
    (37, "random", SHUFFLED),  # T*k = 148: not a multiple of any row tile
    (29, "same", SHUFFLED),  # k huge groups, every other group empty
])
def test_gmm_matches_reference(tokens, routing, order):
    case = make_case(tokens, tokens, routing)
    got = run_layer(case, order, "gmm")
    assert got.shape == (tokens, case["x"].shape[1])
    assert rel_err(got, reference_moe(case)) < REL_TOL
    assert rel_err(got, run_layer(case, order, "ragged")) < REL_TOL


@pytest.mark.parametrize("tokens,routing", [(23, "random"), (40, "same")])
def test_gmm_sentinel_uneven_and_empty_groups(tokens, routing):
    case = local_case(11 + tokens, tokens, routing)
    local = case["local_ids"]
    counts = np.bincount(local.reshape(-1), minlength=LOCAL_ROWS + 1)
    assert counts[LOCAL_ROWS] > 0  # some assignments are held elsewhere
    if routing == "same":
        assert (counts[:LOCAL_ROWS] == 0).any()  # empty groups
    got = run_local(case)
    want = local_reference(case)
    assert np.isfinite(got).all()
    assert rel_err(got, want) < REL_TOL


def test_all_assignments_elsewhere_gives_zero():
    """A device none of whose experts is chosen: every group empty, the result exactly 0."""
    case = local_case(3, 9)
    case["local_ids"] = np.full_like(case["local_ids"], LOCAL_ROWS)
    np.testing.assert_array_equal(run_local(case), 0.0)


@pytest.fixture
def unset_is_nan(monkeypatch):
    """The EP passes' loop-carried sums start as ``jax.lax.empty``: on TPU uninitialised
    memory, zeros on CPU. NaN here, so that a pass reading them before it should (or a
    result that is the unwritten carry) shows."""
    monkeypatch.setattr(jax.lax, "empty",
                        lambda shape, dtype, **_: jnp.full(shape, jnp.nan, dtype))
    jax.clear_caches()  # read at trace time
    yield
    jax.clear_caches()


def test_all_assignments_elsewhere_under_ep_gives_zero(unset_is_nan):
    """Under EP, a device none of whose experts is chosen still takes one pass: it writes
    its sums (zeros), never returns the loop's unread carry."""
    case = local_case(3, 9)
    case["local_ids"] = np.full_like(case["local_ids"], LOCAL_ROWS)
    args = [case[k] for k in ("x", "local_ids", "topk_weights", "w_gate", "w_up", "w_down")]
    assert gmm.pass_rows(case["local_ids"].size, 4, gmm.CAPACITY_FACTOR) < case["local_ids"].size
    for out_dtype in (jnp.float32, jnp.bfloat16):
        backend = functools.partial(gmm.GmmExperts(shards=4), out_dtype=out_dtype)
        got = jax.jit(backend)(*args)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), 0.0)


@pytest.mark.parametrize("routing,shards,factor,experts", [
    ("random", 4, 2.0, 16),  # a wide window: usually one pass
    ("random", 8, 1.0, 16),  # a small window: several passes, groups split across windows
    ("same", 8, 0.5, 16),  # every token on the same experts: many passes
    ("random", 16, 0.5, LOCAL_ROWS),  # every assignment held: the last window runs past M
])
def test_passes_over_windows_of_the_local_assignments(routing, shards, factor, experts,
                                                      nan_in_unwritten_rows, unset_is_nan):
    """Under EP (``shards`` > 1) the assignments are computed in windows of
    ``pass_rows`` sorted positions (padded to the row tile): however many passes the routing
    needs, the result is the reference's (nothing dropped, nothing counted twice), with NaN
    in unwritten rows."""
    case = local_case(29, 33 if experts == LOCAL_ROWS else 47, routing, experts)
    local = case["local_ids"]
    held = int((local < LOCAL_ROWS).sum())
    rows = gmm.pass_rows(local.size, shards, factor)
    window = gmm.pad_rows(rows, gmm.row_tile(rows, case["w_gate"], case["w_down"]))
    assert window < local.size
    if factor < 2.0:
        assert held > window  # more than one window of held assignments
    if experts == LOCAL_ROWS:
        assert held == local.size and held % window  # the last window ends past M
    args = [case[k] for k in ("x", "local_ids", "topk_weights", "w_gate", "w_up", "w_down")]
    backend = gmm.GmmExperts(shards=shards, capacity_factor=factor)
    got = np.asarray(jax.jit(backend)(*args))
    assert np.isfinite(got).all()
    assert rel_err(got, local_reference(case)) < REL_TOL


def test_passes_with_a_bias_column(unset_is_nan):
    """gpt-oss's experts read ``[x, 1]`` against ``[E, H + 1, I]`` gate/up weights (the bias
    as one more input row) and write ``[T, H]``: under EP, where the sums are carried over
    passes, the carry is the output's width, not x's (a [T, H + 1] carry failed to compile
    at gpt-oss-120b's widths). A zero bias row gives the plain layer's result."""
    case = local_case(29, 47, "random", 16)
    tokens = case["x"].shape[0]
    x = np.concatenate([case["x"], np.ones((tokens, 1), case["x"].dtype)], axis=1)
    biased = {k: np.concatenate([case[k], np.zeros_like(case[k][:, :1])], axis=1)
              for k in ("w_gate", "w_up")}
    backend = gmm.GmmExperts(shards=8, capacity_factor=0.5)  # several passes
    got = np.asarray(jax.jit(backend)(x, case["local_ids"], case["topk_weights"],
                                      biased["w_gate"], biased["w_up"], case["w_down"]))
    assert got.shape == case["x"].shape
    assert rel_err(got, local_reference(case)) < REL_TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shards,factor", [(4, 1.25), (8, 0.5), (16, 0.25)])
def test_passes_with_fetched_rows(monkeypatch, unset_is_nan, dtype, shards, factor):
    """The prefill path under EP: gate/up fetching its rows by DMA (x too large to hold;
    bfloat16 x packed once for all passes) and the combine kernel updating the earlier
    passes' sums in place (in the output dtype: bfloat16 for bfloat16), over one to
    several windows: the reference's result."""
    case = local_case(29, 47, "random", 16, hidden=256, inter=128)
    tokens, hidden = case["x"].shape
    # x not held whole, the sums (with the earlier passes') held 128 columns at a time.
    out_item = jnp.dtype(dtype).itemsize
    monkeypatch.setattr(vmem_rows, "HELD_BUDGET", vmem_rows.pad_block(tokens) * 128
                        * gmm_combine.SUMS_BYTES)
    jax.clear_caches()
    rows = gmm.pass_rows(case["local_ids"].size, shards, factor)
    tm = gmm.row_tile(rows, case["w_gate"], case["w_down"])
    window = gmm.pad_rows(rows, tm)
    assert gmm_gate_up.token_mode(tokens, hidden, 128, dtype, window, tm) == gmm_gate_up.FETCH
    assert gmm_combine.fits(tokens, hidden, window, tm, 128, 4, out_item)
    if factor < 1:
        assert int((case["local_ids"] < LOCAL_ROWS).sum()) > 2 * window  # three passes or more
    args = [case[k] for k in ("x", "local_ids", "topk_weights", "w_gate", "w_up", "w_down")]
    args = [jnp.asarray(a, dtype) if k in (0, 3, 4, 5) else a for k, a in enumerate(args)]
    backend = functools.partial(gmm.GmmExperts(shards=shards, capacity_factor=factor),
                                out_dtype=dtype)
    traced = str(jax.make_jaxpr(backend)(*args))
    assert "name=gate_up_act" in traced and "name=down_and_combine" in traced
    assert "name=gather_rows" not in traced
    out = jax.jit(backend)(*args)
    assert out.dtype == dtype
    got = np.asarray(out.astype(jnp.float32))
    jax.clear_caches()
    assert np.isfinite(got).all()
    tol = REL_TOL if dtype == jnp.float32 else 2e-2  # bf16 inputs and activations
    want = local_reference(case) if dtype == jnp.float32 else local_reference({
        **case, "full": {**case["full"], **{k: np.asarray(jnp.asarray(case["full"][k], dtype)
                                                         .astype(jnp.float32))
                                            for k in ("x", "w_gate", "w_up", "w_down")}}})
    assert rel_err(got, want) < tol


def test_row_tile_pads_a_window_by_at_most_an_eighth():
    """The window of an EP pass (1.25x a device's share) padded to the row tile: the tile
    is halved while it would pad by more than an eighth (XLA's estimates count the padding:
    160 rows would be 192 at the 64-row tile the tilings pick)."""
    w_gate = jax.ShapeDtypeStruct((32, 4096, 384), jnp.bfloat16)
    w_down = jax.ShapeDtypeStruct((32, 384, 4096), jnp.bfloat16)
    for rows in (160, 640, 20_480, 43, 3):
        tm = gmm.row_tile(rows, w_gate, w_down)
        assert tm in gmm.ROW_TILES  # the smallest tile may pad more: it cannot be halved
        assert tm == gmm.ROW_TILES[-1] or gmm.pad_rows(rows, tm) - rows <= rows // 8
    assert gmm.row_tile(160, w_gate, w_down) == 32
    assert gmm.pad_rows(gmm.pass_rows(64 * 8, 4, gmm.CAPACITY_FACTOR),
                        gmm.row_tile(160, w_gate, w_down)) == 160


@pytest.fixture
def nan_in_unwritten_rows(monkeypatch):
    """The kernel with NaN in every row past ``sum(group_sizes)`` (sentinel and padding rows),
    as an unwritten output buffer may hold."""
    real = gmm.megablox_gmm

    def garbage_tail(lhs, rhs, group_sizes, **kw):
        out = real(lhs, rhs, group_sizes, **kw)
        tail = jnp.arange(lhs.shape[0]) >= jnp.sum(group_sizes)
        return jnp.where(tail[:, None], jnp.nan, out)

    monkeypatch.setattr(gmm, "megablox_gmm", garbage_tail)
    monkeypatch.setattr(gmm_combine, "megablox_gmm", garbage_tail)
    monkeypatch.setattr(gmm_gate_up, "megablox_gmm", garbage_tail)
    jax.clear_caches()  # read at trace time: no program traced with the real kernel
    yield
    jax.clear_caches()


def test_rows_outside_every_group_never_reach_the_result(nan_in_unwritten_rows):
    """Whatever the kernel leaves in rows past ``sum(group_sizes)`` is masked out."""
    case = local_case(5, 31)
    args = [case[k] for k in ("x", "local_ids", "topk_weights", "w_gate", "w_up", "w_down")]
    got = np.asarray(jax.jit(gmm.gmm_experts)(*args))
    assert np.isfinite(got).all()
    assert rel_err(got, local_reference(case)) < REL_TOL


# The kernels each path of the dispatch traces (by their jitted names).
PATH_KERNELS = {
    "vmem": {"gate_up_act", "down_and_combine"},  # gate/up pick x's rows themselves
    "fetched_rows": {"gate_up_act", "down_and_combine"},  # gate/up DMA x's rows themselves
    "gathered_rows": {"gather_rows", "gate_up_act", "down_and_combine"},
    "combine_blocks": {"gate_up_act", "down_and_combine"},
    "xla": set(),
}
KERNEL_NAMES = ("gather_rows", "gate_up_act", "down_and_combine")


@pytest.fixture(params=list(PATH_KERNELS))
def row_gathers(request, monkeypatch):
    """Every path of the dispatch for the test's 19 tokens (x and the float32 sums [32 rows
    padded, 256 columns]): x held whole by gate/up, which pick the rows themselves, and the
    sums by down's combine kernel (the default budget); x too large to hold whole, its rows
    copied by gate/up's own row DMAs (``fetched_rows``) or, those not fitting either,
    gathered by ``vmem_rows`` 128 columns at a time (``gathered_rows``); x gathered by XLA
    and the sums held 128 columns at a time (``combine_blocks``); no kernel of ours at all:
    XLA's gathers, Megablox's three gmm calls and ``sum_token_rows`` (``xla``)."""
    not_whole = 32 * 128 * vmem_rows.held_bytes(4)  # x held 128 of its 256 columns at most
    held = {"fetched_rows": not_whole, "gathered_rows": not_whole,
            "combine_blocks": 32 * 128 * gmm_combine.SUMS_BYTES, "xla": 0}
    if request.param in held:
        monkeypatch.setattr(vmem_rows, "HELD_BUDGET", held[request.param])
    if request.param != "fetched_rows":  # x's rows gathered before gate/up, if held
        monkeypatch.setattr(gmm_gate_up, "FETCH_BUDGET", 0)
    if request.param == "xla":
        monkeypatch.setattr(gmm_gate_up, "BLOCKS_BUDGET", 0)
    jax.clear_caches()  # the budgets are read at trace time: no program traced with another
    yield request.param
    jax.clear_caches()


def test_lane_tiled_gathers_with_garbage_rows(nan_in_unwritten_rows, row_gathers):
    """H a multiple of 128 takes the tile-shaped paths (``take_rows`` of the token rows,
    ``sum_token_rows``' [T, k, H/128, 128] un-permute) or the VMEM kernels: still the
    float64 reference, with NaN in every row Megablox leaves unwritten and assignments held
    elsewhere."""
    full = make_case(41, 19, hidden=256, inter=128)
    ids = full["topk_ids"]
    case = {"x": full["x"], "topk_weights": full["topk_weights"],
            "local_ids": np.where(ids < LOCAL_ROWS, ids, LOCAL_ROWS).astype(np.int32),
            **{k: full[k][:LOCAL_ROWS] for k in ("w_gate", "w_up", "w_down")}, "full": full}
    args = [case[k] for k in ("x", "local_ids", "topk_weights", "w_gate", "w_up", "w_down")]
    traced = str(jax.make_jaxpr(gmm.gmm_experts)(*args))  # the path this case takes
    assert {k for k in KERNEL_NAMES if f"name={k}" in traced} == PATH_KERNELS[row_gathers]
    got = np.asarray(jax.jit(gmm.gmm_experts)(*args))
    assert got.shape == (19, 256) and np.isfinite(got).all()
    assert rel_err(got, local_reference(case)) < REL_TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vmem_gather_rows_is_exact(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((37, 256)), dtype)  # rows not a multiple of 16
    idx = jnp.asarray(rng.integers(0, 37, 148), jnp.int32)
    got = vmem_rows.gather_rows(x, idx, 160, True)
    assert got.shape == (160, 256) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got[:148]), np.asarray(x)[np.asarray(idx)])


def test_packed_pairs_unpack_to_every_bfloat16_value():
    """The fetch path's packing of bfloat16 rows two columns to a 32-bit word, and its unpack
    by shifts, give back every one of the 65,536 bfloat16 bit patterns' values (zeros of
    both signs, subnormals, infinities; NaN stays NaN)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = jnp.asarray(bits.view(jnp.bfloat16).reshape(128, 512))
    words = gmm_gate_up.pack_pairs(x)
    assert words.shape == (128, 256) and words.dtype == jnp.uint32
    back = np.asarray(gmm_gate_up._unpack_pairs(words, jnp.bfloat16))
    want = np.asarray(x)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(back.astype(np.float32)), nan)
    np.testing.assert_array_equal(back.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def combine_case(seed: int, sizes: list[int], m_pad: int, tokens: int, hidden: int,
                 dtype: Any) -> dict[str, Any]:
    """Activations sorted by group (NaN in every row past the groups: never to be read),
    down weights, each row's token, starting sums, and the float64 sums
    ``init + sum over rows m in the groups of act[m] @ w[group of m]`` at ``token[m]``."""
    rng = np.random.default_rng(seed)
    sizes_a = np.asarray(sizes, np.int32)
    used, inter = int(sizes_a.sum()), 128
    act = np.array(jnp.asarray(rng.standard_normal((m_pad, inter)), dtype).astype(jnp.float32))
    act[used:] = np.nan
    w = np.array(jnp.asarray(rng.standard_normal((len(sizes), inter, hidden)) / 8, dtype)
                 .astype(jnp.float32))
    token = rng.integers(0, tokens - 2, m_pad).astype(np.int32)  # the last 2 get no row
    init = rng.standard_normal((tokens, hidden)).astype(np.float32)
    weight = rng.random(m_pad).astype(np.float32)
    want = np.zeros((tokens, hidden))
    weighted = np.zeros((tokens, hidden))
    for m, g in enumerate(np.repeat(np.arange(len(sizes)), sizes_a)):
        row = act[m].astype(np.float64) @ w[g].astype(np.float64)
        want[token[m]] += row
        weighted[token[m]] += np.float64(weight[m]) * row
    return {"act": jnp.asarray(act, dtype), "w": jnp.asarray(w, dtype), "token": token,
            "sizes": sizes_a, "init": init, "want": want, "weight": weight,
            "weighted": weighted}


@pytest.mark.parametrize("sizes,tm", [
    ([7, 0, 20, 3, 11], 16),  # empty group, groups sharing tiles, rows past the groups
    ([40, 24], 32),  # groups on tile boundaries, no row past them
    ([0, 0, 0], 16),  # no row at all: the sums are the starting ones
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_init", [False, True])
def test_down_and_combine_adds_each_group_row_at_its_token(sizes, tm, dtype, with_init):
    """Down's kernel with the combine: every row inside the groups multiplied by its group's
    weights and added at its token in float32, rows past the groups (NaN) never read, tokens
    no row points at left at their starting sums (zeros or ``init``)."""
    tokens, hidden = 37, 256  # tokens not a multiple of 16
    case = combine_case(7, sizes, 64, tokens, hidden, dtype)
    init = case["init"] if with_init else None
    got = np.asarray(gmm_combine.down_and_combine(
        case["act"], case["w"], jnp.asarray(case["sizes"]), jnp.asarray(case["token"]),
        None if init is None else jnp.asarray(init), tokens, tm, True))
    want = case["want"] + (init if with_init else 0.0)
    assert got.shape == (tokens, hidden) and got.dtype == np.float32
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if with_init:
        np.testing.assert_array_equal(got[-2:], init[-2:])
    else:
        np.testing.assert_array_equal(got[-2:], 0.0)


@pytest.mark.parametrize("sizes,tm", [([7, 0, 20, 3, 11], 16), ([40, 24], 32), ([0, 0], 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("contract_minor", [False, True])
@pytest.mark.parametrize("source", ["rows", "hold", "fetch"])
def test_gate_up_act_rows_inside_the_groups(monkeypatch, sizes, tm, dtype, contract_minor,
                                            source):
    """Gate, up and the gated activation in one kernel: every row inside the groups is
    ``silu(x @ gate[g]) * (x @ up[g]) * weight`` of its group g (tiles shared by groups each
    get their own group's rows), rounded once to the compute dtype, whatever the rows past
    the groups hold (NaN; their results are unspecified). ``contract_minor`` reads the
    weights as stored K-minor; ``source``: the sorted rows given, or the kernel takes each
    row from the tokens [23, H] itself, held in VMEM or by a row DMA (bfloat16 rows packed
    in pairs of columns)."""
    if source == "fetch":
        monkeypatch.setattr(vmem_rows, "HELD_BUDGET", 0)  # x not held: its rows fetched
    rng = np.random.default_rng(5)
    m_pad, hidden, inter, tokens = 64, 256, 128, 23
    sizes_a = np.asarray(sizes, np.int32)
    used = int(sizes_a.sum())
    token = rng.integers(0, tokens, m_pad).astype(np.int32)
    x = np.array(jnp.asarray(rng.standard_normal((tokens, hidden)), dtype).astype(jnp.float32))
    xs = x[token]
    xs[used:] = np.nan
    w = [np.array(jnp.asarray(rng.standard_normal((len(sizes), hidden, inter)) / 16, dtype)
                  .astype(jnp.float32)) for _ in range(2)]
    weight = rng.random(m_pad).astype(np.float32)
    operand, rows = (xs, None) if source == "rows" else (x, jnp.asarray(token))
    if rows is not None:
        assert gmm_gate_up.token_mode(tokens, hidden, inter, dtype, m_pad, tm) == source
    got = np.asarray(gmm_gate_up.gate_up_act(
        jnp.asarray(operand, dtype), rows, jnp.asarray(w[0], dtype), jnp.asarray(w[1], dtype),
        jnp.asarray(weight), jnp.asarray(sizes_a), tm, contract_minor, True)
        .astype(jnp.float32))
    groups = np.repeat(np.arange(len(sizes)), sizes_a)
    x64 = xs[:used].astype(np.float64)
    gate = np.einsum("mh,mhi->mi", x64, w[0][groups])
    up = np.einsum("mh,mhi->mi", x64, w[1][groups])
    want = gate / (1 + np.exp(-gate)) * up * weight[:used, None]
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # one rounding to the compute dtype
    assert got.shape == (m_pad, inter)
    np.testing.assert_allclose(got[:used], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("source", ["rows", "hold", "fetch"])
def test_gate_up_act_several_column_tiles(monkeypatch, source):
    """I split into column tiles (a VMEM budget that holds 128 of I's 384 columns): each
    tile's output block; the held tokens' float32 copy made once for all of them, or every
    tile's rows fetched again for each column tile (the DMA slots alternating across the
    column tiles' boundary)."""
    rng = np.random.default_rng(6)
    m_pad, hidden, inter, tokens, tm = 96, 128, 384, 29, 32
    held = tokens + 3 if source == "hold" else 0  # 29 tokens padded to 32 rows
    budget = gmm_gate_up._vmem(tm, hidden, 128, 4, source, held)
    monkeypatch.setattr(gmm_gate_up, "BLOCKS_BUDGET", budget)
    monkeypatch.setattr(gmm_gate_up, "FETCH_BUDGET", budget)
    if source == "fetch":
        monkeypatch.setattr(vmem_rows, "HELD_BUDGET", 0)
    assert gmm_gate_up.column_tile(tm, hidden, inter, 4, source, held) == 128
    sizes = np.asarray([2, 0, 37, 1, 0, 30, 9], np.int32)  # 79 rows; tiles shared by groups
    used = int(sizes.sum())
    token = rng.integers(0, tokens, m_pad).astype(np.int32)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w = [rng.standard_normal((len(sizes), hidden, inter)).astype(np.float32) / 8
         for _ in range(2)]
    weight = rng.random(m_pad).astype(np.float32)
    operand, rows = (x[token], None) if source == "rows" else (x, jnp.asarray(token))
    if rows is not None:
        assert gmm_gate_up.token_mode(tokens, hidden, inter, jnp.float32, m_pad, tm) == source
    got = np.asarray(gmm_gate_up.gate_up_act(
        jnp.asarray(operand), rows, jnp.asarray(w[0]), jnp.asarray(w[1]), jnp.asarray(weight),
        jnp.asarray(sizes), tm, False, True))
    groups = np.repeat(np.arange(len(sizes)), sizes)
    x64 = x[token[:used]].astype(np.float64)
    gate = np.einsum("mh,mhi->mi", x64, w[0][groups])
    up = np.einsum("mh,mhi->mi", x64, w[1][groups])
    want = gate / (1 + np.exp(-gate)) * up * weight[:used, None]
    np.testing.assert_allclose(got[:used], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes,tm", [([7, 0, 20, 3, 11], 16), ([0, 0, 0], 16)])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("columns", [256, 128])
def test_down_and_combine_weighs_rows_and_rounds_once(monkeypatch, sizes, tm, out_dtype,
                                                      columns):
    """With the routing weights (prefetched to SMEM) every row is multiplied by its own
    weight before it is added; with a bfloat16 output the float32 sums are rounded once
    at the end of each column block (``columns`` of 256 held at a time): exactly the
    float32 result's rounding (tokens no row points at: zeros)."""
    tokens, hidden = 37, 256
    item = jnp.dtype(out_dtype).itemsize
    monkeypatch.setattr(vmem_rows, "HELD_BUDGET",
                        48 * columns * gmm_combine.SUMS_BYTES)
    jax.clear_caches()  # the budget is read at trace time (again after the test: below)
    assert gmm_combine.column_width(tokens, hidden, tm, 128, 2, item) == columns
    case = combine_case(8, sizes, 64, tokens, hidden, jnp.bfloat16)
    args = (case["act"], case["w"], jnp.asarray(case["sizes"]), jnp.asarray(case["token"]),
            None, tokens, tm, True, jnp.asarray(case["weight"]))
    got = gmm_combine.down_and_combine(*args, out_dtype=out_dtype)
    assert got.shape == (tokens, hidden) and got.dtype == out_dtype
    sums = gmm_combine.down_and_combine(*args)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(sums.astype(out_dtype).astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(sums), case["weighted"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(sums[-2:]), 0.0)
    assert gmm_combine.weighs_rows(64)
    assert not gmm_combine.weighs_rows(vmem_rows.MAX_INDICES)
    # Starting from the sums of an earlier pass, in the output dtype (staged into the float32
    # scratch): added in float32 and rounded once, as a float32 start would be.
    init = jnp.asarray(case["init"]).astype(out_dtype)
    resumed = gmm_combine.down_and_combine(*args[:4], init, *args[5:], out_dtype=out_dtype)
    assert resumed.dtype == out_dtype
    want = gmm_combine.down_and_combine(*args[:4], init.astype(jnp.float32), *args[5:])
    np.testing.assert_array_equal(np.asarray(resumed.astype(jnp.float32)),
                                  np.asarray(want.astype(out_dtype).astype(jnp.float32)))
    # A first pass's buffer is never read (on TPU it is allocated, not initialised).
    unset = jnp.full_like(init, jnp.nan)
    fresh = gmm_combine.down_and_combine(*args[:4], unset, *args[5:], out_dtype=out_dtype,
                                         reads_init=jnp.bool_(False))
    np.testing.assert_array_equal(np.asarray(fresh.astype(jnp.float32)),
                                  np.asarray(got.astype(jnp.float32)))
    if out_dtype != jnp.float32:
        with pytest.raises(ValueError, match="the same dtype"):
            gmm_combine.down_and_combine(*args[:4], jnp.asarray(case["init"]), *args[5:],
                                         out_dtype=out_dtype)
    jax.clear_caches()


def test_vmem_limit_follows_the_chip():
    """The combine's scoped VMEM: 100 MiB on chips with 128 MiB per TensorCore (v5e, v6e),
    48 MiB on those with 64 (v5p), the default 40 MiB on the others and for kinds JAX's
    table does not know; the held block takes what a larger limit adds. The 235B's 8,192
    tokens' sums are held 1,024 of 4,096 columns at a time on v5p (512 at the default), the
    30B's whole on v6e: the float32 sums alone (a bfloat16 output stays in HBM, staged)."""
    (_, big), (_, mid) = vmem_rows.VMEM_TIERS
    assert vmem_rows.vmem_limit("TPU v6 lite") == big
    assert vmem_rows.vmem_limit("TPU v5 lite") == big
    assert vmem_rows.vmem_limit("TPU v5p") == vmem_rows.vmem_limit("TPU v5") == mid
    for kind in ("TPU v4", "cpu", "", None):
        assert vmem_rows.vmem_limit(kind) == vmem_rows.VMEM_LIMIT, kind
    assert gmm_combine.column_width(8192, 4096, 512, 384, 2, 2) == 512
    assert gmm_combine.column_width(8192, 4096, 512, 384, 2, 2, mid) == 1024
    assert vmem_rows.budgets() == (vmem_rows.HELD_BUDGET, vmem_rows.KERNEL_BUDGET)
    extra = big - vmem_rows.VMEM_LIMIT
    assert vmem_rows.budgets(big) == (vmem_rows.HELD_BUDGET + extra,
                                      vmem_rows.KERNEL_BUDGET + extra)
    narrow = gmm_combine.column_width(8192, 2048, 512, 192, 2, 2)
    wide = gmm_combine.column_width(8192, 2048, 512, 192, 2, 2, big)
    assert (narrow, wide) == (512, 2048)


def test_down_and_combine_column_blocks(monkeypatch):
    """Sums too wide to hold whole are held a column block at a time (prefill): each block
    sees every row, the same sums."""
    tokens, hidden = 45, 512
    monkeypatch.setattr(vmem_rows, "HELD_BUDGET", 48 * 128 * gmm_combine.SUMS_BYTES)
    assert vmem_rows.column_block(48, hidden, gmm_combine.SUMS_BYTES) == 128
    assert gmm_combine.column_width(tokens, hidden, 32, 128, 2) == 128
    assert gmm_combine.fits(tokens, hidden, 96, 32, 128, 2)
    case = combine_case(9, [13, 30, 0, 41], 96, tokens, hidden, jnp.bfloat16)
    got = np.asarray(gmm_combine.down_and_combine(
        case["act"], case["w"], jnp.asarray(case["sizes"]), jnp.asarray(case["token"]),
        jnp.asarray(case["init"]), tokens, 32, True))
    np.testing.assert_allclose(got, case["want"] + case["init"], rtol=1e-5, atol=1e-5)


def test_vmem_column_blocks_of_large_operands(monkeypatch):
    """An operand too large to hold whole is held a column block at a time (prefill): the
    same rows, block by block."""
    monkeypatch.setattr(vmem_rows, "HELD_BUDGET", 48 * 128 * vmem_rows.held_bytes(2))
    assert vmem_rows.column_block(48, 512, vmem_rows.held_bytes(2)) == 128
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((45, 512)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, 45, 100), jnp.int32)
    got = vmem_rows.gather_rows(x, idx, 112, True)
    np.testing.assert_array_equal(np.asarray(got[:100]), np.asarray(x)[np.asarray(idx)])


def test_bfloat16_gmm_vmem_and_xla_paths_agree(monkeypatch):
    """The same bfloat16 layer through our kernels and through XLA's gathers with Megablox's
    three gmm calls: the same rows reach the kernels, and both are near the float64
    reference; the combine kernel adds down's rows in float32 where the other path rounds
    them to bfloat16 first, so it is the nearer of the two."""
    full = make_case(43, 40, hidden=256, inter=128)
    ids = full["topk_ids"]
    local = np.where(ids < LOCAL_ROWS, ids, LOCAL_ROWS).astype(np.int32)
    args = [jnp.asarray(full["x"], jnp.bfloat16), local, full["topk_weights"],
            *[jnp.asarray(full[k][:LOCAL_ROWS], jnp.bfloat16)
              for k in ("w_gate", "w_up", "w_down")]]
    want = local_reference({"local_ids": local, "full": full})
    vmem = np.asarray(jax.jit(gmm.gmm_experts)(*args))
    monkeypatch.setattr(vmem_rows, "HELD_BUDGET", 0)
    monkeypatch.setattr(gmm_gate_up, "BLOCKS_BUDGET", 0)  # Megablox's three calls
    jax.clear_caches()  # the budgets are read at trace time
    xla = np.asarray(jax.jit(gmm.gmm_experts)(*args))
    jax.clear_caches()
    assert rel_err(xla, want) < BF16_TOL
    assert rel_err(vmem, want) <= rel_err(xla, want)


def test_bfloat16_gmm():
    case = make_case(17, 64)
    got = run_layer(case, SHUFFLED, "gmm", jnp.bfloat16)
    assert rel_err(got, reference_moe(case)) < BF16_TOL


# -- tiles --------------------------------------------------------------------------------------
# (M, K, N, groups) -> (tm, tk, tn): the table of docs/moe_backends.md (per device, bf16).
TABLE = {
    # Qwen3-30B-A3B, tp 4: H 2048, I 192, 128 experts; decode 64, 256, prefill 8192 tokens.
    (512, 2048, 192, 128): (128, 2048, 192), (512, 192, 2048, 128): (64, 192, 2048),
    (2048, 2048, 192, 128): (256, 2048, 192), (2048, 192, 2048, 128): (256, 192, 2048),
    (65536, 2048, 192, 128): (512, 2048, 192), (65536, 192, 2048, 128): (256, 192, 2048),
    # Qwen3-235B-A22B, tp 4 x ep 4: H 4096, I 384, 32 experts per device.
    (512, 4096, 384, 32): (256, 4096, 384), (512, 384, 4096, 32): (64, 384, 4096),
    (2048, 4096, 384, 32): (256, 4096, 384), (2048, 384, 4096, 32): (256, 384, 2048),
    (65536, 4096, 384, 32): (512, 2048, 384), (65536, 384, 4096, 32): (512, 384, 1024),
}


@pytest.mark.parametrize("shape", list(TABLE))
def test_tiling_table_and_mosaic_constraints(shape):
    m, k, n, groups = shape
    tm, tk, tn = gmm.gmm_tiling(m, k, n, groups)
    assert (tm, tk, tn) == TABLE[shape]
    assert tm % 16 == 0  # bfloat16 rows pack 16 to a sublane tile
    for tile, dim in ((tk, k), (tn, n)):
        assert tile == dim or (tile % 128 == 0 and dim % tile == 0)
    assert gmm.vmem_bytes(tm, tk, tn, 2) <= gmm.VMEM_BUDGET
    # The choice is the modelled optimum (among the row tiles that fit) up to the tie margin.
    best = min(gmm.modelled_seconds(gmm.estimate(m, k, n, groups, (r, tk, tn), 2))
               for r in gmm.ROW_TILES if gmm.vmem_bytes(r, tk, tn, 2) <= gmm.VMEM_BUDGET)
    chosen = gmm.modelled_seconds(gmm.estimate(m, k, n, groups, (tm, tk, tn), 2))
    assert chosen <= best * (1 + gmm.TIE)


def test_k_minor_weights_are_read_transposed():
    assert gmm.k_minor(2048, 192)  # Qwen3-30B-A3B gate/up at tp 4
    assert not gmm.k_minor(192, 2048)  # its down projection
    assert not gmm.k_minor(4096, 384)  # Qwen3-235B-A22B at tp 4
    assert not gmm.k_minor(64, 32)  # neither dimension lane-aligned: left as is


def test_resolve_gmm_backend():
    assert "gmm" in MOE_BACKENDS and "gmm" in MOE_BACKEND_CHOICES
    for platform in ("cpu", "gpu", "tpu"):
        assert resolve_moe_backend("gmm", platform) == "gmm"
    assert resolve_moe_backend("auto", "tpu") == "gmm"
    assert resolve_moe_backend("auto", "cpu") == "dense"
    backend = create_moe_backend("gmm", "tpu")
    assert backend.name == "gmm" and backend.compute == gmm.GmmExperts("tpu")
    assert not gmm.interpret_on("tpu") and gmm.interpret_on("cpu")
    # Batch-invariant mode: the dense reference (gmm groups depend on the batch).
    assert create_moe_backend("gmm", "tpu", batch_invariant=True).name == "dense"
    # Hashable and equal by value: a static of the compiled step.
    assert hash(get_moe_backend("gmm", "cpu")) == hash(get_moe_backend("gmm", "cpu"))


# -- expert and tensor parallelism (4 fake CPU devices, one subprocess) -------------------------
# name -> (ep, tp, dispatch): None = replicated tokens, one psum; "all_gather" / "all_to_all"
# = DP attention (tokens split over "expert", ``ep_moe_forward(tokens_split=True)``);
# "all_gather_sp": DP attention with each rank's tokens split over its "tensor" devices too
# (``sequence_split``: both sums reduce-scattered).
PARALLEL: dict[str, tuple[int, int, str | None]] = {
    "ep2": (2, 1, None), "ep4": (4, 1, None), "tp2_ep2": (2, 2, None),
    "dp2_all_gather": (2, 1, "all_gather"), "dp2_tp2_all_to_all": (2, 2, "all_to_all"),
    "dp2_tp2_all_gather_sp": (2, 2, "all_gather_sp"),
}


def parallel_tokens(name: str) -> tuple[int, ...]:
    dispatch = PARALLEL[name][2]
    if dispatch == "all_gather_sp":
        return (40,)  # a multiple of ep x tp
    return (38,) if dispatch else (1, 37)  # split tokens: a multiple of ep


def _worker(out_dir: str) -> None:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from sgl_jax.srt.layers.moe.dispatch import emulated_ragged_all_to_all
    from sgl_jax.srt.layers.moe.ep_moe import W_DOWN_SPEC, W_GATE_UP_SPEC

    specs = {"w_gate": W_GATE_UP_SPEC, "w_up": W_GATE_UP_SPEC, "w_down": W_DOWN_SPEC}
    results: dict[str, np.ndarray] = {}
    for name, (ep, tp, dispatch) in PARALLEL.items():
        mesh = Mesh(np.array(jax.devices()[: ep * tp]).reshape(ep, tp), ("expert", "tensor"))
        a2a = emulated_ragged_all_to_all if dispatch == "all_to_all" else None
        sp = dispatch == "all_gather_sp"
        fn = jax.jit(lambda a, split=dispatch is not None, a2a=a2a, sp=sp: ep_moe_forward(
            a["x"], a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"],
            SHUFFLED, backend=get_moe_backend("gmm"), tokens_split=split, all_to_all=a2a,
            sequence_split=sp,
        ))
        token_spec = (("expert", "tensor"),) if sp else ("expert",) if dispatch else ()
        for tokens in parallel_tokens(name):
            args = {k: jax.device_put(v, NamedSharding(mesh, P(*specs.get(k, token_spec))))
                    for k, v in physical(make_case(tokens, tokens), SHUFFLED).items()}
            with jax.set_mesh(mesh):
                results[f"{name}/{tokens}"] = np.asarray(fn(args))
    # Sequence parallelism in bfloat16 (x split by token over "tensor", gathered inside with
    # its packed rows for gmm's DMAs; the sums written in bfloat16 and reduce-scattered).
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("expert", "tensor"))
    fn = jax.jit(lambda a: ep_moe_forward(
        a["x"], a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"],
        SHUFFLED, backend=get_moe_backend("gmm"), sequence_split=True))
    case = physical(make_case(SP_TOKENS, SP_TOKENS, hidden=256), SHUFFLED)
    args = {k: jax.device_put(jnp.asarray(v, jnp.bfloat16) if v.dtype == np.float32
                              and k != "topk_weights" else v,
                              NamedSharding(mesh, P(*specs.get(k, ("tensor",)))))
            for k, v in case.items()}
    with jax.set_mesh(mesh):
        out = fn(args)
    results["tp2_sp_bf16"] = np.asarray(out.astype(jnp.float32))
    results["tp2_sp_bf16_dtype"] = np.asarray(str(out.dtype))
    # What gmm's row DMAs would read: x packed on each device's own tokens, then gathered.
    backend = get_moe_backend("gmm")
    gather = jax.jit(jax.shard_map(lambda x: backend.gather_tokens(x, "tensor"), mesh=mesh,
                                   in_specs=P("tensor"), out_specs=(P(), P()),
                                   check_vma=False))
    with jax.set_mesh(mesh):
        whole, words = gather(args["x"])
    results["sp_words"] = np.asarray(words)
    results["sp_words_want"] = np.asarray(gmm_gate_up.fetch_source(whole))
    results["sp_whole"] = np.asarray(whole.astype(jnp.float32))
    np.savez(os.path.join(out_dir, "parallel.npz"), **results)


SP_TOKENS = 38


def test_parallel_gmm_matches_reference():
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": fake_devices_flags(4)}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.test_moe_gmm", json.dumps({"out": tmp})],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        with np.load(os.path.join(tmp, "parallel.npz")) as z:
            got = dict(z)
    for name in PARALLEL:
        for tokens in parallel_tokens(name):
            case = make_case(tokens, tokens)
            assert rel_err(got[f"{name}/{tokens}"], reference_moe(case)) < REL_TOL, name
    case = make_case(SP_TOKENS, SP_TOKENS, hidden=256)
    bf16 = {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32))
            if k.startswith("w_") or k == "x" else v for k, v in case.items()}
    assert str(got["tp2_sp_bf16_dtype"]) == "bfloat16"
    np.testing.assert_array_equal(got["sp_whole"], bf16["x"])  # every device's tokens
    assert got["sp_words"].dtype == np.uint32 and got["sp_words"].shape == (SP_TOKENS, 128)
    np.testing.assert_array_equal(got["sp_words"], got["sp_words_want"])
    assert rel_err(got["tp2_sp_bf16"], reference_moe(bf16)) < 2e-2  # bfloat16 roundings


# -- the whole model --------------------------------------------------------------------------
def test_model_forward_with_gmm_matches_reference():
    """The bundled model through the engine's runner with ``--moe-backend gmm``: routed
    experts exactly and logits to 1e-5 of the float64 reference forward, in every bucket
    (chunked prefill, cached prefix, mixed extend, decode), with nothing compiled twice."""
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.model_executor.model_runner import ModelRunner
    from sgl_jax.srt.server_args import ServerArgs
    from sgl_jax.testing import TEST_MODEL_PATH
    from tests.backend_scenario import assert_matches, reference_scenario, run_scenario

    args = ServerArgs(
        model_path=TEST_MODEL_PATH, moe_backend="gmm", page_size=16,
        max_running_requests=4, chunked_prefill_size=32, precompile_token_paddings=[32],
        precompile_bs_paddings=[4], max_total_tokens=512, attention_block_size=16,
        context_length=256, enable_return_routed_experts=True,
    )
    runner = ModelRunner(args, ModelConfig.from_hf(TEST_MODEL_PATH, args.context_length))
    assert runner.backends.moe.name == "gmm"
    runner.precompile()
    compiled = runner.num_compiles
    assert_matches(run_scenario(runner), reference_scenario(TEST_MODEL_PATH), REL_TOL)
    assert runner.num_compiles == compiled


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1])["out"])
