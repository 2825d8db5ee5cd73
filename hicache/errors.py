"""The hicache exception tree.

Every error hicache raises on purpose derives from :class:`HiCacheError` and, where one fits,
from the built-in it resembles, so callers may catch either::

    HiCacheError
    ├── ConfigError (ValueError)            bad option, unknown key, value out of range
    ├── BackendNotFoundError (LookupError)  no backend registered under that name
    ├── BackendLoadError (ImportError)      a backend is registered but cannot be imported, built or opened
    ├── InvalidKeyError (ValueError)        a page key that can never be stored
    ├── StorageStateError (RuntimeError)    storage used before open / after close
    ├── LoopMisuseError (RuntimeError)      blocking facade called inside a loop; cache used on another loop
    ├── CacheClosedError (RuntimeError)     cache or controller used after aclose()
    ├── TraceFormatError (ValueError)       a request trace line that is not a Mooncake record
    ├── OutOfKVSlotsError (MemoryError)     no device KV slots even after eviction and offload
    ├── RequestAbortedError (RuntimeError)  a request aborted while its admit waited
    ├── PrefixLoadError (RuntimeError)      a request's prefix KV failed to load to the device
    └── ChainGoneError (LookupError)        a tree node that left the tree: no storage key chain

A *miss* is never an exception: reads return ``None``/``False`` for pages that are absent,
corrupt or unreachable, because in a cache a miss is the normal path.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "quoted",
    "HiCacheError",
    "ConfigError",
    "BackendNotFoundError",
    "BackendLoadError",
    "InvalidKeyError",
    "StorageStateError",
    "LoopMisuseError",
    "CacheClosedError",
    "OutOfKVSlotsError",
    "TraceFormatError",
    "RequestAbortedError",
    "PrefixLoadError",
    "ChainGoneError",
]


# what an error message shows of a value a user sent: a few levels, a few items, a short string
# (quoted whole, a megabyte string or 100k field names made a megabyte message per request)
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxset = 3, 6, 6, 6, 6
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 80, 80, 40


def quoted(value: Any) -> str:
    """``repr(value)`` cut short, for an error message that names a bad value."""
    return _SHORT.repr(value)


class HiCacheError(Exception):
    """Base of every error raised by hicache on purpose."""


class ConfigError(HiCacheError, ValueError):
    """A configuration value or option is invalid; the message names it and what is allowed."""


class BackendNotFoundError(HiCacheError, LookupError):
    """No storage backend is registered under the requested name."""


class BackendLoadError(HiCacheError, ImportError):
    """A backend is registered but importing it failed (usually a missing extra), or its
    constructor or open failed on an error of its own."""


class InvalidKeyError(HiCacheError, ValueError):
    """A page key that no backend may store (wrong type, empty, too long, NUL byte)."""


class StorageStateError(HiCacheError, RuntimeError):
    """A storage object was used in a state that does not allow it (for example after close)."""


class LoopMisuseError(HiCacheError, RuntimeError):
    """The blocking facade was called from a thread that runs an event loop, or an async cache
    was used on another event loop than the one that started it (its tree, pools and queues
    belong to that loop)."""


class CacheClosedError(HiCacheError, RuntimeError):
    """A cache, controller or facade was used after it was closed."""


class TraceFormatError(HiCacheError, ValueError):
    """A line of a request trace is not a Mooncake record; the message names file and line."""


class OutOfKVSlotsError(HiCacheError, MemoryError):
    """No device KV slots (or request slots) are left even after eviction and session offload;
    the request should be retried when others finish, or aborted."""


class RequestAbortedError(HiCacheError, RuntimeError):
    """The request was aborted (``abort_req``, from another task) while its ``admit`` waited:
    admit released what it locked instead of admitting it."""


class PrefixLoadError(HiCacheError, RuntimeError):
    """A request's prefix KV could not be copied to the device (its load from host failed):
    the prefix slots hold no valid KV. Abort the request (``commit`` aborts it too); the
    prefix stays cached below the device, so a retry loads or recomputes it."""


class ChainGoneError(HiCacheError, LookupError):
    """A tree node left the tree before its page keys were made: no storage key chain
    continues from it (the namespace's seed would give its continuation a root prompt's keys)."""
