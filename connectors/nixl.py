"""NixlConnector (pull and push): re-apply the checks vLLM keys on its name."""

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

    def validate(self, vllm_config: Any, backend_name: str) -> None:
        parallel = vllm_config.parallel_config
        dcp = _compat.dcp_world_size(parallel)
        if dcp <= 1:
            return
        # vLLM checks these only when kv_connector is literally NixlConnector.
        transfer_tp = max(
            int(parallel.tensor_parallel_size),
            int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
        )
        if dcp != transfer_tp:
            raise ValueError(
                f"{backend_name} behind KVTailConnector: decode_context_parallel_size={dcp} "
                f"must be 1 or equal to the NIXL transfer parallel size ({transfer_tp})."
            )
        model = getattr(vllm_config, "model_config", None)
        if model is not None and not getattr(model, "use_mla", False):
            raise ValueError(
                f"{backend_name} behind KVTailConnector: P/D with "
                "decode_context_parallel_size > 1 is only supported for MLA models."
            )
        block_size = int(vllm_config.cache_config.block_size)
        interleave = _compat.dcp_interleave_size(parallel)
        if interleave != block_size:
            raise ValueError(
                f"{backend_name} behind KVTailConnector with decode_context_parallel_size="
                f"{dcp}: vLLM sets cp_kv_cache_interleave_size to the block size only when "
                f"it sees {backend_name} by name, and it cannot see through the wrapper. "
                f"Set --cp-kv-cache-interleave-size {block_size} (now {interleave})."
            )
