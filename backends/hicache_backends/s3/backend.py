"""``FsspecStorage`` (any fsspec URL) and ``S3Storage`` (object stores through s3fs).

The shared L3 tier: every inference process on every machine reads and writes one bucket. The
design follows from three facts about object stores:

* **Round trips dominate.** A page of known size is read with one ranged GET of header+payload
  (the header length is a function of key and pool), and every batch runs its requests
  concurrently under a per-loop semaphore sized like the HTTP connection pool. Lookups are
  concurrent HEADs, skipped for pages this process already knows exist (:mod:`.cache`).
* **The service fails.** Every request has a timeout, transient errors are retried with
  backoff (:mod:`.retry`), a circuit breaker turns an outage into instant misses
  (:mod:`.breaker`), and every batch is bounded by ``call_timeout`` as a whole - all in
  :mod:`.runner`. A background prober notices the service is back without a user request. A miss is the
  answer to every failure; nothing raises out of a primitive.
* **Client CPU per request bounds a batch** once requests overlap, so a page's PUT, ranged GET
  and HEAD skip botocore's per-request machinery, half of a request's CPU: they are signed with
  botocore's SigV4 signer and sent on the s3fs client's own session (:mod:`.direct`). A write
  body is built once in a reused buffer and sent with one socket write, unsigned (the page
  checksum guards the bytes; :mod:`.bodies`); a read streams the payload straight into the pool
  page once the header is this page's (no joined copy of the object), and hashes it after.
* **Many writers share one bucket.** Pages use the same self-verifying format as the file
  backend (:class:`~hicache.storage.page_format.PageCodec`), checked on every read, so a torn,
  foreign or tampered object is a counted miss, never returned bytes. Objects are named by a
  hash of (key, pool) under a per-namespace prefix that also holds a ``manifest.json``.

Capacity and lifetime are left to the bucket's own policy (lifecycle rules); ``_clear`` removes
this namespace's pages.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any, ClassVar

import fsspec
import numpy as np
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from hicache.errors import BackendLoadError, ConfigError
from hicache.keys import Namespace
from hicache.storage import AsyncHiCacheStorage, HiCacheStorageConfig, PageCodec, PageKey, Verdict
from hicache.storage.base import time_share
from hicache.storage.changes import Written
from hicache.storage.hit_policy import leading_run
from hicache.storage.offload import OFFLOAD_MIN_BYTES, copy_bytes, run_to_completion
from hicache.storage.stats import Throttle
from hicache_backends.s3.bodies import BodyBuffers
from hicache_backends.s3.breaker import BreakerState, CircuitBreaker
from hicache_backends.s3.cache import ExistsCache
from hicache_backends.s3 import fs as s3_fs
from hicache_backends.s3.fs import (
    CloseLeft, LoopLocal, LoopResources, ObjectOps, S3ObjectOps, ThreadObjectOps, built_target, close_all, is_s3fs,
    make_ops, put_requests,
)
from hicache_backends.s3.naming import ObjectNames, Redactor, redact_options, redact_url
from hicache_backends.s3.runs import MAX_BYTES as MAX_INDEX_BYTES, MIN_RUN, decode_run, encode_run
from hicache_backends.s3.retry import RetryPolicy, is_transient
from hicache_backends.s3.runner import GaveUp, RequestRunner

__all__ = ["FsspecStorage", "S3Storage"]

logger = logging.getLogger("hicache.storage.s3")

_S3_PROTOCOLS = ("s3", "s3a")
#: bytes a read of a page of unknown size asks for first: any header a page key makes, and a
#: small page whole (see ``FsspecStorage._read_bytes``)
_HEADER_PROBE = 4096
#: what the store said of an object was not asked yet (see ``FsspecStorage._corrupt_at_rest``)
_NOT_ASKED = object()
#: object stores whose urls are ``protocol://bucket/key-prefix`` (the first path part names a
#: bucket or container, whichever filesystem package serves them): a url of one must name it
_BUCKET_PROTOCOLS = (*_S3_PROTOCOLS, "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "oci", "tos")


#: storage options that are credentials or an address: text, whatever parsed them
_TEXT_OPTIONS = ("key", "secret", "token", "endpoint_url", "profile")
_TEXT_CLIENT_OPTIONS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "endpoint_url")


def _runs_async(fs_class: Any, options: dict[str, Any]) -> bool:
    """Whether filesystems of ``fs_class`` built with ``options`` serve coroutines (each loop's
    is built ``asynchronous``). Not a DirFileSystem (``dir://``) over a synchronous filesystem
    (its ``fs``, or one of ``target_protocol``, local files by default): asked to be
    asynchronous it refuses to be built, so the store failed to open; it is built synchronous
    and served in threads, as its target alone is. A target protocol fsspec does not know is
    left to the DirFileSystem to refuse, with its own error."""
    if not getattr(fs_class, "async_impl", False):
        return False
    if not issubclass(fs_class, DirFileSystem):
        return True
    target = options.get("fs")
    if target is not None:  # (s3fs's, built synchronous by default, is served in threads too)
        return bool(getattr(target, "async_impl", False) and getattr(target, "asynchronous", False))
    try:
        return bool(getattr(fsspec.get_filesystem_class(options.get("target_protocol") or "file"), "async_impl", False))
    except (ImportError, ValueError):
        return True


def _dir_root(fs_class: Any, options: dict[str, Any]) -> tuple[str, ...]:
    """Where a DirFileSystem's paths are (its target, its ``path``; nothing for another
    filesystem): its stores' paths are relative to it, so two stores over different folders
    shared one existence cache, each answering the other's pages as stored."""
    if not issubclass(fs_class, DirFileSystem):
        return ()
    target = options.get("fs")
    kind = type(target).__qualname__ if target is not None else str(options.get("target_protocol") or "file")
    # the target's service wherever s3fs takes it (a filesystem object keeps its own options)
    target_options = getattr(target, "storage_options", None) if target is not None else options.get("target_options")
    return kind, _endpoint_of(target_options or {}), str(options.get("path") or options.get("fo") or "")


def _dir_over_s3(fs_class: Any, options: dict[str, Any]) -> bool:
    """Whether ``fs_class`` is a DirFileSystem that builds an S3 target from ``options``."""
    return (issubclass(fs_class, DirFileSystem) and options.get("fs") is None
            and str(options.get("target_protocol") or "").lower() in _S3_PROTOCOLS)


def _endpoint_of(options: dict[str, Any]) -> str:
    """The service a filesystem's ``options`` name (``endpoint_url``, or s3fs's
    ``client_kwargs``), without trailing slashes; ``""`` for none."""
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url") or ""
    return str(endpoint).rstrip("/")


def _text_credentials(options: dict[str, Any], backend: str) -> dict[str, Any]:
    """``options`` with credentials made of digits kept as text: a config file (YAML) or a
    ``HICACHE__`` variable parses ``1234567890`` as a number, and s3fs then failed every request
    (a ``TypeError`` counted as a permanent error). Anything else that is not text is a
    :class:`ConfigError` naming the option, never its value."""

    def fixed(table: dict[str, Any], names: tuple[str, ...], where: str) -> dict[str, Any]:
        out = dict(table)
        for name in names:
            value = out.get(name)
            if value is None or isinstance(value, str):
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                out[name] = str(value)
                continue
            raise ConfigError(f"{backend} backend: {where}{name} must be text, got a {type(value).__name__}")
        return out

    options = fixed(options, _TEXT_OPTIONS, "storage_options.")
    client = options.get("client_kwargs")
    if isinstance(client, dict):
        options["client_kwargs"] = fixed(client, _TEXT_CLIENT_OPTIONS, "storage_options.client_kwargs.")
    return options


def _checked_s3_options(options: dict[str, Any], backend: str) -> dict[str, Any]:
    """``options`` (s3fs's, after :func:`_text_credentials`) if what no request can mend is
    right, else a :class:`ConfigError` naming the option: ``client_kwargs`` and
    ``config_kwargs`` tables, an ``endpoint_url`` that is an http(s) url with a host (botocore
    takes ``ftp://host`` and refuses it at every request), a ``region_name`` that is text, a
    ``session`` that is one, a CA bundle (``client_kwargs.verify``) that is there, and
    ``config_kwargs`` botocore refuses only at a request (:func:`_check_config_kwargs`). Left
    wrong, the store opened and missed every call for good, a warning a minute."""
    for name in ("client_kwargs", "config_kwargs", "s3_additional_kwargs"):
        value = options.get(name)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{backend} backend: storage_options.{name} must be a table (dict), "
                              f"got a {type(value).__name__}")
    session = options.get("session")
    if session is not None and not callable(getattr(session, "create_client", None)):
        raise ConfigError(f"{backend} backend: storage_options.session must be an aiobotocore session, "
                          f"got a {type(session).__name__}")
    client = options.get("client_kwargs") or {}
    verify = client.get("verify")
    if isinstance(verify, str) and not os.path.isfile(verify):
        raise ConfigError(f"{backend} backend: storage_options.client_kwargs.verify names no CA bundle file: "
                          f"{verify!r}")
    for where, endpoint in (("", options.get("endpoint_url")), ("client_kwargs.", client.get("endpoint_url"))):
        if endpoint is not None and not _is_http_url(endpoint):
            raise ConfigError(f"{backend} backend: storage_options.{where}endpoint_url must be an http:// or "
                              f"https:// url with a host, got {redact_url(str(endpoint))!r}")
    for where, table in (("client_kwargs.", client), ("config_kwargs.", options.get("config_kwargs") or {})):
        region = table.get("region_name")
        if region is not None and not isinstance(region, str):
            raise ConfigError(f"{backend} backend: storage_options.{where}region_name must be text, "
                              f"got a {type(region).__name__}")
    _check_config_kwargs(options.get("config_kwargs") or {}, backend)
    return options


def _check_config_kwargs(config: dict[str, Any], backend: str) -> None:
    """A :class:`ConfigError` for ``config_kwargs`` botocore takes when the client is built and
    refuses at every request (or turns into a timeout of every request): ``retries`` that is
    not a table, a timeout that is not a positive number, a signature version it does not know."""
    retries = config.get("retries")
    if retries is not None and not isinstance(retries, dict):
        raise ConfigError(f"{backend} backend: storage_options.config_kwargs.retries must be a table (dict), "
                          f"got a {type(retries).__name__}")
    for name in ("connect_timeout", "read_timeout"):
        if config.get(name) is not None:
            _positive(f"storage_options.config_kwargs.{name}", config[name])
    from botocore import UNSIGNED
    from botocore.auth import AUTH_TYPE_MAPS

    signature = config.get("signature_version")
    if signature is not None and signature is not UNSIGNED and not (isinstance(signature, str)
                                                                     and signature in AUTH_TYPE_MAPS):
        raise ConfigError(f"{backend} backend: storage_options.config_kwargs.signature_version {signature!r} is "
                          "not one botocore knows (S3's own is 's3v4')")


def _is_http_url(text: str) -> bool:
    """Whether ``text`` is an http:// or https:// url with a host (and a port that is one)."""
    try:
        parts = urllib.parse.urlsplit(text)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # a port that is no number or out of range, a bracketed host that is no address
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname) and port_ok


def _botocore_takes_bucket(bucket: str) -> bool:
    """Whether botocore sends requests for ``bucket`` (the first part of an ``s3://`` url): its
    own check of a name, or an access point ARN (whose first part holds no whole ARN: let
    through). ``True`` without botocore: the missing package is said next."""
    try:
        from botocore.handlers import VALID_BUCKET
    except ImportError:  # pragma: no cover
        return True
    return bucket.startswith("arn:") or VALID_BUCKET.match(bucket) is not None


def _client_config_errors() -> tuple[type[Exception], ...]:
    """What building an S3 client raises for options that can never work (see
    ``FsspecStorage._check_client``); not a credential source that fails to answer."""
    from botocore import exceptions as bce

    return (TypeError, ValueError, bce.ProfileNotFound, bce.PartialCredentialsError, bce.InvalidConfigError,
            bce.UnknownSignatureVersionError, bce.InvalidS3AddressingStyleError, bce.ConfigParseError,
            bce.UnknownCredentialError, bce.InvalidRetryConfigurationError, bce.DataNotFoundError)


def _positive(name: str, value: Any, kind: type = float, allow_zero: bool = False) -> Any:
    """``value`` if it is a finite number of the right kind and sign, else a ConfigError naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        ok = ok and isinstance(value, int)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"option {name} must be a {'non-negative' if allow_zero else 'positive'} {kind.__name__}, got {value!r}")
    return value


class FsspecStorage(AsyncHiCacheStorage):
    """Pages as objects under any fsspec URL (``s3://``, ``gs://``, ``memory://``, ``file://``...).

    Async filesystems run natively on the caller's event loop (one filesystem per loop);
    synchronous ones (``memory://``, ``file://``) run each call in a worker thread.

    Options:
        url: where the store lives, e.g. ``s3://bucket/prefix`` or ``memory://hicache``.
        storage_options: passed to the fsspec filesystem (for s3: ``endpoint_url``,
            ``key``/``secret``/``token``, ``client_kwargs={"region_name": ...}``,
            ``config_kwargs``...). Never logged, printed or shown in ``repr``.
        concurrency: requests in flight per event loop; also the HTTP connection pool size.
        request_timeout: seconds one request attempt may take. A page from 100 MiB goes to S3
            as a multipart upload: each of its requests (the create, each part, the complete)
            gets this long, the upload as a whole as many times this as it makes requests one
            after another (parts go ``max_concurrency`` at a time, an s3fs option, sharing the
            link: on a slow one, raise this or lower that).
        call_timeout: seconds one backend call (a whole batch, retries included) may take;
            pages not done by then are misses/failures. A close waits as long for the writes
            and clears of its event loop in progress; writes still running after that (or on
            another loop) fail, counted in ``close_cut_write_pages`` and logged. A close given
            a deadline (``aclose(timeout)``, a server's drain) waits at most half of what is
            left for them, and ends by it: multipart uploads it could not see aborted by then
            are counted in ``close_uploads_not_aborted``, other loops whose client had not
            closed in ``close_loops_not_closed``, and said in one line.
        retries: extra attempts after a transient failure (connection, timeout, 5xx, throttling).
        retry_backoff, retry_backoff_max: first and largest wait between attempts (seconds).
        breaker_threshold: consecutive transient failures that open the circuit breaker.
        breaker_cooldown: seconds the breaker stays open before one probe request.
        exists_cache_size, exists_cache_ttl: how many known-present pages to remember, and for
            how long (0 entries disables the cache). Stores of one process on the same location
            and namespace share the cache, so a clear through one is seen by all. While the
            breaker is not closed the cache is not consulted: lookups answer misses. A page
            removed by someone else is claimed for at most the TTL; a read that finds it
            missing is a miss that forgets it (``stale_hits``), and run indexes stop vouching
            for it until the store answers for that page again.
        manifest_check_interval: seconds between checks that the namespace manifest is still
            there (a bucket deleted and re-created loses it); it is rewritten when missing.
        namespace: override the namespace derived from the storage config.
    """

    backend_name: ClassVar[str] = "fsspec"
    #: the biggest object a failed ``verify_page`` reads whole to prove it damaged at rest
    #: (:meth:`_rest_for_proof`): the size up to which pages go in one PUT, whose ETag is the
    #: MD5 the proof compares (a multipart upload's is not; ``S3ObjectOps.put`` sends those
    #: from twice its 50 MiB part size)
    verify_whole_max: ClassVar[int] = 100 << 20

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None = None,
        *,
        url: str,
        storage_options: dict[str, Any] | None = None,
        concurrency: int = 32,
        request_timeout: float = 5.0,
        call_timeout: float = 30.0,
        retries: int = 2,
        retry_backoff: float = 0.05,
        retry_backoff_max: float = 1.0,
        breaker_threshold: int = 5,
        breaker_cooldown: float = 5.0,
        exists_cache_size: int = 100_000,
        exists_cache_ttl: float = 300.0,
        manifest_check_interval: float = 60.0,
        namespace: Namespace | dict[str, Any] | None = None,
    ) -> None:
        super().__init__(storage_config, namespace=namespace)
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"{self.backend_name} backend: url must look like 'protocol://path', got {redact_url(str(url))!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"{self.backend_name} backend: storage_options must be a dict")
        scheme, rest = url.split("://", 1)
        if "::" in scheme:
            raise ConfigError(
                f"{self.backend_name} backend: chained urls ({redact_url(url)!r}) are not taken; give the outer "
                "filesystem's url and the inner one in storage_options, e.g. url='dir://prefix' with "
                "storage_options={'path': '/data/kv', 'target_protocol': 'file'}"
            )
        self.protocol = scheme.lower()
        self.process_local = self.protocol == "memory"  # fsspec's memory filesystem: one per process
        # the path is taken as given from here on: with the scheme as typed ("FILE://") it was
        # stripped as a relative path (pages written under the working directory) or a bucket
        # named "S3:"
        url = self.url = f"{self.protocol}://{rest}"
        if "?" in rest or "#" in rest:
            # s3fs cuts object paths at "?versionId=": every page, index and the manifest were
            # one object outside the prefix (a user's object overwritten, then deleted as corrupt)
            raise ConfigError(f"{self.backend_name} backend: url must be a plain path, without '?' or '#': "
                              f"{redact_url(url)!r}")
        if self.protocol in _S3_PROTOCOLS and "@" in rest.split("/", 1)[0]:
            # s3fs takes no credentials from the url: they became part of the bucket name, every
            # request failed, and the name (secret and all) reached the logs
            raise ConfigError(f"{self.backend_name} backend: credentials do not go in the url "
                              f"({redact_url(url)!r}); give storage_options key and secret")
        self._check_protocol()
        if self.protocol in _BUCKET_PROTOCOLS:
            url = self.url = self._bucket_url(rest)
        try:
            self._fs_class: Any = fsspec.get_filesystem_class(self.protocol)
        except ImportError as exc:
            raise BackendLoadError(
                f"{self.backend_name} backend: the {self.protocol!r} filesystem needs a package: {exc} "
                "(pip install 'hicache[s3]' for s3)"
            ) from None
        except ValueError as exc:
            raise ConfigError(f"{self.backend_name} backend: no fsspec filesystem for {self.protocol!r}: {exc}") from None
        self._storage_options: dict[str, Any] = dict(storage_options or {})
        if issubclass(self._fs_class, DirFileSystem) and not (
                self._storage_options.get("path") or self._storage_options.get("fo")):
            # without one the store failed to open with fsspec's "'NoneType' object has no
            # attribute 'startswith'", which names neither the option nor the store
            raise ConfigError(f"{self.backend_name} backend: a {self.protocol}:// url needs storage_options 'path', "
                              "the folder (or bucket and prefix) its paths are under, e.g. "
                              "{'path': '/data/kv', 'target_protocol': 'file'}")
        if self.protocol in _S3_PROTOCOLS:  # s3fs's are text; other filesystems take objects (gcsfs's token)
            self._storage_options = _checked_s3_options(
                _text_credentials(self._storage_options, self.backend_name), self.backend_name)
        elif _dir_over_s3(self._fs_class, self._storage_options):  # (before the redactor learns them)
            self._storage_options["target_options"] = _checked_s3_options(_text_credentials(
                dict(self._storage_options.get("target_options") or {}), self.backend_name), self.backend_name)
        self._redactor = Redactor(self._storage_options, url)
        self.concurrency = _positive("concurrency", concurrency, int)
        self.request_timeout = float(_positive("request_timeout", request_timeout))
        self.call_timeout = float(_positive("call_timeout", call_timeout))
        try:
            self.retry_policy = RetryPolicy(
                retries=_positive("retries", retries, int, allow_zero=True),
                backoff=float(_positive("retry_backoff", retry_backoff, allow_zero=True)),
                backoff_max=float(_positive("retry_backoff_max", retry_backoff_max, allow_zero=True)),
            )
            self.breaker = CircuitBreaker(
                _positive("breaker_threshold", breaker_threshold, int),
                float(_positive("breaker_cooldown", breaker_cooldown, allow_zero=True)),
            )
        except ValueError as exc:
            raise ConfigError(f"{self.backend_name} backend: {exc}") from None
        self.exists_cache = ExistsCache(
            _positive("exists_cache_size", exists_cache_size, int, allow_zero=True),
            float(_positive("exists_cache_ttl", exists_cache_ttl, allow_zero=True)),
        )
        self.manifest_check_interval = float(_positive("manifest_check_interval", manifest_check_interval))
        #: whether each loop's filesystem is built asynchronous (see :func:`_runs_async`)
        self._async_fs = _runs_async(self._fs_class, self._storage_options)
        # bytes can be damaged on the way only from a network store (async fsspec filesystems);
        # memory:// or file:// deliver what they hold
        self._remote = self._async_fs
        self._transit_warnings = Throttle(60.0)
        if issubclass(self._fs_class, LocalFileSystem) and not rest.strip("/"):
            # fsspec takes 'file://' for the working directory and the names under 'file:///'
            # were relative ones, so either wrote its pages under whatever folder the process
            # started in (the url of an empty variable, 'file://${KV_DIR}'), as the file
            # backend's root '' is refused for
            raise ConfigError(f"{self.backend_name} backend: url {url!r} names no folder; give the store's own, "
                              f"e.g. '{self.protocol}:///data/kv'")
        self.root = self._fs_class._strip_protocol(url).rstrip("/")
        if issubclass(self._fs_class, DirFileSystem) and ".." in self.root.split("/"):
            # the dir's root is the store's bound: a DirFileSystem refuses such a path only over
            # local files, and only in recent fsspec releases
            raise ConfigError(f"{self.backend_name} backend: a dir:// url must stay under the dir's root, got "
                              f"{redact_url(url)!r}")
        self._local: LoopLocal[LoopResources] = LoopLocal(self._make_resources, _close_resources)
        self.runner = RequestRunner(
            name=type(self).__name__,
            location=redact_url(url),
            local=self._local,
            breaker=self.breaker,
            policy=self.retry_policy,
            request_timeout=self.request_timeout,
            call_timeout=self.call_timeout,
            stats=self.stats,
            redactor=self._redactor,
        )
        self._names: ObjectNames | None = None
        self._codec: PageCodec | None = None
        self._manifest_ok = False
        self._manifest_refused = False  # the store refused the manifest (read-only): retried at the check interval
        self._prober: asyncio.Task[None] | None = None
        #: the open's sweep of killed local writers' temporary files, and what stops it (a close)
        self._tmp_sweep: asyncio.Task[None] | None = None
        self._tmp_sweep_stop = threading.Event()
        # (changed and read from every loop that uses the store: under this lock)
        self._tasks_lock = threading.Lock()
        self._index_writes: set[asyncio.Task[None]] = set()  # run indexes still being stored
        self._clears: set[asyncio.Future[None]] = set()  # clears in progress: a close waits for them
        #: write calls in progress (-> how many of their pages are not answered yet): likewise
        self._writes: dict[asyncio.Future[None], list[int]] = {}

    # ------------------------------------------------------------------ configuration

    def _bucket_url(self, rest: str) -> str:
        """The url of an object store (``rest``: what follows ``protocol://``), checked, and
        without leading slashes in its key prefix.

        * It must name a bucket: with none, the namespace digest became the bucket's name, and
          pages and manifest went into a bucket nobody configured (on AWS, one a stranger may
          own: bucket names are global and the digest follows from the model's settings).
        * ``s3://bucket//lead`` (``f"s3://{bucket}/{prefix}"`` with ``prefix="/lead"``) is
          ``s3://bucket/lead``: s3fs wrote and read its pages under the key ``/lead/...``, but
          its listings strip leading slashes, so a clear listed ``lead/...``: another store's
          pages went, its own stayed. Only the leading slashes go, and a warning says so: a
          ``//`` inside the prefix is listed as written, so pages under one stay where they are.
        """
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise ConfigError(f"{self.backend_name} backend: url must name a bucket "
                              f"({self.protocol}://bucket/prefix), got {redact_url(self.url)!r}")
        if self.protocol in _S3_PROTOCOLS and not _botocore_takes_bucket(bucket):
            # refused before any request is sent: the store opened and every call failed for good
            raise ConfigError(f"{self.backend_name} backend: {bucket!r} is not a bucket name S3 clients take "
                              f"(letters, digits, '.', '-', '_'; at most 255), in {redact_url(self.url)!r}")
        if not key.startswith("/"):
            return self.url
        url = f"{self.protocol}://{bucket}/{key.lstrip('/')}"
        logger.warning("%s backend: url %r: leading '/' of the prefix dropped (object store listings ignore "
                       "it); the store is %r", self.backend_name, redact_url(self.url), redact_url(url))
        return url

    def _check_protocol(self) -> None:
        """Hook for subclasses that accept only some protocols."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(url={redact_url(self.url)!r}, namespace={self.namespace.digest!r}, "
            f"storage_options={redact_options(self._storage_options)!r}, concurrency={self.concurrency})"
        )

    __str__ = __repr__

    def _filesystem_options(self) -> dict[str, Any]:
        """Options for one filesystem instance (called per event loop)."""
        opts = dict(self._storage_options)
        if self._async_fs:
            opts["asynchronous"] = True
        opts["skip_instance_cache"] = True  # an instance is bound to one loop: never share it
        if self.protocol in _S3_PROTOCOLS:
            opts = self._s3_options(opts)
        elif self._async_fs and issubclass(self._fs_class, DirFileSystem) and opts.get("fs") is None:
            opts["target_options"] = self._dir_target_options(opts)
        return opts

    def _dir_target_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """Options of the filesystem a ``dir://`` store's DirFileSystem builds from
        ``target_protocol``: asynchronous as it is, one per loop like it (a DirFileSystem refuses
        a target in another mode, so ``dir://`` over S3 did not open unless its options said
        so), and an S3 target configured as the ``s3`` backend configures its own."""
        target = dict(opts.get("target_options") or {})
        target["asynchronous"] = True
        target["skip_instance_cache"] = True
        if _dir_over_s3(self._fs_class, opts):
            target = self._s3_options(target)
        return target

    def _s3_options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """s3fs ``opts`` with the store's defaults for one client of one loop."""
        opts = dict(opts)
        opts.setdefault("use_listings_cache", False)  # other processes write the bucket
        cfg = dict(opts.get("config_kwargs") or {})
        # one connection per request in flight, or requests queue inside botocore
        cfg["max_pool_connections"] = max(int(cfg.get("max_pool_connections") or 0), self.concurrency)
        cfg.setdefault("connect_timeout", self.request_timeout)
        cfg.setdefault("read_timeout", self.request_timeout)
        # we retry (and count, and trip the breaker) ourselves; botocore's retries would
        # multiply ours and hide outages
        cfg.setdefault("retries", {"total_max_attempts": 1})
        # pages carry their own xxh3 checksum, verified on every read
        cfg.setdefault("request_checksum_calculation", "when_required")
        cfg.setdefault("response_checksum_validation", "when_required")
        # and for the same reason no SHA-256 of every body for the signature (botocore signs
        # the payload on http://, and on https:// when no checksum header is sent): that
        # hash was the largest CPU cost of a PUT, and it guards nothing the page checksum
        # (and TLS on https) does not. An explicit "s3" config_kwargs entry wins.
        s3cfg = dict(cfg.get("s3") or {})
        s3cfg.setdefault("payload_signing_enabled", False)
        cfg["s3"] = s3cfg
        opts["config_kwargs"] = cfg
        return opts

    def _make_resources(self) -> LoopResources:
        fs = self._fs_class(**self._filesystem_options())
        # (a dir:// store's target may be S3: the one it built, never a filesystem the caller gave)
        target = built_target(fs)
        s3 = fs if target is None else target
        if is_s3fs(s3):
            # s3fs's own retry loop: one attempt (see _filesystem_options). It still sleeps 0.1 s
            # after a transient error before giving up; the breaker keeps that rare.
            s3.retries = 1
        # twice the request slots: every request in flight can have the next body ready
        return LoopResources(
            make_ops(fs, self.request_timeout), asyncio.Semaphore(self.concurrency), asyncio.Semaphore(2 * self.concurrency),
            BodyBuffers(self.concurrency),
        )

    def _cache_scope(self) -> tuple[str, ...]:
        """What identifies this store's objects within the process: filesystem, service, path.

        The filesystem class, not the protocol as spelled, and the endpoint without trailing
        slashes: ``s3a://b/p`` and ``s3://b/p``, or ``http://host:9000/`` and ``http://host:9000``,
        are one store's objects. Spelled differently, two stores kept two caches, and after a
        clear (or delete) through one the other answered its removed pages as hits for a TTL."""
        opts = self._storage_options
        fs = self._fs_class
        return (f"{fs.__module__}.{fs.__qualname__}", _endpoint_of(opts), *_dir_root(fs, opts),
                self.names.namespace_dir)

    @property
    def names(self) -> ObjectNames:
        """Object paths of this store's namespace (fixed when the store opens)."""
        if self._names is None:
            self._names = ObjectNames(self.root, self.namespace.digest)
        return self._names

    # ------------------------------------------------------------------ lifecycle

    async def _open(self) -> None:
        self.runner.closed = False  # a store may be opened again after a close
        self._names = ObjectNames(self.root, self.namespace.digest)
        self._codec = PageCodec(self.namespace.digest_bytes)
        self.exists_cache = ExistsCache.shared(
            self._cache_scope(), self.exists_cache.max_entries, self.exists_cache.ttl
        )
        # the filesystem is built here (for this loop), from storage_options only: one that
        # refuses them is a configuration error, said once, not the filesystem's own TypeError
        # or ValueError out of open() and every call after it (each opening again), unredacted
        try:
            res = self._local.get()
        except Exception as exc:  # noqa: BLE001 - whatever a filesystem's constructor raises
            raise ConfigError(f"{self.backend_name} backend: the {self.protocol} filesystem refused its "
                              f"storage_options: {type(exc).__name__}: {self._redactor.scrub(str(exc))}") from None
        await self._check_client(res.ops)
        try:  # never raises and never hangs: an unreachable store opens, misses, and probes
            async with asyncio.timeout(self.call_timeout):
                await self._ensure_manifest()
        except TimeoutError:
            self.stats.incr("manifest_errors")
        self._prober = asyncio.get_running_loop().create_task(self._probe_loop(), name="hicache-s3-prober")
        self._tmp_sweep_stop = threading.Event()
        self._tmp_sweep = asyncio.get_running_loop().create_task(self._sweep_tmps(), name="hicache-s3-tmp-sweep")

    async def _check_client(self, ops: ObjectOps) -> None:
        """Build this loop's S3 client now, where s3fs builds it on the first request: options
        the client refuses (a keyword it does not take, a profile that does not exist, a key
        without its secret, a region that is no region) are a ConfigError here, said once.
        Found by the first request, they were a permanent error of every call, the store open
        and missing for good. Building a client sends no request; whatever else goes wrong
        building it (a credential source that does not answer, within ``call_timeout``) may
        mend by itself, and is left to the requests, as before."""
        if not isinstance(ops, S3ObjectOps):
            return
        try:
            async with asyncio.timeout(self.call_timeout):
                await ops.fs.set_session()
        except _client_config_errors() as exc:
            await close_all(self._local)  # (the filesystem built for this loop, unused)
            raise ConfigError(f"{self.backend_name} backend: the S3 client refused its storage_options: "
                              f"{type(exc).__name__}: {self._redactor.scrub(str(exc))}") from None
        except Exception:  # noqa: BLE001 - not the options' fault: the first request tries again
            logger.debug("%s: building the S3 client at open failed", type(self).__name__, exc_info=True)

    async def _sweep_tmps(self) -> None:
        """Remove the temporary files that local writers killed mid-write left in this namespace
        (see :meth:`ThreadObjectOps.remove_abandoned_tmps`): only a clear removed them, so a
        crash loop grew the folder for good. In the background: a big namespace takes a while
        to walk. Never raises."""
        ops = self._local.get().ops
        if not isinstance(ops, ThreadObjectOps):
            return
        try:
            removed = await ops.remove_abandoned_tmps(self.names.namespace_dir, self._tmp_sweep_stop)
        except Exception as exc:  # noqa: BLE001 - a sweep that fails leaves the files for the next one
            logger.warning("%s: sweeping %s for temporary files of killed writers failed: %s: %s",
                           type(self).__name__, redact_url(self.url), type(exc).__name__,
                           self._redactor.scrub(str(exc)))
            return
        if removed:
            logger.info("%s: removed %d temporary file(s) of killed writers under %s", type(self).__name__,
                        removed, redact_url(self.url))

    async def _close(self) -> None:
        # clears and writes in progress finish first, within call_timeout (which bounds each of
        # them anyway, but for a clear): a close cut a clear's listing or deletes mid-way (the
        # namespace half cleared, the clear logged at ERROR as the endpoint's fault), and cut a
        # write batch at once - pages waiting for a slot dropped, pages whose PUT had landed
        # reported as failed, nothing said. Reads and lookups give up instead.
        # With a caller's deadline (``aclose(timeout)``), the waits for writes and run indexes
        # take at most half of what is left each time: the rest is for aborting the uploads the
        # close cuts and closing every loop's client, and what is left undone is reported.
        here = asyncio.get_running_loop()
        deadline = self._close_deadline
        cut = 0
        try:
            with self._tasks_lock:
                running = [f for f in (*self._clears, *self._writes) if f.get_loop() is here]
            waited = time_share(self.call_timeout, deadline, 0.5)
            if running:
                await asyncio.wait(running, timeout=waited)
            with self._tasks_lock:  # (another loop's are cut too: the close cannot wait on its loop)
                cut = sum(left[0] for f, left in self._writes.items() if not f.done())
            if cut:  # (close_cut_write_pages counts those that do answer failed: see _write_one)
                logger.warning("%s: closing %s with writes of %d page(s) still running (after %.1f s on this "
                               "event loop; another loop's are not waited for): they answer failed, though the "
                               "store may hold some", type(self).__name__, redact_url(self.url), cut, waited)
            # (after the writes: each finished one leaves an index behind)
            await self.wait_index_writes(None if deadline is None else time_share(self.call_timeout, deadline, 0.5))
        finally:
            # also when the close is cancelled while it waits (a shutdown's deadline): the store is
            # marked closed then, so no later close releases it, and its prober went on probing
            # the bucket and its clients stayed open for good
            self._report_close(cut, await self._release(deadline))

    def _report_close(self, cut: int, left: CloseLeft) -> None:
        """Count and say, in one line, what the close left unfinished: the page writes it cut,
        the multipart uploads it could not see aborted (billed until the bucket's lifecycle rule
        removes them) and the other event loops whose client had not closed in time."""
        if left.uploads:
            self.stats.incr("close_uploads_not_aborted", left.uploads)
        if left.loops:
            self.stats.incr("close_loops_not_closed", left.loops)
        parts = [f"{cut} page write(s) cut"] if cut else []
        if left.uploads:
            parts.append(f"{left.uploads} multipart upload(s) not aborted (their parts stay until the bucket's "
                         "lifecycle rule AbortIncompleteMultipartUpload removes them)")
        if left.loops:
            parts.append(f"{left.loops} other event loop(s) still closing their client")
        if parts:
            logger.warning("%s: closed %s leaving %s", type(self).__name__, redact_url(self.url), ", ".join(parts))

    async def _release(self, deadline: float | None = None) -> CloseLeft:
        """Stop the background tasks and close every loop's filesystem (the end of a close),
        by ``deadline`` if given; what it left unfinished."""
        await self._stop_tmp_sweep()
        self.runner.closed = True  # calls still in flight give up rather than open a new client
        prober, self._prober = self._prober, None
        if prober is not None and not prober.done():
            if prober.get_loop() is asyncio.get_running_loop():
                prober.cancel()
                await asyncio.gather(prober, return_exceptions=True)
            else:
                try:
                    prober.get_loop().call_soon_threadsafe(prober.cancel)
                except RuntimeError:  # its loop is closed, and the task with it
                    pass
        return await close_all(self._local, deadline)

    async def _stop_tmp_sweep(self) -> None:
        """Stop the open's sweep (:meth:`_sweep_tmps`) at its next folder and, on its loop, wait
        for it: its thread would otherwise go on walking the store after the close."""
        self._tmp_sweep_stop.set()
        sweep, self._tmp_sweep = self._tmp_sweep, None
        if sweep is not None and sweep.get_loop() is asyncio.get_running_loop():
            await asyncio.gather(sweep, return_exceptions=True)

    async def wait_index_writes(self, timeout: float | None = None) -> None:
        """Wait for the run indexes of finished writes (this loop's; others' are cancelled),
        those of this loop for at most ``timeout`` if given (the rest cancelled: an index is
        only an index)."""
        here = asyncio.get_running_loop()
        with self._tasks_lock:  # another loop's writes add and finish theirs meanwhile
            tasks = list(self._index_writes)
        mine = [t for t in tasks if t.get_loop() is here]
        for t in (t for t in tasks if t.get_loop() is not here):
            try:
                t.get_loop().call_soon_threadsafe(t.cancel)
            except RuntimeError:  # that loop is closed, and the task with it
                pass
        if mine and timeout is not None:
            _, late = await asyncio.wait(mine, timeout=timeout)
            for t in late:
                t.cancel()
        elif mine:
            await asyncio.gather(*mine, return_exceptions=True)

    async def _probe_loop(self) -> None:
        """While the breaker is open (or the manifest is unwritten), probe the store so it is
        noticed as back without sacrificing a user request. Never dies on an error."""
        interval = max(0.05, min(self.breaker.cooldown / 2, 5.0, self.manifest_check_interval))
        checked = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                due = time.monotonic() - checked >= self.manifest_check_interval
                # an unwritten manifest is retried soon, unless the store refused it (a read-only
                # principal: every few seconds, forever); then at the check interval
                retry = not self._manifest_ok and not self._manifest_refused
                if due or self.breaker.state is not BreakerState.CLOSED or retry:
                    checked = time.monotonic()
                    await self._ensure_manifest()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a background task must survive anything
                self.stats.incr("probe_errors")
                logger.warning("%s: probe failed", type(self).__name__, exc_info=True)

    async def _ensure_manifest(self) -> bool:
        """Write ``manifest.json`` (namespace.to_dict()) once; ``False`` if the store is unreachable."""
        names = self.names
        try:
            size = await self.runner.request("head manifest", lambda ops: ops.size(names.manifest))
            if size is None:
                body = json.dumps(self.namespace.to_dict(), indent=1, sort_keys=True).encode()
                await self.runner.request("put manifest", lambda ops: ops.put(names.manifest, body))
        except (GaveUp, FileNotFoundError) as exc:  # unreachable, or the bucket is gone: check again soon
            self.stats.incr("manifest_errors")
            self._manifest_ok = False
            cause = exc.__cause__
            self._manifest_refused = isinstance(exc, GaveUp) and cause is not None and not is_transient(cause)
            return False
        self._manifest_ok = True
        self._manifest_refused = False
        return True

    # ------------------------------------------------------------------ one request

    # ------------------------------------------------------------------ primitives

    async def _exists(self, pages: Sequence[PageKey]) -> list[bool]:
        names = self.names
        generation = self.exists_cache.generation
        paths = [names.page(p.key, p.pool) for p in pages]
        if self.breaker.state is BreakerState.CLOSED:
            out = [self.exists_cache.contains(path) for path in paths]
        else:  # unreachable: a remembered page cannot be read either, so it is a miss (the
            out = [False] * len(paths)  # HEADs below are refused, or one of them is the probe)
        todo = [i for i, known in enumerate(out) if not known]
        self.stats.incr("exists_cache_hits", len(pages) - len(todo))
        found = await self.runner.batch(
            "exists",
            [self._exists_one(paths[i], PageCodec.header_len(pages[i].key, pages[i].pool), generation) for i in todo],
        )
        for i, flag in zip(todo, found):
            out[i] = flag
        return out

    async def _exists_prefix(self, pages: Sequence[PageKey]) -> int:
        """How many pages from the start exist, in waves of one round trip: each wave asks for
        the run index of the chain starting at the first unknown page (:mod:`.runs`) and HEADs
        the next ``concurrency - 1`` pages; it stops at the first page known to be missing."""
        names, cache = self.names, self.exists_cache
        generation = cache.generation
        paths = [names.page(p.key, p.pool) for p in pages]
        n, pos = len(pages), 0
        # while the breaker is not closed the store is down for readers too: a remembered page
        # cannot be read, so only an answer from the store (the probe) may count (as in _exists)
        if self.breaker.state is BreakerState.CLOSED:
            while pos < n and cache.contains(paths[pos]):
                pos += 1
        self.stats.incr("exists_cache_hits", pos)
        wave = max(1, self.concurrency - 1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout  # the whole lookup, not each wave

        async def head_wave(lo: int, hi: int) -> list[bool]:
            # the per-page coroutines are made here, inside the wave's task: made by the caller,
            # a wave cancelled before its task ran left them never awaited (a warning per page)
            return await self.runner.batch("exists", [
                self._exists_one(paths[i], PageCodec.header_len(pages[i].key, pages[i].pool), generation)
                for i in range(lo, hi)
            ])

        while pos < n:
            width = min(wave, n - pos)
            try:
                async with asyncio.timeout_at(deadline):
                    index, flags = await asyncio.gather(self._read_run(pages[pos]), head_wave(pos, pos + width))
            except TimeoutError:  # answer the run confirmed so far
                self.stats.incr("call_timeouts")
                return pos
            self.stats.incr("exists_waves")
            heads = leading_run(flags)
            if heads < width:
                # a HEAD found this page missing (fresher than any index): the index vouches for
                # nothing from there, not even in the cache (it would claim the page for a TTL)
                return pos + heads
            run = 0
            if index:
                want = [ObjectNames.page_hash(p.key, p.pool) for p in pages[pos : pos + len(index)]]
                # an index is second-hand: it never vouches for a page a read found gone
                while run < len(want) and index[run] == want[run] and not cache.is_gone(paths[pos + run]):
                    cache.add(paths[pos + run], generation)
                    run += 1
            pos += max(run, width)
        return n

    async def _read_run(self, first: PageKey) -> list[str] | None:
        path = self.names.run_index(first.key, first.pool)
        try:
            # one byte more than an index can be: a huge object at this name (no index of ours)
            # is not downloaded whole by every lookup, and still reads as too long
            data = await self.runner.request("exists", lambda ops: ops.get_range(path, 0, MAX_INDEX_BYTES + 1))
        except (GaveUp, FileNotFoundError):
            return None
        return decode_run(data)

    async def _write_run(self, pages: Sequence[PageKey], ok: Sequence[bool], parents: Sequence[PageKey | None],
                         generation: int) -> None:
        """After a batch is stored: index its leading chain of stored pages (best effort, never
        raises: it runs as a task of this store, drained by close).

        Not when a clear ran while the batch was in flight (``generation``: the batch's ticket),
        or runs now: the clear removed the pages that had landed before its listing, and an
        index stored after it vouched for them, so a lookup answered present for pages no read
        returned. An index whose PUT a clear overlapped (one through another store of this
        process, which does not wait for this store's indexes) is removed again: the clear's
        listing may have missed it."""
        cache = self.exists_cache
        if cache.cleared_since(generation):
            self.stats.incr("writes_racing_clear")
            return
        run = 0
        while run < len(pages) and ok[run] and (run == 0 or parents[run] == pages[run - 1]):
            run += 1
        if run < MIN_RUN:
            return
        body = encode_run([ObjectNames.page_hash(p.key, p.pool) for p in pages[:run]])
        path = self.names.run_index(pages[0].key, pages[0].pool)
        ticket = cache.generation
        try:
            await self.runner.request("write run index", lambda ops: ops.put(path, body))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - GaveUp, a missing bucket, anything: the index is optional
            self.stats.incr("run_index_failures")
            return
        if cache.cleared_since(ticket):
            self.stats.incr("writes_racing_clear")
            try:
                await self.runner.request("remove run index", lambda ops: ops.remove(path))
            except (GaveUp, FileNotFoundError):
                self.stats.incr("run_index_failures")

    async def _exists_one(self, path: str, min_size: int, generation: int) -> bool:
        try:
            size = await self.runner.request("exists", lambda ops: ops.size(path))
        except (GaveUp, FileNotFoundError):
            return False
        if size is None or size < min_size:
            return False
        self.exists_cache.add(path, generation)
        return True

    async def _read(self, pages: Sequence[PageKey], buffers: Sequence[memoryview]) -> list[bool]:
        generation = self.exists_cache.generation
        return await self.runner.batch("read", [self._read_one(p, b, generation) for p, b in zip(pages, buffers)])

    async def _read_one(self, page: PageKey, buf: memoryview, generation: int) -> bool:
        path = self.names.page(page.key, page.pool)
        codec = self._codec or PageCodec(self.namespace.digest_bytes)
        hlen = PageCodec.header_len(page.key, page.pool)
        want = len(buf)
        landing: _Landing | None = None

        def read(ops: ObjectOps) -> Any:
            nonlocal landing
            landing = _Landing(codec, page, hlen, buf)  # afresh for every attempt
            return ops.get_range_into(path, 0, hlen + want, landing.next_view)

        try:  # header and payload in one ranged GET, the payload straight into the pool page
            got = await self.runner.request("read", read)
        except FileNotFoundError:
            _zero(buf)
            self._vanished(path, page)
            return False
        except GaveUp:
            _zero(buf)  # a body cut mid-way (any attempt) left unchecked bytes
            return False
        except BaseException:
            _zero(buf)  # a cancellation mid-stream too
            raise
        assert landing is not None
        if got == hlen + want and landing.in_pool:
            # the header is this page's, so only the checksum is left; a big page is hashed on
            # a thread (milliseconds of loop time otherwise), waited for on cancellation
            verdict = await run_to_completion(landing.check) if want >= OFFLOAD_MIN_BYTES else landing.check()
            if verdict is Verdict.OK:
                self.exists_cache.add(path, generation)
                return True
        data = landing.received(got)  # rare: a page that is short, foreign or damaged
        landing.wipe()  # no unverified byte stays in pool memory
        verdict = self._verify(data[:hlen], data[hlen:], page, want)
        if verdict is Verdict.OK and not want and got == hlen:  # an empty page: nothing to land
            self.exists_cache.add(path, generation)
            return True
        if verdict is Verdict.OK:  # a correct page followed by bytes nobody asked for
            verdict = Verdict.WRONG_LENGTH
        await self._reject(path, data, hlen, verdict, want, page)
        return False

    def _vanished(self, path: str, page: PageKey) -> None:
        """A read found ``path`` missing: a clean miss, and no lookup of this process claims it
        again on old evidence (the exists cache or a run index) until the store says it is
        there. A page this process believed present was removed by someone else (another
        process's clear, a lifecycle rule): counted, and reported like the file backend does."""
        if self.exists_cache.mark_gone(path):
            self.stats.incr("stale_hits")
            self.report_removed([page], reason="vanished", origin="peer")

    async def _read_bytes(self, page: PageKey) -> bytes | None:
        """A page of unknown size (``verify_page``, a v0 ``get`` without a target): its first
        bytes (the header, whichever page's it is, and a small page whole), then the rest of
        the page the header describes, and one byte more (trailing bytes are a wrong length).
        An object at the page's name that is no page at all (a foreign upload, of any size)
        costs those first bytes: it was downloaded whole, held and hashed."""
        path = self.names.page(page.key, page.pool)
        hlen = PageCodec.header_len(page.key, page.pool)
        probe = max(hlen, _HEADER_PROBE)

        async def one() -> bytes | None:
            rest = b""
            try:
                first = await self.runner.request("read", lambda ops: ops.get_range(path, 0, probe))
                parsed = PageCodec.parse(first)
                end = 0 if parsed is None else parsed.header_len + parsed.payload_len + 1
                if len(first) == probe and end > probe:  # a page (this one or not) goes on
                    rest = await self.runner.request("read", lambda ops: ops.get_range(path, probe, end))
            except FileNotFoundError:
                self._vanished(path, page)
                return None
            except GaveUp:
                return None
            split = hlen if parsed is None else parsed.header_len
            payload = first[split:] + rest
            verdict = self._verify(memoryview(first)[:split], memoryview(payload), page, None)
            if verdict is Verdict.OK:
                return payload
            data = first + rest
            # all of the object read unless it filled every range asked for
            whole = len(first) < probe if end <= probe else len(data) < end
            stored: tuple[int, str] | None | object = _NOT_ASKED
            if not whole:
                data, stored = await self._rest_for_proof(path, data)
            await self._reject(path, memoryview(data), split, verdict, None, page, stored)
            return None

        try:
            async with asyncio.timeout(self.call_timeout):
                return await one()
        except TimeoutError:
            self.stats.incr("call_timeouts")
            return None

    async def _rest_for_proof(self, path: str, data: bytes) -> tuple[bytes, tuple[int, str] | None | object]:
        """``data`` (the start of the object at ``path``, which failed verification) with the
        rest of the object, where that can prove it damaged at rest: only the whole object's
        MD5 against its ETag does (and deletes it), and a page whose header is damaged, or that
        has bytes after it, was otherwise kept for good, counted as damaged in transit at every
        inspect. Also what the store says of the object (``stored_md5``), asked once here for
        :meth:`_corrupt_at_rest`. Nothing is read where no proof is needed (a local store) or
        possible (no digest), nor beyond :attr:`verify_whole_max` (a foreign upload of gigabytes
        at a page's name costs what was read: it stays, a counted miss)."""
        if not self._remote:
            return data, _NOT_ASKED
        try:
            stored = await self.runner.request("head corrupt", lambda ops: ops.stored_md5(path))
            if stored is None or not len(data) < stored[0] <= self.verify_whole_max:
                return data, stored
            size = stored[0]
            return data + await self.runner.request("read", lambda ops: ops.get_range(path, len(data), size)), stored
        except (GaveUp, FileNotFoundError):
            return data, None  # not proven: kept, a counted miss (see _reject)

    def _verify(self, header: memoryview, payload: memoryview, page: PageKey, want: int | None) -> Verdict:
        codec = self._codec or PageCodec(self.namespace.digest_bytes)
        return codec.verify(header, payload, page.key, page.pool, expected_len=want)

    async def _reject(
        self, path: str, data: memoryview, hlen: int, verdict: Verdict, want: int | None, page: PageKey,
        stored: tuple[int, str] | None | object = _NOT_ASKED,
    ) -> None:
        """A page that failed verification. A size the caller did not expect is just a miss.
        Otherwise it is deleted only when the bytes received are the bytes stored (their MD5 is
        the object's ETag): a link that flips bits must not delete a good page that every other
        reader shares. Without that evidence it is a counted miss (``transit_errors``) and the
        object stays. (A concurrent good rewrite lost to a delete costs one miss, never wrong
        bytes.)"""
        parsed = PageCodec.parse(data[:hlen])
        if verdict is Verdict.WRONG_LENGTH and parsed is not None and want is not None and parsed.payload_len != want:
            self.stats.incr("size_mismatches")
            return
        if not await self._corrupt_at_rest(path, data, stored):
            self.stats.incr("transit_errors")
            count = self._transit_warnings.due()
            if count:
                logger.warning("%s: %d page read(s) failed verification but the stored objects may be intact "
                               "(damaged in transit?); kept, served as misses (last: %s, %s)",
                               type(self).__name__, count, path, verdict.value)
            return
        self.stats.incr("corrupt_pages")
        self.exists_cache.mark_gone(path)  # a run index written with it still lists it
        self.report_removed([page], reason="corrupt")
        logger.warning("%s: corrupt page %s (%s); deleting it", type(self).__name__, path, verdict.value)
        try:
            await self.runner.request("delete corrupt", lambda ops: ops.remove(path))
        except (GaveUp, FileNotFoundError):
            pass

    async def _corrupt_at_rest(self, path: str, data: memoryview, stored: tuple[int, str] | None | object = _NOT_ASKED
                               ) -> bool:
        """Whether ``data`` (which failed verification) is exactly what the store holds
        (``stored``: its ``stored_md5`` if the caller asked already)."""
        if not self._remote:
            return True
        if stored is _NOT_ASKED:
            try:
                stored = await self.runner.request("head corrupt", lambda ops: ops.stored_md5(path))
            except (GaveUp, FileNotFoundError):
                return False
        if not isinstance(stored, tuple):
            return False
        if stored[0] != len(data):
            return False
        if len(data) >= OFFLOAD_MIN_BYTES:
            digest = await run_to_completion(_md5_hex, data)
        else:
            digest = _md5_hex(data)
        return digest == stored[1]

    async def _write(
        self, pages: Sequence[PageKey], buffers: Sequence[memoryview], parents: Sequence[PageKey | None]
    ) -> list[bool]:
        # a missing manifest is written by the prober, never on the write path: the manifest
        # only describes the namespace, and waiting for it would stretch a batch past its timeout
        generation = self.exists_cache.generation
        cache = self.exists_cache
        # the pages held before (see :meth:`_held_still`), asked before any PUT: a lookup's HEAD
        # answered during this write would have the page found held though it was never announced
        paths = [self.names.page(p.key, p.pool) for p in pages]
        held = list(map(cache.known, paths))
        loop = asyncio.get_running_loop()
        done = loop.create_future()  # a close waits for it (see _close)
        left = [len(pages)]
        with self._tasks_lock:
            self._writes[done] = left
        try:
            ok = await self.runner.batch(
                "write", [self._write_one(p, path, b, generation, left) for p, path, b in zip(pages, paths, buffers)])
            # the index follows the pages in the background: the batch does not wait a round trip
            task = loop.create_task(self._write_run(list(pages), ok, list(parents), generation))
            with self._tasks_lock:
                self._index_writes.add(task)
            task.add_done_callback(self._index_write_done)
        finally:
            with self._tasks_lock:
                del self._writes[done]
            done.set_result(None)
        return Written(ok, self._held_still(paths, held, generation))

    def _held_still(self, paths: list[str], held: list[bool], generation: int) -> list[bool] | None:
        """Which pages of a write are not announced stored (see
        :class:`~hicache.storage.changes.Written`): every one where a clear raced the batch
        (``generation``: its ticket), since a page that landed before the clear's listing went
        with it, and which did is unknown (a router then misses a hint, and never believes in
        a page no removal will ever name); else those held before the write and still:
        known to this process's exists cache (written or found here, expired or not) when it
        began, and not removed since (a removal this process made or saw drops the entry, and
        was reported). What it cannot know is announced again: a page another process wrote,
        or one pushed out of a full cache (``exists_cache_size``; with 0 every page written is
        announced). Nor is a page a delete here overlapped since the write began: one that found
        its PUT landed before the PUT answered reported its removal already, and announced after
        it, the page stayed stored for a router for good (one that found nothing leaves a
        stored page unannounced: a hint lost)."""
        cache = self.exists_cache
        if cache.cleared_since(generation):
            return [True] * len(paths)
        quiet = held
        if any(held):
            known = cache.known
            quiet = [was and known(path) for was, path in zip(held, paths)]
        if cache.generation != generation:  # something was removed here meanwhile (the usual batch: not)
            quiet = [q or cache.removed_since(path, generation) for q, path in zip(quiet, paths)]
        return quiet if any(quiet) else None

    def _index_write_done(self, task: asyncio.Task[None]) -> None:
        with self._tasks_lock:
            self._index_writes.discard(task)

    async def _write_one(self, page: PageKey, path: str, buf: memoryview, generation: int, left: list[int]) -> bool:
        """One page's PUT to ``path`` (its object, named once by the batch); ``left``: its
        call's pages not answered yet (one less when it ends)."""
        codec = self._codec or PageCodec(self.namespace.digest_bytes)
        try:
            # (the runner's: a loop whose filesystem cannot be built is a counted miss, said
            # once a minute; got here, it was an ERROR with a traceback for every page)
            res = self.runner.resources("write")
            # One PUT of header+payload: an object store publishes an object whole or not at all.
            # The body is built before a request slot is free, so a PUT starts the moment one
            # frees (built inside the slot, every PUT waited for its own hashing and copy: set
            # was 0.96x plain s3fs with ready bytes). At most 2 x concurrency bodies exist, so a
            # huge batch never holds a copy of every page; a big one is built on a thread.
            async with res.staging:
                data = await self._body(res, codec, page, buf)
                attempts = 0

                def put(ops: ObjectOps) -> Any:
                    nonlocal attempts
                    attempts += 1
                    return ops.put(path, data)

                # (a multipart upload: each of its requests gets request_timeout, see put_requests)
                timeout = self.request_timeout * put_requests(res.ops, len(data))
                await self.runner.request("write", put, timeout=timeout)
                if isinstance(data, bytearray) and attempts == 1:
                    # answered, and no attempt was abandoned: nothing refers to it any more.
                    # An attempt given up (timed out) may still be flushing it from its
                    # transport (Python 3.12+ keeps a view, not a copy): never reused then
                    res.bodies.give_back(data)
        except FileNotFoundError as exc:
            self._manifest_ok = False  # the bucket is gone; if it comes back, so must the manifest
            # (counted, and said once a minute: said per page, a write-back flooded the log)
            self.runner.permanent("write", f"write to {self.runner.location} (bucket not found)", exc)
            return False
        except GaveUp:
            if self.runner.closed:  # cut by the close: counted here, where it is known to be lost
                self.stats.incr("close_cut_write_pages")
            return False
        finally:
            left[0] -= 1
        self.exists_cache.add(path, generation)
        return True

    @staticmethod
    async def _body(res: LoopResources, codec: PageCodec, page: PageKey, buf: memoryview) -> bytes | bytearray:
        """Header + payload as one body: in a reused buffer where the filesystem allows it
        (:mod:`.bodies`: one copy, sent with one socket write), else as ``bytes``."""
        big = len(buf) >= OFFLOAD_MIN_BYTES
        if not res.ops.reuses_bodies:
            def join() -> bytes:
                return b"".join((codec.encode(page.key, page.pool, buf), buf))

            return await run_to_completion(join) if big else join()
        hlen = PageCodec.header_len(page.key, page.pool)
        body = res.bodies.take(hlen + len(buf))

        def fill() -> None:
            with memoryview(body) as view:
                view[:hlen] = codec.encode(page.key, page.pool, buf)
                copy_bytes(view[hlen:], buf)

        if big:  # hashing and copying a big page would stall the loop for milliseconds
            await run_to_completion(fill)
        else:
            fill()
        return body

    async def _delete(self, pages: Sequence[PageKey]) -> list[bool]:
        """Evictions a placement policy chose: a HEAD per page, concurrently (S3's delete answers
        the same whether the object existed, and the caller counts what it freed), then one
        DeleteObjects per 1,000 pages that exist. Like every batch, the whole call (HEADs,
        deletes, retries) is bounded by ``call_timeout``: a page whose delete has not answered
        by then is reported not deleted (``False``, counted in ``call_timeouts``), though the
        store may have removed it."""
        # a page named twice is asked about and deleted once, and answered at its first place
        # only (as the memory backend answers): deleted_pages and the REMOVED event count it once
        asked = [self.names.page(p.key, p.pool) for p in pages]
        named = dict(zip(asked, pages))
        paths = list(named)
        # gone, not just forgotten: the run index written with a page still lists it, and
        # would vouch for it again once the cache's entry for it is forgotten
        for path in paths:
            self.exists_cache.mark_gone(path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout  # the whole call, not each phase
        deleted: dict[str, bool] = {}
        try:
            present = await self.runner.batch("delete", [self._present(path) for path in paths])
            targets = [path for path, there in zip(paths, present) if there]
            left = deadline - loop.time()
            if targets and left > 0:  # (else the HEADs used the whole call: their batch counted the timeout)
                # the run index stored under a page (when the page started a written chain) goes
                # with it: left behind, it is an object nothing bounds or removes but a clear, and
                # in another process it vouches for its whole chain again once the chain is
                # written anew. In the same DeleteObjects requests (S3 answers a missing key as
                # deleted); an index that fails to go is only an index, never a page reported not
                # deleted
                indexes = [self.names.run_index(named[path].key, named[path].pool) for path in targets]
                failed = await self._remove_many(targets + indexes, left)
                deleted = {path: path not in failed for path in targets}
        finally:
            for path in paths:  # a lookup that overlapped the delete
                self.exists_cache.mark_gone(path)
        return [deleted.pop(path, False) for path in asked]  # popped: a second place answers False

    async def _remove_many(self, paths: list[str], timeout: float) -> set[str]:
        """Remove ``paths`` within ``timeout`` s; those not known to be removed by then. One
        request (its own timeout, its own answer) per DeleteObjects, concurrently: a big
        eviction in one request timed out as a whole, was retried from scratch, and opened the
        breaker; and a request still retrying at the deadline is abandoned, not waited for."""
        failed: set[str] = set()

        async def one(chunk: list[str]) -> bool:
            try:
                failed.update(await self.runner.request("delete", lambda ops: ops.remove_many(chunk)))
                return True
            except (GaveUp, FileNotFoundError):
                return False

        per = s3_fs.DELETE_BATCH
        chunks = [paths[i : i + per] for i in range(0, len(paths), per)]
        answered = await self.runner.batch("delete", [one(c) for c in chunks], timeout=timeout)
        for chunk, ok in zip(chunks, answered):
            if not ok:
                failed.update(chunk)
        return failed

    async def _present(self, path: str) -> bool:
        try:
            return await self.runner.request("delete", lambda ops: ops.size(path)) is not None
        except (GaveUp, FileNotFoundError):
            return False

    async def _clear(self) -> None:
        """Remove this namespace's pages (the manifest stays: it only describes the namespace).
        Bounded by ``max(call_timeout, 300)`` s: a big namespace takes many list/delete calls.
        Names no pages (reported as a clear of any page): an object's name is a hash of its
        key, which only its header holds, a read per object."""
        done = asyncio.get_running_loop().create_future()
        with self._tasks_lock:
            self._clears.add(done)
        try:
            removed = await self._clear_pages()
        finally:
            with self._tasks_lock:
                self._clears.discard(done)
            done.set_result(None)
        logger.info("%s: cleared %d objects of namespace %s", type(self).__name__, removed, self.namespace.digest)

    async def _clear_pages(self) -> int:
        # run indexes of writes that returned before the clear land first, so that the listing
        # removes them (one landing after it would vouch for pages the clear removed)
        await self.wait_index_writes()
        self.exists_cache.begin_clear()  # (writes' run indexes meanwhile: see _write_run)
        try:
            removed = await self.runner.request(
                "clear", lambda ops: ops.remove_tree(self.names.pages_dir), timeout=max(self.call_timeout, 300.0)
            )
        except FileNotFoundError:
            removed = 0
        except GaveUp as exc:
            cause = exc.__cause__
            if self.runner.closed:  # cut by our own close (it waited call_timeout): not the service's fault
                raise RuntimeError(f"clearing {redact_url(self.url)} cut short: the store was closed") from None
            detail = f": {type(cause).__name__}: {self._redactor.scrub(str(cause))}" if cause else ""
            raise RuntimeError(f"clearing {redact_url(self.url)} failed{detail}") from None
        finally:
            self.exists_cache.end_clear()  # also drops answers of lookups that overlapped the delete
        return removed

    def _backend_stats(self) -> dict[str, Any]:
        return {
            "url": redact_url(self.url),
            "breaker_state": self.breaker.state.value,
            "breaker_times_opened": self.breaker.times_opened,
            "exists_cache_entries": len(self.exists_cache),
            "concurrency": self.concurrency,
            "event_loops": len(self._local),
        }


async def _close_resources(res: LoopResources) -> None:
    """Close one loop's filesystem (its loop is shutting down: see :class:`LoopLocal`)."""
    await res.ops.close()


class _Landing:
    """Where the bytes of one page read go as they arrive (``ObjectOps.get_range_into``): the
    header into a small buffer, then the payload into the pool page only if the header is this
    page's (its namespace, key, pool and length), so a foreign or misnamed object puts no byte
    into pool memory; a torn or flipped payload lands there (like the file backend's
    ``preadv``), and then the page is a miss whose pool page is zeroed before the read returns
    (:meth:`wipe`): no unverified byte stays in the pool."""

    __slots__ = ("codec", "page", "head", "buf", "in_pool", "spill", "_step")

    def __init__(self, codec: PageCodec, page: PageKey, hlen: int, buf: memoryview) -> None:
        self.codec, self.page, self.buf = codec, page, buf
        self.head = bytearray(hlen)
        self.in_pool = False
        self.spill: bytearray | None = None
        self._step = 0

    def next_view(self) -> memoryview | None:
        self._step += 1
        if self._step == 1:
            return memoryview(self.head)
        if self._step == 2:
            p = self.page
            if self.codec.verify(self.head, None, p.key, p.pool, expected_len=len(self.buf)) is Verdict.OK:
                self.in_pool = True
                return self.buf
            self.spill = bytearray(len(self.buf))  # kept for the verdict and the at-rest check
            return memoryview(self.spill)
        return None

    def check(self) -> Verdict:
        """The checksum of the payload now in the pool page."""
        return self.codec.verify(self.head, self.buf, self.page.key, self.page.pool, expected_len=len(self.buf))

    def wipe(self) -> None:
        """Zero the pool page if any payload byte went there (call after :meth:`received`)."""
        if self.in_pool:
            _zero(self.buf)

    def received(self, got: int) -> memoryview:
        """What the store sent (up to header + payload), as one buffer, for the failure path."""
        body = self.buf if self.in_pool else memoryview(self.spill or b"")
        n = max(0, min(got, len(self.head) + len(body)) - len(self.head))
        return memoryview(b"".join((self.head[: min(got, len(self.head))], body[:n])))


def _zero(buf: memoryview) -> None:
    """Zero a read's target page in place: no byte of a read that did not check out (or did
    not finish: cut, given up, cancelled) stays in pool memory."""
    np.frombuffer(buf, dtype=np.uint8).fill(0)


def _md5_hex(data: memoryview) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


class S3Storage(FsspecStorage):
    """Pages in an S3-compatible bucket through s3fs, natively async (see :class:`FsspecStorage`
    for the options). ``url`` is ``s3://bucket[/prefix]``; point ``storage_options`` at a non-AWS
    service with ``endpoint_url``."""

    backend_name: ClassVar[str] = "s3"

    def _check_protocol(self) -> None:
        if self.protocol not in _S3_PROTOCOLS:
            raise ConfigError(f"s3 backend: url must start with s3://, got {redact_url(self.url)!r} (use the fsspec backend for other protocols)")
        # (a url without a bucket is refused next, whichever backend: see _bucket_url)
