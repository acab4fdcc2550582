"""A single-process engine on a 2 x 2 mesh of 4 fake CPU devices, updated from JAX arrays laid
out as a trainer's might be; prints a JSON report (stdout's last line).

``python -m tests.on_device_update_worker '[prompts, sampling_params]'`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (test_weight_update_on_device.py sets
it). The new weights are a seed-2 random checkpoint rounded to bfloat16: the arrays are given
in bfloat16, sharded over a 1-D mesh of the devices in another order than the engine's, so the
update must move them between devices, transpose, stack and cast them (to the served float32,
exactly); the report names a float32 checkpoint of the same values for the reference.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from sgl_jax import Engine
from sgl_jax.testing import engine_args
from sgl_jax.tools.make_random_model import write_random_model


def main() -> None:
    prompts, sampling = json.loads(sys.argv[1])
    devices = jax.devices()
    assert len(devices) == 4, devices
    path = tempfile.mkdtemp(prefix="sgl_jax_on_device_")
    write_random_model(path, "tiny", seed=2)
    rounded = {k: v.astype(ml_dtypes.bfloat16)
               for k, v in load_file(f"{path}/model.safetensors").items()}
    save_file({k: v.astype(np.float32) for k, v in rounded.items()}, f"{path}/model.safetensors",
              metadata={"format": "pt"})
    trainer = Mesh(np.array(devices), ("fsdp",))
    arrays = {k: jax.device_put(jnp.asarray(v), NamedSharding(
        trainer, PartitionSpec("fsdp" if v.shape[0] % 4 == 0 else None)))
        for k, v in rounded.items()}
    mesh = Mesh(np.array(devices[::-1]).reshape(2, 2), ("expert", "tensor"))
    with Engine(**engine_args(enable_single_process=True, enable_return_routed_experts=True,
                              mesh=mesh)) as engine:
        before = engine.get_server_info()["num_compiles"]
        jax.config.update("jax_transfer_guard_host_to_device", "disallow")
        jax.config.update("jax_transfer_guard_device_to_host", "disallow")
        out = engine.update_weights_from_arrays(arrays)
        jax.config.update("jax_transfer_guard_host_to_device", "allow")
        jax.config.update("jax_transfer_guard_device_to_host", "allow")
        outs = engine.generate(input_ids=prompts, sampling_params=sampling,
                               return_routed_experts=True)
        after = engine.get_server_info()["num_compiles"]
    print(json.dumps({
        "host_bytes": out["host_bytes"], "compiles_before": before, "compiles_after": after,
        "output_ids": [o["output_ids"] for o in outs],
        "routed_experts": [o["meta_info"]["routed_experts"] for o in outs],
        "model_path": path,
    }))


if __name__ == "__main__":
    main()
