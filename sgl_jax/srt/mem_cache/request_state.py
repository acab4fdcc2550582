"""Per-request auxiliary state beside the KV pages: one slot table for every kind of state a
request carries besides its KV (DESIGN.md section 6).

A request that holds memory holds one state slot (``req.state_slot``), taken when it is
admitted and given back when it is released (finished, aborted or retracted), exactly like
its request slot. Each kind of state registers a host table with one row per slot: the
speculative draft tokens of EAGLE / NEXTN today; linear-attention conv and recurrent states
(their device copies live with the KV cache) are the next kind; grammar matchers
(``constrained/matchers.py``) are objects in a table of dtype object, dropped when their slot
is freed.

``snapshot`` copies every kind's row of a slot into a fresh slot that no request holds: what
a prefix cache keeps for a state that cannot be recomputed from the tokens alone. A retracted
request keeps no state: it resumes by prefilling every token it has, which rebuilds it.

Invariant: after every request is released and every snapshot dropped, every slot is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StateKind:
    """One kind of per-request state: a row of ``shape`` and ``dtype`` per slot, set to
    ``fill`` whenever the slot is taken (a new owner never sees its predecessor's state)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fill: int | float = 0


class RequestStateTable:
    """Hands out state slots and holds one host table per registered ``StateKind``."""

    def __init__(self, num_slots: int, kinds: tuple[StateKind, ...] = ()) -> None:
        if num_slots <= 0:
            raise ValueError(f"a request state table needs slots, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._held = np.zeros(num_slots, bool)
        self.kinds: dict[str, StateKind] = {}
        self._rows: dict[str, np.ndarray] = {}
        for kind in kinds:
            self.register(kind)

    def register(self, kind: StateKind) -> None:
        if kind.name in self.kinds:
            raise ValueError(f"state kind {kind.name!r} registered twice")
        self.kinds[kind.name] = kind
        self._rows[kind.name] = np.full((self.num_slots, *kind.shape), kind.fill, kind.dtype)

    def rows(self, name: str) -> np.ndarray:
        """The host table of kind ``name``: ``rows(name)[slot]`` is that slot's state."""
        return self._rows[name]

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, its every row reset to its kind's fill; None when none is left."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._held[slot] = True
        for name, kind in self.kinds.items():
            self._rows[name][slot] = kind.fill
        return slot

    def free(self, slot: int) -> None:
        if not self._held[slot]:
            raise RuntimeError(f"state slot {slot} freed while free")
        self._held[slot] = False
        self._free.append(slot)
        for name, kind in self.kinds.items():
            if kind.dtype == object:  # objects (grammar matchers) go with their owner
                self._rows[name][slot] = kind.fill

    def snapshot(self, slot: int) -> int | None:
        """A new slot holding a copy of ``slot``'s every row (None when none is left); the
        caller owns it and frees it like any other."""
        if not self._held[slot]:
            raise RuntimeError(f"snapshot of state slot {slot}, which no one holds")
        copy = self.alloc()
        if copy is not None:
            for rows in self._rows.values():
                rows[copy] = rows[slot]
        return copy


# The draft tokens EAGLE / NEXTN proposed for a request's next verify step: the step that
# computes its last token drafts them on the device, and the host keeps them to know which
# tokens that verify step fed (speculative/verify_schedule.py). -1 pads a short row.
SPEC_DRAFTS = "spec_drafts"


def spec_drafts_kind(num_steps: int) -> StateKind:
    return StateKind(SPEC_DRAFTS, (num_steps,), np.dtype(np.int32), fill=-1)
