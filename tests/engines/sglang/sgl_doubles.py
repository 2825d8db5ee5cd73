"""Test doubles for what SGLang 0.5.23 reaches on a GPU only, in plain Python/torch, for the
CPU tests (never in the library). Everything else is SGLang's real code.

Two kinds:

* **modules** that cannot load on this CPU-only torch (:func:`install_module_doubles`):
  torchvision (its registry wheel is built against the CUDA torch), and for the engine
  ``sgl_kernel`` (SGLang's kernel package: a CUDA wheel, or a CPU build for Intel AMX that is
  not on the registry). SGLang's CPU engine imports a few names from it at module level; the
  double answers every name with a placeholder that fails loudly if it is ever called, and it
  registers no ``torch.ops.sgl_kernel`` op, so SGLang sees no AMX backend and runs its
  torch-native layers.
* **names** that SGLang binds only on CUDA/HIP/XPU (:func:`install_engine_doubles`), added to
  its modules right after they load: the ``sgl_kernel.kvcacheio`` copies of KV pages between
  the device pool and the host pool of the ``direct`` I/O backend (``transfer_kv_direct`` for
  ``layer_first``; ``transfer_kv_per_layer_direct_pf_lf`` / ``transfer_kv_all_layer_direct_lf_pf``
  for ``page_first_direct``), here indexed torch copies; and ``_cuda_host_register`` (``cudaHostRegister`` page-locking of the
  host pool), a no-op: with the device on the CPU there is nothing to pin.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable

#: torchvision: imported by SGLang's managers at module level, built for CUDA on the registry
TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
#: sgl_kernel: imported by SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) at module level
SGL_KERNEL = ("sgl_kernel",)


class _Placeholder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a GPU-only / CUDA-built module was used in the CPU tests")

    def __class_getitem__(cls, item: Any) -> type:
        return cls


class _Double(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


def install_module_doubles(names: tuple[str, ...]) -> None:
    """A double in ``sys.modules`` for each of ``names`` whose top package does not import
    (a package that is really there and loads, e.g. a CPU build, is used as it is)."""
    try:  # transformers decides once, at import, which optional packages exist: before the doubles
        importlib.import_module("transformers.utils.import_utils")
    except Exception:  # noqa: BLE001
        pass
    for top in sorted({n.split(".")[0] for n in names}):
        if isinstance(sys.modules.get(top), _Double):
            continue
        try:
            importlib.import_module(top)
            continue  # really there and loadable: use it
        except Exception:  # noqa: BLE001 - missing, or built for CUDA
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
        for name in (n for n in names if n == top or n.startswith(top + ".")):
            module = _Double(name)
            module.__path__ = []  # a package: submodule imports resolve to the doubles
            module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, module)


# ---------------------------------------------------------------------------- kernel doubles


def transfer_kv_direct(src_layers: list[Any], dst_layers: list[Any], src_indices: Any, dst_indices: Any,
                       page_size: int) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct``: for each (src, dst) layer buffer, the token
    rows at ``src_indices`` copied to the rows at ``dst_indices`` (device <-> host pool)."""
    import torch

    assert len(src_layers) == len(dst_layers), (len(src_layers), len(dst_layers))
    assert src_indices.numel() == dst_indices.numel(), (src_indices.numel(), dst_indices.numel())
    with torch.no_grad():
        for src, dst in zip(src_layers, dst_layers):
            si = src_indices.to(device=src.device, dtype=torch.long)
            di = dst_indices.to(device=dst.device, dtype=torch.long)
            dst[di] = src[si].to(dst.device)


def _page_first_rows(indices: Any, page_size: int, device: Any) -> tuple[Any, Any]:
    """Token rows of a ``page_first_direct`` host buffer ``(pages, layers, page_size, ...)``:
    each token index as (page, offset in the page)."""
    import torch

    idx = indices.to(device=device, dtype=torch.long)
    return torch.div(idx, page_size, rounding_mode="floor"), idx % page_size


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: list[Any], dst_ptrs: list[Any], src_indices: Any,
                                       dst_indices: Any, layer_id: int, page_size: int) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_per_layer_direct_pf_lf`` (host -> device, one layer):
    ``src_ptrs`` the host K and V buffers ``(pages, layers, page_size, heads, head_dim)``,
    ``dst_ptrs`` that layer's device K and V ``(tokens, heads, head_dim)``; the host tokens at
    ``src_indices`` of layer ``layer_id`` copied to the device rows at ``dst_indices``."""
    import torch

    assert len(src_ptrs) == len(dst_ptrs), (len(src_ptrs), len(dst_ptrs))
    assert src_indices.numel() == dst_indices.numel(), (src_indices.numel(), dst_indices.numel())
    with torch.no_grad():
        for src, dst in zip(src_ptrs, dst_ptrs):
            page, off = _page_first_rows(src_indices, page_size, src.device)
            di = dst_indices.to(device=dst.device, dtype=torch.long)
            dst[di] = src[page, layer_id, off].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: list[Any], dst_ptrs: list[Any], src_indices: Any,
                                       dst_indices: Any, page_size: int) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_all_layer_direct_lf_pf`` (device -> host, every
    layer): ``src_ptrs`` the device K buffers of every layer then the V buffers
    ``(tokens, heads, head_dim)``, ``dst_ptrs`` the host K and V buffers
    ``(pages, layers, page_size, heads, head_dim)``; the device rows at ``src_indices`` of each
    layer copied to the host tokens at ``dst_indices`` of that layer."""
    import torch

    assert len(dst_ptrs) in (1, 2), len(dst_ptrs)
    layers = dst_ptrs[0].shape[1]
    assert len(src_ptrs) == layers * len(dst_ptrs), (len(src_ptrs), layers, len(dst_ptrs))
    assert src_indices.numel() == dst_indices.numel(), (src_indices.numel(), dst_indices.numel())
    with torch.no_grad():
        for half, dst in enumerate(dst_ptrs):
            page, off = _page_first_rows(dst_indices, page_size, dst.device)
            for layer in range(layers):
                src = src_ptrs[half * layers + layer]
                si = src_indices.to(device=src.device, dtype=torch.long)
                dst[page, layer, off] = src[si].to(dst.device)


def _cuda_host_register(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
    """``cudaHostRegister`` of a host pool: nothing to pin when the device is the CPU."""


#: module -> names set on it right after it is executed
ENGINE_PATCHES: dict[str, dict[str, Callable[..., Any]]] = {
    "sglang.srt.mem_cache.pool_host.common": {"_cuda_host_register": _cuda_host_register},
    "sglang.srt.mem_cache.pool_host.mha": {
        "transfer_kv_direct": transfer_kv_direct,
        "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
        "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
    },
}


def _unpinned_dummy_page(module: types.ModuleType) -> None:
    """SGLang's ``file`` backend reads each page into ``get_dummy_flat_data_page()``, a
    ``torch.zeros(..., pin_memory=pool.pin_memory)``; the engine's host pool says
    ``pin_memory=True``, which a torch without CUDA refuses: the same page, unpinned, when
    there is no CUDA to pin for (as ``_cuda_host_register`` above)."""
    cls = module.MHATokenToKVPoolHost  # type: ignore[attr-defined]
    original = cls.get_dummy_flat_data_page

    def get_dummy_flat_data_page(self: Any) -> Any:
        import torch

        if self.pin_memory and not torch.cuda.is_available():
            return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                               dtype=self.dtype, device=self.device).flatten()
        return original(self)

    cls.get_dummy_flat_data_page = get_dummy_flat_data_page


#: module -> what runs on it right after it is executed (the doubles above; a benchmark adds
#: its own through :func:`after_import`)
AFTER_IMPORT: dict[str, list[Callable[[types.ModuleType], None]]] = {
    name: [lambda module, names=names: module.__dict__.update(names)] for name, names in ENGINE_PATCHES.items()
}
AFTER_IMPORT["sglang.srt.mem_cache.pool_host.mha"].append(_unpinned_dummy_page)


def after_import(name: str, hook: Callable[[types.ModuleType], None]) -> None:
    """Run ``hook(module)`` right after module ``name`` is executed (before anything uses it),
    in this process; call before it is imported."""
    assert name not in sys.modules, f"{name} is imported already"
    AFTER_IMPORT.setdefault(name, []).append(hook)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, hooks: list[Callable[[types.ModuleType], None]]) -> None:
        self.inner, self.hooks = inner, hooks

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        for hook in self.hooks:
            hook(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds the hooked modules with the other finders, and wraps their loader."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hooks = AFTER_IMPORT.get(name)
        if hooks is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _PatchingLoader(spec.loader, hooks)
                return spec
        return None


def install_engine_doubles() -> None:
    """Everything SGLang's engine needs on the CPU: the module doubles and the kernel doubles.
    Call before anything imports SGLang, in every process of the engine (the runner does it
    at import, so SGLang's spawned scheduler and detokenizer processes do it too)."""
    loaded = [m for m in AFTER_IMPORT if m in sys.modules]
    assert not loaded, f"imported before the doubles: {loaded}"
    if not any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchingFinder())
    install_module_doubles(TORCHVISION + SGL_KERNEL)
