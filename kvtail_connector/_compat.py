"""Every difference between the supported vLLM releases (0.32, 0.33, 0.34), and nothing else.

Other modules ask this one; none of them compares versions itself.

Differences between 0.32.0 and 0.33.0 that need no bridge here, because the
package reads none of them:

- ``Scheduler``: 0.33 adds ``deferred_loads`` (async loads whose
  ``update_state_after_alloc`` waits for ``_drain_deferred_loads`` in
  ``update_from_output``; only with ``defer_async_loads``, i.e. HiSparse with
  ``defer_block_free``; ``finish_requests`` frees a deferred load at once),
  ``_pending_encoder_input_ids`` and ``has_request()``;
  ``grammar_compile_error_reqs`` goes from ``set[str]`` to
  ``dict[str, RequestError]``; a waiting request left with 0 schedulable
  tokens (encoder budget, MTP lookahead) is requeued and the scan goes on
  (0.32 stops the scan).
- ``BlockPool`` skips the null block in its free/touch loops (0.32 filters
  ``not block.is_null`` inside them); the free paths and
  ``get_unhashed_block_ids_all_groups`` trim leading null blocks
  (``trim_null_head``, sliding-window prefixes); ``KVCacheBlocks.get_block_ids``
  does not (block index = token index // block size, as in 0.32).
- ``MambaManager`` asserts ``mamba_cache_mode == "align"`` with prefix
  caching (0.32 accepts ``"none"``).
- Hash lookahead: ``num_hash_lookahead_tokens`` on
  ``get_request_block_hasher``, ``KVCacheManager``, ``BlockPool`` and
  ``VllmConfig``; ``get_computed_blocks(..., max_cache_hit_length=None)``.
  The defaults keep 0.32's behaviour.
- ``kv_cache_interface``: ``AttentionSpec.is_draft`` (kw-only,
  ``compare=False``), ``MLAAttentionSpec.topk_buffer_width``, new
  ``KVQuantMode`` members (``OCTAVE_*``, ``CUSTOM``).
- ``AsyncModelRunnerOutput`` gains an abstract ``get_kv_connector_output()``.
- ``CpuPlatform`` picks its default block size in
  ``update_block_size_for_backend`` (0.32: ``check_and_update_config``); both
  keep an explicit block size, except for MLA models where torch reports no
  AMX tiles (forced to 16).

The same in both: ``Scheduler.__init__``, ``Request``, ``KVCacheConfig``,
``KVConnectorFactory``, ``resolve_kv_cache_block_sizes`` and the worker's call
order (``KVConnectorModelRunnerMixin._get_kv_connector_output``). The
sleep-mode hooks of ``KVConnectorBase_V1`` (0.33) are bridged below.

Differences between 0.33.0 and 0.34.0 that the package relies on, or that were
checked and need no bridge:

- Model runner: 0.34 has only the V2 runner (``VllmConfig.use_v2_model_runner``
  and ``KVConnectorModelRunnerMixin`` are gone). Its x86 CPU runner subclasses
  it; other CPUs get ``StandaloneCPUModelRunner``, which calls the connector in
  the same places. Bridged: :func:`runs_v2_model_runner`, so a producer zeroes
  in ``finish_forward`` (:func:`producer_tail_hook`). The worker's call order
  is ``ActiveKVConnector``'s (``v1/worker/gpu/kv_connector.py``, the same file
  as 0.33's).
- ``KVCacheConfig.needs_kv_cache_zeroing``: 0.33's property (Mamba layers or
  mixed precision, per config) is an ``init=False`` field, set the same way in
  ``__post_init__`` and then OR-ed across the workers' configs
  (``get_kv_cache_configs``) before the scheduler and the workers are built,
  so the scheduler's and every worker's connector see the resolved value. The
  package reads it once, from the config vLLM hands the connector, and never
  sets it or builds a ``KVCacheConfig`` from another (``dataclasses.replace``
  would compute it again from that config alone).
- The two bugs remain: async-load blocks are still kept from alloc-time
  zeroing and a successful load's tail is never zeroed; MoRIIO's READ filter is
  still gated on ``_has_mamba``. On 0.34 it covers every attention group of a
  hybrid (``block_ids[:len(_attn_group_ids)]``), as 0.34 drops the
  one-attention-group rule for hybrid READ, so the wrapper leaves Mamba
  hybrids to it (Mamba pages are never on the list). Every MoRIIO READ of a
  step still lands in ``start_load_kv`` (:func:`moriio_reads_landed_at_start`).
- ``Scheduler.add_request`` calls ``on_new_request`` before it queues the
  request (0.33: after); the wrapper only keeps the request object there.
- ``KVConnectorBase_V1`` gains ``supports_lookahead_block_hashes``,
  ``kv_cache_access`` and ``may_load_async``; nothing is removed or newly
  abstract, and no signature changed. ``unregister_kv_caches`` and
  ``restore_kv_caches`` gain callers (weight-update release and restore); the
  bridges below serve them unchanged.
- SimpleCPUOffloadConnector's scheduler-side pool is still sized by name
  (``v1/engine/core.py``): :func:`simple_cpu_offload_pool_sized_by_name`.
- ``ModelRunnerOutput.req_id_to_index`` and ``CachedRequestData``'s
  ``resumed_req_ids`` and ``all_token_ids`` are gone; the package reads none.

The same in 0.33 and 0.34, as this module reads it: the model-parallel groups
(``get_dcp_group``, ``_PCP``, ``_WORLD``), the ``ParallelConfig`` fields,
the null block (the first block the pool hands out), ``get_conv_state_layout``,
ROCm's interleaved-V and shuffle-layout switches and ``fuse_qk_norm_rope_kvcache``.
Read where they are used, the same in 0.32 to 0.34: ``KVTransferConfig`` is a
dataclass (``facade/inner.py`` copies it with ``dataclasses.replace``),
``CompilationConfig.static_forward_context`` (``facade/worker_hooks.py``) and
``ParallelConfig._allow_auto_resolve_cp_interleave_size`` (``facade/name_keyed.py``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

SUPPORTED = ((0, 32), (0, 33), (0, 34))
SUPPORTED_TEXT = "vLLM 0.32.x, 0.33.x and 0.34.x"


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside the supported range."""


def installed_vllm() -> str:
    """The installed vLLM's ``__version__`` text (``"unknown"`` if it has none)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _parse(text: str) -> tuple[int, int] | None:
    # "0.33.1", "0.33.0rc1", "0.33.1.dev5+gabc" -> (0, 33); "dev" -> None.
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_supported_vllm() -> bool:
    """Whether the installed vLLM is one this package supports (never raises)."""
    return _parse(installed_vllm()) in SUPPORTED


def unsupported_vllm_message() -> str:
    """The one message for an unsupported vLLM: the range, what is installed, the fix."""
    return (
        f"kvtail-connector supports {SUPPORTED_TEXT}; the installed vLLM is "
        f"{installed_vllm()}. Install a supported vLLM (pip install 'vllm>=0.32,<0.35') or a "
        "kvtail-connector release that supports yours, or remove KVTailConnector from "
        "--kv-transfer-config."
    )


def check_vllm_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed vLLM; one clear error outside the supported range.

    Only ``KVTailConnector`` (its constructor and the classmethods vLLM calls
    before building it) asks this: an engine that does not use the wrapper
    never sees the error.
    """
    version = _parse(installed_vllm())
    if version is None or version not in SUPPORTED:
        raise UnsupportedVLLMError(unsupported_vllm_message())
    return version


def moriio_reads_landed_at_start(forward_context: Any) -> bool:
    """Whether every MoRIIO READ of this step has landed when ``start_load_kv`` returns.

    0.33 and 0.34 wait for all of them there. 0.32 does only under FULL CUDA graphs,
    where no host wait can run inside the graph; otherwise each attention
    layer's READs land in that layer's ``wait_for_layer_load``, inside the forward.
    """
    if check_vllm_version() >= (0, 33):
        return True
    from vllm.config import CUDAGraphMode

    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return bool(mode == CUDAGraphMode.FULL)


def moriio_reads_may_land_per_layer() -> bool:
    """0.32: outside FULL CUDA graphs, MoRIIO READs land in ``wait_for_layer_load``."""
    return check_vllm_version() < (0, 33)


# vLLM's null block (sliding-window gaps, skipped blocks) is the first block the
# BlockPool hands out: block_id 0 in 0.32 to 0.34 (tests check it).
NULL_BLOCK_ID = 0


def dcp_world_size(parallel_config: Any) -> int:
    """``decode_context_parallel_size`` (absent or 0 means 1; 0.32 to 0.34)."""
    return int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1)


def pcp_world_size(parallel_config: Any) -> int:
    """``prefill_context_parallel_size`` (absent or 0 means 1; 0.32 to 0.34)."""
    return int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)


def dcp_interleave_size(parallel_config: Any) -> int:
    """``cp_kv_cache_interleave_size`` (absent means 1; 0.32 to 0.34)."""
    return int(getattr(parallel_config, "cp_kv_cache_interleave_size", 1) or 1)


# Compile passes that hand a layer's KV-cache insert to an AITER kernel whose
# addressing of a strided page is not in vLLM's source (ROCm only; 0.32-0.34,
# compilation/passes/pass_manager.py). None (not resolved) counts as on.
_FUSED_WRITER_PASSES = ("fuse_qk_norm_rope_kvcache", "fuse_rope_kvcache")
# 0.34 fuses QK-norm, RoPE and the cache insert for these architectures on ROCm
# whenever AITER is on, with no pass flag of its own (pass_manager.py ~219).
_MUSE_GLIMMER = frozenset({"MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration"})


def fused_kv_writer(vllm_config: Any) -> str | None:
    """The setting under which vLLM's compiled graph writes the KV pages with a
    fused AITER op instead of the attention backend's own writer (None where
    none is on; only ROCm runs these passes)."""
    from vllm.platforms import current_platform

    if not current_platform.is_rocm():
        return None
    compilation = getattr(vllm_config, "compilation_config", None)
    pass_config = getattr(compilation, "pass_config", None)
    for flag in _FUSED_WRITER_PASSES:
        value = getattr(pass_config, flag, False)
        if value is None or bool(value):
            return f'--compilation-config \'{{"pass_config": {{"{flag}": false}}}}\''
    model_config = getattr(vllm_config, "model_config", None)
    if check_vllm_version() >= (0, 34) and (
        getattr(model_config, "architecture", None) in _MUSE_GLIMMER
    ):
        return "VLLM_ROCM_USE_AITER=0 (this architecture's fused QK-norm/RoPE/KV pass)"
    return None


# Sleep-mode hooks arrived in 0.33 (KVConnectorBase_V1.supports_sleep_mode,
# unregister_kv_caches, restore_kv_caches; 0.34 also calls the last two around
# weight updates); a 0.32 inner connector has none.
def call_inner_sleep_hook(
    inner: Any, hook: Literal["unregister_kv_caches", "restore_kv_caches"]
) -> None:
    """Call the inner connector's sleep-mode ``hook`` where it has one (0.33, 0.34)."""
    method = getattr(inner, hook, None)
    if method is not None:
        method()


def inner_supports_sleep_mode(inner_cls: type, kv_transfer_config: Any) -> bool:
    """The inner connector class's sleep-mode answer; False on 0.32 (no hook)."""
    check = getattr(inner_cls, "supports_sleep_mode", None)
    return bool(check(kv_transfer_config)) if check is not None else False


def dcp_rank_and_world(configured_world: int, role: Any) -> tuple[int, int]:
    """This process's (DCP rank, DCP world size).

    Workers read vLLM's DCP process group (0.32 to 0.34:
    ``vllm.distributed.parallel_state.get_dcp_group``); the scheduler has no
    rank and only needs the world size, from the parallel config.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    if role == KVConnectorRole.SCHEDULER or configured_world <= 1:
        return 0, max(configured_world, 1)
    from vllm.distributed.parallel_state import get_dcp_group

    group = get_dcp_group()
    return int(group.rank_in_group), int(group.world_size)


def producer_tail_hook(vllm_config: Any) -> str | None:
    """The worker hook where a producer zeroes its prompt tails, or None.

    It must run after the step's last KV write and before the step's output
    (and so the request's ``kv_transfer_params``) can leave the worker, on the
    stream the forward ran on:

    - V2 model runner (on 0.32 and 0.33 where ``use_v2_model_runner`` picks
      it; the only runner of 0.34, whose CPU runners call the connector in
      the same places): ``finish_forward``, called in ``execute_model`` right
      after the forward, before sampling and the output copy (its
      ``wait_for_save`` runs in ``post_forward``, which ``sample_tokens``
      calls after the output copy has started: too late).
    - V1 model runner (0.32 and 0.33 only): ``wait_for_save``, called as the
      connector context exits, right after the forward is enqueued and before
      sampling (V1 never calls ``finish_forward``).
    - A drafter (speculative decoding): None. EAGLE/MTP drafters write draft
      KV past the prompt after the forward, and both runners then defer or
      reorder ``wait_for_save``; the producer makes no claim.
    """
    if getattr(vllm_config, "speculative_config", None) is not None:
        return None
    if runs_v2_model_runner(vllm_config):
        return "finish_forward"
    return "wait_for_save"


def runs_v2_model_runner(vllm_config: Any) -> bool:
    """Whether this engine's workers run vLLM's V2 model runner.

    0.34 removed the V1 runner and ``VllmConfig.use_v2_model_runner`` with it;
    0.32 and 0.33 choose by that property (absent on a test double: V1).
    """
    if check_vllm_version() >= (0, 34):
        return True
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def platform_is_cpu() -> bool:
    """vLLM runs on its CPU platform (0.32 to 0.34: ``current_platform.device_type``)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type) == "cpu"


def worker_rank() -> int:
    """This worker's rank among the engine's workers (vLLM's world group; 0
    without initialized groups: a single process, tests)."""
    from vllm.distributed import parallel_state as ps

    if getattr(ps, "_WORLD", None) is None:
        return 0
    return int(ps.get_world_group().rank_in_group)


def worker_count(parallel_config: Any) -> int:
    """Workers whose outputs vLLM's ``KVOutputAggregator`` folds per step
    (``ParallelConfig.world_size``: PP x TP x PCP, 0.32 to 0.34)."""
    return int(getattr(parallel_config, "world_size", 1) or 1)


def counts_requests_on_this_rank() -> bool:
    """Whether this worker reports per-request counters (0.32 to 0.34).

    Every TP/PP/PCP worker handles the same request, and vLLM's
    ``KVOutputAggregator`` sums their stats: only the first rank of each
    group counts requests, so a request counts once. Without initialized
    model-parallel groups (a single process, tests) this worker is the only one.
    """
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    groups = [ps.get_tp_group(), ps.get_pp_group()]
    pcp = getattr(ps, "_PCP", None)
    if pcp is not None:
        groups.append(ps.get_pcp_group())
    return all(g.rank_in_group == 0 for g in groups)


def kv_head_placement(vllm_config: Any) -> tuple[int, int, int]:
    """``(tp_rank, tp_size, total_kv_heads)`` of this worker (0.32 to 0.34):
    the KV digest keys heads by their global index. MLA caches hold one
    latent for every head (1); without initialized model-parallel groups (a
    single process, tests) the rank is 0."""
    from vllm.distributed import parallel_state as ps

    tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    rank = ps.get_tp_group().rank_in_group if ps.model_parallel_is_initialized() else 0
    model = getattr(vllm_config, "model_config", None)
    if model is None or getattr(model, "use_mla", False):
        return rank, tp_size, 1
    return rank, tp_size, int(model.get_total_num_kv_heads())


# vLLM's ROCm AITER FlashAttention backend reports get_name() "FLASH_ATTN":
# it is told apart by its class path (AttentionBackendEnum.ROCM_AITER_FA).
_AITER_FA_CLASS = "vllm.v1.attention.backends.rocm_aiter_fa.AiterFlashAttentionBackend"


def rocm_v_interleaved(backend_name: str | None, layer_object: Any) -> bool | None:
    """Whether a ROCm layer's V plane is interleaved ``[Hkv, N/x, D, x]``;
    None when the layer's pages are not ROCm paged-attention planes.

    ``ROCM_AITER_FA`` uses the planes only under the shuffle layout
    (``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT``, every release), with V interleaved.
    ``ROCM_ATTN`` always uses them; from 0.33 its V is interleaved once the
    fused QK-norm/RoPE/cache writer is enabled (``impl._use_interleaved_v_cache``,
    set by the compile pass, which runs before the caches are registered);
    0.32 has no such writer.
    """
    backend = getattr(layer_object, "attn_backend", None)
    path = f"{getattr(backend, '__module__', '')}.{getattr(backend, '__qualname__', '')}"
    if path == _AITER_FA_CLASS:
        from vllm._aiter_ops import rocm_aiter_ops

        return True if rocm_aiter_ops.is_shuffle_kv_cache_enabled() else None
    if backend_name == "ROCM_ATTN":
        impl = getattr(layer_object, "impl", None)
        return bool(getattr(impl, "_use_interleaved_v_cache", False))
    return None


def conv_state_layout() -> str:
    """The Mamba conv-state layout this process uses, "SD" or "DS" (0.32 to
    0.34: ``mamba_utils.get_conv_state_layout``, cached at its first call)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def simple_cpu_offload_pool_sized_by_name() -> bool:
    """The engine core of 0.33 and 0.34 sizes SimpleCPUOffloadConnector's
    scheduler-side CPU pool from its workers when it sees the name (with prefix
    caching); 0.32 has no such step."""
    return check_vllm_version() >= (0, 33)


def deepseek_v41_records_interleaved() -> bool:
    """Whether DeepSeek-V4.1's packed KV records (528 B MXFP8, 288 B NVFP4)
    keep each token's scales right after its own data, one row per token
    (0.33, 0.34: ``deepseek_v41/common/ops/fused_compress_quant_cache.py``
    ``scales = values + 512``), or put a page's data before its scales as the
    V4 record does (0.32: ``scales = page + CACHE_BLOCK * 512 + ...``)."""
    return check_vllm_version() >= (0, 33)


def kv_cache_access(inner_transfer_config: Any) -> Any:
    """How the inner connector's workers reach the device KV cache (0.34's
    ``KVCacheAccess`` flags), asked through ``KVConnectorFactory`` as vLLM asks
    a plain config, so the factory's own per-connector adjustments apply."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.kv_cache_access(inner_transfer_config)  # type: ignore[attr-defined]


def nvfp4_head_slot_layout_in_tree() -> bool:
    """Whether the installed vLLM ships the definition of MiniMax-M3's NVFP4
    page layout (``fmha_sm100``'s ``nvfp4_kv`` and ``interleave_v_scales``):
    0.33 and 0.34; 0.32's tree has only ``nvfp4_kv_cache_views``' docstring."""
    return check_vllm_version() >= (0, 33)
