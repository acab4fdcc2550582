"""Arrays handed from the caller's thread to the scheduler's thread by reference
(single-process mode: ``Engine.update_weights_from_arrays``).

The caller puts its arrays here under a fresh random token and sends the scheduler a small,
typed operation carrying only that token (``control.UpdateWeightsInProcess``); the scheduler
thread takes the arrays when it applies the update. The registry is a dict of this process:
a token names nothing outside it, so no other process, and nothing arriving over a socket, can
reach the arrays through it (a scheduler in another process finds no arrays under any token).
No JAX here: the arrays are held, never looked at.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

_lock = threading.Lock()
_held: dict[str, dict[str, Any]] = {}


def hand_over(arrays: dict[str, Any]) -> str:
    """Holds ``arrays`` until taken or withdrawn; returns their token."""
    token = secrets.token_hex(16)
    with _lock:
        _held[token] = arrays
    return token


def holds(token: str) -> bool:
    with _lock:
        return token in _held


def take(token: str) -> dict[str, Any]:
    """The arrays of ``token``, released by the registry (ValueError if there are none)."""
    with _lock:
        arrays = _held.pop(token, None)
    if arrays is None:
        raise ValueError("no arrays were handed over under this token: arrays travel by "
                         "reference only to an engine in the caller's process "
                         "(enable_single_process), once")
    return arrays


def withdraw(token: str) -> None:
    """Forgets the arrays of ``token`` if they were not taken (the call ended otherwise)."""
    with _lock:
        _held.pop(token, None)
