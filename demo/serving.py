"""Prefill/decode pairs of API servers, plain or with ``KVTailConnector``.

A :class:`ServePair` is one prefill server and one or more decode servers (one
per ``kv_load_failure_policy`` asked for) with the same connector: vLLM's plain
``NixlConnector`` or ``MooncakeStoreConnector``, or ``KVTailConnector`` around
it. MooncakeStore pairs get a local ``mooncake_master`` of their own. A
:class:`Fleet` starts several pairs and a single-engine reference server at
once (their imports overlap) and stops them all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from demo.api_server import APIServer, ServerSpec, start_all
from demo.mooncake import MooncakeMaster
from demo.pd import Backend, ZeroTails, kv_config, wrapped_kv_config

Policy = Literal["recompute", "fail"]


def pair_kv_config(
    backend: Backend,
    role: Literal["producer", "consumer"],
    wrapped: bool,
    zero_tails: ZeroTails = "always",
    policy: Policy = "recompute",
    probe: bool = True,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One side's ``kv_transfer_config``. The tiny Llama has one KV precision, so
    vLLM zeroes nothing for it and only ``zero_tails: always`` zeroes its tails;
    ``probe`` is the wrapper's ``probe_stale_tails``; ``options`` its other
    fields (e.g. ``verify_kv``)."""
    if wrapped:
        cfg = wrapped_kv_config(backend, role, zero_tails, probe, **(options or {}))
    else:
        cfg = kv_config(backend, role)
    cfg["kv_load_failure_policy"] = policy
    return cfg


class ServePair:
    """A prefill server and a decode server per policy in ``policies``.

    ``decode`` is the first decode server; ``decodes[policy]`` any of them.
    ``options``: the wrapper's fields on every server; ``producer_options``
    on the prefill server only, over ``options`` (e.g. ``vouch_tails``).
    """

    def __init__(
        self,
        name: str,
        model: str | os.PathLike[str],
        log_dir: str | os.PathLike[str],
        *,
        backend: Backend = "nixl",
        wrapped: bool = True,
        zero_tails: ZeroTails = "always",
        policies: Sequence[Policy] = ("recompute",),
        probe: bool = True,
        spec: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        producer_options: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.backend: Backend = backend
        self.wrapped = wrapped
        self.log_dir = Path(log_dir)
        self.master: MooncakeMaster | None = None
        overrides = dict(spec or {})
        env = overrides.pop("env", {})
        if backend == "mooncake":
            self.master = MooncakeMaster(self.log_dir / f"{name}-mooncake").start()
            env = {**env, **self.master.env}

        def server(side: str, role: Literal["producer", "consumer"], policy: Policy) -> APIServer:
            side_options = {**(options or {}), **((role == "producer" and producer_options) or {})}
            kv = pair_kv_config(backend, role, wrapped, zero_tails, policy, probe, side_options)
            return APIServer(
                ServerSpec(f"{name}-{side}", str(model), kv, env=dict(env), **overrides),
                self.log_dir,
            )

        try:
            self.prefill = server("prefill", "producer", policies[0])
            self.decodes = {p: server(f"decode-{p}", "consumer", p) for p in policies}
        except BaseException:
            self.close()
            raise

    @property
    def decode(self) -> APIServer:
        return next(iter(self.decodes.values()))

    @property
    def servers(self) -> list[APIServer]:
        return [self.prefill, *self.decodes.values()]

    def close(self) -> None:
        for s in getattr(self, "decodes", {}).values():
            s.close()
        if hasattr(self, "prefill"):
            self.prefill.close()
        if self.master is not None:
            self.master.close()


class Fleet:
    """Servers started together and stopped together (also on failure)."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self.pairs: dict[str, ServePair] = {}
        self.reference: APIServer | None = None

    def add_reference(self, model: str | os.PathLike[str], **spec: Any) -> APIServer:
        """A single plain engine (no connector): the outputs P/D must reproduce."""
        self.reference = APIServer(ServerSpec("reference", str(model), **spec), self.log_dir)
        return self.reference

    def add_pair(self, name: str, model: str | os.PathLike[str], **kw: Any) -> ServePair:
        pair = ServePair(name, model, self.log_dir, **kw)
        self.pairs[name] = pair
        return pair

    def servers(self) -> Iterable[APIServer]:
        if self.reference is not None:
            yield self.reference
        for pair in self.pairs.values():
            yield from pair.servers

    def start(self, timeout: float = 900.0) -> Fleet:
        try:
            start_all(list(self.servers()), timeout)
        except BaseException:
            self.close()
            raise
        return self

    def close_pair(self, name: str) -> None:
        pair = self.pairs.pop(name, None)
        if pair is not None:
            pair.close()

    def close(self) -> None:
        for name in list(self.pairs):
            self.close_pair(name)
        if self.reference is not None:
            self.reference.close()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
