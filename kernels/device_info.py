"""What the launchers and benchmarks need to know about the device: its multiprocessor count, and its clock and
power draw at a given moment."""
from __future__ import annotations

from functools import cache

import torch


@cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 elsewhere (the CPU interpreter runs one program at a time)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def clock_and_power(device: torch.device) -> dict | None:
    """The CUDA device's SM clock (``sm_mhz``) and power draw (``power_w``) now, read through NVML
    (``torch.cuda.clock_rate``, ``power_draw``); ``None`` on other devices or where NVML cannot be read."""
    if device.type != "cuda":
        return None
    try:
        return {"sm_mhz": int(torch.cuda.clock_rate(device)), "power_w": torch.cuda.power_draw(device) / 1e3}
    except Exception:  # noqa: BLE001 - no NVML (pynvml missing, or not initialised): the state is unknown
        return None
