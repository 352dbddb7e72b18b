"""One rule for every integer argument of the kernel API.

Accepted: any integral scalar — a Python ``int``, a numpy integer, a 0-d
integer array or tensor. Refused with a ValueError that names the argument:
``bool`` (``True`` is not block 1), floats (``1.7`` is not block 1), strings,
sparse tensors, anything else. Nothing is truncated or parsed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

_INT64 = np.iinfo(np.int64)


def _integral_dtype(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex
    return np.dtype(dtype).kind in "iu"


def _scalar(value: Any) -> int | None:
    """``value`` as an int if it is an integral scalar, else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.dim() != 0 or not _integral_dtype(value.dtype):
            return None
        return int(value.item())
    if isinstance(value, np.ndarray):
        return int(value.item()) if value.ndim == 0 and _integral_dtype(value.dtype) else None
    return None


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.layout} {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{value!r} ({type(value).__name__})"


def as_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` as a Python int under the module's rule, at least ``minimum``.

    Raises:
        ValueError: naming ``name``: not an integral scalar, or below ``minimum``.
    """
    result = _scalar(value)
    if result is None:
        raise ValueError(f"{name}: expected an integer, got {_shown(value)}")
    if minimum is not None and result < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {result}")
    return result


def int_rows(values: Any, cols: int, name: str) -> np.ndarray:
    """``values`` as an int64 ``[n, cols]`` array, every entry checked by the rule.

    ``cols == 1``: a sequence of integers (block ids); ``cols > 1``: a
    sequence of ``cols``-tuples ((block id, first slot) pairs). An integer
    numpy array or dense tensor of that shape is taken as a whole.

    Raises:
        ValueError: naming ``name`` (and the offending entry).
    """
    what = "block ids" if cols == 1 else f"({cols}-tuples of integers)"
    if isinstance(values, (torch.Tensor, np.ndarray)):
        return _int_array(values, cols, name, what)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name}: expected a sequence of {what}, got {_shown(values)}")
    rows: list[list[int]] = []
    for i, entry in enumerate(values):
        if cols == 1:
            rows.append([as_int(f"{name}[{i}]", entry)])
            continue
        parts = _parts(entry)
        if parts is None or len(parts) != cols:
            raise ValueError(f"{name}[{i}]: expected {cols} integers, got {_shown(entry)}")
        rows.append([as_int(f"{name}[{i}][{j}]", p) for j, p in enumerate(parts)])
    for i, row in enumerate(rows):
        for v in row:
            if not _INT64.min <= v <= _INT64.max:
                raise ValueError(f"{name}[{i}]: {v} does not fit in int64")
    return np.array(rows, dtype=np.int64).reshape(-1, cols)


def _parts(entry: Any) -> list[Any] | None:
    if isinstance(entry, (torch.Tensor, np.ndarray)):
        return list(entry) if entry.ndim == 1 else None
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Iterable):
        return None
    return list(entry)


def _int_array(values: Any, cols: int, name: str, what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.layout != torch.strided:
            raise ValueError(f"{name}: expected {what}, got {_shown(values)}; pass a dense tensor")
        if not _integral_dtype(values.dtype):
            raise ValueError(f"{name}: expected {what}, got {_shown(values)}")
        values = values.detach().cpu().numpy()
    if not _integral_dtype(values.dtype):
        raise ValueError(f"{name}: expected {what}, got an array of dtype {values.dtype}")
    if values.size == 0:
        return np.zeros((0, cols), dtype=np.int64)
    if (cols == 1 and values.ndim != 1) or (cols > 1 and values.shape[1:] != (cols,)):
        raise ValueError(f"{name}: expected {what}, got an array of shape {values.shape}")
    if values.dtype == np.uint64 and int(values.max()) > _INT64.max:
        raise ValueError(f"{name}: {int(values.max())} does not fit in int64")
    return values.astype(np.int64).reshape(-1, cols)
