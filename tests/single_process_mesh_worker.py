"""Runs single-process engines on 4 fake CPU devices; prints a JSON report (stdout's last line).

``python -m tests.single_process_mesh_worker`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (test_single_process.py sets it): the
mesh must be fixed before JAX starts, so it cannot run in the pytest process. Two engines, one
after the other, each reporting its outputs (with routed experts) and the devices that hold
the arrays it created:

- ``mesh``: Engine(mesh=...) on a 2 x 2 ("expert", "tensor") mesh of devices 3, 2, 1, 0 (not
  the order the engine would pick), tp and ep taken from the mesh;
- ``device_indexes``: tp_size=2 on device_indexes=[2, 3].
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from jax.sharding import Mesh

from sgl_jax import Engine
from sgl_jax.testing import engine_args


def run(prompts: list[list[int]], max_new_tokens: int, **kwargs) -> dict:
    keep = jax.live_arrays()  # held, so that no id below is reused by a new array
    before = {id(a) for a in keep}
    with Engine(**engine_args(enable_single_process=True, enable_return_routed_experts=True,
                              **kwargs)) as engine:
        mine = [a for a in jax.live_arrays() if id(a) not in before]
        outs = engine.generate(input_ids=prompts, max_new_tokens=max_new_tokens,
                               temperature=0.0, ignore_eos=True, return_routed_experts=True)
        pids = engine.child_pids()
    return {
        "output_ids": [o["output_ids"] for o in outs],
        "routed_experts": [o["meta_info"]["routed_experts"] for o in outs],
        "devices": sorted({d.id for a in mine for d in a.sharding.device_set}),
        "max_devices_per_array": max(len(a.sharding.device_set) for a in mine),
        "child_pids": pids,
    }


def main() -> None:
    prompts, max_new_tokens = json.loads(sys.argv[1])
    devices = jax.devices()
    assert len(devices) == 4, devices
    mesh = Mesh(np.array(devices[::-1]).reshape(2, 2), ("expert", "tensor"))
    report = {
        "mesh": run(prompts, max_new_tokens, mesh=mesh),
        "device_indexes": run(prompts, max_new_tokens, tp_size=2, device_indexes=[2, 3]),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
