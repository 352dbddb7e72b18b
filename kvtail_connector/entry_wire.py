"""The ``kvtail`` entry's strict wire model (pydantic), for :func:`kvtail_connector.entry.read`.

Apart from :mod:`kvtail_connector.entry` so that the worker side, which only
builds and folds digests, imports no pydantic (the GPU benchmarks run where it
is not installed). Types are strict: no booleans or floats for integers, no
numeric strings; bounds that depend on D's model are checked by ``read``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

__all__ = ["ValidationError", "WireDigest", "WireEntry", "WireGeometry", "WireStates"]

_Hex16 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
_HexU64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{16}$")]
_Key = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]
_Count = Annotated[int, Field(ge=1, le=1 << 24)]
_STRICT = ConfigDict(strict=True, extra="ignore", frozen=True)


class WireGeometry(BaseModel):
    model_config = _STRICT

    bs: list[_Count]
    dcp: _Count
    ilv: _Count
    sig: _Hex16


class WireEntry(BaseModel):
    model_config = _STRICT

    v: int
    pv: Annotated[str, StringConstraints(pattern=r"^[0-9A-Za-z.+!_-]{1,32}$")]
    n: _Count
    geom: WireGeometry
    bind: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")] | None = None
    tail: Annotated[str, StringConstraints(max_length=16)] | None = None
    mac: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None


class WireStates(BaseModel):
    model_config = _STRICT

    alg: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    sig: _Hex16
    g: dict[_Key, dict[_Key, _HexU64]]


class WireDigest(BaseModel):
    model_config = _STRICT

    alg: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    seg: _Count
    sig: _Hex16
    g: dict[_Key, dict[_Key, list[_HexU64]]]
    st: WireStates | None = None
