"""Compile-only TPU devices: libtpu's environment, a named topology's devices, the chip
each is (its published peak, HBM size and bandwidth) and the mesh order of the devices."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from typing import Any

from sgl_jax.tools.aot.errors import ReportError

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float  # peak bf16 FLOP/s per chip
    hbm_bytes: float  # HBM capacity per chip
    hbm_bandwidth: float  # HBM bytes/s per chip
    cores_per_chip: int  # TensorCores per chip (a compile-only device may be one core)


# Published per-chip figures, Google Cloud TPU documentation ("System architecture" tables):
#   v4:  https://cloud.google.com/tpu/docs/v4   275 TFLOPs bf16, HBM2 32 GiB, 1200 GBps, 2 cores
#   v5e: https://cloud.google.com/tpu/docs/v5e  197 TFLOPs bf16, HBM2 16 GB, 819 GBps
#   v5p: https://cloud.google.com/tpu/docs/v5p  459 TFLOPs bf16, HBM2e 95 GB, 2765 GBps, 2 cores
#   v6e: https://cloud.google.com/tpu/docs/v6e  918 TFLOPs bf16, HBM 32 GB, 1640 GBps
# (GB/GBps taken as 1e9, GiB as 2**30, as printed. XLA:TPU itself lets a program use about
# 15.7 GiB on v5e, 31.2 GiB on v6e, 95.7 GiB on v5p and 15.2 GiB per v4 core.)
CHIPS = {
    "v4": Chip("v4", 275e12, 32 * GiB, 1200e9, 2),
    "v5e": Chip("v5e", 197e12, 16e9, 819e9, 1),
    "v5p": Chip("v5p", 459e12, 95e9, 2765e9, 2),
    "v6e": Chip("v6e", 918e12, 32e9, 1640e9, 1),
}
# jax.Device.device_kind -> chip
DEVICE_KINDS = {
    "TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
    "TPU v6 lite": "v6e", "TPU v6e": "v6e",
}


def prepare_environment() -> None:
    """Before JAX is imported: compile-only TPU devices next to a default CPU backend."""
    if importlib.util.find_spec("libtpu") is None:
        raise ReportError(
            "compiling for TPU topologies needs libtpu, which is not installed. "
            'Install it with: pip install "sgl_jax[tpu]"'
        )
    # The CPU stays the default backend (no TPU is attached; on a TPU VM this also leaves the
    # chips free). Without TPU_WORKER_HOSTNAMES libtpu logs an error looking for TPU workers;
    # TPU_SKIP_MDS_QUERY avoids asking a GCE metadata server about TPUs; libtpu's lockfile
    # would otherwise allow one such process per machine (tests, two reports at once).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_devices(name: str) -> list[Any]:
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu raises JaxRuntimeError / ValueError with its own text
        raise ReportError(
            f"cannot create the TPU topology {name!r} ({e}); use names like v5e:2x2, "
            "v6e:2x4, v5p:2x2x1, v4:2x2x1"
        ) from e


def chip_of(device: Any, overrides: argparse.Namespace) -> tuple[Chip, float]:
    """The chip and the fraction of it one compile-only device is (v4: one of two cores)."""
    key = DEVICE_KINDS.get(device.device_kind)
    chip = CHIPS.get(key) if key else None
    if chip is None:
        if None in (overrides.peak_tflops, overrides.hbm_gb, overrides.hbm_gbps):
            raise ReportError(
                f"no published figures for device kind {device.device_kind!r}; pass "
                "--peak-tflops, --hbm-gb and --hbm-gbps"
            )
        chip = Chip(device.device_kind, 0.0, 0.0, 0.0, 1)
    chip = dataclasses.replace(
        chip,
        bf16_flops=overrides.peak_tflops * 1e12 if overrides.peak_tflops else chip.bf16_flops,
        hbm_bytes=overrides.hbm_gb * 1e9 if overrides.hbm_gb else chip.hbm_bytes,
        hbm_bandwidth=overrides.hbm_gbps * 1e9 if overrides.hbm_gbps else chip.hbm_bandwidth,
    )
    cores = getattr(device, "num_cores", chip.cores_per_chip) or chip.cores_per_chip
    return chip, min(1.0, cores / chip.cores_per_chip)


def mesh_order(devices: list, ep: int, tp: int) -> list:
    """The first ep x tp devices in an order where the "tensor" axis is physically close."""
    need = ep * tp
    if need == len(devices):
        try:
            from jax.experimental import mesh_utils

            return list(mesh_utils.create_device_mesh((ep, tp), devices).reshape(-1))
        except Exception:  # an unusual shape: keep the topology's own order
            pass
    return devices[:need]
