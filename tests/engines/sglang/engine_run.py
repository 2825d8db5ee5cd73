"""One SGLang engine (``sglang.Engine``: tokenizer manager here, SGLang's own scheduler and
detokenizer in processes it spawns), on the CPU: ``python engine_run.py SPEC.json``.

The spec names the model, the store (hicache's file backend at a root, through SGLang's
``dynamic`` storage factory; or none: no hierarchical cache at all), the prompts (token ids)
and where to write the result: every prompt's generated token ids, SGLang's cached-token
count and its breakdown by source (device / host / storage), and the pages on disk. With
``wait_pages`` the engine is shut down only once that many pages are in the store (SGLang
writes to storage in the background).

The GPU-only kernel modules are replaced by the tests' doubles (``sgl_doubles``) when this
file is imported: SGLang starts its processes with ``spawn``, which imports the parent's main
script again in every child (as ``__mp_main__``), so the scheduler gets the doubles too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU engine (device="cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sgl_doubles  # noqa: E402

sgl_doubles.install_engine_doubles()


def store_pages(root: str | None) -> int:
    return 0 if root is None or not os.path.isdir(root) else sum(1 for _ in Path(root).rglob("*.page"))


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
            "hicache_backend": "file",
            "hicache_options": {"root": store["root"]},
        }
        kwargs.update(
            enable_hierarchical_cache=True,
            # the host pool's layout and I/O backend whose device <-> host copy is
            # ``transfer_kv_direct`` (a double here: SGLang binds it on CUDA only)
            hicache_mem_layout="layer_first", hicache_io_backend="direct",
            # a storage hit is waited for, whatever the machine's speed: the test asks for it
            hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
        )
    return kwargs


def main(spec_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    import sglang

    root = (spec.get("store") or {}).get("root")
    t0 = time.monotonic()
    engine = sglang.Engine(**engine_kwargs(spec))
    started = time.monotonic() - t0
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
            while store_pages(root) < want and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        engine.shutdown()
    result = {
        "startup_s": started,
        "seconds": seconds,
        "outputs": [list(o["output_ids"]) for o in outs],
        "cached": [int(o["meta_info"].get("cached_tokens") or 0) for o in outs],
        "details": [o["meta_info"].get("cached_tokens_details") for o in outs],
        "pages": store_pages(root),
    }
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
