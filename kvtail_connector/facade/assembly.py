"""How a ``KVTailConnector`` is built: :func:`assemble`, once per connector.

In the order data flows: the config (parsed once, with the inner class, by
:func:`kvtail_connector.facade.inner.resolve`) -> the inner connector (its children,
adapter, name-keyed start-up checks and HMA check, then built) -> the facts
vLLM's config and the adapter state about this engine -> the policy
(:func:`~kvtail_connector.core.policy.resolve_policy`) -> one side, the
:class:`~kvtail_connector.core.scheduler.TailScheduler` or the
:class:`~kvtail_connector.core.worker.TailWorker`. Every refusal is raised here, at
start-up, before any hook runs; the facade keeps only what its hooks use.

This is the one place the opt-in features (``kvtail_connector.extras``) are
wired in, imported only where the policy turns one on: a package without
that folder runs the core, and refuses the settings that need it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    supports_hma,
)

from kvtail_connector import _compat
from kvtail_connector.config import KVTailConfig
from kvtail_connector.connectors import InnerAdapter
from kvtail_connector.core.extension import SchedulerExtra, WorkerExtra
from kvtail_connector.core.kvgroups import GroupInfo, group_infos
from kvtail_connector.core.parts.records import LoadRecords
from kvtail_connector.core.parts.zeroing import RankCaches, RankPlacement
from kvtail_connector.core.policy import ProducerHook, TailPolicy, resolve_policy
from kvtail_connector.core.scheduler import TailScheduler
from kvtail_connector.core.stats import KVTailStats, connector_path
from kvtail_connector.core.worker import TailWorker
from kvtail_connector.facade import name_keyed
from kvtail_connector.facade.inner import (
    BACKEND_FIELD,
    Resolved,
    build_inner,
    build_inner_adapter,
    children_of,
    hma_blocker,
    resolve,
)
from kvtail_connector.log import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = get_logger(__name__)


@dataclass(frozen=True)
class Assembled:
    """What the facade's hooks use; exactly one of ``scheduler`` and ``worker`` is set.

    Attributes:
        cfg: the wrapper's settings.
        inner: the inner connector, built.
        inner_supports_hma: its class implements ``SupportsHMA``
            (``request_finished_all_groups``).
        policy: the wrapper's duties on this engine.
        stats: the counters both the facade and the side write.
        sync_read: the inner connector loads by synchronous READ (MoRIIO
            READ): READ tails are zeroed after ``start_load_kv`` or per layer.
        scheduler: the scheduler side (role SCHEDULER), else None.
        worker: the worker side (role WORKER), else None.
    """

    cfg: KVTailConfig
    inner: KVConnectorBase_V1
    inner_supports_hma: bool
    policy: TailPolicy
    stats: KVTailStats
    sync_read: bool
    scheduler: TailScheduler | None
    worker: TailWorker | None


@dataclass(frozen=True)
class PolicyFacts:
    """What vLLM's config and the inner connector's adapter say about this
    engine: the arguments of :func:`~kvtail_connector.core.policy.resolve_policy`
    beside the user's config (each field is the parameter of that name)."""

    needs_zeroing: bool
    has_mamba: bool
    is_consumer: bool
    sync_read: bool
    writes_past_the_fence: bool
    reads_may_land_per_layer: bool
    is_producer: bool
    carries_producer_tail: bool
    producer_hook: ProducerHook | None
    dcp_world_size: int
    pipeline_parallel_size: int
    prefill_context_parallel_size: int


def assemble(
    vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
) -> Assembled:
    """Build the wrapper's parts for ``role``: config -> inner -> facts -> policy -> one side.

    Raises:
        ValueError: a setting, an inner connector or an engine the wrapper
            cannot run with, naming the field and the fix.
        ImportError: a missing transport, naming the extra to install.
    """
    assert vllm_config.kv_transfer_config is not None, "checked by the base class"
    resolved = resolve(vllm_config.kv_transfer_config)
    cfg = resolved.cfg
    extras = extras_installed()
    entry_key = _entry_key(cfg) if extras else None
    adapter, inner = _inner(resolved, vllm_config, role, kv_cache_config)
    facts = _policy_facts(vllm_config, kv_cache_config, adapter)
    policy = resolve_policy(cfg, **dataclasses.asdict(facts), extras_installed=extras)
    # Said at start-up: an auto producer that does not vouch where trust would.
    trust_would_vouch = (
        extras
        and cfg.vouch_tails == "auto"
        and resolve_policy(
            cfg.model_copy(update={"vouch_tails": "trust"}),
            **dataclasses.asdict(facts),
            extras_installed=extras,
        ).vouches_for_tails
    )
    stats = KVTailStats(inner_connector=connector_path(resolved.inner_cls))
    scheduler, worker = _one_side(
        vllm_config, role, kv_cache_config, inner, adapter, policy, stats, entry_key
    )
    logger.info(
        "KVTailConnector (%s) wrapping %s: zero_tails=%s (model needs zeroing: %s) -> %s; "
        "probe_stale_tails=%s; vouch_tails=%s -> %s; verify_kv=%s -> %s",
        role.name.lower(),
        cfg.backend,
        cfg.zero_tails,
        facts.needs_zeroing,
        "zeroing tails" if policy.zeroes_tails else "not zeroing tails",
        cfg.probe_stale_tails,
        cfg.vouch_tails,
        _vouch_summary(policy, trust_would_vouch),
        cfg.verify_kv,
        _verify_summary(policy),
    )
    return Assembled(
        cfg=cfg,
        inner=inner,
        inner_supports_hma=supports_hma(resolved.inner_cls),
        policy=policy,
        stats=stats,
        sync_read=adapter.sync_read,
        scheduler=scheduler,
        worker=worker,
    )


def _inner(
    resolved: Resolved, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any
) -> tuple[InnerAdapter, KVConnectorBase_V1]:
    """The inner connector's adapter, then the connector itself, once every
    start-up check has passed."""
    cfg, transfer_config = resolved.cfg, resolved.inner_transfer_config
    label = f"{BACKEND_FIELD} ({cfg.backend})"
    # An inner MultiConnector: each child gets its own adapter, at its index.
    children = children_of(resolved.inner_cls, transfer_config)
    adapter = build_inner_adapter(resolved.inner_cls, transfer_config, children)
    adapter.validate(vllm_config, cfg.backend)
    # vLLM's rules keyed on the connector's name see "KVTailConnector":
    # apply them to the inner one (and its MultiConnector children).
    name_keyed.check_start_up(
        vllm_config,
        transfer_config,
        label,
        children=[(c.label, c.transfer_config.kv_connector) for c in children],
        has_mamba=bool(kv_cache_config.has_mamba_layers),
        is_worker=role == KVConnectorRole.WORKER,
        kv_block_size=min(
            (int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups),
            default=None,
        ),
    )
    if not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        blocker = hma_blocker(label, transfer_config, children)
        if blocker is not None:
            raise ValueError(
                f"{blocker}: does not support the hybrid KV cache manager (HMA), which is "
                "on. vLLM turns HMA off by itself only for a top-level connector without "
                "it, and the top level here is KVTailConnector: pass "
                "--disable-hybrid-kv-cache-manager."
            )
    return adapter, build_inner(resolved, vllm_config, role, kv_cache_config)


def _policy_facts(vllm_config: Any, kv_cache_config: Any, adapter: InnerAdapter) -> PolicyFacts:
    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    return PolicyFacts(
        needs_zeroing=bool(kv_cache_config.needs_kv_cache_zeroing),
        has_mamba=bool(kv_cache_config.has_mamba_layers),
        is_consumer=bool(transfer.is_kv_consumer),
        sync_read=adapter.sync_read,
        writes_past_the_fence=adapter.writes_past_the_fence,
        reads_may_land_per_layer=_compat.moriio_reads_may_land_per_layer(),
        is_producer=bool(transfer.is_kv_producer),
        carries_producer_tail=adapter.carries_producer_tail(vllm_config),
        producer_hook=cast("ProducerHook | None", _compat.producer_tail_hook(vllm_config)),
        dcp_world_size=_compat.dcp_world_size(parallel),
        pipeline_parallel_size=int(parallel.pipeline_parallel_size),
        prefill_context_parallel_size=_compat.pcp_world_size(parallel),
    )


def _one_side(
    vllm_config: Any,
    role: KVConnectorRole,
    kv_cache_config: Any,
    inner: KVConnectorBase_V1,
    adapter: InnerAdapter,
    policy: TailPolicy,
    stats: KVTailStats,
    entry_key: bytes | None,
) -> tuple[TailScheduler | None, TailWorker | None]:
    """The side ``role`` runs, over this rank's view of the KV cache groups."""
    parallel = vllm_config.parallel_config
    dcp_rank, dcp_world = _compat.dcp_rank_and_world(_compat.dcp_world_size(parallel), role)
    groups = group_infos(kv_cache_config, dcp_world)
    if role == KVConnectorRole.SCHEDULER:
        records = LoadRecords(inner, groups, records_every_load=policy.records_every_load)
        extra = (
            _scheduler_extra(
                vllm_config, kv_cache_config, groups, dcp_world, records, policy, stats, entry_key
            )
            if policy.runs_extras
            else None
        )
        scheduler = TailScheduler(
            inner, groups, policy, adapter=adapter, stats=stats, records=records, extra=extra
        )
        return scheduler, None
    placement = RankPlacement(dcp_rank, dcp_world, _compat.dcp_interleave_size(parallel))
    worker = build_worker(
        groups,
        placement,
        policy,
        counts_requests=_compat.counts_requests_on_this_rank(),
        rank=_compat.worker_rank(),
        stats=stats,
        heads=(
            _compat.kv_head_placement(vllm_config)
            if policy.digests_prompts or policy.verifies_loads
            else None
        ),
    )
    return None, worker


# ---------------------------------------------------------------- the extras


def extras_installed() -> bool:
    """Whether this package holds the opt-in features (``kvtail_connector.extras``)."""
    return importlib.util.find_spec("kvtail_connector.extras") is not None


def _entry_key(cfg: KVTailConfig) -> bytes | None:
    from kvtail_connector.extras import trust

    return trust.key_from_env(cfg.entry_key_env)  # refused here when named but unset


def _scheduler_extra(
    vllm_config: Any,
    kv_cache_config: Any,
    groups: tuple[GroupInfo, ...],
    dcp_world: int,
    records: LoadRecords,
    policy: TailPolicy,
    stats: KVTailStats,
    entry_key: bytes | None,
) -> SchedulerExtra:
    from kvtail_connector.extras import entry_values
    from kvtail_connector.extras.scheduler import EntryFeatures

    parallel = vllm_config.parallel_config
    specs = [kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec for g in groups]
    geometry = entry_values.geometry(
        [spec for spec, g in zip(specs, groups, strict=True) if g.has_tails],
        dcp_world,
        _compat.dcp_interleave_size(parallel),
    )
    return EntryFeatures(
        records,
        policy,
        stats,
        geometry=geometry,
        num_workers=_compat.worker_count(parallel),
        limits=entry_values.Limits(
            max_tokens=int(vllm_config.model_config.max_model_len),
            num_groups=len(kv_cache_config.kv_cache_groups),
            num_kv_heads=_compat.kv_head_placement(vllm_config)[2],
        ),
        min_block_size=min((int(s.block_size) for s in specs), default=16),
        key=entry_key,
    )


def build_worker(
    groups: tuple[GroupInfo, ...],
    placement: RankPlacement,
    policy: TailPolicy,
    *,
    counts_requests: bool = True,
    rank: int = 0,
    stats: KVTailStats,
    heads: tuple[int, int, int] | None = None,
) -> TailWorker:
    """The worker side, with the opt-in features' half where the policy
    turns one on (``heads``: this rank's ``(tp_rank, tp_size, num_kv_heads)``,
    for ``verify_kv``)."""
    make_extra = None
    if policy.runs_extras:
        from kvtail_connector.extras.kv_verification.placement import HeadPlacement
        from kvtail_connector.extras.worker import EntryFeaturesWorker

        placement_of_heads = HeadPlacement(*heads) if heads is not None else HeadPlacement()

        def make_extra(caches: RankCaches) -> WorkerExtra:
            return EntryFeaturesWorker(caches, policy, rank_id=rank, heads=placement_of_heads)

    return TailWorker(
        groups,
        placement,
        policy,
        counts_requests=counts_requests,
        rank=rank,
        stats=stats,
        extra=make_extra,
    )


def _vouch_summary(policy: TailPolicy, trust_would_vouch: bool) -> str:
    parts = []
    if policy.vouches_for_tails:
        parts.append(f"vouching for prompt tails (zeroed in {policy.producer_hook})")
    if policy.trusts_load_claims:
        parts.append("trusting bound producer claims")
    elif policy.trusts_read_claims:
        parts.append("trusting bound producer claims on per-layer READ tails only")
    elif policy.checks_claims:
        parts.append("checking producer claims, zeroing every tail")
    if parts:
        return ", ".join(parts)
    if trust_would_vouch:
        return "not vouching (an auto consumer would not use the claims; trust vouches)"
    return "no claims made or trusted"


def _verify_summary(policy: TailPolicy) -> str:
    parts = []
    if policy.digests_prompts:
        every = "" if policy.digest_every == 1 else f" one in {policy.digest_every}"
        parts.append(f"digesting remote-decode prompts{every} (in {policy.producer_hook})")
    if policy.verifies_loads:
        parts.append("verifying loads against the producer's digest")
    if policy.verify_kv_off is not None:
        parts.append(f"off here: {policy.verify_kv_off}")
    return ", ".join(parts) or "nothing digested"
