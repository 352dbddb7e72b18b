"""Host-to-device staging of small int64 tables through pinned memory.

Allocating pinned memory per call costs ~170 µs (vLLM's ``async_tensor_h2d``);
reusing a fixed buffer while an earlier copy may still read it corrupts that
launch's input (vLLM #48085). Two classes here avoid both:

- :class:`PinnedStaging` hands out consecutive regions of one pinned arena,
  split in two halves; a half is refilled only after every copy out of it has
  completed (events recorded behind the copies), so in steady state it
  allocates nothing and waits for nothing.
- :class:`GraphSlots` keeps a few fixed (pinned, device) buffer pairs with one
  CUDA graph each (copy + launch); a slot is reused once its event fired.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# int64 entries per half of the arena (256 KiB each).
_HALF_CAPACITY = 1 << 15


class PinnedStaging:
    """Copy int64 tables to ``device`` on the current stream, asynchronously."""

    def __init__(self, device: torch.device, half_capacity: int = _HALF_CAPACITY) -> None:
        self._device = device
        self._alloc(half_capacity)

    def _alloc(self, half_capacity: int) -> None:
        self._half = half_capacity
        self._host = torch.empty(2 * half_capacity, dtype=torch.int64, pin_memory=True)
        self._np = self._host.numpy()
        self._current, self._offset = 0, 0
        self._events: tuple[list[torch.cuda.Event], list[torch.cuda.Event]] = ([], [])
        self._spare: list[torch.cuda.Event] = []

    def _switch_half(self) -> None:
        # Every copy out of the other half must be done before it is refilled;
        # they were enqueued long ago, so this rarely waits.
        self._current ^= 1
        self._offset = 0
        events = self._events[self._current]
        for event in events:
            event.synchronize()
        self._spare.extend(events)
        events.clear()

    def to_device(self, table: np.ndarray) -> torch.Tensor:
        """A device copy of ``table``, ordered on the current stream."""
        n = table.size
        if n > self._half:
            for events in self._events:
                for event in events:
                    event.synchronize()
            self._alloc(1 << (n - 1).bit_length())
        if self._offset + n > self._half:
            self._switch_half()
        start = self._current * self._half + self._offset
        self._np[start : start + n] = table.reshape(-1)
        out = torch.empty(table.shape, dtype=torch.int64, device=self._device)
        out.view(-1).copy_(self._host[start : start + n], non_blocking=True)
        event = self._spare.pop() if self._spare else torch.cuda.Event()
        event.record()
        self._events[self._current].append(event)
        self._offset += n
        return out


@dataclass
class _Slot:
    host: torch.Tensor  # pinned; the graph's copy source
    device: torch.Tensor  # the graph's copy destination and kernel input
    graph: torch.cuda.CUDAGraph
    done: torch.cuda.Event  # recorded behind the slot's last replay
    recorded_by_graph: bool  # the graph records ``done`` itself (an event node)
    host_bytes: memoryview  # host's bytes (written without numpy)


def _graph_event() -> torch.cuda.Event | None:
    """An event a captured graph can record as a node of its own, or None
    where this torch cannot (``external`` events, torch >= 2.6)."""
    try:
        return torch.cuda.Event(external=True)
    except TypeError:
        return None


class GraphSlots:
    """Fixed work buffers, each replayed by a CUDA graph of (H2D copy, launch).

    ``launch(device_buffer)`` must enqueue only work whose arguments do not
    change between calls (the kernel reads its sizes from the buffer).
    """

    def __init__(
        self,
        device: torch.device,
        entries: int,
        launch: Callable[[torch.Tensor], None],
        slots: int = 4,
    ) -> None:
        self.entries = entries
        self._slots: list[_Slot] = []
        self._next = 0
        for _ in range(slots):
            host = torch.zeros(entries, dtype=torch.int64, pin_memory=True)
            dev = torch.zeros(entries, dtype=torch.int64, device=device)
            graph = torch.cuda.CUDAGraph()
            # Recorded inside the graph where torch allows it: a host-side
            # record costs about as much as the replay itself (~9 µs, H200).
            done = _graph_event()
            with torch.cuda.graph(graph):
                dev.copy_(host, non_blocking=True)
                launch(dev)
                if done is not None:
                    done.record()
            in_graph = done is not None
            if done is None:
                done = torch.cuda.Event()
                done.record()
            host_bytes = host.numpy().data.cast("B")
            self._slots.append(_Slot(host, dev, graph, done, in_graph, host_bytes))

    def next_bytes(self) -> memoryview:
        """The bytes of the pinned buffer :meth:`replay` copies next, once free
        (the copy out of it by the slot's last replay has completed)."""
        slot = self._slots[self._next]
        if not slot.done.query():
            slot.done.synchronize()
        return slot.host_bytes

    def replay(self) -> torch.cuda.Event:
        """Replay the slot :meth:`next_bytes` handed out (copy, launch);
        returns the event behind it."""
        slot = self._slots[self._next]
        slot.graph.replay()
        if not slot.recorded_by_graph:
            slot.done.record()
        self._next = (self._next + 1) % len(self._slots)
        return slot.done
