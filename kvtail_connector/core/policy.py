"""What the wrapper does for one engine, resolved once from plain facts.

:func:`resolve_policy` turns the user's :class:`~kvtail_connector.config.KVTailConfig`,
two facts about the KV cache, the engine's role, what the inner connector's
adapter says about its loads and the vLLM release into one frozen
:class:`TailPolicy`. The scheduler and worker sides receive that object and
never look at the config, vLLM's config or the adapter to decide again. The
function is pure (no vLLM import), so every rule below is tested directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvtail_connector.config import KVTailConfig

ProducerHook = Literal["finish_forward", "wait_for_save"]


@dataclass(frozen=True)
class TailPolicy:
    """The wrapper's duties on this engine.

    Attributes:
        zeroes_tails: zero the stale tail of every completed async load.
        zeroes_failed_loads: zero a failed load's destination blocks from its
            first invalid block on (only where vLLM does not re-zero them).
        records_every_load: the scheduler ships every async load to the
            workers, block-aligned ones too (needed by ``zeroes_failed_loads``).
        zeroes_read_tails: zero the producer tail a MoRIIO READ copies in.
        excludes_reads: drop MoRIIO READ destinations from vLLM's
            ``new_block_ids_to_zero`` (the READ would race the zeroing); off
            on Mamba hybrids, where vLLM's MoRIIO drops them itself.
        zeroes_reads_by_layer: READs may land layer by layer (vLLM 0.32, outside
            FULL CUDA graphs): be ready to zero each layer's READ tail.
        holds_completions: keep completions whose zeroing has not executed out
            of ``finished_recving`` (transfers that bypass the worker's fence).
        probes: count stale bytes before zeroing (``probe_stale_tails``).
        vouches_for_tails: as a producer, zero each remote-decode prompt's tail and
            vouch for it in the request's ``kv_transfer_params``.
        producer_hook: the worker hook that zeroes those tails: the first one
            ordered after the step's last KV write and before the step's
            output leaves the worker (None when neither vouching nor
            digesting prompts).
        checks_claims: as a consumer, read producers' claims (counted as
            ``vouches_unused``, ``vouches_declined`` or, where skipped,
            ``vouched_tails``).
        trusts_load_claims: skip an async load's tail zeroing on a bound,
            matching claim (``vouch_tails: trust`` only: the saving is a
            share of a launch D makes anyway).
        trusts_read_claims: mark a MoRIIO READ whose bound claim matches
            (``trust``, or ``auto`` where READ tails may be zeroed per layer);
            the worker skips its zeroing under ``trust``, and under ``auto``
            only in a step whose READs are zeroed layer by layer (0.9-1.7 ms
            per step saved, benchmarks/RESULTS.md), not where one launch at
            start zeroes them all.
        digests_prompts: as a producer, digest each remote-decode prompt's KV
            in ``producer_hook`` and send the sums in its ``kvtail`` entry
            (``verify_kv: digest``).
        verifies_loads: as a consumer, digest what each async load wrote and
            compare it with the producer's sums (``verify_kv: digest``).
        verify_kv_off: why ``verify_kv: auto`` is off on this engine (what
            ``digest`` would be refused for), or None.
        digest_every: a producer digests one remote-decode prompt in this many
            (``verify_kv: sample``), 1 otherwise.
        digest_steps_aside: the digest was not asked for by name (``auto``,
            ``sample``, the default): a worker that cannot map its pages or
            build the digest turns it off instead of refusing to start, where
            nothing else needs the page maps (:attr:`maps_pages`).
    """

    zeroes_tails: bool
    zeroes_failed_loads: bool
    records_every_load: bool
    zeroes_read_tails: bool
    excludes_reads: bool
    zeroes_reads_by_layer: bool
    holds_completions: bool
    probes: bool
    vouches_for_tails: bool = False
    producer_hook: ProducerHook | None = None
    checks_claims: bool = False
    trusts_load_claims: bool = False
    trusts_read_claims: bool = False
    digests_prompts: bool = False
    verifies_loads: bool = False
    verify_kv_off: str | None = None
    digest_every: int = 1
    digest_steps_aside: bool = False

    @property
    def maps_pages(self) -> bool:
        """Whether workers zero anything (their page maps must exist: a layout
        they cannot map refuses start-up)."""
        return (
            self.zeroes_tails
            or self.zeroes_failed_loads
            or self.zeroes_read_tails
            or self.vouches_for_tails
        )

    @property
    def needs_caches(self) -> bool:
        """Whether workers zero or digest anything at all (and so map the KV caches)."""
        return self.maps_pages or self.digests_prompts or self.verifies_loads

    @property
    def runs_extras(self) -> bool:
        """Whether an opt-in feature is on (producer claims, KV verification):
        the assembly then wires in ``kvtail_connector.extras`` on either side."""
        return (
            self.vouches_for_tails
            or self.checks_claims
            or self.digests_prompts
            or self.verifies_loads
        )

    @property
    def trusts_some_claim(self) -> bool:
        """Some claim can make this consumer skip a zeroing."""
        return self.trusts_load_claims or self.trusts_read_claims

    @property
    def reports_worker_meta(self) -> bool:
        """Workers wrap their metadata every step (claims, digests, verdicts,
        false vouches the probe found)."""
        return (
            self.vouches_for_tails
            or self.digests_prompts
            or self.verifies_loads
            or (self.trusts_some_claim and self.probes)
        )


_VERIFY = "kv_connector_extra_config.verify_kv"


def _digest_duties(
    cfg: KVTailConfig,
    *,
    is_producer: bool,
    is_consumer: bool,
    sync_read: bool,
    carries_producer_tail: bool,
    producer_hook: ProducerHook | None,
    dcp_world_size: int,
    pipeline_parallel_size: int,
    prefill_context_parallel_size: int = 1,
) -> tuple[bool, bool, str | None]:
    """``(digests_prompts, verifies_loads, why_off)`` for ``verify_kv``; where
    the digest cannot work, ``digest`` is refused here, at start-up, never
    discovered per request, and ``auto`` turns both duties off (``why_off``:
    the reason, for the start-up line).

    Raises:
        ValueError: ``digest`` where it cannot work, naming
            ``kv_connector_extra_config.verify_kv`` and why.
    """
    if cfg.verify_kv == "off":
        return False, False, None
    refusal = None
    if not carries_producer_tail:
        refusal = (
            "the inner connector gives the consumer no per-request producer parameters taken "
            "after the producer's last prompt forward (store backends such as MooncakeStore, "
            "MoRIIO WRITE, a MultiConnector backend, NIXL with a host buffer: "
            'kv_buffer_device "cpu" on a GPU)'
        )
    elif sync_read and (is_consumer or cfg.verify_kv != "digest"):
        # A READ producer's digest could only be checked by a READ consumer,
        # which refuses it: by default the producer does not digest in vain.
        refusal = (
            "MoRIIO READ loads synchronously: the request's forward reads the KV in the step "
            "its READ lands, before any verdict could reach the scheduler"
        )
    elif dcp_world_size > 1:
        refusal = (
            f"decode context parallelism (size {dcp_world_size}) deals a segment's tokens "
            "over ranks, so no rank can compare a segment on its own"
        )
    elif pipeline_parallel_size > 1:
        refusal = (
            f"pipeline parallelism (size {pipeline_parallel_size}) gives each rank a subset "
            "of the layers a segment's sum covers"
        )
    elif is_producer and not is_consumer and prefill_context_parallel_size > 1:
        refusal = (
            f"prefill context parallelism (size {prefill_context_parallel_size}) runs a "
            "prompt on ranks that share a TP rank, so the producer's ranks would count its "
            "KV more than once"
        )
    elif is_producer and not is_consumer and producer_hook is None:
        refusal = (
            "no runner hook on this producer is ordered after the prompt's last KV write "
            "(a drafter writes draft KV past the prompt after the forward)"
        )
    if refusal is not None:
        if cfg.verify_kv in ("auto", "sample"):
            # On wherever it can work, off elsewhere (the start-up line says why).
            return False, False, refusal
        raise ValueError(
            f'{_VERIFY}: "digest" cannot work here: {refusal}. Set it to "auto" (on only '
            'where it can work) or "off".'
        )
    # kv_both with a drafter (a decode engine as vLLM's NIXL examples set it up)
    # or with prefill context parallelism (its ranks would each count a prompt;
    # PCP alone replicates the KV cache, so each still checks its own copy): it
    # verifies what it loads and digests nothing it sends.
    digests = is_producer and producer_hook is not None and prefill_context_parallel_size == 1
    return digests, is_consumer, None


def _refuse_without_extras(cfg: KVTailConfig) -> None:
    # "auto", the defaults (and "off") turn the features off without them;
    # anything else asks for them, "sample" set by name included.
    asked = [
        f"kv_connector_extra_config.{name}: {value!r}"
        for name, value in (
            ("vouch_tails", cfg.vouch_tails),
            ("verify_kv", cfg.verify_kv),
            ("entry_key_env", cfg.entry_key_env),
        )
        if value not in ("auto", "off", None)
        and not (name == "verify_kv" and name not in cfg.model_fields_set)
    ]
    if "verify_kv_every" in cfg.model_fields_set:
        asked.append(f"kv_connector_extra_config.verify_kv_every: {cfg.verify_kv_every}")
    if asked:
        raise ValueError(
            f"{'; '.join(asked)} needs the opt-in features (kvtail_connector/extras), which "
            "this installation of kvtail-connector does not hold: install the full package, "
            'or leave the setting out (vouch_tails "auto" and verify_kv "sample" turn off '
            "without them)."
        )


def resolve_policy(
    cfg: KVTailConfig,
    *,
    needs_zeroing: bool,
    has_mamba: bool,
    is_consumer: bool,
    sync_read: bool,
    writes_past_the_fence: bool,
    reads_may_land_per_layer: bool,
    is_producer: bool = False,
    carries_producer_tail: bool = False,
    producer_hook: ProducerHook | None = None,
    dcp_world_size: int = 1,
    pipeline_parallel_size: int = 1,
    prefill_context_parallel_size: int = 1,
    extras_installed: bool = True,
) -> TailPolicy:
    """The policy for one engine.

    Args:
        cfg: the user's settings.
        needs_zeroing: ``kv_cache_config.needs_kv_cache_zeroing`` (Mamba layers
            or mixed precision: vLLM zeroes new blocks, stale bytes can be NaN).
        has_mamba: ``kv_cache_config.has_mamba_layers``.
        is_consumer: the engine loads KV (``kv_role`` consumer or both).
        sync_read: the inner connector loads by synchronous READ (MoRIIO READ).
        writes_past_the_fence: the inner connector's transfers can start from
            the scheduler side, bypassing ``start_load_kv`` (MoRIIO WRITE).
        reads_may_land_per_layer: this vLLM waits for READs per layer (0.32).
        is_producer: the engine sends KV (``kv_role`` producer or both).
        carries_producer_tail: the inner connector's transfer copies the
            producer's whole blocks after the producer's step output (NIXL,
            MoRIIO READ): a tail the producer zeroed arrives zeroed.
        producer_hook: the runner's hook ordered after the last prompt KV
            write and before the step's output (``_compat.producer_tail_hook``;
            None where no hook is, e.g. a drafter writes KV past the prompt).
        dcp_world_size, pipeline_parallel_size: this engine's DCP and PP sizes
            (``verify_kv`` needs both to be 1).
        prefill_context_parallel_size: this engine's PCP size (a producer's
            ``verify_kv`` needs 1).
        extras_installed: the package holds ``kvtail_connector.extras``
            (producer claims, KV verification); without it ``auto`` turns
            them off and an explicit setting is refused.

    Raises:
        ValueError: ``verify_kv: digest`` where it cannot work (see
            :func:`_digest_duties`); a setting that needs the extras where
            they are not installed.
    """
    without_extras = None
    if not extras_installed:
        _refuse_without_extras(cfg)
        if cfg.verify_kv in ("auto", "sample"):
            without_extras = "kvtail_connector/extras is not installed"
        cfg = cfg.model_copy(update={"vouch_tails": "off", "verify_kv": "off"})
    zero = cfg.zero_tails == "always" or (cfg.zero_tails == "auto" and needs_zeroing)
    # vLLM re-zeroes a failed load's blocks itself whenever it zeroes at all
    # (Scheduler._update_waiting_for_remote_kv, 0.32 and 0.33).
    zero_failed = zero and not needs_zeroing
    # A READ copies the producer's tail into blocks kept from vLLM's zeroing (by
    # the wrapper, or by vLLM itself on Mamba hybrids): on a model vLLM zeroes
    # the wrapper zeroes those tails whatever zero_tails says, so no setting
    # leaves less zeroed than vLLM would.
    zero_reads = sync_read and is_consumer and (zero or needs_zeroing)
    # Tails matter wherever this config has a consumer zero them (tails or READ
    # tails): the producer runs the same model and settings. Under "auto" a
    # claim pays only where a consumer with these settings skips on it (READ
    # tails zeroed layer by layer): elsewhere it zeroes anyway, and the
    # producer's zeroing is most of the wrapper's own CPU time on a CPU
    # prefill engine (benchmarks/RESULTS.md, section 5).
    claims_used = cfg.vouch_tails == "trust" or (sync_read and reads_may_land_per_layer)
    vouch = (
        claims_used
        and is_producer
        and carries_producer_tail
        and producer_hook is not None
        and (zero or (needs_zeroing and sync_read))
    )
    digest, verify, verify_off = _digest_duties(
        cfg,
        is_producer=is_producer,
        is_consumer=is_consumer,
        sync_read=sync_read,
        carries_producer_tail=carries_producer_tail,
        producer_hook=producer_hook,
        dcp_world_size=dcp_world_size,
        pipeline_parallel_size=pipeline_parallel_size,
        prefill_context_parallel_size=prefill_context_parallel_size,
    )
    check = cfg.vouch_tails != "off" and is_consumer and carries_producer_tail
    by_layer = zero_reads and reads_may_land_per_layer
    return TailPolicy(
        zeroes_tails=zero,
        zeroes_failed_loads=zero_failed,
        records_every_load=zero_failed,
        zeroes_read_tails=zero_reads,
        # On Mamba hybrids vLLM's MoRIIO drops the READ destinations of every
        # attention group itself (0.32/0.33 allow one, 0.34 several), and Mamba
        # pages are never on the list (only attention groups record new blocks).
        excludes_reads=sync_read and needs_zeroing and not has_mamba,
        zeroes_reads_by_layer=by_layer,
        # Neither runner orders every completion after the zeroing launched
        # with it (V2's post_forward, V1's no-forward steps); only transfers
        # started past the fence can overtake it.
        holds_completions=writes_past_the_fence,
        probes=cfg.probe_stale_tails,
        vouches_for_tails=vouch,
        producer_hook=producer_hook if vouch or digest else None,
        checks_claims=check,
        trusts_load_claims=check and cfg.vouch_tails == "trust",
        trusts_read_claims=check and (cfg.vouch_tails == "trust" or by_layer),
        digests_prompts=digest,
        verifies_loads=verify,
        verify_kv_off=verify_off or without_extras,
        digest_every=cfg.verify_kv_every if cfg.verify_kv == "sample" else 1,
        digest_steps_aside=cfg.verify_kv != "digest",
    )
