"""ServerArgs: defaults, validation messages, and the CLI generated from the dataclass."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sgl_jax.srt.server_args import PortArgs, ServerArgs


def test_defaults_and_buckets():
    args = ServerArgs()
    assert args.max_running_requests == 64
    assert args.bs_paddings()[-1] == 64 and args.bs_paddings()[0] == 1
    assert args.token_paddings()[-1] == args.chunked_prefill_size


def test_max_running_defaults_to_largest_bs_bucket():
    assert ServerArgs(precompile_bs_paddings=[1, 4]).max_running_requests == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"precompile_bs_paddings": [4], "max_running_requests": 8}, "add a bucket >= 8"),
        ({"precompile_token_paddings": [64], "chunked_prefill_size": 128}, "add a bucket >= 128"),
        ({"dtype": "float16"}, "use one of auto, float32, bfloat16"),
        ({"page_size": 12}, "power of two"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"moe_backend": "sparse"}, "moe_backend"),
        ({"max_running_requests": 0}, "max_running_requests=0 must be >= 1"),
        ({"port": 70000}, "port=70000"),
    ],
)
def test_invalid_combinations_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_cli_round_trip():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args([
        "--max-running-requests", "4", "--precompile-bs-paddings", "1", "4",
        "--enable-return-routed-experts", "--chunked-prefill-size", "256",
    ])
    args = ServerArgs.from_cli_args(ns)
    assert args.max_running_requests == 4
    assert args.precompile_bs_paddings == [1, 4]
    assert args.enable_return_routed_experts is True
    assert args.chunked_prefill_size == 256


def test_port_args_are_fresh():
    a, b = PortArgs.new(), PortArgs.new()
    assert a != b
    a.remove()
    b.remove()


def test_help_explains_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "sgl_jax.launch_server", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    for flag in ("--model-path", "--port", "--enable-return-routed-experts",
                 "--max-running-requests", "--chunked-prefill-size", "--precompile-bs-paddings"):
        assert flag in out
