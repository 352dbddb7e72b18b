"""Keep a load's completion from the scheduler until its zeroing has executed.

The scheduler may free, reuse and hand a block to a new owner as soon as it
sees the load finished. Where a new owner's KV can arrive without passing the
worker's ``start_load_kv`` fence (MoRIIO WRITE: the consumer's *scheduler*
tells the producer to write, from ``update_state_after_alloc``), a completion can
reach the scheduler before the zeroing launched with it has run on the device
(vLLM's V2 model runner copies the step's output before the connector's
``post_forward``; both runners' no-forward steps return without a device
sync), and an old owner's tail zeroing could land after the new owner's
tokens and wipe them. Holding the completion until the zeroing's CUDA event
has fired closes that window at the price of one step of latency for those
requests only; no host thread ever blocks on it unless a hold outlives
:data:`MAX_PASSES`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Passes a completion may be held before the hold synchronizes on its event.
MAX_PASSES = 8


@dataclass
class _Held:
    event: Any  # torch.cuda.Event: recorded behind the zeroing launch
    failed: bool
    passes: int = 0


class CompletionHold:
    """Completions withheld from ``finished_recving`` until their event fired."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        # Released since the caller last said its results reached vLLM
        # (:meth:`reported`): a failure in between must still report them.
        self._unreported: set[str] = set()

    def withhold(self, req_ids: Iterable[str], failed: set[str], event: Any) -> None:
        for req_id in req_ids:
            self._held[req_id] = _Held(event, req_id in failed)

    def release(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)``: held completions whose zeroing has executed
        (after :data:`MAX_PASSES` passes, waited for)."""
        finished: set[str] = set()
        failed: set[str] = set()
        for req_id, held in self._held.items():
            held.passes += 1
            if not held.event.query():
                if held.passes < MAX_PASSES:
                    continue
                held.event.synchronize()
            finished.add(req_id)
            if held.failed:
                failed.add(req_id)
        # Removed only once every one is decided: if deciding raises, every
        # completion is still held, for the caller's fallback to report.
        for req_id in finished:
            del self._held[req_id]
        self._unreported.update(finished)
        return finished, failed

    def reported(self) -> None:
        """What :meth:`release` returned has reached vLLM."""
        self._unreported.clear()

    def drain(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)``: every held completion, after its zeroing
        has executed (waited for), and every one released since the last
        :meth:`reported` (a failed pass never returned them to vLLM)."""
        for held in self._held.values():
            held.event.synchronize()
        finished = set(self._held) | self._unreported
        failed = {r for r, h in self._held.items() if h.failed}
        self._held.clear()
        self._unreported.clear()
        return finished, failed

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._held
