"""Host values to the device without making the host wait for the GPU."""
import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}   # lists convert 2x faster


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """From pageable memory PyTorch syncs the stream after the copy, so the host would wait for every step in
    flight; from pinned memory the copy is queued and the host goes on (PyTorch's pinned-memory cache keeps each
    staging buffer until its copy is done)."""
    host = torch.from_numpy(np.asarray(values, dtype=_NUMPY[dtype])) if dtype in _NUMPY else \
        torch.as_tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else host
