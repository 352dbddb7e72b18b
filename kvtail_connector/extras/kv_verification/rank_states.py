"""Worker side of ``verify_kv`` for state groups (Mamba, linear attention).

A hybrid model's state groups hold one state per request, not one slot per
token. After P's forward the state of each remote-decode prompt is in the
block vLLM's transfer sends (the running-state block,
:func:`~kvtail_connector.core.kvgroups.state_block`); D's load writes that block.
P digests it in the producer hook (:meth:`RankStates.digest_prompts`), D
digests what the load wrote before anything reads it
(:meth:`RankStates.check_loads`), holds the completion until the sums are on
the host and compares its own TP shard's sum with P's shard of the same rank
(:meth:`RankStates.release`); the definition is in
``ops/state_digest/reference.py``. On CUDA a digest call is one kernel launch
that waits for nothing: its sums reach the host behind an event (``_launch``).
The sums are keyed by group, layer, state and word, and the TP shard: the
signature covers the layers' state shapes and dtypes and the TP size, so
equal signatures mean the same shard layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from kvtail_connector.core.kvgroups import GroupInfo, layer_spec
from kvtail_connector.core.metadata import NULL_BLOCK
from kvtail_connector.extras import entry_values
from kvtail_connector.extras.kv_verification.held_checks import HeldChecks
from kvtail_connector.extras.metadata import (
    MISMATCH,
    UNVERIFIED,
    VERIFIED,
    CheckedLoad,
    Compared,
    StatePart,
)
from kvtail_connector.extras.ops.state_digest import (
    STATE_ALGORITHM,
    StateDigester,
    StateLayer,
    as_u64,
)
from kvtail_connector.log import get_logger

logger = get_logger(__name__)


@dataclass
class StateSet:
    """One state group's layers on this rank.

    Attributes:
        group_id: the KV cache group.
        layers: per layer, its pages and states.
        layer_names: the layers, for messages.
        layout: per layer, its states' shapes and dtypes (the signature).
    """

    group_id: int
    layers: list[StateLayer]
    layer_names: list[str]
    layout: list[str]


def state_sets(
    kv_caches: Mapping[str, Any], kv_cache_config: Any, groups: tuple[GroupInfo, ...]
) -> list[StateSet]:
    """The state groups whose every layer this worker holds as a ``[B, 1, 1,
    C]`` page view (vLLM 0.32 / 0.33 ``create_kv_cache_views`` of a
    ``MambaSpec``) with room for its states; others are left out (logged)."""
    sets = []
    for info in groups:
        if info.state_scratch is None:
            continue
        group = kv_cache_config.kv_cache_groups[info.group_id]
        layers: list[StateLayer] = []
        layout: list[str] = []
        for name in group.layer_names:
            view = kv_caches.get(name)
            spec = layer_spec(group.kv_cache_spec, name)
            shapes = getattr(spec, "shapes", None)
            dtypes = getattr(spec, "dtypes", None)
            if (
                not isinstance(view, torch.Tensor)
                or view.dim() != 4
                or tuple(view.shape[1:3]) != (1, 1)
                or view.element_size() != 1
                or shapes is None
                or dtypes is None
            ):
                break
            states = []
            offset = 0
            for shape, dtype in zip(shapes, dtypes, strict=True):
                nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
                states.append((offset, nbytes))
                offset += nbytes
            if offset > int(view.shape[3]):
                break
            pages = view[:, 0, 0, :].view(torch.uint8)
            layers.append(StateLayer(pages, tuple(states)))
            layout.append(f"{[tuple(s) for s in shapes]}:{[str(d) for d in dtypes]}")
        else:
            sets.append(StateSet(info.group_id, layers, list(group.layer_names), layout))
            continue
        logger.info(
            "KVTailConnector: verify_kv: state group %d not digested (a layer without a "
            "state page view on this worker)",
            info.group_id,
        )
    return sets


@dataclass
class _Check:
    """A consumer's state digest of one load, on its way to the host."""

    record: CheckedLoad
    sums: Any  # int64 [groups] (host tensor, valid once event fired)
    event: Any  # CUDA event, or None
    groups: tuple[int, ...]  # the groups compared
    passes: int = 0


class RankStates:
    """This rank's state groups: a producer's digests, a consumer's checks.

    Args:
        sets: the rank's state sets (:func:`state_sets`).
        tp_rank, tp_size: this rank in its TP group (the shard key).
    """

    def __init__(self, sets: Sequence[StateSet], tp_rank: int = 0, tp_size: int = 1) -> None:
        self.group_ids = tuple(s.group_id for s in sets)
        self.shard = tp_rank
        self._digester = StateDigester([(s.group_id, s.layers) for s in sets], tp_rank)
        parts = [f"t{tp_size}"] + [f"g{s.group_id}:{'|'.join(s.layout)}" for s in sets]
        self.signature = hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]
        self._checks: HeldChecks[_Check] = HeldChecks(self._compare)

    def __bool__(self) -> bool:
        return bool(self.group_ids)

    # -------------------------------------------------------------- producer

    def digest_prompts(self, records: Sequence[CheckedLoad]) -> dict[str, StatePart]:
        """The state sums of each record (one pass over the state groups);
        they resolve when read (after a non-blocking copy on CUDA)."""
        todo = [r for r in records if r.states]
        if not todo:
            return {}
        host, event = self._launch([self._blocks(r) for r in todo])
        out = {}
        for i, r in enumerate(todo):
            have = {load.group for load in r.states if load.block_ids[0] != NULL_BLOCK}
            out[r.req_id] = StatePart(
                STATE_ALGORITHM,
                self.signature,
                resolve=_Resolve(host, event, i, self.group_ids, have, self.shard),
            )
        return out

    # -------------------------------------------------------------- consumer

    def check_loads(self, records: Iterable[CheckedLoad]) -> None:
        """Digest the state blocks of completed loads whose producer sent a
        state digest, and hold them until :meth:`release`; a load whose
        digest was made on another layout gets no comparison (not verified)."""
        todo: list[tuple[CheckedLoad, tuple[int, ...]]] = []
        for r in records:
            expected = r.expected
            states = expected.digest.states if expected is not None else None
            if states is None or not r.states:
                continue
            if states.algorithm != STATE_ALGORITHM or states.signature != self.signature:
                logger.debug("kvtail: %s: state digest of another algorithm or layout", r.req_id)
                self._checks.decide(r.req_id, UNVERIFIED)
                continue
            groups = tuple(
                load.group
                for load in r.states
                if load.block_ids[0] != NULL_BLOCK
                and load.group in self.group_ids
                and self.shard in states.sums.get(load.group, {})
            )
            if not groups:
                self._checks.decide(r.req_id, UNVERIFIED)
                continue
            todo.append((r, groups))
        if not todo:
            return
        host, event = self._launch([self._blocks(r, groups) for r, groups in todo])
        for i, (r, groups) in enumerate(todo):
            self._checks.hold(r.req_id, _Check(r, host[i], event, groups))

    def release(self) -> tuple[set[str], set[str]]:
        """``(finished, mismatched)`` as :meth:`RankDigests.release`."""
        return self._checks.release()

    def reported(self) -> None:
        self._checks.reported()

    def drop_held(self) -> set[str]:
        return self._checks.drop_held()

    def take_verdicts(self) -> dict[str, str]:
        return self._checks.take_verdicts()

    def take_differs(self) -> dict[str, str]:
        return self._checks.take_differs()

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._checks

    @property
    def held(self) -> set[str]:
        return self._checks.held

    @property
    def num_tracked(self) -> int:
        return self._checks.num_tracked

    # --------------------------------------------------------------- helpers

    def _blocks(self, record: CheckedLoad, only: Sequence[int] | None = None) -> list[int | None]:
        by_group = {
            load.group: load.block_ids[0]
            for load in record.states
            if load.block_ids[0] != NULL_BLOCK and (only is None or load.group in only)
        }
        return [by_group.get(g) for g in self.group_ids]

    def _launch(self, blocks: list[list[int | None]]) -> tuple[torch.Tensor, Any]:
        sums = self._digester.digest(blocks)
        if sums.device.type != "cuda":
            return sums, None
        host = torch.empty(sums.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _compare(self, check: _Check) -> Compared:
        record = check.record
        assert record.expected is not None and record.expected.digest.states is not None
        theirs = record.expected.digest.states.sums
        for gid in check.groups:
            mine = as_u64(int(check.sums[self.group_ids.index(gid)]))
            if mine != theirs[gid][self.shard]:
                differs = (
                    f"the Mamba / linear-attention state: state group {gid}, TP shard {self.shard}"
                )
                logger.debug("kvtail: %s: %s differs", record.req_id, differs)
                return Compared(MISMATCH, differs)
        return Compared(VERIFIED)


class _Resolve:
    """A producer's state sums of one request, read when first asked."""

    def __init__(
        self,
        host: torch.Tensor,
        event: Any,
        index: int,
        group_ids: tuple[int, ...],
        have: set[int],
        shard: int,
    ) -> None:
        self._host, self._event, self._index = host, event, index
        self._group_ids, self._have, self._shard = group_ids, have, shard

    def __call__(self) -> entry_values.StateSums:
        if self._event is not None:
            self._event.synchronize()
        row = self._host[self._index].tolist()
        return {
            g: {self._shard: as_u64(int(v))}
            for g, v in zip(self._group_ids, row, strict=True)
            if g in self._have
        }
