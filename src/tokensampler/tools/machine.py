"""What a recorded benchmark says about the machine it ran on."""

from __future__ import annotations

import os
import platform

import torch


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": str(device),
            # libgomp's wait policy, read when torch was imported (docs/cpu-fast-path.md)
            "omp": {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
