"""The negative control: hicache's connector, except that every block it restores is
overwritten with noise right after the restore (after hicache verified the page), so the
end-to-end check that restored KV gives the same text is shown to be able to fail."""

from __future__ import annotations

import torch

from hicache.integrations.vllm.connector import HiCacheConnector, HiCacheConnectorMetadata


class CorruptingConnector(HiCacheConnector):
    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        worker = self._worker
        if worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        i = self._layer_names.index(layer_name) if layer_name in self._layer_names else -1
        if not isinstance(meta, HiCacheConnectorMetadata) or i < 0:
            return
        g = torch.Generator().manual_seed(1234 + i)
        for spec in meta.loads:
            for block in spec.block_ids:
                dst = worker.layers[i][block]
                dst.copy_(torch.randn(dst.shape, generator=g).to(dst.dtype))
