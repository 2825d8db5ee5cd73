"""The demo inference server: aiohttp over a scheduler over the reference engine, with hicache
embedded.

- :mod:`hicache.server.app` - :func:`create_app` (routes and handlers)
- :mod:`hicache.server.scheduler` - :class:`Scheduler` (bounded queue, admission, drain)
- :mod:`hicache.server.protocol` - request validation
- :mod:`hicache.server.metrics` - server counters in Prometheus text
- :mod:`hicache.server.run` - :func:`serve` (CLI) and :func:`running_server` (demo, tests)
- :mod:`hicache.server.loadgen` - multi-turn chat load generator (``scripts/loadgen.py``)
"""

from hicache.server.app import STATE, ServerState, create_app
from hicache.server.run import RunningServer, running_server, serve
from hicache.server.scheduler import QueueFullError, Scheduler, SchedulerClosedError

__all__ = [
    "QueueFullError",
    "RunningServer",
    "STATE",
    "Scheduler",
    "SchedulerClosedError",
    "ServerState",
    "create_app",
    "running_server",
    "serve",
]
