"""``hicache inspect``: what a store holds, and whether it is intact.

Works with any backend that implements the optional introspection hooks of
:class:`~hicache.storage.AsyncHiCacheStorage` (``list_namespaces``, ``list_pages``); every page
check goes through the backend's normal verified read, so "intact" means exactly what a cache
read would accept. A page found corrupt is dropped by that read, as it would be in service.

Stores are opened as observers where the backend has such a mode (``supports_read_only``: the
file backend's ``read_only``): inspecting changes nothing but those corrupt pages (and the
namespace's shared count, which they leave). Opened as a
writer, a store evicted down to its own ``max_bytes`` (64 GiB unless the options said
otherwise) once its scan was done, so inspecting a server's store that was allowed more (or
unbounded) deleted its pages, and swept temp files, trash and the usage ledger besides.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from typing import Any

from hicache.errors import ConfigError, HiCacheError
from hicache.storage import AsyncHiCacheStorage, create_async_storage
from hicache.replay.trace import progress_bar
from hicache.storage.registry import available_backends, backend_class

logger = logging.getLogger(__name__)

__all__ = ["inspect_store"]

# describe_space() keys about the medium as a whole (reported once), and about one namespace
_MEDIUM_KEYS = ("free_bytes", "fs_bytes", "min_free_bytes", "writes_refused_for_free_space")
_NAMESPACE_KEYS = ("used_bytes", "inflight_bytes", "refused_pages_no_space", "last_refused_at")


def _lists_namespaces(cls: type[AsyncHiCacheStorage]) -> bool:
    """Whether a backend class implements the (optional) namespace listing inspect starts from."""
    return cls.list_namespaces is not AsyncHiCacheStorage.list_namespaces


def _pages_damage(pages_dir: str) -> str | None:
    """Why a namespace's page folder cannot be listed (``None``: it can, or there is none, as
    before a namespace's first write). Opened, such a namespace's store logged its scan's failure
    with a traceback, and its survey raised: one damaged namespace failed the whole report."""
    try:
        with os.scandir(pages_dir):
            pass
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return "its pages is a file, not a folder"
    except OSError as exc:
        return f"its pages folder cannot be listed: {exc.strerror or exc}"
    return None


def _cannot_inspect(backend: str) -> ConfigError:
    """The one-line error for a backend whose store cannot be inspected, naming those that can
    (each installed backend is imported to ask; one that cannot be imported is left out)."""
    can = []
    for name in available_backends():
        try:
            if _lists_namespaces(backend_class(name)):
                can.append(name)
        except HiCacheError:
            continue
    why = backend_class(backend).not_inspectable_why
    return ConfigError(f"backend {backend!r} {why}; backends that can be inspected: {', '.join(can) or 'none installed'}")


async def inspect_store(
    root: str | None = None,
    *,
    backend: str = "file",
    options: dict[str, Any] | None = None,
    verify: str = "sample",
    sample: int = 256,
    progress: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Namespaces, page counts, bytes and (``verify``: none/sample/all) integrity of a store.

    A namespace whose manifest is corrupt is listed under its digest with ``corrupt_manifest``
    (why) and no page counts; ``corrupt_manifests`` counts them. ``corrupt`` counts the page
    files that could not be listed and the pages that failed verification; ``vanished`` the
    pages a live writer removed (evicted) between the listing and their check: no damage. A
    namespace whose pages cannot be listed (its ``pages`` a file, not a folder) is listed with
    ``damaged`` (why) and no page counts; ``damaged_namespaces`` counts them."""
    if verify not in ("none", "sample", "all"):
        raise ValueError(f"verify must be none, sample or all, got {verify!r}")
    # before the store is built: a ROOT given to a backend without one (memory) was an error about
    # an unknown option, which named neither the real problem nor what to use instead
    if not _lists_namespaces(backend_class(backend)):
        raise _cannot_inspect(backend)
    opts = dict(options or {})
    if "namespace" in opts:
        # every namespace of the store is opened with its own: one given here was passed beside
        # it, a TypeError traceback once the store held a namespace
        raise ConfigError("inspect reads every namespace of the store; 'namespace' is not an option here")
    if root is not None:
        opts["root"] = root
    if backend_class(backend).supports_read_only:
        opts["read_only"] = True  # an observer, whatever the options say (see the module docstring)
    if backend == "file" and "root" in opts and not os.path.isdir(opts["root"]):
        # a report of zero pages would read as "the store is empty", not "wrong path"
        # a file there is not "no such folder" (the message sent an operator looking for a typo)
        why = "a file, not a folder" if os.path.exists(opts["root"]) else "no such folder"
        raise ConfigError(f"no file store at {opts['root']!r}: {why}")
    probe = create_async_storage(backend, None, **opts)
    try:  # not opened: opening would create the probe's own (empty) namespace
        namespaces, unreadable = await probe.read_namespaces()  # one pass over the manifests
        space = await probe.describe_space()
    except NotImplementedError:
        # the hooks are optional (only the file backend has them here): one line, not a traceback
        raise _cannot_inspect(backend) from None
    finally:
        await probe.aclose()
    report: dict[str, Any] = {"backend": backend, "namespaces": {}, "pages": 0, "bytes": 0, "checked": 0, "corrupt": 0,
                              "vanished": 0, "corrupt_manifests": len(unreadable), "damaged_namespaces": 0}
    # the medium's free space against the floor (the default one unless options say otherwise):
    # a floor above it makes a store refuse every write
    report.update({k: v for k, v in space.items() if k in _MEDIUM_KEYS})
    rng = random.Random(seed)
    # by digest: two folders whose manifests describe the same namespace (one copied over the
    # other) would count its pages twice
    for ns in {ns.digest: ns for ns in namespaces}.values():
        store = create_async_storage(backend, None, namespace=ns, **opts)
        layout = getattr(store, "layout", None)  # a store of folders (file)
        if layout is not None and not await asyncio.to_thread(os.path.isdir, layout.ns_dir):
            # a namespace whose folder is not there (a backend that lists a manifest naming
            # another folder, or the folder removed since): opening it would create a folder
            # in the store being inspected
            report["unmatched_manifests"] = report.get("unmatched_manifests", 0) + 1
            logger.warning("inspect: a manifest names namespace %s, which has no folder; not opened", ns.digest)
            continue
        damage = await asyncio.to_thread(_pages_damage, layout.pages_dir) if layout is not None else None
        if damage is not None:  # not opened: its scan would fail, and its survey raise
            report["namespaces"][ns.digest] = {"model": ns.model, "kv_dtype": ns.kv_dtype, "page_size": ns.page_size,
                                               "layout": ns.layout, "damaged": damage}
            report["damaged_namespaces"] += 1
            continue
        async with store:
            # the page files the listing could not read (torn, a damaged footer: corrupt too)
            # are counted in the same look at the folders: counted after verifying, the
            # corrupt pages verification dropped hid as many torn ones, and a live server's
            # new pages (or its evictions) in between counted as corrupt
            pages, unlisted = await store.survey_pages()
            nbytes = sum(size for _, size in pages)
            if verify == "all":
                chosen = pages
            elif verify == "sample":
                chosen = rng.sample(pages, min(sample, len(pages)))
            else:
                chosen = []
            bad, vanished = unlisted, 0
            # the trace tools' bar: drawn on a terminal only (into a log or a pipe, every
            # redraw was a line of carriage returns)
            with progress_bar(progress and bool(chosen), total=len(chosen), desc=f"verify {ns.digest[:8]}",
                              unit="page", leave=False) as bar:
                for page, _ in chosen:
                    verdict = await store.check_page(page)
                    # a page gone since the listing was evicted (or cleared) by its writer, as
                    # a live store at its max_bytes does all the time: no damage, but shown
                    if verdict == "vanished":
                        vanished += 1
                    elif verdict != "ok":
                        bad += 1
                    bar.update()
            pools: dict[str, int] = {}
            for page, _ in pages:
                pools[page.pool] = pools.get(page.pool, 0) + 1
            ns_space = {k: v for k, v in (await store.describe_space()).items() if k in _NAMESPACE_KEYS}
        report["namespaces"][ns.digest] = {
            "model": ns.model,
            "kv_dtype": ns.kv_dtype,
            "page_size": ns.page_size,
            "layout": ns.layout,
            "pages": len(pages),
            "pages_per_pool": pools,
            "bytes": nbytes,
            "checked": len(chosen),
            "corrupt": bad,
            "vanished": vanished,
            **ns_space,  # the shared count, and writes refused for space (by any process)
        }
        report["pages"] += len(pages)
        report["bytes"] += nbytes
        report["checked"] += len(chosen)
        report["corrupt"] += bad
        report["vanished"] += vanished
    for digest, why in unreadable.items():
        # listed, not left to a warning line: an operator must see a namespace inspect could not
        # read. Its pages are not counted: without a namespace the store cannot open them.
        report["namespaces"][digest] = {"model": None, "kv_dtype": None, "page_size": None, "layout": None,
                                        "corrupt_manifest": why}
    return report

