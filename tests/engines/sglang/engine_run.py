"""One SGLang engine (``sglang.Engine``: tokenizer manager here, SGLang's own scheduler and
detokenizer in processes it spawns), on the CPU: ``python engine_run.py SPEC.json``.

The spec names the model, the store (a hicache backend and its options, through SGLang's
``dynamic`` storage factory: ``{"backend": "file", "options": {"root": ...}}`` or ``"s3"`` with
its URL, endpoint and credentials; or none: no hierarchical cache at all), the host pool's
layout and I/O backend, the prompts (token ids) and where to write the result: every prompt's
generated token ids, SGLang's cached-token count and its breakdown by source (device / host /
storage), the layout SGLang resolved, and the pages in the store. With ``wait_pages`` the
engine is shut down only once that many pages are in the store (SGLang writes to storage in
the background). A launch that fails is no result: SGLang kills its whole process tree,
this one included, when a child process fails to start.

The GPU-only kernel modules are replaced by the tests' doubles (``sgl_doubles``) when this
file is imported: SGLang starts its processes with ``spawn``, which imports the parent's main
script again in every child (as ``__mp_main__``), so the scheduler gets the doubles too.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU engine (device="cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sgl_doubles  # noqa: E402

sgl_doubles.install_engine_doubles()


#: an s3 page object: ``<prefix>/<namespace>/pages/<h[:2]>/<h>`` (run indexes live under ``pages/runs/``)
_S3_PAGE = re.compile(r"/pages/([0-9a-f]{2})/\1[0-9a-f]{30}$")


@functools.lru_cache(maxsize=None)
def _s3_client(endpoint: str | None, key: str | None, secret: str | None, region: str | None) -> Any:
    """One client per endpoint for the polls (a boto3 client costs ~0.1 s of CPU to make)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret, region_name=region,
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
    )


def store_pages(store: dict[str, Any] | None) -> int:
    """Pages in the store: ``*.page`` files under a file store's root, page objects under an
    s3 store's prefix (0 when there is none, or the store cannot be reached)."""
    if store is None:
        return 0
    backend, options = store.get("backend", "file"), store.get("options", {})
    if backend == "file":
        root = options.get("root")
        return 0 if root is None or not os.path.isdir(root) else sum(1 for _ in Path(root).rglob("*.page"))
    if backend == "s3":
        bucket, _, prefix = options["url"].split("://", 1)[1].partition("/")
        so = options.get("storage_options", {})
        client = _s3_client(so.get("endpoint_url"), so.get("key"), so.get("secret"),
                            so.get("client_kwargs", {}).get("region_name"))
        try:
            n = 0
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                n += sum(1 for o in page.get("Contents", []) if _S3_PAGE.search(o["Key"]))
            return n
        except Exception:  # noqa: BLE001 - unreachable: nothing to count
            return 0
    raise ValueError(f"no page count for backend {backend!r}")


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model_path=spec["model"], device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
        skip_tokenizer_init=True, dtype="bfloat16", page_size=spec["page_size"], max_total_tokens=4096,
        disable_cuda_graph=True, random_seed=0, log_level="info",
    )
    store = spec.get("store")
    if store is not None:
        extra = {
            "backend_name": "hicache",
            "module_path": store.get("module", "hicache.integrations.sglang"),
            "class_name": store.get("class", "HiCacheSGLangStorage"),
            "hicache_backend": store.get("backend", "file"),
            "hicache_options": store.get("options", {}),
            **store.get("extra", {}),
        }
        kwargs.update(
            enable_hierarchical_cache=True,
            # the host pool's layout and I/O backend; with ``direct`` the device <-> host copies
            # are ``transfer_kv_direct`` (layer_first) and the ``*_direct_*`` copies
            # (page_first_direct), doubles here: SGLang binds them on CUDA only. SGLang itself
            # turns page_first with direct I/O into page_first_direct.
            hicache_mem_layout=spec.get("layout", "layer_first"),
            hicache_io_backend=spec.get("io_backend", "direct"),
            # a storage hit is waited for, whatever the machine's speed: the test asks for it
            hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
        )
    return kwargs


def resolved_settings(engine: Any) -> dict[str, Any]:
    """The server settings after SGLang resolved them (e.g. a layout its I/O backend cannot copy
    swapped for one it can: what SGLang logs and runs); the arguments keep what was asked."""
    args = getattr(engine, "server_args", None)
    resolved = getattr(args, "resolved_dict", None)
    if callable(resolved):
        return dict(resolved())
    return dict(vars(args)) if args is not None else {}


def main(spec_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    import sglang

    store = spec.get("store")
    t0 = time.monotonic()
    engine = sglang.Engine(**engine_kwargs(spec))
    started = time.monotonic() - t0
    settings = resolved_settings(engine)
    try:
        t = time.monotonic()
        outs = engine.generate(
            input_ids=spec["prompts"],
            sampling_params={"temperature": 0.0, "max_new_tokens": spec["max_new_tokens"], "ignore_eos": True},
        )
        seconds = time.monotonic() - t
        want = spec.get("wait_pages")
        if want:
            deadline = time.monotonic() + 60
            while store_pages(store) < want and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        engine.shutdown()
    result = {
        "startup_s": started,
        "seconds": seconds,
        "outputs": [list(o["output_ids"]) for o in outs],
        "cached": [int(o["meta_info"].get("cached_tokens") or 0) for o in outs],
        "details": [o["meta_info"].get("cached_tokens_details") for o in outs],
        "layout": settings.get("hicache_mem_layout"),
        "io_backend": settings.get("hicache_io_backend"),
        "pages": store_pages(store),
    }
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
