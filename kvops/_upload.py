"""Host data onto the device without waiting for the GPU.

A copy from pageable host memory can wait for the work already queued on the stream; through
pinned memory with ``non_blocking`` it is queued behind that work instead, and the caching
host allocator keeps the pinned block until the copy has run, so the host array may change
at once. The engine's steps and the runtime's policies upload this way while earlier device
work is still running.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(a, device: torch.device) -> torch.Tensor:
    """``a`` (a numpy array or a CPU tensor) on ``device``; on CUDA through pinned memory,
    without a sync. On the CPU the result may share ``a``'s memory."""
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
