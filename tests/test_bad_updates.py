"""A failed weight update never kills the server (M16 item 4).

Against a real server over HTTP, ``/update_weights_from_disk`` is given malformed configs (a JSON
list, zero KV heads, strings, negatives, nulls, missing keys, a million layers, huge numbers,
nested garbage, a non-UTF-8 file, a missing directory, no safetensors) and bad checkpoints (all
NaN, one infinity, integers, a missing tensor, an extra one, thousands of long extra names, a
wrong shape, a corrupt file). Each must be a 400 whose message names the new path and what is
wrong, in a body under 4 KB that never quotes a file; after each, a greedy ``/generate`` still
returns the tokens of the old weights, and a good update afterwards works. The Engine's
``update_weights_from_arrays`` refuses NaN, integer, mis-shaped and non-array tensors alike.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.testing import TEST_MODEL_PATH, engine_args, server_flags
from sgl_jax.tools.make_random_model import write_random_model
from tests.server_utils import server_fixture

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], list(range(30, 70))]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
MAX_BODY = 4096  # bytes of a 400's body, whatever the input


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory) -> str:
    """A checkpoint of the served shapes (other weights): what the bad ones are made from."""
    path = str(tmp_path_factory.mktemp("good_ckpt"))
    write_random_model(path, "tiny", seed=1, check_routing=False)
    return path


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, server_flags())


@pytest.fixture(scope="module")
def before(server) -> list[list[int]]:
    """The greedy tokens of the weights the server started with."""
    return generate(server)


def generate(server) -> list[list[int]]:
    res = server.post("/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY})
    assert res.status_code == 200, res.text
    return [r["output_ids"] for r in res.json()]


# -- bad checkpoints: each writes into a directory and returns (path to load, pattern) ----------
def config_of(good: str) -> dict[str, Any]:
    with open(os.path.join(good, "config.json")) as f:
        return json.load(f)


def with_config(good: str, out: Path, config: Any = None, raw: bytes | None = None) -> str:
    """``out`` with the good tensors and this config.json (a JSON value, or raw bytes)."""
    os.symlink(os.path.join(good, "model.safetensors"), out / "model.safetensors")
    data = raw if raw is not None else json.dumps(config).encode()
    (out / "config.json").write_bytes(data)
    return str(out)


def config_only(good: str, out: Path) -> str:
    (out / "config.json").write_text(json.dumps(config_of(good)))
    return str(out)


def with_tensors(good: str, out: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> str:
    """``out`` with the good config.json and the good tensors as ``edit`` changed them."""
    tensors = load_file(os.path.join(good, "model.safetensors"))
    edit(tensors)
    (out / "config.json").write_text(json.dumps(config_of(good)))
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def changed(**fields: Any) -> Callable[[str, Path], str]:
    return lambda good, out: with_config(good, out, {**config_of(good), **fields})


def without(key: str) -> Callable[[str, Path], str]:
    return lambda good, out: with_config(
        good, out, {k: v for k, v in config_of(good).items() if k != key})


def all_nan(t: dict[str, np.ndarray]) -> None:
    for name in t:
        t[name] = np.full_like(t[name], np.nan)


def one_inf(t: dict[str, np.ndarray]) -> None:
    t["model.layers.2.mlp.experts.5.up_proj.weight"][3, 7] = np.inf


def as_int(t: dict[str, np.ndarray]) -> None:
    for name in t:
        t[name] = (t[name] * 100).astype(np.int32)


def drop(name: str) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda t: t.pop(name)


def add(names: list[str]) -> Callable[[dict[str, np.ndarray]], None]:
    def edit(t: dict[str, np.ndarray]) -> None:
        for name in names:
            t[name] = np.zeros((2, 2), np.float32)
    return edit


def reshape_one(t: dict[str, np.ndarray]) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"
    t[name] = t[name][:, :-1].copy()


def corrupt(good: str, out: Path) -> str:
    (out / "config.json").write_text(json.dumps(config_of(good)))
    (out / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    return str(out)


LONG = "x" * 500
BAD: dict[str, tuple[Callable[[str, Path], str], str]] = {
    # config.json
    "config_is_a_list": (lambda g, o: with_config(g, o, [config_of(g)]), r"holds a JSON list"),
    "config_is_a_string": (lambda g, o: with_config(g, o, "Qwen3MoeForCausalLM"),
                           r"holds a JSON string"),
    "kv_heads_zero": (changed(num_key_value_heads=0), r"num_key_value_heads is 0; it must be"),
    "heads_zero": (changed(num_attention_heads=0), r"num_attention_heads is 0; it must be"),
    "string_for_int": (changed(hidden_size="64"), r"hidden_size is '64'; it must be an integer"),
    "float_for_int": (changed(num_experts=16.5), r"num_experts is 16\.5; it must be an integer"),
    "string_for_float": (changed(rms_norm_eps="tiny"), r"rms_norm_eps is 'tiny'; it must be a "
                         r"positive number"),
    "string_for_bool": (changed(norm_topk_prob="yes"), r"norm_topk_prob is 'yes'; it must be "
                        r"true or false"),
    "negative": (changed(num_experts=-16), r"num_experts is -16; it must be in \[1, "),
    "negative_layers": (changed(num_hidden_layers=-4), r"num_hidden_layers is -4"),
    "null": (changed(num_attention_heads=None), r"lacks the field 'num_attention_heads'"),
    "missing_key": (without("vocab_size"), r"lacks the field 'vocab_size'"),
    "missing_architectures": (without("architectures"), r"unsupported architecture \[\]"),
    "million_layers": (changed(num_hidden_layers=10**6),
                       r"num_hidden_layers is 1000000; it must be in \[1, 1024\]"),
    "huge_number": (changed(moe_intermediate_size=10**40), r"moe_intermediate_size is 1000+; "
                    r"it must be in \[1, 2147483647\]"),
    "other_shapes_1000_layers": (changed(num_hidden_layers=1000),
                                 r"does not match the served model \(num_hidden_layers 4 -> "
                                 r"1000, moe_layers .*<tuple of 1000 items"),
    "nested_garbage": (changed(rope_scaling={"rope_type": {"deep": [[[1, {"x": None}]]]}}),
                       r"rope_scaling\.rope_type is \{'deep'.*; it must be a string"),
    "nested_list_of_lists": (changed(mlp_only_layers=[[0], [1]]),
                             r"mlp_only_layers is \[0\]; it must be an integer"),
    "architectures_object": (changed(architectures={"Qwen3MoeForCausalLM": 1}),
                             r"architectures must be a list of names"),
    "megabyte_architecture": (changed(architectures=["A" * 2**20]),
                              r"unsupported architecture \['AAAA"),
    "non_utf8": (lambda g, o: with_config(g, o, raw=b'{"x": "\xff\xfe SECRET"}'),
                 r"config\.json is not UTF-8 text"),
    "not_json": (lambda g, o: with_config(g, o, raw=b'{"architectures": SECRET'),
                 r"config\.json is not valid JSON at line 1 column"),
    "missing_dir": (lambda g, o: str(o / "nowhere"), r"is not a directory"),
    "no_config": (lambda g, o: str(o), r"has no config\.json"),
    "no_safetensors": (config_only, r"no \*\.safetensors file in"),
    # tensors
    "all_nan": (lambda g, o: with_tensors(g, o, all_nan), r"tensor '[^']+' has non-finite"),
    "one_inf": (lambda g, o: with_tensors(g, o, one_inf),
                r"tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight' has non-finite"),
    "integers": (lambda g, o: with_tensors(g, o, as_int),
                 r"tensor '[^']+' has dtype I32; weights must be floating point"),
    "missing_tensor": (lambda g, o: with_tensors(
        g, o, drop("model.layers.1.self_attn.k_proj.weight")),
        r"1 tensor\(s\) missing: 'model\.layers\.1\.self_attn\.k_proj\.weight'$"),
    "extra_tensor": (lambda g, o: with_tensors(g, o, add(["model.layers.0.mlp.bogus.weight"])),
                     r"1 unexpected tensor\(s\) for Qwen3MoeForCausalLM: "
                     r"'model\.layers\.0\.mlp\.bogus\.weight'$"),
    "thousands_of_long_extra_names": (
        lambda g, o: with_tensors(g, o, add([f"extra.{i:05d}.{LONG}" for i in range(3000)])),
        r"3000 unexpected tensor\(s\) .*: 'extra\.00000\.x+\.\.\. \(\d+ characters in all\)"
        r".* and 2995 more$"),
    "wrong_shape": (lambda g, o: with_tensors(g, o, reshape_one),
                    r"o_proj\.weight' has shape \(64, 63\); .* expects \(64, 64\)"),
    "corrupt_file": (corrupt, r"cannot read .*model\.safetensors"),
}
# The cases the config reader alone refuses (the others: the compatibility check, the load).
CONFIG_CASES = [c for c in BAD if list(BAD).index(c) < list(BAD).index("no_safetensors")
                and c != "other_shapes_1000_layers"]


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_reader_raises_value_error_naming_path_and_field(good_ckpt, tmp_path, case):
    """The same malformed configs at start-up: ModelConfig.from_hf raises ValueError (what
    launch_server and Engine report as a failed start-up), bounded, naming the path."""
    make, pattern = BAD[case]
    path = make(good_ckpt, tmp_path)
    with pytest.raises(ValueError) as caught:
        ModelConfig.from_hf(path)
    message = str(caught.value)
    assert path in message and re.search(pattern, message), message
    assert len(message) < 2000 and "SECRET" not in message


def test_launch_server_with_a_malformed_config_fails_start_up_cleanly(good_ckpt, tmp_path):
    path = with_config(good_ckpt, tmp_path, {**config_of(good_ckpt), "num_key_value_heads": 0})
    done = subprocess.run(
        [sys.executable, "-m", "sgl_jax.launch_server", *server_flags(model_path=path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"Start-up failed: {path}/config.json: num_key_value_heads is 0" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("case", list(BAD))
def test_bad_update_is_a_bounded_400_and_the_old_weights_serve_on(
        server, before, good_ckpt, tmp_path, case):
    make, pattern = BAD[case]
    path = make(good_ckpt, tmp_path)
    res = server.post("/update_weights_from_disk", json={"model_path": path})
    assert res.status_code == 400, res.text[:2000]
    assert len(res.content) < MAX_BODY, (len(res.content), res.text[:2000])
    error = res.json()["error"]
    assert error["param"] == "model_path"
    message = error["message"]
    assert message.startswith("the weights were not updated: "), message
    assert path in message, message  # the new path, not the served model's
    assert TEST_MODEL_PATH not in message, message
    assert "SECRET" not in message  # a file's contents are never quoted
    assert re.search(pattern, message), message
    assert generate(server) == before  # the same weights still serve
    info = server.get("/get_server_info").json()
    assert info["weight_version"] == "0"


def test_a_path_of_50_kb_is_a_bounded_400(server, before, tmp_path):
    path = str(tmp_path / "/".join(["d" * 250] * 200))
    res = server.post("/update_weights_from_disk", json={"model_path": path})
    assert res.status_code == 400 and len(res.content) < MAX_BODY, len(res.content)
    # Refused by the body's bound on model_path (PATH_MAX), before any file system call.
    assert "at most 4096 characters" in res.text, res.text
    assert generate(server) == before


def test_a_good_update_after_the_bad_ones_works(server, before, good_ckpt):
    res = server.post("/update_weights_from_disk", json={"model_path": good_ckpt})
    assert res.status_code == 200, res.text
    assert res.json()["weight_version"] == "1"
    assert generate(server) != before
    res = server.post("/update_weights_from_disk", json={"model_path": TEST_MODEL_PATH})
    assert res.status_code == 200, res.text
    assert generate(server) == before


# -- the Engine API: tensors given directly -----------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    eng = Engine(**engine_args())
    yield eng
    eng.shutdown()


def test_engine_refuses_bad_arrays_and_serves_on(engine):
    def run() -> list[list[int]]:
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        return [r["output_ids"] for r in out]

    first = run()
    tensors = load_file(os.path.join(TEST_MODEL_PATH, "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    nan = tensors[q].copy()
    nan[1, 2] = np.nan
    inf = jnp.asarray(tensors[q]).at[0, 0].set(jnp.inf)
    experts = {f"model.layers.3.mlp.experts.{e}.down_proj.weight":
               tensors[f"model.layers.3.mlp.experts.{e}.down_proj.weight"] for e in range(16)}
    experts_nan = {**experts}
    name_7 = "model.layers.3.mlp.experts.7.down_proj.weight"
    experts_nan[name_7] = np.full_like(experts[name_7], np.nan)
    bad: list[tuple[dict, str]] = [
        ({q: nan}, rf"the arrays: tensor '{re.escape(q)}' has non-finite"),
        ({q: inf}, rf"the arrays: tensor '{re.escape(q)}' has non-finite"),
        (experts_nan, rf"the arrays: tensor '{re.escape(name_7)}' has non-finite"),
        ({q: tensors[q].astype(np.int32)}, r"has dtype int32; weights must be floating point"),
        ({q: tensors[q].astype(np.complex64)}, r"has dtype complex64"),
        ({q: tensors[q][:, :5]}, r"q_proj\.weight' has shape \(64, 5\)"),
        # Values pass np.asarray on the way to the scheduler: these become str / object.
        ({q: "weights"}, r"q_proj\.weight' has dtype str\d*; weights must be floating"),
        ({q: {"a": 1}}, r"q_proj\.weight' has dtype object"),
        ({q: [[1.0], [1.0, 2.0]]}, r"inhomogeneous"),
        ({7: tensors[q]}, r"array names must be strings"),
        ({}, r"no arrays given"),
    ]
    for arrays, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            engine.update_weights_from_arrays(arrays)
        assert engine.get_server_info()["weight_version"] == "0"
    assert run() == first
    # The same values again: accepted, and the outputs stay.
    out = engine.update_weights_from_arrays({q: tensors[q], **experts})
    assert out["num_parameters"] == 2 and out["weight_version"] == "1"
    assert run() == first
