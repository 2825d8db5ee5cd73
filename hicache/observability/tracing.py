"""Optional OpenTelemetry spans around a request's cache work.

Spans: ``hicache.begin`` (a request's whole admission) with children ``hicache.match``,
``hicache.admit`` (the prefetch wait and the start of the load-back), ``hicache.prefetch`` (the
storage fetch, on its own task) and ``hicache.load_back`` (host->device, until the last layer
landed); ``hicache.backup`` (device->host batch) and ``hicache.backup.storage`` (host->storage
job) run on the controller's workers, outside any request, so they are roots. Attributes say
the pages, tokens and tiers involved; a prefetch that stopped short says why (``hicache.stop``), and
one that raised carries the error status and the exception.

Why process-wide and off by default: a tracer provider is process-wide in OpenTelemetry too,
and tracing costs an allocation and a context switch per span. While off, :func:`span` returns
one shared no-op object: a global read and a call, nothing allocated, and ``opentelemetry`` is
never imported (it is an optional extra: ``pip install hicache[otel]``). It is turned on by
``[tracing] enabled = true`` in a cache's config (the process's global tracer provider) or by
:func:`enable` with a provider of the caller's own.
"""

from __future__ import annotations

from typing import Any

from hicache.errors import ConfigError

__all__ = ["disable", "enable", "enabled", "span"]

_tracer: Any = None


class _NoopSpan:
    """Stands for both the context manager and the span while tracing is off."""

    __slots__ = ()

    def __enter__(self) -> _NoopSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        return None


_NOOP = _NoopSpan()


def enabled() -> bool:
    return _tracer is not None


def enable(provider: Any = None) -> None:
    """Turn spans on, from ``provider`` (a ``TracerProvider``) or, when None, the global one.
    A later call without a provider keeps the tracer already chosen."""
    global _tracer
    if provider is None and _tracer is not None:
        return
    try:
        from opentelemetry import trace
    except ImportError:
        raise ConfigError("tracing.enabled needs OpenTelemetry: pip install 'hicache[otel]'") from None
    source = provider if provider is not None else trace.get_tracer_provider()
    _tracer = source.get_tracer("hicache")


def disable() -> None:
    global _tracer
    _tracer = None


def span(name: str) -> Any:
    """A context manager for span ``name`` (current span as parent); the span it yields takes
    ``set_attribute``. The shared no-op while tracing is off."""
    tracer = _tracer
    if tracer is None:
        return _NOOP
    return tracer.start_as_current_span(name)
