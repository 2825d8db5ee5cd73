"""Every hicache metric is a ``prometheus_client`` object on the default registry.

Why ``prometheus_client`` and not hand-written text: the engines that embed hicache (vLLM,
SGLang) export through it, so our families land on the same ``/metrics`` as theirs; its
multi-process mode gives several workers one scrape; and whatever else registers on the default
registry (miss attribution, KV events, an engine) renders beside ours through :func:`exposition`.

**Several caches in one process** (the test suite opens hundreds; a process may embed two).
A family name can be registered once per process, so families are process-wide and every family
an owner writes carries a ``cache`` label: each owner (a controller's metrics, a server, the
recompute baseline) is an :class:`InstanceMetrics` that takes a label value from
:func:`next_instance_label` (``"0"``, ``"1"``, ... in creation order in the process, or a name
its creator gives) and binds its own children under it. :meth:`InstanceMetrics.close` (or the
owner's garbage collection) removes its children, so a process that opens and closes many caches
does not grow its registry or its scrape.

**Owners sharing a label.** Two owners given one label (two caches of one name, a cache replaced
by a new one of the same name before the old one closed, an app built twice on one cache) write
one series per family and labels: counters add up, a gauge shows the last value set. Each
series is counted per owner writing it and leaves with the last of them (the first to close
used to remove the series of the one still running). Why not a label made unique instead
("prod-1"): a name is given to keep a dashboard row, and a replacement must continue that row
(and the rates over it), not start another. Owners that share a label but write different
families (the server's ``hicache_server_*`` beside its cache's) share no series; the first
owner that does share one says so in the log. In multi-process mode every worker's first cache is
``"0"``, so one scrape sums the workers' counters and histograms per label set, which is what a
dashboard of a deployment wants.

**Gauges that are callbacks.** Queue depths, pages in use, whether the store answers: their
value lives in the owner's objects, so the owner registers a function (:meth:`InstanceMetrics.gauge`)
and :func:`refresh` reads every live owner's functions into real gauges right before an exposition.
In multi-process mode a scrape in another process cannot call them, so each owner also refreshes
its own gauges, at most once a second, when it updates any of its metrics: on one process-wide
daemon thread (:class:`_Refresher`), never on the updating thread, since that is the event loop
and the functions read pools, trees and the storage backend's figures. A function that raises
sets its gauge to NaN; the scrape goes on. Refreshes of one owner never overlap (a lock per
owner), so a mirrored counter never counts one growth twice.

**Multi-process mode.** Set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory shared by the
workers before they import ``prometheus_client`` (``prometheus_client``'s own rule: the value
class is chosen at import). :func:`exposition` then renders a ``MultiProcessCollector`` over the
directory, so whichever process serves the scrape shows all of them. Gauges take a
``multiprocess_mode``: ``livesum`` (queue depths, pages: the deployment's total over live
workers) unless a family says otherwise (``storage_up`` is ``livemin``: one worker that lost its
store shows). A process marks its live gauges dead when it exits (``atexit``); counters of dead
workers keep counting, as totals should. A worker killed by a signal runs no ``atexit``: a
scrape marks dead every worker whose live gauge files name a pid that no longer exists.

Metric names: ``hicache_`` then the name the owner gives; counters get ``_total`` from
``prometheus_client``; label values are lower case.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from hicache.errors import ConfigError

__all__ = [
    "CONTENT_TYPE",
    "INSTANCE_LABEL",
    "LATENCY_BUCKETS",
    "InstanceMetrics",
    "counter",
    "exposition",
    "exposition_text",
    "gauge",
    "histogram",
    "multiprocess_dir",
    "next_instance_label",
    "refresh",
]

logger = logging.getLogger("hicache.metrics")

INSTANCE_LABEL = "cache"
CONTENT_TYPE = CONTENT_TYPE_LATEST
#: seconds; from a page-cache hit (~100 us) to a stalled store (the default stall trip is 5 s)
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_REFRESH_EVERY_S = 1.0

_lock = threading.RLock()
_families: dict[str, MetricWrapperBase] = {}
_labels = itertools.count()
_live: weakref.WeakSet[InstanceMetrics] = weakref.WeakSet()
_atexit_done = False
_pending: collections.deque[dict[MetricWrapperBase, set[tuple[str, ...]]]] = collections.deque()
# (family, label values) -> live owners writing that series (see "Owners sharing a label")
_holders: dict[tuple[MetricWrapperBase, tuple[str, ...]], int] = {}


def multiprocess_dir() -> str | None:
    """The multi-process directory when this process runs in multi-process mode, else None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir") or None


def _get_or_create(kind: type[MetricWrapperBase], name: str, doc: str, labels: Sequence[str], **kw: Any) -> Any:
    if not _NAME.match(name):
        raise ValueError(f"invalid metric name {name!r}")
    with _lock:
        have = _families.get(name)
        if have is None:
            have = kind(name, doc, labelnames=tuple(labels), **kw)
            _families[name] = have
            return have
    if type(have) is not kind or tuple(have._labelnames) != tuple(labels):
        raise ValueError(
            f"metric {name!r} is already a {type(have).__name__} with labels {have._labelnames}, "
            f"not a {kind.__name__} with labels {tuple(labels)}"
        )
    return have


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    """The process-wide counter ``name`` (created on first use; ``_total`` is added on export)."""
    return _get_or_create(Counter, name.removesuffix("_total"), doc, labels)


def gauge(name: str, doc: str, labels: Sequence[str] = (), mode: str = "livesum") -> Gauge:
    """The process-wide gauge ``name``; ``mode`` is its multi-process aggregation."""
    return _get_or_create(Gauge, name, doc, labels, multiprocess_mode=mode)


def histogram(name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
    """The process-wide histogram ``name``."""
    return _get_or_create(Histogram, name, doc, labels, buckets=tuple(buckets))


def next_instance_label() -> str:
    """``"0"``, ``"1"``, ...: the ``cache`` label of the next owner that does not name itself."""
    return str(next(_labels))


def refresh() -> None:
    """Read every live owner's gauge functions into their gauges (before an exposition)."""
    _unbind_pending()
    with _lock:  # owners open and close on other threads (a WeakSet is not thread-safe)
        owners = list(_live)
    for owner in owners:
        owner.refresh()


def _scrape_registry() -> CollectorRegistry:
    path = multiprocess_dir()
    if path is None:
        return prometheus_client.REGISTRY
    from prometheus_client import multiprocess

    _mark_killed_dead(path)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    return registry


_LIVE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


def _mark_killed_dead(path: str) -> None:
    """Mark dead the workers whose live gauge files outlived them: a worker killed by a signal
    (the OOM killer, a supervisor's SIGKILL) runs no ``atexit``, and its last queue depths,
    sizes and ``storage_up`` stayed in every scrape for good. A pid that no longer exists is
    dead; one that exists (or that this process may not signal) is left alone. The files are
    named by pid, so the workers of one directory share a pid namespace already (two namespaces
    would write one another's files)."""
    from prometheus_client import multiprocess

    try:
        names = os.listdir(path)
    except OSError:
        return
    me = os.getpid()
    for pid in sorted({int(m.group(1)) for m in map(_LIVE_FILE.match, names) if m is not None}):
        if pid == me or pid <= 0:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                multiprocess.mark_process_dead(pid, path)
                logger.info("metrics: worker %d is gone without marking its gauges dead (killed?); done now", pid)
            except OSError:
                logger.debug("could not mark pid %d dead in %s", pid, path, exc_info=True)
        except OSError:  # EPERM: it exists, under another user
            continue


def exposition() -> bytes:
    """The scrape body: the default registry, or every worker's files in multi-process mode."""
    refresh()
    return generate_latest(_scrape_registry())


def exposition_text() -> str:
    return exposition().decode("utf-8")


def _mark_dead_at_exit(path: str) -> None:
    global _atexit_done
    with _lock:
        if _atexit_done:
            return
        _atexit_done = True
    pid = os.getpid()

    def mark() -> None:
        if os.getpid() != pid:  # a forked child inherits atexit hooks; it is not us
            return
        from prometheus_client import multiprocess

        try:
            multiprocess.mark_process_dead(pid, path)
        except OSError:
            logger.debug("could not mark pid %d dead in %s", pid, path, exc_info=True)

    atexit.register(mark)


class _Refresher:
    """The one daemon thread that runs the refreshes :meth:`InstanceMetrics.touched` asks for.

    Why one thread and not ``asyncio.to_thread``: updates come from the event loop and from
    worker threads alike, a refresh must not become a task someone has to own, and several
    requests for one owner while it waits coalesce into one refresh. Owners are held weakly
    (a closed or collected owner is skipped). A forked child starts without the thread; its
    first request starts its own.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        # owner id -> (owner, when: a time.monotonic() at which to refresh it)
        self._due: dict[int, tuple[weakref.ref[InstanceMetrics], float]] = {}
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.running = 0  # refreshes in progress (tests wait for 0)

    def request(self, owner: InstanceMetrics, at: float = 0.0) -> None:
        """Refresh ``owner`` now, or at ``at`` (``time.monotonic()``) at the latest."""
        with self._cond:
            if self._pid != os.getpid():  # forked: the parent's thread is not ours
                self._pid, self._thread = os.getpid(), None
                self._due.clear()
            have = self._due.get(id(owner))
            when = at if have is None else min(at, have[1])
            self._due[id(owner)] = (weakref.ref(owner), when)
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="hicache-metrics-refresh", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # interpreter shutdown: no new threads; the refresh is skipped
                    self._due.clear()
                    return
                self._thread = thread
            self._cond.notify()

    def idle(self) -> bool:
        """True when no refresh is queued or running."""
        with self._cond:
            return not self._due and self.running == 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._due:
                        wait = min(when for _, when in self._due.values()) - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                now = time.monotonic()
                due = [ref for ref, when in self._due.values() if when <= now]
                self._due = {key: entry for key, entry in self._due.items() if entry[1] > now}
                self.running += 1
            try:
                for ref in due:
                    owner = ref()
                    if owner is not None:
                        owner.refresh()  # never raises: a broken function is a NaN gauge
            except Exception:  # noqa: BLE001 - the thread outlives any owner's bug
                logger.exception("metrics refresh failed")
            finally:
                with self._cond:
                    self.running -= 1


_refresher = _Refresher()


def _defer_unbind(used: dict[MetricWrapperBase, set[tuple[str, ...]]]) -> None:
    """The garbage collector's path: it may run while this thread holds a family's
    (non-reentrant) lock, so only queue the work; :func:`_unbind_pending` does it later."""
    _pending.append(used)


def _unbind_pending() -> None:
    while _pending:
        try:
            used = _pending.popleft()
        except IndexError:
            return
        _unbind(used)


def _unbind(used: dict[MetricWrapperBase, set[tuple[str, ...]]]) -> None:
    """Release one owner's series: each leaves the registry with the last owner writing it."""
    with _lock:  # against another owner taking the series between the count and the removal
        for family, label_sets in list(used.items()):
            for values in list(label_sets):
                key = (family, values)
                left = _holders.pop(key, 1) - 1
                if left > 0:
                    _holders[key] = left
                    continue
                try:
                    family.remove(*values)
                except KeyError:
                    pass
        used.clear()


def _shared(family: MetricWrapperBase, values: tuple[str, ...]) -> bool:
    with _lock:
        return _holders.get((family, values), 0) > 1


class _Dropped:
    """What a closed owner's late updates go to: its series have left the registry."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        return None

    def set(self, value: float) -> None:
        return None

    def observe(self, value: float) -> None:
        return None


_DROPPED = _Dropped()


class InstanceMetrics:
    """One owner's children in the process-wide families, under its own ``cache`` label.

    Families are named without the ``hicache_`` prefix here (``child("hit_tokens", ...)``), the
    ``cache`` label is added to every family this class creates, and children are cached so a
    hot-path increment is one dict lookup and ``prometheus_client``'s own lock.
    """

    def __init__(self, label: str | None = None) -> None:
        self.label: str = label if label is not None else next_instance_label()
        self._used: dict[MetricWrapperBase, set[tuple[str, ...]]] = {}
        # (name, sorted label items) -> child: the one memo of children, so owners look theirs
        # up here rather than keeping their own
        self._children: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._gauge_fns: list[tuple[Any, Callable[[], float]]] = []
        self._refreshers: list[Callable[[InstanceMetrics], object]] = []
        self._mirrors: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._multiprocess = multiprocess_dir() is not None
        self._next_refresh = 0.0
        self._deferred = False  # a refresh at the end of the throttle window is queued
        self._refresh_lock = threading.RLock()  # a gauge function that scrapes must not deadlock
        self._closed = False
        self._told_shared = False  # logged that a series of this label has another owner
        if self._multiprocess:
            path = multiprocess_dir() or ""
            if not os.path.isdir(path):
                raise ConfigError(
                    f"PROMETHEUS_MULTIPROC_DIR={path!r} is not a directory: create it (empty) before the workers start"
                )
            _mark_dead_at_exit(path)
        with _lock:
            _live.add(self)
        _unbind_pending()
        self._finalizer = weakref.finalize(self, _defer_unbind, self._used)

    # -- children
    def _family(self, kind: str, name: str, doc: str, labels: Sequence[str], **kw: Any) -> MetricWrapperBase:
        full = f"hicache_{name}"
        names = (INSTANCE_LABEL, *labels)
        if kind == "counter":
            return counter(full, doc, names)
        if kind == "gauge":
            return gauge(full, doc, names, **kw)
        return histogram(full, doc, names, **kw)

    def child(self, kind: str, name: str, doc: str = "", labels: Mapping[str, str] | None = None, **kw: Any) -> Any:
        """The child of family ``hicache_<name>`` (``kind``: counter, gauge or histogram) for
        this owner and ``labels``; created, with the family, on first use."""
        items = tuple(sorted((labels or {}).items())) if labels else ()
        key = (name, items)
        have = self._children.get(key)
        if have is not None:
            return have
        if self._closed:  # a late update (a task finishing after close) must not re-add a series
            return _DROPPED
        family = self._family(kind, name, doc or name.replace("_", " "), [k for k, _ in items], **kw)
        values = (self.label, *(str(v) for _, v in items))
        with _lock:  # the count and the child together: a close of another owner releases both
            if self._closed:  # closed meanwhile: its series were released, add none back
                return _DROPPED
            have = family.labels(*values)
            used = self._used.setdefault(family, set())
            if values not in used:
                used.add(values)
                holders = _holders[(family, values)] = _holders.get((family, values), 0) + 1
                if holders > 1 and not self._told_shared:
                    self._told_shared = True
                    logger.info("metrics: cache label %r is written by another live owner too (%s): their series are "
                                "one (counters add up, a gauge shows the last value set); each stays until the last "
                                "owner writing it closes", self.label, family._name)
        self._children[key] = have
        return have

    # -- gauges read from callbacks
    def gauge(self, name: str, fn: Callable[[], float], doc: str = "", mode: str = "livesum",
              labels: Mapping[str, str] | None = None) -> None:
        """Gauge ``hicache_<name>`` read from ``fn()`` at each :meth:`refresh`."""
        self._gauge_fns.append((self.child("gauge", name, doc, labels, mode=mode), fn))

    def on_refresh(self, fn: Callable[[InstanceMetrics], object]) -> None:
        """Call ``fn(self)`` at each :meth:`refresh` (gauges or mirrored counters whose names
        are only known then, e.g. a backend's own figures)."""
        self._refreshers.append(fn)

    def mirror(self, kind: str, name: str, value: float, doc: str = "", labels: Mapping[str, str] | None = None,
               **kw: Any) -> bool:
        """Publish a figure kept elsewhere: a gauge is set to ``value``; a counter (``value``
        a running total) is increased by what it grew since the last call (a total that went
        down was reset: it counts from zero again). False when ``name`` is taken by a family of
        another kind or labels (dynamic names must never break a scrape)."""
        try:
            child = self.child(kind, name, doc, labels, **kw)
        except ValueError:
            return False
        if kind == "gauge":
            child.set(value)
            return True
        key = (name, tuple(sorted((labels or {}).items())))
        last = self._mirrors.get(key, 0.0)
        grew = value - last if value >= last else value
        if grew > 0:
            child.inc(grew)
        self._mirrors[key] = value
        return True

    def refresh(self) -> None:
        """Read the gauge functions (NaN for one that raises) and run the refreshers; one
        refresh of this owner at a time (a scrape thread and the refresher thread may both ask)."""
        with self._refresh_lock:
            self._deferred = False  # before reading: a change from now on asks again
            if self._closed:
                return
            for child, fn in list(self._gauge_fns):
                try:
                    value = float(fn())
                except Exception:  # noqa: BLE001 - a broken gauge must not break scraping
                    value = math.nan
                if self._closed:  # closed meanwhile: its series are gone, set nothing more
                    return
                child.set(value)
            for refresher in list(self._refreshers):
                if self._closed:
                    return
                try:
                    refresher(self)
                except Exception:  # noqa: BLE001
                    logger.debug("metrics refresher %r failed", refresher, exc_info=True)

    def touched(self) -> None:
        """Called on updates: in multi-process mode, have this owner's gauges refreshed now and
        then (since no scrape in this process will), on the refresher thread."""
        if self._multiprocess:
            now = time.monotonic()
            if now >= self._next_refresh:
                self._next_refresh = now + _REFRESH_EVERY_S
                _refresher.request(self)
            elif not self._deferred:  # throttled: still refreshed once the window ends, or the
                # last change of a burst (a recovery right after a probe) would wait for the next
                # update; one request per window (each one took a lock and woke the thread)
                self._deferred = True
                _refresher.request(self, at=self._next_refresh)

    async def aclose(self) -> None:
        """:meth:`close` for a caller on the event loop: the final multi-process refresh runs
        on a thread."""
        try:
            if self._multiprocess and not self._closed:
                await asyncio.to_thread(self.refresh)
        finally:  # cancelled or not, the series leave
            self._close(final_refresh=False)

    def close(self) -> None:
        """Remove this owner's children from the registry (its values leave the scrape);
        idempotent. In multi-process mode the files stay (counters keep counting), and the
        gauges are read a last time on this thread (on the event loop use :meth:`aclose`)."""
        self._close(final_refresh=True)

    def _close(self, final_refresh: bool) -> None:
        if self._closed:
            return
        if self._multiprocess and final_refresh:
            self.refresh()
        with self._refresh_lock:  # a refresh on another thread must not re-add a series after
            if self._closed:
                return
            self._closed = True
            with _lock:
                _live.discard(self)
            self._gauge_fns.clear()
            self._refreshers.clear()
            if self._multiprocess:
                self._neutral_gauges()
            self._children.clear()
            self._finalizer.detach()
            _unbind(self._used)

    def _neutral_gauges(self) -> None:
        """Multi-process mode cannot remove a series (its values stay in this worker's files
        until the process exits): a closed owner's gauges are set to what their aggregation
        ignores: 0 where summed, +inf where the minimum is taken, -inf where the maximum (they
        lose every comparison, in whatever order the workers' files are read; NaN won when
        read first), so a replaced cache's sizes are not added in, nor its last
        ``storage_up = 0`` read as DOWN. A "most recent" gauge is left as it is."""
        for family, label_sets in self._used.items():
            if not isinstance(family, Gauge):
                continue
            mode = getattr(family, "_multiprocess_mode", "livesum")
            if mode.endswith("mostrecent"):
                continue
            value = math.inf if mode.endswith("min") else -math.inf if mode.endswith("max") else 0.0
            for values in label_sets:
                if _shared(family, values):  # another live owner writes it: its value stands
                    continue
                try:
                    family.labels(*values).set(value)
                except Exception:  # noqa: BLE001 - closing must not fail on one series
                    pass


def numeric_items(stats: Mapping[str, Any]) -> Iterable[tuple[str, float]]:
    """``(key, value)`` of the numeric entries of a stats dict whose keys can be metric names."""
    for key, value in stats.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if _NAME.match(key) and key.islower():
            yield key, float(value)
