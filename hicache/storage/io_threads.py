"""I/O thread pools whose torch copies stay on the thread that makes them.

A backend's I/O threads copy pages with torch: a host pool without ``page_view`` is read into
with ``set_from_flat_data_page`` and written from with ``get_data_page``, each a tensor copy
made by the thread that moves the page. torch splits a large copy over its intra-op OpenMP
team, and every thread that runs one gets a team of its own: 4 I/O threads on 2 cores then
keep up to 8 threads busy, handing each 4 MiB copy around and spin-waiting after it. The I/O
threads already are the parallelism; the teams only add cycles (2 cores, 4 threads each
reading, hashing and committing 4 MiB pages: 1.30 CPU ms per page with teams, 1.08 without;
128 x 4 MiB seed-protocol gets through the file store: 1.41 and 1.27).

:func:`io_executor` makes a pool whose threads run torch's intra-op work serially. Only those
threads change: the OpenMP thread count is per-thread state, set here on each new thread,
so the caller's threads (and threads made later elsewhere) keep torch's setting.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["copy_threads", "io_executor", "serial_torch_thread"]

logger = logging.getLogger("hicache.storage")

_lock = threading.Lock()
_setter: Callable[[int], object] | None = None
_looked_up = False


def _openmp_runtimes() -> list[str | None]:
    """Where ``omp_set_num_threads`` may live: the process's global symbols first, then every
    loaded library that looks like an OpenMP runtime (torch's may be loaded locally)."""
    found: list[str | None] = [None]
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                name = os.path.basename(path)
                if "omp" in name and ".so" in name and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _find_setter() -> Callable[[int], object] | None:
    """The ``omp_set_num_threads`` of the runtime torch uses: the one that, called on this
    thread, makes ``torch.get_num_threads()`` answer 1 here. ``None`` when there is none
    (torch built without OpenMP, or a runtime we cannot reach): then nothing is changed."""
    torch.get_num_threads()  # torch sets up this thread's count first (later calls keep ours)
    for where in _openmp_runtimes():
        try:
            lib = ctypes.CDLL(where, mode=getattr(os, "RTLD_NOLOAD", 0)) if where else ctypes.CDLL(None)
            fn = lib.omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        fn(1)
        if torch.get_num_threads() == 1:
            return fn
    return None


def serial_torch_thread() -> None:
    """Thread initializer: torch's intra-op work on this thread runs on this thread alone."""
    global _setter, _looked_up
    if torch.get_num_threads() == 1:
        return
    with _lock:
        if not _looked_up:
            _setter = _find_setter()
            _looked_up = True
            if _setter is None:
                logger.debug("no OpenMP runtime found: I/O threads keep torch's intra-op threads")
            return
    if _setter is not None:
        _setter(1)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def copy_threads(limit: int) -> int:
    """Threads worth giving a batch whose pages are copied through host memory (at most ``limit``).

    Staged seed-protocol reads are CPU work more than I/O: each page is read from the page
    cache into a staging page, hashed and copied into the pool, and every such stream
    competes for the same caches and memory bandwidth. More streams than cores only slow
    each one down (2 cores, 128 x 4 MiB pages: 1.30 CPU ms per page on 4 threads, 1.11 on 3
    and on 2); one thread beyond the cores keeps them busy while another waits on a file.
    """
    return max(1, min(limit, usable_cores() + 1))


def io_executor(threads: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``threads`` I/O threads named ``name-N``, torch-serial (see the module)."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=serial_torch_thread)
