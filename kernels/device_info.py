"""What the launchers need to know about the device: its multiprocessor count."""
from __future__ import annotations

from functools import cache

import torch


@cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 elsewhere (the CPU interpreter runs one program at a time)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
