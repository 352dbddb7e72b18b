"""vLLM's CPU attention cache writers, re-written in plain torch for every CPU.

``cpu_attn_reshape_and_cache`` stores each head's page (``[B, H, N, 2*D]``,
viewed as ``[B, H, 2N, D]``: K in the first N rows, V in the last N) in an
ISA-specific order. These writers reproduce that order from vLLM 0.32's C++
(``csrc/cpu/cpu_attn_vec.hpp``, ``cpu_attn_vec16.hpp``, ``cpu_attn_amx.hpp``,
``cpu_attn_fp8.hpp``), so the AMX layout is exercised on machines without AMX;
``tests/with_vllm/test_cpu_pages.py`` checks them against the real writer wherever
the ISA runs.

- ``vec`` (and ``vec16``, which inherits it): K column-major ``[D, N]``
  (element ``d`` of slot ``o`` at ``d*N + o``), V row-major ``[N, D]``.
- ``amx`` (bf16, and fp8 caches, whose bytes follow the same element order):
  K packed in pairs of elements (a 32-bit VNNI word for bf16, a 16-bit
  halfword for fp8) and tiled by 16 tokens: pair ``j`` of slot ``o`` is pair
  number ``(o // 16) * 16 * (D/2) + o % 16 + 16 * j``; V in groups of 16 head
  elements, each group ``[N/2, 16, 2]``: two tokens interleaved element by
  element, so element ``16*i + j`` of slot ``o`` sits at
  ``i * 16 * N + (o // 2) * 32 + 2 * j + o % 2``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

AMX_TOKENS_PER_TILE = 16  # AMX_TILE_ROW_NUM: tokens of one K tile
AMX_V_ELEMS_PER_GROUP = 16  # AMX_TILE_ROW_BYTES / 4: head elements of one V group
AMX_PACK = 2  # elements per K pair, tokens per V pair


def vec_positions(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, D]`` element positions of slot o's K and V inside a head's half."""
    o = torch.arange(n)[:, None]
    e = torch.arange(d)[None, :]
    return e * n + o, o * d + e


def amx_positions(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, D]`` element positions of slot o's K and V inside a head's half."""
    o = torch.arange(n)[:, None]
    e = torch.arange(d)[None, :]
    pair = (o // AMX_TOKENS_PER_TILE) * AMX_TOKENS_PER_TILE * (d // AMX_PACK)
    pair = pair + o % AMX_TOKENS_PER_TILE + AMX_TOKENS_PER_TILE * (e // AMX_PACK)
    k = pair * AMX_PACK + e % AMX_PACK
    group = e // AMX_V_ELEMS_PER_GROUP
    v = group * AMX_V_ELEMS_PER_GROUP * n
    v = v + (o // AMX_PACK) * AMX_PACK * AMX_V_ELEMS_PER_GROUP
    v = v + AMX_PACK * (e % AMX_V_ELEMS_PER_GROUP) + o % AMX_PACK
    return k, v


POSITIONS: dict[str, Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "vec": vec_positions,
    "vec16": vec_positions,
    "amx": amx_positions,
}


def write(
    isa: str,
    cache: torch.Tensor,
    slots: Sequence[int],
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Store ``keys[t], values[t]`` (``[T, H, D]``) at flat slot ``slots[t]`` of
    ``cache`` (``[B, H, N, 2*D]``, inner dims contiguous), as vLLM's ``isa``
    writer does. Values are cast to the cache dtype (fp8 caches: pass
    ``keys``/``values`` already as the cache's uint8 codes)."""
    b, h, n, c = cache.shape
    d = c // 2
    k_pos, v_pos = POSITIONS[isa](n, d)
    halves = cache.view(b, h, 2, n * d)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, o = divmod(int(slot), n)
        halves[block, :, 0, k_pos[o]] = keys[t].to(cache.dtype)
        halves[block, :, 1, v_pos[o]] = values[t].to(cache.dtype)


def page_writer(isa: str) -> Callable[..., None]:
    """A stand-in for ``cpu_attn_reshape_and_cache`` with the synthetic
    ``isa`` layout (the signature ``kvtail_connector.pages.cpu`` calls)."""

    def write_page(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        isa_name: str,
        kv_cache_dtype: str = "auto",
    ) -> None:
        assert isa_name == isa, (isa_name, isa)
        # key_cache / value_cache are the two halves of one [B, H, 2N, D] view.
        b, h, n, d = key_cache.shape
        page = torch.as_strided(
            key_cache,
            (b, h, n, 2 * d),
            (key_cache.stride(0), key_cache.stride(1), 2 * d, 1),
        )
        write(isa, page, slot_mapping.tolist(), key, value)

    return write_page
