"""The object-store backends: ``s3`` (S3-compatible services via s3fs, natively async) and
``fsspec`` (any fsspec URL: ``gs://``, ``memory://``, ``file://``...).

Modules, one job each: :mod:`.naming` (object names, redaction), :mod:`.retry` (what to retry and
when), :mod:`.breaker` (circuit breaker), :mod:`.cache` (positive existence cache), :mod:`.fs`
(per-event-loop filesystems and their operations), :mod:`.runner` (timeouts, retries, breaker
and bounded batches around every request), :mod:`.backend` (the storage classes).
"""

from hicache_backends.s3.backend import FsspecStorage, S3Storage

__all__ = ["FsspecStorage", "S3Storage"]
