"""The routed-experts rows of KV slots, on the host: one row per slot, beside the KV it describes.

``gather(slots)`` gives ``[n, num_hidden_layers, num_experts_per_tok]`` int32: the experts the
router chose for the tokens whose K/V the slots hold (-1 for layers without a router). Keyed by
slot, the rows of prefix-cached tokens stay valid for as long as their KV does, and a request's
rows are ``gather(req_to_token[req_pool_idx, start:n])``.

Storage is the narrowest unsigned dtype that holds every expert id and the no-router marker
(the dtype's maximum): uint8 up to 255 experts, else uint16 (4x / 2x less than int32; for 256
requests x 32k slots x 48 layers x top-8 that is 3 GiB instead of 12). The table is written
lazily: ``np.empty`` reserves address space only, so pages are committed as slots are first
written, never at start-up; a slot's row is read only after a step wrote it (``valid``).
Reads convert back to int32 with -1 for the marker, the wire's semantics. A raw read (for the
wire) is the storage dtype's signed twin when every id fits it (up to 128 experts in int8, 32768
in int16): a view in which the marker already reads -1, so the one cast to the wire dtype is a
plain C cast (``to_wire_dtype``'s signed -> signed path), with no pass to find the markers.

``valid[slot]`` says whether the step that last wrote the slot's KV captured its row: a batch
in which no request asked for routed experts skips the device-to-host copy, and a batch in
which only some asked copies only their tokens' rows (gathered on the device), so the rows of
the other KV it wrote are unknown, and a request that would reuse that KV through the prefix
cache must recompute it instead (``valid_prefix_len``).

Validity is set when a step is *launched*, rows are written when it is *processed*. With
overlap scheduling a slot can be freed and handed to a new step before the step that wrote it
is processed; deciding validity at launch keeps it in launch order, and rows are written in
the same order, so both always describe the slot's latest writer. Rows of a slot are read only
once every step that wrote them has been processed (the scheduler settles a request's steps
before it gathers its rows).
"""

from __future__ import annotations

import numpy as np

ROW_DTYPE = np.int32  # the dtype rows are written and read in
NO_ROUTER = -1  # the row entry of a layer without a router (a dense MLP layer)


def storage_dtype(num_experts: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids ``[0, num_experts)`` and a distinct marker."""
    for dtype in (np.uint8, np.uint16):
        if num_experts <= np.iinfo(dtype).max:  # the maximum itself is the marker
            return np.dtype(dtype)
    raise ValueError(f"num_experts={num_experts} > 65535 does not fit a routed-experts table")


class RoutedExpertsHostCache:
    def __init__(
        self, num_slots: int, num_hidden_layers: int, num_experts_per_tok: int, num_experts: int,
        weights: bool = False,
    ) -> None:
        self.num_slots = num_slots
        self.dtype = storage_dtype(num_experts)
        self.marker = np.iinfo(self.dtype).max
        # Not filled: untouched pages of a large np.empty cost no memory (written lazily).
        self.rows = np.empty((num_slots, num_hidden_layers, num_experts_per_tok), self.dtype)
        self.valid = np.zeros(num_slots, dtype=bool)
        # With ``weights``, the routing weights of the same rows (float32, 0 for no router),
        # written with them by the same steps (so ``valid`` covers both); lazily committed too.
        self.weights = (
            np.empty((num_slots, num_hidden_layers, num_experts_per_tok), np.float32)
            if weights else None
        )
        # The signed twin of the storage dtype, if every id fits it (see gather(raw=True)).
        signed = np.dtype(f"i{self.dtype.itemsize}")
        self._signed = signed if num_experts <= np.iinfo(signed).max + 1 else None
        # Storage value -> int32 id in one pass (the marker maps to -1).
        self._to_ids = np.arange(self.marker + 1, dtype=ROW_DTYPE)
        self._to_ids[self.marker] = NO_ROUTER

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """``rows`` int32 with -1 for no router (or already in the storage dtype)."""
        # A C cast wraps -1 to the dtype's maximum, the marker; ids are below it.
        self.rows[slots] = rows.astype(self.dtype, copy=False)

    def write_weights(self, slots: np.ndarray, weights: np.ndarray) -> None:
        self.weights[slots] = weights

    def gather_weights(self, slots: np.ndarray) -> np.ndarray:
        """The routing weights of ``slots`` (float32), copied."""
        assert self.weights is not None, "routing weights are not captured"
        return self.weights[slots]

    def set_valid(self, slots: np.ndarray, valid: bool | np.ndarray) -> None:
        """``valid``: for all ``slots``, or one bool per slot."""
        self.valid[slots] = valid

    def gather(self, slots: np.ndarray, raw: bool = False) -> np.ndarray:
        """The rows of ``slots`` as int32 (-1 = no router), copied: safe to keep after they are
        freed. ``raw``: in a narrow dtype, for a single conversion to the wire dtype later
        (``routed_experts_codec.to_wire_dtype``): the storage dtype's signed twin (-1 = no
        router; a view of the gathered copy) when every id fits it, else the storage dtype
        (marker = its maximum)."""
        rows = self.rows[slots]
        if raw:
            # The marker (the unsigned maximum) reads -1 in the signed twin; ids are below
            # its maximum.
            return rows if self._signed is None else rows.view(self._signed)
        return self._to_ids[rows]

    def valid_prefix_len(self, slots: np.ndarray) -> int:
        """Length of the leading run of ``slots`` whose rows are known."""
        invalid = np.flatnonzero(~self.valid[slots])
        return int(invalid[0]) if len(invalid) else len(slots)

    def all_valid(self, slots: np.ndarray) -> bool:
        return bool(self.valid[slots].all())

    def nbytes(self) -> int:
        """Bytes at most (pages are committed as slots are first written)."""
        weights = 0 if self.weights is None else self.weights.nbytes
        return self.rows.nbytes + weights + self.valid.nbytes
