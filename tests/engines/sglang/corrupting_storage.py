"""The negative control: hicache's SGLang storage, except that every page it reads into the
host pool is overwritten with noise right after the read (after hicache verified it), so the
end-to-end check that restored KV gives the same text is shown to be able to fail."""

from __future__ import annotations

from typing import Any

import torch

from hicache.integrations.sglang.storage import HiCacheSGLangStorage


class CorruptingStorage(HiCacheSGLangStorage):
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        out = super().batch_get_v1(keys, host_indices, extra_info)
        host = self.mem_pool_host
        assert host.layout == "layer_first", host.layout  # kv_buffer: (2, layers, tokens, heads, head_dim)
        ps = host.page_size
        g = torch.Generator().manual_seed(1234)
        for i, ok in enumerate(out):
            if ok:
                rows = host_indices[i * ps:(i + 1) * ps].long()
                dst = host.kv_buffer[:, :, rows]
                host.kv_buffer[:, :, rows] = torch.randn(dst.shape, generator=g).to(dst.dtype)
        return out
