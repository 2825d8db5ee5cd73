"""Which errors are worth retrying, and how long to wait between attempts.

Only *transient* failures are retried: the connection could not be made or broke, the request
timed out, the service answered 5xx, or it asked us to slow down (429, ``SlowDown``,
``Throttling``...). A 404 is an answer (a miss), and 403/400-class errors will not change by
asking again - retrying them only delays the miss and hammers the service.

The classification walks the exception's ``__cause__``/``__context__`` chain because s3fs turns
botocore's ``ClientError`` into ``OSError``\\s and keeps the original as the cause.
"""

from __future__ import annotations

import errno
import random
from dataclasses import dataclass

__all__ = ["RetryPolicy", "is_transient", "is_throttle"]

_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
        "429",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    e
    for e in (
        getattr(errno, "EREMOTEIO", None),  # s3fs: InternalError / 500
        errno.EBUSY,  # s3fs: SlowDown / ServiceUnavailable / 503
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
    )
    if e is not None
)


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [TimeoutError, ConnectionError]
    try:  # botocore and aiohttp are there with s3fs; the fsspec backend works without them
        from botocore import exceptions as bce

        types += [bce.HTTPClientError, bce.ConnectionError]
    except ImportError:  # pragma: no cover
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_TRANSIENT_TYPES = _transient_types()


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _client_error_info(exc: BaseException) -> tuple[int | None, str | None] | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    return (status if isinstance(status, int) else None, str(code) if code is not None else None)


def is_throttle(exc: BaseException) -> bool:
    """Whether the service asked us to slow down (429 / SlowDown and friends)."""
    for e in _chain(exc):
        info = _client_error_info(e)
        if info is not None:
            status, code = info
            return status == 429 or code in {"SlowDown", "Throttling", "ThrottlingException", "429"}
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether asking again might succeed (see the module docstring)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    for e in _chain(exc):
        info = _client_error_info(e)
        if info is not None:  # the service answered: its status decides
            status, code = info
            if code in _THROTTLE_CODES:
                return True
            return status is not None and (status >= 500 or status == 429)
        if isinstance(e, _TRANSIENT_TYPES):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` extra attempts after the first, with capped exponential backoff and jitter
    (so many clients recovering from one outage do not retry in lock step)."""

    retries: int = 2
    backoff: float = 0.05
    backoff_max: float = 1.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        if self.backoff < 0 or self.backoff_max < 0:
            raise ValueError("retry backoff must be >= 0")

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def delay(self, attempt: int, throttled: bool = False) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 0)."""
        cap = min(self.backoff_max, self.backoff * (2**attempt) * (4 if throttled else 1))
        return random.uniform(cap / 2, cap)
