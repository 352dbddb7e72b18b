"""NixlConnector (pull and push): what its transfers carry (the checks vLLM keys
on its name are in :mod:`kvtail_connector.facade.name_keyed`)."""

from __future__ import annotations

from typing import Any

from kvtail_connector import _compat

from .base import InnerAdapter


class NixlAdapter(InnerAdapter):
    """NIXL copies whole blocks, producer tail included; vLLM's own NIXL
    post-processing zeroes only what a transfer clipped (heterogeneous block
    sizes), so the wrapper still zeroes from the loaded count on."""

    def carries_producer_tail(self, vllm_config: Any) -> bool:
        # Pull: the consumer reads after it has the params. Push: the writer
        # thread starts from a later step's metadata. Unequal block sizes are
        # caught by the entry's geometry. Not with a host buffer (GPU KV,
        # kv_buffer_device "cpu"): NIXL copies each block to the host in the
        # step it is allocated (NixlBaseScheduler._build_save_meta), so a
        # chunked prompt's last block can be copied before the step that
        # completes the prompt, and the wrapper's zeroing never reaches the host.
        device = getattr(vllm_config.kv_transfer_config, "kv_buffer_device", None)
        return _compat.platform_is_cpu() or device != "cpu"
