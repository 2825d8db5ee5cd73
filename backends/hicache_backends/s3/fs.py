"""Filesystems bound to event loops, behind four object operations the backend needs.

Async fsspec filesystems (s3fs, gcsfs, ...) hold an aiohttp session, which belongs to the event
loop that created it. A backend may be used from several loops (a server's loop, the blocking
facade's private loop, one loop per test), so :class:`LoopLocal` creates one filesystem - and
one semaphore, also loop-bound - per running loop, lazily on first use, and closes them on
``aclose`` or when their loop shuts down. Every call then runs natively on the caller's loop:
no thread hop per request.

Synchronous filesystems (``memory://``, ``file://`` ...) have no coroutine API; for them
:class:`ThreadObjectOps` runs each call in the default thread pool via ``asyncio.to_thread``.
Timeouts still bound how long the *caller* waits, but a call already running in a thread runs to
completion in the background (threads cannot be cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from hicache.storage.base import time_share
from hicache.storage.offload import OFFLOAD_MIN_BYTES, run_to_completion
from hicache_backends.s3.bodies import BodyBuffers
from hicache_backends.writers import MACHINE_HEX, parse_machine, remove_if_abandoned, tmp_abandoned

if TYPE_CHECKING:  # botocore is there only with s3fs; the fsspec backend works without it
    from hicache_backends.s3.direct import Route

__all__ = [
    "AsyncObjectOps",
    "CloseLeft",
    "DirS3ObjectOps",
    "LoopLocal",
    "LoopResources",
    "ObjectOps",
    "S3ObjectOps",
    "NextView",
    "ThreadObjectOps",
    "ViewFiller",
    "built_target",
    "close_all",
    "fill_views",
    "is_s3fs",
    "make_ops",
    "put_requests",
]

logger = logging.getLogger("hicache.storage.s3")

T = TypeVar("T")

#: hands out the buffer the next bytes of a ranged read go to (see ``ObjectOps.get_range_into``)
NextView = Callable[[], "memoryview | None"]
#: what :meth:`S3ObjectOps._try_direct` answers when botocore must send the request
_BOTOCORE = object()


async def _fill(data: bytes, next_view: NextView) -> int:
    """:func:`fill_views`, on a thread for a big object (a long copy would stall the loop); the
    views are pool memory, so a cancelled caller waits for the thread before unwinding."""
    if len(data) >= OFFLOAD_MIN_BYTES:
        return await run_to_completion(fill_views, data, next_view)
    return fill_views(data, next_view)


def fill_views(data: bytes | memoryview, next_view: NextView) -> int:
    """``get_range_into`` for bytes already received: spread ``data`` over the views."""
    ViewFiller(next_view).feed(data)
    return len(data)


class ViewFiller:
    """Spreads bytes that arrive in pieces over the views ``next_view`` hands out, asking for
    the next view only when the previous one is full; bytes past the last view are dropped."""

    __slots__ = ("_next_view", "_view", "_pos", "_done")

    def __init__(self, next_view: NextView) -> None:
        self._next_view = next_view
        self._view: memoryview | None = None
        self._pos = 0
        self._done = False

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        src = memoryview(data)
        i, size = 0, len(src)
        while i < size and not self._done:
            view = self._view
            if view is None:
                view = self._next_view()
                if view is None:
                    self._done = True
                    return
                self._view, self._pos = view, 0
            n = min(len(view) - self._pos, size - i)
            view[self._pos : self._pos + n] = src[i : i + n]
            self._pos += n
            i += n
            if self._pos == len(view):
                self._view = None


class ObjectOps(Protocol):
    """What the backend asks of a filesystem; paths carry no protocol."""

    fs: Any
    #: whether ``put`` is done with its body when it returns, so the body's buffer may be
    #: reused (:mod:`.bodies`); a filesystem that may keep the object it was given says no
    reuses_bodies: bool

    async def put(self, path: str, data: bytes | bytearray) -> None: ...

    async def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; fewer if the object is shorter; ``FileNotFoundError`` if absent."""
        ...

    async def get_range_into(self, path: str, start: int, end: int, next_view: NextView) -> int:
        """Bytes ``[start, end)`` into the views ``next_view()`` hands out in turn (asked for
        the next one only when the previous is full; ``None``: no more). Returns how many
        bytes the store sent, those past the last view counted but dropped; fewer than
        ``end - start`` if the object is shorter. ``FileNotFoundError`` if absent."""
        ...

    async def get(self, path: str) -> bytes: ...

    async def size(self, path: str) -> int | None:
        """The object's size, or ``None`` if it does not exist."""
        ...

    async def remove(self, path: str) -> None: ...

    async def remove_many(self, paths: list[str]) -> set[str]:
        """Delete the objects at ``paths`` (an absent one counts as deleted) in as few requests
        as the service allows; returns the paths it failed to delete."""
        ...

    async def stored_md5(self, path: str) -> tuple[int, str] | None:
        """``(size, MD5 hex)`` of the object as stored, where the service says (S3's ETag of a
        single-part upload); ``None`` when it cannot tell. ``FileNotFoundError`` if absent."""
        ...

    async def remove_tree(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many."""
        ...

    async def close(self, deadline: float | None = None) -> int:
        """Release the filesystem's client, done by ``deadline`` (``time.monotonic()``; ``None``:
        the filesystem's own bounds); how many multipart uploads it cut and left unaborted."""
        ...


class AsyncObjectOps:
    """Any async fsspec filesystem, through its coroutine methods."""

    reuses_bodies = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    async def put(self, path: str, data: bytes | bytearray) -> None:
        await self.fs._pipe_file(path, data)

    async def get_range(self, path: str, start: int, end: int) -> bytes:
        return await self.fs._cat_file(path, start=start, end=end)

    async def get_range_into(self, path: str, start: int, end: int, next_view: NextView) -> int:
        return await _fill(await self.get_range(path, start, end), next_view)

    async def get(self, path: str) -> bytes:
        return await self.fs._cat_file(path)

    async def size(self, path: str) -> int | None:
        try:
            info = await self.fs._info(path)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    async def remove(self, path: str) -> None:
        await self.fs._rm_file(path)

    async def remove_many(self, paths: list[str]) -> set[str]:
        # no portable batch delete with per-object answers: one request per object, concurrently
        outcomes = await asyncio.gather(*(self.fs._rm_file(p) for p in paths), return_exceptions=True)
        return {p for p, r in zip(paths, outcomes) if isinstance(r, BaseException) and not isinstance(r, FileNotFoundError)}

    async def stored_md5(self, path: str) -> tuple[int, str] | None:
        return None  # no portable digest: never delete on a verification failure alone

    async def remove_tree(self, prefix: str) -> int:
        try:
            files, strays = _under(self.fs, prefix, _not_in_flight(await self.fs._find(prefix)))
        except FileNotFoundError:
            return 0
        failed: set[str] = set()
        for at in range(0, len(files), _REMOVE_CHUNK):  # bounded concurrency, like fsspec's rm
            failed |= await self.remove_many(files[at : at + _REMOVE_CHUNK])
        return _removed_all(prefix, files, failed, strays)

    async def close(self, deadline: float | None = None) -> int:
        fs = self.fs
        if isinstance(fs, DirFileSystem):  # it holds no session: its target does
            fs = built_target(fs)
            if fs is None:
                return 0  # a filesystem the caller gave, theirs to close
        if is_s3fs(fs):
            await _close_s3_client(fs)
            return 0
        session = getattr(fs, "_session", None)
        closer = getattr(session, "close", None)
        if callable(closer):
            result = closer()
            if asyncio.iscoroutine(result):
                await result
        return 0


class S3ObjectOps(AsyncObjectOps):
    """s3fs, with one round trip per lookup, and the page requests (PUT, ranged GET, HEAD)
    signed and sent directly (:mod:`.direct`: botocore's per-request machinery was half the
    client CPU of a request) wherever the bucket's request shape allows; botocore otherwise.

    ``S3FileSystem._info`` answers a missing key with a HEAD *and* a LIST (it checks for a
    "directory"); a page is never a directory, so ``size`` sends the HEAD only. A GET with a range
    starting past the end of an (empty, so corrupt) object answers 416; that is a short read here,
    which the page check then rejects. Whole-object reads ask for ``bytes=0-`` so s3fs does not
    HEAD first to plan a multi-part download. A PUT is done with its body when it returns
    (neither path keeps a reference), so bodies are built in reused buffers.
    """

    reuses_bodies = True
    #: a body from twice this size goes as a multipart upload of parts this big (s3fs's rule
    #: and default chunk; S3 takes parts from 5 MiB), smaller ones as one PUT
    part_size = 50 << 20

    def __init__(self, fs: Any, request_timeout: float | None = None) -> None:
        from hicache_backends.s3.direct import DirectRequests, UseBotocore

        super().__init__(fs)
        #: seconds each request of a multipart upload may take (``None``: no bound of its own)
        self.request_timeout = request_timeout
        self.direct = DirectRequests(fs)
        #: what a direct request raises to be sent through botocore instead (imported here:
        #: the module needs botocore, which the fsspec backend does without)
        self._use_botocore: type[Exception] = UseBotocore
        self._aborts: set[asyncio.Task[None]] = set()  # multipart uploads being aborted
        self._uploads: set[asyncio.Task[None]] = set()  # multipart uploads being sent (a close cuts them)
        self._closed = False

    async def _route(self, path: str, operation: str) -> tuple[Route, str, str] | None:
        """(route, bucket, key) to send ``operation`` on ``path`` directly, or ``None``."""
        bucket, key, version = self.fs.split_path(path)
        if version is not None or not key:
            return None
        route = await self.direct.route(bucket, operation)
        return None if route is None else (route, bucket, key)

    async def _try_direct(self, path: str, operation: str,
                          send: Callable[[Route, str, str], Awaitable[T]]) -> T | object:
        """``send(route, bucket, key)`` when ``operation`` on ``path`` can go direct, else
        :data:`_BOTOCORE`: no route for the bucket, or the direct request handed this one to
        botocore (another region, a closed session; always before any byte reached a view)."""
        target = await self._route(path, operation)
        if target is None:
            return _BOTOCORE
        try:
            return await send(*target)
        except self._use_botocore:
            return _BOTOCORE

    def put_requests(self, nbytes: int) -> int:
        """1 for a body sent in one PUT; for a multipart upload, its create, its rounds of parts
        (``max_concurrency`` at a time) and its complete, each request bounded by
        ``request_timeout`` on its own. Bounded as a whole by one request's timeout, a big page
        whose requests each took well under it was never written when together they did not
        (every attempt a timeout, counted as the service's failure, until the breaker opened)."""
        if nbytes < 2 * self.part_size:
            return 1
        parts = -(-nbytes // self.part_size)
        return 2 + -(-parts // self._window())

    def _window(self) -> int:
        """How many parts of an upload are sent at once (s3fs's ``max_concurrency``)."""
        return max(1, int(getattr(self.fs, "max_concurrency", 1) or 1))

    async def _within_request_timeout(self, request: Awaitable[T]) -> T:
        """One request of a multipart upload, within ``request_timeout`` (``TimeoutError``)."""
        async with asyncio.timeout(self.request_timeout):
            return await request

    async def put(self, path: str, data: bytes | bytearray) -> None:
        if len(data) >= 2 * self.part_size:
            await self._put_cuttable(path, data)
            return
        if len(data) >= self.direct.max_put or await self._try_direct(
                path, "PutObject", lambda route, bucket, key: self.direct.put(route, bucket, key, data)) is _BOTOCORE:
            await super().put(path, data)
            return
        if self.fs.dircache:
            self.fs.invalidate_cache(path)

    async def _put_cuttable(self, path: str, data: bytes | bytearray) -> None:
        """:meth:`_put_multipart` in a task of its own that a close can cut (:meth:`close`),
        so the upload is aborted while the client is still there: cut with the client (a
        close from another loop, which cannot wait for this loop's writes), its abort was
        refused and the upload stayed in the bucket. A cancelled caller cancels it, and waits
        for its abort, as before; cut by a close, it fails as a request of a closed store."""
        task = asyncio.get_running_loop().create_task(self._put_multipart(path, data))
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and not (current is not None and current.cancelling()):
                raise ConnectionAbortedError(errno.ECONNABORTED, f"multipart upload of {path} cut by a close") from None
            raise

    async def _put_multipart(self, path: str, data: bytes | bytearray) -> None:
        """``data`` as a multipart upload, parts sent ``fs.max_concurrency`` at a time, as s3fs's
        ``_pipe_file`` sends them. Unlike it, an upload cut short by a cancellation (a request
        timeout, a batch cut at its deadline, a close) is aborted too: its parts stayed in the
        bucket, billed and listed by no listing, until a lifecycle rule removed them."""
        bucket, key, _ = self.fs.split_path(path)
        # in a task of its own: cut while it waits (a request timeout, a close), the service may
        # still begin the upload, never known here and so never aborted
        create = asyncio.ensure_future(self.fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key))
        try:  # (its timeout leaves it running: the upload it may begin is aborted once known)
            upload = (await self._within_request_timeout(asyncio.shield(create)))["UploadId"]
        except (asyncio.CancelledError, TimeoutError):
            await self._abort_upload(bucket, key, create)
            raise
        size, window = self.part_size, self._window()
        count = -(-len(data) // size)
        parts: list[dict[str, Any]] = []
        try:
            for first in range(1, count + 1, window):
                numbers = range(first, min(first + window, count + 1))
                sent = await _all_or_none([self._within_request_timeout(self.fs._call_s3(
                    "upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=n,
                    Body=data[(n - 1) * size : n * size])) for n in numbers])
                parts += [{"PartNumber": n, "ETag": out["ETag"]} for n, out in zip(numbers, sent)]
            await self._within_request_timeout(self.fs._call_s3(
                "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                MultipartUpload={"Parts": parts}))
        except BaseException:
            await self._abort_upload(bucket, key, upload)
            raise
        if self.fs.dircache:
            self.fs.invalidate_cache(path)

    async def _abort_upload(self, bucket: str, key: str, upload: str | asyncio.Future[Any]) -> None:
        """Abort an upload cut short (``upload``: its id, or the request that begins it, still
        unanswered). A task of its own, so a caller cancelled again while it waits leaves it
        running (and a close waits for it before the client goes)."""
        if self._closed:  # its request would build a client nobody closes
            if not isinstance(upload, str):
                upload.cancel()
            logger.warning("multipart upload of %s/%s cut by a close, not aborted: its parts stay until the "
                           "bucket's lifecycle rule (AbortIncompleteMultipartUpload) removes them", bucket, key)
            return
        task = asyncio.get_running_loop().create_task(self._abort(bucket, key, upload))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        await asyncio.shield(task)

    async def _abort(self, bucket: str, key: str, upload: str | asyncio.Future[Any]) -> None:
        try:
            async with asyncio.timeout(ABORT_TIMEOUT):
                if not isinstance(upload, str):  # the upload is begun once the service answers
                    try:
                        upload = str((await upload)["UploadId"])
                    except Exception:  # noqa: BLE001 - not begun: nothing to abort
                        return
                await self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        except Exception as exc:  # noqa: BLE001 - the put's own error is what its caller sees
            # (cut by a close past its deadline, which took the client: counted in its report)
            logger.log(logging.DEBUG if self._closed else logging.WARNING,
                       "aborting a multipart upload of %s/%s failed (%s: %s): its parts stay until the "
                       "bucket's lifecycle rule (AbortIncompleteMultipartUpload) removes them",
                       bucket, key, type(exc).__name__, exc)

    async def get_range(self, path: str, start: int, end: int | None) -> bytes:
        """Bytes ``[start, end)`` (to the object's end if ``end`` is ``None``), sent directly
        where the bucket allows; an empty object (S3 answers a range on it 416) is ``b""``."""
        try:
            chunks: list[bytes] = []
            if await self._try_direct(path, "GetObject", lambda route, bucket, key: self.direct.get_into(
                    route, bucket, key, start, end, chunks.append)) is _BOTOCORE:
                return await self.fs._cat_file(path, start=start, end=end)
            return b"".join(chunks)
        except OSError as exc:
            if _is_invalid_range(exc):
                return b""
            raise

    async def get_range_into(self, path: str, start: int, end: int, next_view: NextView) -> int:
        """The response body read straight into the views as it arrives: no joined ``bytes``
        of the whole object, no copy of it afterwards (one copy in all, from the socket's
        chunks, as plain s3fs makes into its result)."""
        try:
            got = await self._try_direct(path, "GetObject", lambda route, bucket, key: self.direct.get_into(
                route, bucket, key, start, end, ViewFiller(next_view).feed))
            if got is _BOTOCORE:
                return await self._botocore_get_into(path, start, end, next_view)
            return got  # type: ignore[return-value]
        except OSError as exc:
            if _is_invalid_range(exc):
                return 0
            raise

    async def _botocore_get_into(self, path: str, start: int, end: int, next_view: NextView) -> int:
        bucket, key, _ = self.fs.split_path(path)
        resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        body = resp["Body"]
        filler = ViewFiller(next_view)
        total = 0
        try:
            while chunk := await body.read(1 << 16):  # a service may send more than asked: counted
                total += len(chunk)
                filler.feed(chunk)
            return total
        finally:
            body.close()

    async def get(self, path: str) -> bytes:
        return await self.get_range(path, 0, None)

    async def size(self, path: str) -> int | None:
        try:
            headers = await self._try_direct(path, "HeadObject", self.direct.head)
            if headers is not _BOTOCORE:
                return int(headers.get("content-length", 0))  # type: ignore[attr-defined]
            bucket, key, _ = self.fs.split_path(path)
            out = await self.fs._call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return int(out.get("ContentLength", 0))

    async def stored_md5(self, path: str) -> tuple[int, str] | None:
        bucket, key, _ = self.fs.split_path(path)
        out = await self.fs._call_s3("head_object", Bucket=bucket, Key=key)
        etag = str(out.get("ETag", "")).strip('"').lower()
        # a multipart or SSE-KMS ETag is not the MD5 of the bytes: then we cannot tell
        if len(etag) != 32 or not all(c in "0123456789abcdef" for c in etag):
            return None
        return int(out.get("ContentLength", 0)), etag

    async def remove_tree(self, prefix: str) -> int:
        """Delete every object under ``prefix``; keys S3 failed to delete are tried once more,
        then an ``OSError`` names how many are left (a clear must not report success then)."""
        try:
            files, strays = _under(self.fs, prefix, await self.fs._find(prefix))
        except FileNotFoundError:
            return 0
        failed = await self._delete_objects(files)
        if failed:
            failed = await self._delete_objects(sorted(failed))
        return _removed_all(prefix, files, failed, strays)

    async def remove_many(self, paths: list[str]) -> set[str]:
        return await self._delete_objects(paths)

    async def _delete_objects(self, paths: list[str]) -> set[str]:
        """DeleteObjects, up to 1,000 keys a request, in quiet mode: S3 answers only the keys it
        failed to delete (s3fs's ``_bulk_delete`` drops those answers)."""
        failed: set[str] = set()
        by_bucket: dict[str, list[str]] = {}
        for path in paths:
            by_bucket.setdefault(self.fs.split_path(path)[0], []).append(path)
        for bucket, group in by_bucket.items():
            for i in range(0, len(group), DELETE_BATCH):
                chunk = group[i : i + DELETE_BATCH]
                keys = {self.fs.split_path(p)[1]: p for p in chunk}
                out = await self.fs._call_s3(
                    "delete_objects", Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
                )
                for err in out.get("Errors", []):
                    failed.add(keys.get(err.get("Key", ""), f"{bucket}/{err.get('Key', '')}"))
                for p in chunk:
                    self.fs.invalidate_cache(p)
        return failed

    async def close(self, deadline: float | None = None) -> int:
        # uploads still sending are cut (their parts stop first: a part landing after the abort
        # stays in the bucket) and, like uploads cut short before, aborted with the client they
        # need, within ABORT_TIMEOUT or by the close's deadline (on its loop: closed from another
        # loop, this one's is closed, and its aborts never run). Those not aborted by then are
        # counted: the client goes all the same, and their parts stay for the lifecycle rule
        here = asyncio.get_running_loop()
        cut = [t for t in self._uploads if t.get_loop() is here]
        for task in cut:
            task.cancel()
        waiting = cut + [t for t in self._aborts if t.get_loop() is here]
        pending: set[asyncio.Task[None]] = set()
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=time_share(ABORT_TIMEOUT, deadline))
        self._closed = True
        await _close_s3_client(self.fs)
        return len(pending)

    def unfinished_uploads(self) -> int:
        """Multipart uploads still sending or being aborted, on any loop (a close of another
        loop that did not answer in time: what it may leave)."""
        return len(self._uploads) + len(self._aborts)


async def _close_s3_client(fs: Any) -> None:
    """Close the client of the s3fs filesystem ``fs`` (and its HTTP session)."""
    client = getattr(fs, "_s3", None)
    creator = getattr(fs, "_s3creator", None)
    fs._s3 = None
    if creator is not None and _is_region_cache(creator):
        # region caching (AWS without an endpoint): the default client and one per region
        # the buckets live in; closing the default one alone left the others open
        fs._s3creator = None
        await creator.clear()
    elif client is not None:
        await client.close()


class DirS3ObjectOps(S3ObjectOps):
    """A DirFileSystem over s3fs it built (``dir://`` over S3), served on its target as S3 is
    (:class:`S3ObjectOps`), each path joined to the dir's root. Through the generic coroutines
    (:class:`AsyncObjectOps`) a page damaged at rest could not be proven so (no ETag) and stayed,
    a hit of every lookup whose every read failed; an empty object's 416 was an error."""

    def __init__(self, dirfs: DirFileSystem, request_timeout: float | None = None) -> None:
        super().__init__(dirfs.fs, request_timeout)
        self._join: Callable[[str], str] = dirfs._join

    async def put(self, path: str, data: bytes | bytearray) -> None:
        await super().put(self._join(path), data)

    async def get_range(self, path: str, start: int, end: int | None) -> bytes:
        return await super().get_range(self._join(path), start, end)

    async def get_range_into(self, path: str, start: int, end: int, next_view: NextView) -> int:
        return await super().get_range_into(self._join(path), start, end, next_view)

    async def size(self, path: str) -> int | None:
        return await super().size(self._join(path))

    async def stored_md5(self, path: str) -> tuple[int, str] | None:
        return await super().stored_md5(self._join(path))

    async def remove(self, path: str) -> None:
        await super().remove(self._join(path))

    async def remove_many(self, paths: list[str]) -> set[str]:
        joined = {self._join(p): p for p in paths}
        return {joined.get(p, p) for p in await self._delete_objects(list(joined))}

    async def remove_tree(self, prefix: str) -> int:
        return await super().remove_tree(self._join(prefix))


async def _all_or_none(coros: list[Awaitable[T]]) -> list[T]:
    """Every result of ``coros``, run concurrently; when one fails (or the caller is cancelled)
    the others are cancelled and waited for before the error goes on: ``gather`` left them
    running, and a part that landed after its upload's abort stayed in the bucket."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        raise


def _is_region_cache(creator: Any) -> bool:
    try:
        from s3fs.utils import S3BucketRegionCache
    except ImportError:  # an s3fs without region caching
        return False
    return isinstance(creator, S3BucketRegionCache)


def _is_invalid_range(exc: BaseException) -> bool:
    cur: BaseException | None = exc
    for _ in range(4):
        if cur is None:
            return False
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return err.get("Code") in ("InvalidRange", "416") or status == 416
        cur = cur.__cause__
    return False


_tmp_serial = itertools.count()


def _put_local(path: str, data: bytes | bytearray) -> None:
    """A local file written whole, then renamed into place: fsspec's local ``pipe_file``
    truncates and writes in place, so a reader saw a partial page (and, judging it corrupt,
    deleted it while the writer went on to report success); its folder is made as needed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}-{next(_tmp_serial)}.{MACHINE_HEX}.tmp"  # whose: see _in_flight
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _is_local(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's local files (``file://``)."""
    protocol = getattr(fs, "protocol", ())
    return bool({"file", "local"} & set((protocol,) if isinstance(protocol, str) else protocol))


def _local_path_of(fs: Any) -> Callable[[str], str] | None:
    """How a path of ``fs`` names a local file (``None``: its files are not local ones).

    Local files are written by :func:`_put_local`, whole then renamed, and under a DirFileSystem
    over local files too: its ``pipe_file`` is the local one, writing in place. Its ``_join``
    gives the file (the backend refuses a url that climbs out of the dir's root)."""
    if _is_local(fs):
        return str
    if isinstance(fs, DirFileSystem) and _is_local(fs.fs):
        return fs._join
    return None


class ThreadObjectOps:
    """A synchronous fsspec filesystem, each call in a worker thread (see module docstring);
    also a DirFileSystem over one (built synchronous: see ``FsspecStorage``)."""

    reuses_bodies = False  # memory:// keeps the very object it is given

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._local_path = _local_path_of(fs)
        self.local = self._local_path is not None
        self._serial = _shared_state_lock(fs)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker thread, one at a time across every store of a
        filesystem whose state is shared and not thread-safe (see :func:`_shared_state_lock`)."""
        lock = self._serial
        if lock is None:
            return await asyncio.to_thread(fn, *args, **kwargs)

        def serial() -> T:
            with lock:
                return fn(*args, **kwargs)

        return await asyncio.to_thread(serial)

    async def put(self, path: str, data: bytes | bytearray) -> None:
        if self._local_path is not None:
            await asyncio.to_thread(_put_local, self._local_path(path), data)
        else:
            await self._run(self.fs.pipe_file, path, data)

    async def get_range(self, path: str, start: int, end: int) -> bytes:
        return await self._run(self.fs.cat_file, path, start=start, end=end)

    async def get_range_into(self, path: str, start: int, end: int, next_view: NextView) -> int:
        return await _fill(await self.get_range(path, start, end), next_view)

    async def get(self, path: str) -> bytes:
        return await self._run(self.fs.cat_file, path)

    async def size(self, path: str) -> int | None:
        def info() -> int | None:
            try:
                got = self.fs.info(path)
            except FileNotFoundError:
                return None
            return None if got.get("type") == "directory" else int(got.get("size") or 0)

        return await self._run(info)

    async def remove(self, path: str) -> None:
        await self._run(self.fs.rm_file, path)

    async def remove_many(self, paths: list[str]) -> set[str]:
        def rm() -> set[str]:
            failed = set()
            for path in paths:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass
                except Exception:  # noqa: BLE001 - reported as not deleted
                    failed.add(path)
            return failed

        return await self._run(rm)

    async def stored_md5(self, path: str) -> tuple[int, str] | None:
        return None

    async def remove_tree(self, prefix: str) -> int:
        try:
            listed = await self._run(self.fs.find, prefix)
            files, strays = _under(self.fs, prefix, _not_in_flight(listed, self._local_path or str))
        except FileNotFoundError:
            return 0
        return _removed_all(prefix, files, await self.remove_many(files), strays)

    async def remove_abandoned_tmps(self, prefix: str, stop: threading.Event) -> int:
        """Remove the temporary files under ``prefix`` of local writers that are surely gone
        (:func:`remove_abandoned_tmps`); 0 where files are not local ones."""
        if self._local_path is None:
            return 0
        return await asyncio.to_thread(remove_abandoned_tmps, self._local_path(prefix), stop)

    async def close(self, deadline: float | None = None) -> int:
        return 0


#: the lock of fsspec's memory filesystem (see :func:`_shared_state_lock`)
_MEMORY_LOCK = threading.Lock()


def _shared_state_lock(fs: Any) -> threading.Lock | None:
    """The lock every call on ``fs`` takes, where its state is shared and not thread-safe:
    fsspec's memory filesystem keeps every instance's files in one class-level dict, which a
    listing iterates, so a clear's listing failed ("dictionary changed size during iteration")
    while another store of the process wrote its pages or run index on another thread. Also
    one under a DirFileSystem. ``None``: calls run side by side (local files and the rest)."""
    inner = fs.fs if isinstance(fs, DirFileSystem) else fs
    return _MEMORY_LOCK if isinstance(inner, MemoryFileSystem) else None


#: keys one DeleteObjects request takes (S3's limit)
DELETE_BATCH = 1000

#: seconds an abort of a multipart upload cut short may take (and a close waits for aborts)
ABORT_TIMEOUT = 10.0
#: seconds a close waits for another running loop to close its filesystem (and abort its
#: uploads: see ``S3ObjectOps.close``)
OTHER_LOOP_CLOSE_TIMEOUT = ABORT_TIMEOUT + 5.0
#: seconds before a close's deadline another loop's close must end, for its answer to cross
#: back to the closing loop in time
_HANDOFF_S = 0.2

#: objects a tree removal deletes concurrently, one request each (fsspec's own batch size)
_REMOVE_CHUNK = 128


def _not_in_flight(files: list[str], local_path: Callable[[str], str] = str) -> list[str]:
    """A listing without the temporary files of local writes in flight (:func:`_put_local`
    renames them into place: removing one fails that write, not a page). A temporary file of
    a writer that is gone (killed mid-write) is removed like any other file. ``local_path``:
    the local file a listed name is (a DirFileSystem lists names under its root)."""
    return [f for f in files if not (f.endswith(".tmp") and _in_flight(local_path(f)))]


def _tmp_writer(tmp: str) -> tuple[int, int | None] | None:
    """The writer (pid, machine) that ``<page>.<pid>-<n>.<machine>.tmp`` names (machine ``None``
    in ``<page>.<pid>-<n>.tmp``, before names carried it): :func:`_put_local`'s temporary file;
    ``None`` for any other name."""
    if not tmp.endswith(".tmp"):
        return None
    parts = tmp[: -len(".tmp")].rsplit(".", 2)
    machine = None
    if len(parts) == 3 and "-" not in parts[2]:
        machine = parse_machine(parts[2])
        if machine is None:
            return None
        parts.pop()
    try:
        return int(parts[-1].split("-", 1)[0]), machine
    except (IndexError, ValueError):
        return None


def _in_flight(tmp: str) -> bool:
    """Whether the temporary file ``tmp`` (:func:`_tmp_writer`) may be a write still going on.
    The file store's rule (:func:`hicache_backends.writers.tmp_abandoned`): a ``file://`` root
    may be a shared mount, and a writer in another container or on another machine has pids of
    its own, so its pid is judged only on its own machine; any other writer's file goes by its
    age alone. A name not of this form is no write of ours."""
    writer = _tmp_writer(tmp)
    if writer is None:
        return False
    try:
        return not tmp_abandoned(tmp, *writer)
    except OSError:  # gone meanwhile (renamed into place) or not a local file: nothing to spare
        return False


def remove_abandoned_tmps(folder: str, stop: threading.Event) -> int:
    """Remove, under the local ``folder``, the temporary files of :func:`_put_local` whose writer
    surely gave up (:func:`_in_flight`): killed mid-write, it left them, and only a clear
    removed them, so a crash loop grew the folder for good. Never a live writer's. Stops at the
    next folder once ``stop`` is set (a close). Returns how many were removed."""
    removed = 0
    for here, _dirs, names in os.walk(folder):
        if stop.is_set():
            break
        for name in names:
            writer = _tmp_writer(name)
            if writer is not None and remove_if_abandoned(os.path.join(here, name), *writer):
                removed += 1
    return removed


def _under(fs: Any, prefix: str, listed: list[str]) -> tuple[list[str], int]:
    """The names of a listing of ``prefix`` that are under it, and how many are not.

    A listing is the filesystem's idea of the prefix, which may not be the one its writes use:
    s3fs writes ``bucket//lead/x`` under the key ``/lead/x`` but lists ``bucket//lead`` as
    ``bucket/lead/...`` (it strips the key's leading slashes), and a clear that deleted what it
    listed removed another store's pages and kept its own. A tree removal deletes only names
    under its prefix (as the filesystem spells it), whatever the listing says."""
    root = fs._strip_protocol(prefix).rstrip("/") + "/"
    files = [f for f in listed if f.startswith(root)]
    return files, len(listed) - len(files)


def _removed_all(prefix: str, files: list[str], failed: set[str], strays: int = 0) -> int:
    """How many of ``files`` a tree removal deleted; an error naming what it could not. A file
    already gone (a concurrent delete, a write's rename) is removed as far as a clear cares:
    a filesystem's bulk ``rm`` stopped at the first such file and left the rest. A listing that
    named objects outside the prefix (``strays``, left alone: see :func:`_under`) is an error
    too: the removal cannot tell that it found everything under the prefix."""
    if failed:
        raise OSError(f"{len(failed)} of {len(files)} object(s) under {prefix} could not be deleted "
                      f"(first: {min(failed)})")
    if strays:
        raise OSError(f"the listing of {prefix} named {strays} object(s) outside it: left alone, and what "
                      f"is under it may not all be removed")
    return len(files)


def put_requests(ops: ObjectOps, nbytes: int) -> int:
    """How many requests, one after another, ``ops.put`` of ``nbytes`` makes, each within the
    store's ``request_timeout`` (:meth:`S3ObjectOps.put_requests`); 1 for other filesystems."""
    return ops.put_requests(nbytes) if isinstance(ops, S3ObjectOps) else 1


def make_ops(fs: Any, request_timeout: float | None = None) -> ObjectOps:
    """The adapter for ``fs``: native coroutines where the filesystem has them and was built
    for them (a DirFileSystem over a synchronous filesystem is built synchronous).
    ``request_timeout`` bounds each request of an S3 multipart upload."""
    if getattr(fs, "async_impl", False) and getattr(fs, "asynchronous", False):
        if is_s3fs(built_target(fs)):
            return DirS3ObjectOps(fs, request_timeout)
        return S3ObjectOps(fs, request_timeout) if is_s3fs(fs) else AsyncObjectOps(fs)
    return ThreadObjectOps(fs)


def built_target(fs: Any) -> Any | None:
    """The filesystem a DirFileSystem ``fs`` built itself from its ``target_protocol`` (one per
    loop with it: the store configures and closes it); ``None`` for any other ``fs``, and for a
    DirFileSystem given a filesystem object (the caller's, never configured or closed here)."""
    if isinstance(fs, DirFileSystem) and fs.storage_options.get("fs") is None:
        return fs.fs
    return None


def is_s3fs(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem (``False`` where s3fs is not installed)."""
    try:
        from s3fs import S3FileSystem
    except ImportError:  # pragma: no cover
        return False
    return isinstance(fs, S3FileSystem)


@dataclass
class LoopResources:
    """What one event loop needs: its filesystem adapter, its concurrency limit, the limit on
    write bodies built ahead of a request slot (``staging``, see ``FsspecStorage._write_one``)
    and the buffers those bodies are built in (:mod:`.bodies`)."""

    ops: ObjectOps
    semaphore: asyncio.Semaphore
    staging: asyncio.Semaphore
    bodies: BodyBuffers


class LoopLocal(Generic[T]):
    """One value per running event loop, created on first use in that loop.

    With ``closer``, a loop's value is closed on that loop when it shuts down (the end of
    ``asyncio.run``, or any ``loop.shutdown_asyncgens()``) and forgotten: a caller that runs
    each call in a new loop left a client and its HTTP session open per loop ("Unclosed client
    session" when collected, its pooled connections open until then). The hook is an async
    generator parked at its ``yield``: a loop closes every async generator it saw start at its
    shutdown, while it can still run the ``finally`` that closes the value."""

    def __init__(self, factory: Callable[[], T], closer: Callable[[T], Awaitable[None]] | None = None) -> None:
        self._factory = factory
        self._closer = closer
        self._values: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = weakref.WeakKeyDictionary()
        #: each loop's shutdown hook (see the class docstring)
        self._hooks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncGenerator[None, None]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()  # loops may live in different threads
        #: closes of the values of loops closed without a shutdown (see :meth:`_close_stale`)
        self._stale_closes: set[asyncio.Task[None]] = set()

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        value = self._values.get(loop)
        if value is None:
            stale: list[T] = []
            with self._lock:
                value = self._values.get(loop)
                if value is None:
                    # a value holds its loop (its session, its semaphores), so the weak key
                    # never dies: the values of loops closed since (without a shutdown that
                    # closed them) are dropped here, else a caller that runs each call in a new
                    # loop piled up a filesystem, a client and reusable write bodies per call
                    stale = [self._values.pop(lp) for lp in [lp for lp in self._values if lp.is_closed()]]
                    for old in [lp for lp in self._hooks if lp.is_closed()]:
                        del self._hooks[old]
                    value = self._values[loop] = self._factory()
                    if self._closer is not None:
                        self._watch(loop, value)
            self._close_stale(loop, stale)
        return value

    def _close_stale(self, loop: asyncio.AbstractEventLoop, stale: list[T]) -> None:
        """Close, on ``loop``, the values of loops closed without a shutdown (a hand-made loop
        ended by ``loop.close()`` alone: no hook ran): dropped only, each kept its client and
        HTTP session open until garbage collection ("Unclosed client session"). A closed loop
        runs nothing, so nothing still uses them; closing them needs no loop of theirs (aiohttp
        closes a session whose loop is closed without one)."""
        if self._closer is None or not stale:
            return
        task = loop.create_task(_close_each(self._closer, stale))
        self._stale_closes.add(task)
        task.add_done_callback(self._stale_closes.discard)

    def _watch(self, loop: asyncio.AbstractEventLoop, value: T) -> None:
        """Close ``value`` when ``loop`` shuts down. Only where the loop tracks async generators
        (asyncio's and uvloop's do while they run): one nobody tracks would be closed by the
        garbage collector, outside any loop, where the closer cannot run."""
        if sys.get_asyncgen_hooks().firstiter is None:
            return
        hook = self._close_at_shutdown(loop, value)
        with contextlib.suppress(StopIteration):
            hook.asend(None).send(None)  # started (so the loop tracks it), parked at its yield
        self._hooks[loop] = hook

    async def _close_at_shutdown(self, loop: asyncio.AbstractEventLoop, value: T) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:  # the loop shuts down (or the hook was dropped: then the value is no longer ours)
            with self._lock:
                mine = self._values.get(loop) is value
                if mine:
                    del self._values[loop]
                    self._hooks.pop(loop, None)
            if mine and self._closer is not None:
                try:
                    await self._closer(value)
                except Exception:  # noqa: BLE001 - a loop's shutdown must not fail for it
                    logger.warning("closing a filesystem at its event loop's shutdown failed", exc_info=True)

    def pop_all(self, leave: Callable[[asyncio.AbstractEventLoop], bool] | None = None,
                ) -> list[tuple[asyncio.AbstractEventLoop, T]]:
        """Take every loop's value (and forget its shutdown hook), but those of loops ``leave``
        says to leave: their hooks close them when their loops shut down."""
        with self._lock:
            items = [(loop, value) for loop, value in self._values.items() if leave is None or not leave(loop)]
            for loop, _ in items:
                del self._values[loop]
                self._hooks.pop(loop, None)
        return items

    def __len__(self) -> int:
        return len(self._values)


async def _close_each(closer: Callable[[T], Awaitable[None]], values: list[T]) -> None:
    """``closer`` on each of ``values``; a failure is logged, and the rest are closed."""
    for value in values:
        try:
            await closer(value)
        except Exception:  # noqa: BLE001 - nobody awaits this: a failure must not hide the rest
            logger.warning("closing the filesystem of a closed event loop failed", exc_info=True)


@dataclass
class CloseLeft:
    """What a close of every loop's filesystem left unfinished (see :func:`close_all`)."""

    #: multipart uploads it cut and did not see aborted: their parts stay in the bucket until
    #: its lifecycle rule (AbortIncompleteMultipartUpload) removes them
    uploads: int = 0
    #: other running loops whose close did not answer in time (left to finish there)
    loops: int = 0


async def close_all(local: LoopLocal[LoopResources], deadline: float | None = None) -> CloseLeft:
    """Close every loop's filesystem: this loop's and closed loops' inline (a loop closed
    without a shutdown closed nothing; a closed loop's need no loop of theirs: see
    :meth:`LoopLocal._close_stale`), running loops' through their thread, waited for (see
    :func:`_wait_elsewhere`): a close that returned at once had not yet aborted that loop's
    multipart uploads, and a process that exited then left them in the bucket. Every wait ends
    by ``deadline`` (``time.monotonic()``; ``None``: each its own bound); what was left then is
    returned, not waited for."""
    current = asyncio.get_running_loop()
    left = CloseLeft()
    elsewhere: dict[asyncio.Future[int], tuple[asyncio.AbstractEventLoop, ObjectOps]] = {}
    # (another loop's close ends a little earlier: its answer must cross back by the deadline)
    theirs = None if deadline is None else deadline - _HANDOFF_S
    # An idle loop's (neither running nor closed: an asyncio.Runner between calls) is left to
    # its shutdown hook: nothing can run on it now, closed from here its session would be
    # touched from another thread, and taken from it, nobody ever closed it
    for loop, res in local.pop_all(leave=_idle):
        try:
            if loop is current or loop.is_closed():
                left.uploads += await res.ops.close(deadline)
            elif loop.is_running() and not loop.is_closed():
                future = asyncio.run_coroutine_threadsafe(res.ops.close(theirs), loop)
                elsewhere[asyncio.wrap_future(future)] = (loop, res.ops)
        except Exception:  # noqa: BLE001 - closing must not raise into shutdown paths
            logger.warning("closing a filesystem failed", exc_info=True)
    await _wait_elsewhere(elsewhere, deadline, left)
    return left


def _idle(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is neither running nor closed (see :func:`close_all`)."""
    return not loop.is_running() and not loop.is_closed()


async def _wait_elsewhere(closes: dict[asyncio.Future[int], tuple[asyncio.AbstractEventLoop, ObjectOps]],
                          deadline: float | None, left: CloseLeft) -> None:
    """Wait for the closes of other loops' filesystems (each close -> its loop and filesystem),
    up to :data:`OTHER_LOOP_CLOSE_TIMEOUT` or ``deadline``, but not for one whose loop
    stopped: it never runs. What they left is added to ``left``: their answers, and for a close
    not done, its loop and the uploads its filesystem still had going."""
    limit = time_share(OTHER_LOOP_CLOSE_TIMEOUT, deadline)
    until = time.monotonic() + limit
    pending = set(closes)
    while pending and time.monotonic() < until:
        done, pending = await asyncio.wait(pending, timeout=min(0.05, max(0.0, until - time.monotonic())))
        pending = {fut for fut in pending if closes[fut][0].is_running()}
    for fut, (_, ops) in closes.items():
        if not fut.done():
            left.loops += 1
            left.uploads += ops.unfinished_uploads() if isinstance(ops, S3ObjectOps) else 0
            # (an outcome not waited for is retrieved: no "exception was never retrieved")
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        elif not fut.cancelled() and fut.exception() is not None:
            logger.warning("closing a filesystem failed", exc_info=fut.exception())
        elif not fut.cancelled():
            left.uploads += fut.result()
    if left.loops:
        logger.warning("closing the filesystems of %d other event loop(s) took over %.1f s: left to finish there",
                       left.loops, limit)
