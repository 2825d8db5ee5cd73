"""The asyncio controller that moves KV pages between device, host and storage.

* :class:`HiCacheController` - queues, workers, prefetch, load-back, close report.
* :class:`ControllerConfig` - write/prefetch policies, queue sizes, retries, timeouts.
* :class:`ControllerMetrics` - ``snapshot()`` and ``prometheus_text()``.
"""

from hicache.controller.config import PREFETCH_POLICIES, WRITE_POLICIES, ControllerConfig
from hicache.controller.controller import ControllerState, HiCacheController
from hicache.controller.jobs import (
    BackupJob,
    CloseReport,
    PrefetchOp,
    PrefetchResult,
    StorageWriteJob,
    UnwrittenBackup,
)
from hicache.controller.metrics import ControllerMetrics

__all__ = [
    "BackupJob",
    "CloseReport",
    "ControllerConfig",
    "ControllerMetrics",
    "ControllerState",
    "HiCacheController",
    "PREFETCH_POLICIES",
    "PrefetchOp",
    "PrefetchResult",
    "StorageWriteJob",
    "UnwrittenBackup",
    "WRITE_POLICIES",
]
