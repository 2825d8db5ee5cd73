"""Sizing and allocating host (L2) buffers: bytes or a ratio of the device pool, pinned on CUDA.

Why pinned only with CUDA: pinned (page-locked) memory is what lets a CUDA stream copy
asynchronously at full PCIe speed; without CUDA it buys nothing and may be refused by the OS
limits on locked memory.
"""

from __future__ import annotations

import logging
import math

import torch

__all__ = [
    "resolve_host_units",
    "alloc_host_bytes",
    "want_pinned",
    "available_host_memory",
    "pinned_footprint",
    "units_of_ratio",
]

logger = logging.getLogger("hicache.memory")

DEFAULT_HOST_TO_DEVICE_RATIO = 2.0


def available_host_memory() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def units_of_ratio(device_units: int, ratio: float) -> int:
    """Whole units in ``device_units * ratio``. The product is rounded to 6 places before the
    floor: in floats ``100 * 0.29`` is 28.999999999999996, and a ratio naming 29 of 100 pages
    lost one of them."""
    return math.floor(round(device_units * ratio, 6))


def resolve_host_units(
    *,
    device_units: int,
    unit_nbytes: int,
    host_size_bytes: int | None,
    host_to_device_ratio: float | None,
    what: str,
    pinned: bool = False,
) -> int:
    """Number of units (pages, or state slots) a host pool gets.

    Exactly one of ``host_size_bytes`` / ``host_to_device_ratio`` may be given; with neither the
    ratio defaults to 2.0 (SGLang's default). The result is rounded down to whole units and must
    be at least one unit and fit in available memory, else ``ValueError`` / ``MemoryError`` with
    the numbers in the message. A ``pinned`` pool must fit with the memory torch locks for it
    (:func:`pinned_footprint`), and a warning says when that rounding costs more than 5%.
    """
    if host_size_bytes is not None and host_to_device_ratio is not None:
        raise ValueError(f"{what}: give host_size_bytes or host_to_device_ratio, not both")
    if host_size_bytes is not None:
        if host_size_bytes <= 0:
            raise ValueError(f"{what}: host_size_bytes must be positive, got {host_size_bytes}")
        units = int(host_size_bytes) // unit_nbytes
    else:
        ratio = DEFAULT_HOST_TO_DEVICE_RATIO if host_to_device_ratio is None else float(host_to_device_ratio)
        if ratio <= 0:
            raise ValueError(f"{what}: host_to_device_ratio must be positive, got {ratio}")
        units = units_of_ratio(device_units, ratio)
    if units < 1:
        raise ValueError(
            f"{what}: host pool would hold no page (one page is {unit_nbytes} bytes; "
            f"asked for {host_size_bytes} bytes / ratio {host_to_device_ratio})"
        )
    size = units * unit_nbytes
    need = pinned_footprint(size) if pinned else size
    if need > size * 1.05:
        logger.warning("%s: a pinned host pool of %.2f GiB locks %.2f GiB of RAM (torch rounds pinned allocations "
                       "up to a power of two); a pool of %.2f GiB would use all of it",
                       what, size / 2**30, need / 2**30, need / 2**30)
    avail = available_host_memory()
    if avail is not None and need > avail:
        locked = f" (pinned: torch locks {need / 2**30:.2f} GiB for it)" if need != size else ""
        raise MemoryError(
            f"{what}: host pool needs {size / 2**30:.2f} GiB{locked} but only {avail / 2**30:.2f} GiB "
            f"of host memory is available; lower host_size_bytes or host_to_device_ratio"
        )
    return units


def want_pinned(pin_memory: bool | None) -> bool:
    """Resolve ``pin_memory=None`` to "pinned iff CUDA is present"; refuse pinning without CUDA."""
    if pin_memory is None:
        return torch.cuda.is_available()
    if pin_memory and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA; pass None or False on a machine without a GPU")
    return bool(pin_memory)


def pinned_footprint(nbytes: int) -> int:
    """Bytes torch's pinned-memory allocator locks for a request of ``nbytes``: its caching
    allocator rounds every size up to a power of two (unless ``PYTORCH_CUDA_ALLOC_CONF`` sets a
    lower rounding threshold), so a 40 GiB pool locks 64 GiB of RAM."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


def alloc_host_bytes(shape: tuple[int, ...], pinned: bool) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor (pinned if asked). Not zeroed: touching many GiB at
    start-up is slow, and a host page is only read after something was copied into it."""
    return torch.empty(shape, dtype=torch.uint8, pin_memory=pinned)
