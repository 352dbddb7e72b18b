"""What every page map checks first: that the view is the one the spec says
vLLM allocated (``create_kv_cache_views``: ``[B, num_heads, N states, C]``
with ``C * elem == state_content_size_bytes``)."""

from __future__ import annotations

import torch

from kvtail_connector.pages.layer import LayerPage


def check_view(page: LayerPage) -> tuple[int, int, int]:
    """``(H, N, cell bytes)`` of the view, once checked against the spec.

    Raises:
        ValueError: a view vLLM would not have made from this spec.
    """
    view = page.view
    if view.dim() != 4:
        raise ValueError(f"expected a [B, H, N, C] view, got shape {tuple(view.shape)}")
    _, heads, slots, content = (int(x) for x in view.shape)
    cell = content * view.element_size()
    expected_heads = int(getattr(page.spec, "num_heads", heads))
    expected_cell = getattr(page.spec, "state_content_size_bytes", None)
    if expected_cell is None:
        raise ValueError("the spec has no state_content_size_bytes")
    expected_cell = int(expected_cell)
    if heads != expected_heads or cell != expected_cell:
        raise ValueError(
            f"the view {tuple(view.shape)} of {view.dtype} does not match the spec "
            f"({expected_heads} head slots of {expected_cell} bytes)"
        )
    if view.stride(3) != 1:
        raise ValueError(f"the view's last dim is strided ({tuple(view.stride())})")
    return heads, slots, cell


def dense_rows(page: LayerPage) -> torch.Tensor:
    """The view, once checked to be one contiguous ``[N, C]`` run per page
    (a single head slot, rows one cell apart)."""
    _, _, cell = check_view(page)
    view = page.view
    if view.shape[1] != 1 or view.stride(2) * view.element_size() != cell:
        raise ValueError(
            f"expected [B, 1, N, C] with rows {cell} bytes apart, got shape "
            f"{tuple(view.shape)} strides {tuple(view.stride())}"
        )
    return view
