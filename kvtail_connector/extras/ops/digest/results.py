"""What :meth:`KVDigester.digest <kvtail_connector.extras.ops.digest.launcher.KVDigester.digest>`
returns: :class:`PendingDigest` (the sums on their way to the host) and, per request and group,
a :class:`GroupDigest`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class GroupDigest:
    """One request's sums in one group.

    Attributes:
        heads: the global KV heads this rank counted, ascending.
        sums: uint64 ``[len(heads), ceil(end / segment)]``; column ``s`` sums
            tokens ``[s * segment, (s + 1) * segment)`` of the span (0 where
            the span has none of them).
    """

    heads: tuple[int, ...]
    sums: np.ndarray

    def by_head(self) -> dict[int, list[int]]:
        return dict(zip(self.heads, self.sums.tolist(), strict=True))


@dataclass
class DigestLayout:
    """Where each (request, group) span's cells are in the output."""

    spans: list[list[tuple[int, int, tuple[int, ...]] | None]]  # (offset, n_seg, heads)


class PendingDigest:
    """The sums of one :meth:`KVDigester.digest` call, on their way to the host.

    ``event`` (CUDA) fires once the sums are in pinned host memory;
    :meth:`ready` polls it, :meth:`result` waits for it.
    """

    def __init__(
        self,
        host: torch.Tensor,
        event: torch.cuda.Event | None,
        layout: DigestLayout,
        launched: bool,
    ) -> None:
        self._host = host
        self.event = event
        self._layout = layout
        self.launched = launched
        self._result: list[list[GroupDigest | None]] | None = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> list[list[GroupDigest | None]]:
        """Per request, per group: its :class:`GroupDigest`, or None where the
        request had no span in the group. Waits for the event; read once
        (later calls return the same lists, the host buffer let go)."""
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> list[list[GroupDigest | None]]:
        if self.event is not None:
            self.event.synchronize()
        cells = self._host.numpy().view(np.uint64)
        self._host = None  # type: ignore[assignment]
        out: list[list[GroupDigest | None]] = []
        for spans in self._layout.spans:
            row: list[GroupDigest | None] = []
            for span in spans:
                if span is None:
                    row.append(None)
                    continue
                offset, n_seg, heads = span
                sums = cells[offset : offset + len(heads) * n_seg].reshape(len(heads), n_seg)
                row.append(GroupDigest(heads, sums.copy()))
            out.append(row)
        return out
