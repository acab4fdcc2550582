"""Helpers shared by the engine tests: the reference model, prompts, and leak checks."""

from __future__ import annotations

import functools

import numpy as np

from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.testing import TEST_MODEL_PATH
from sgl_jax.tools.reference_forward import ReferenceModel, routed_experts_rows


@functools.lru_cache(maxsize=4)
def reference(path: str = TEST_MODEL_PATH) -> ReferenceModel:
    return ReferenceModel(path)


def prompt_ids(seed: int, n: int, vocab: int = 500) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@functools.lru_cache(maxsize=256)
def _greedy(path: str, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(reference(path).greedy_generate(list(ids), n))


def reference_greedy(ids: list[int], n: int, path: str = TEST_MODEL_PATH) -> list[int]:
    return list(_greedy(path, tuple(ids), n))


def expected_rows(ids: list[int], output_ids: list[int], path: str = TEST_MODEL_PATH):
    return routed_experts_rows(reference(path), ids, output_ids)


def decoded_rows(result: dict, num_layers: int, top_k: int) -> np.ndarray:
    flat = extract_routed_experts_from_meta_info(result)
    assert flat is not None, "the response carries no routed experts"
    return flat.reshape(-1, num_layers, top_k)


def assert_no_leak(engine) -> None:
    info = engine.get_server_info()
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0, info
    assert info["locked_kv_slots"] == 0, info
    assert info["available_kv_slots"] + info["evictable_kv_slots"] == info["total_kv_slots"], info
    assert info["free_req_slots"] == info["total_req_slots"], info
