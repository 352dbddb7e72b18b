"""Whether the two vLLM bugs the wrapper works around are still in a release, by behaviour.

Each probe drives vLLM's real ``Scheduler`` of the installed release (built as
``EngineCore`` builds it, ``tests/helpers/vllm_factories.py``) with a plain
connector, no wrapper, on a KV cache config that needs zeroing (mixed-precision
attention, no Mamba layers), and reads the ``SchedulerOutput`` vLLM hands the
workers:

1. Async-load tails: is the partial last block of an async KV load still kept
   out of ``new_block_ids_to_zero``? (The load writes only its tokens' slots;
   the rest of that block keeps what the block held before.)
2. MoRIIO READ filter: are MoRIIO READ destinations still left in
   ``new_block_ids_to_zero`` outside Mamba hybrids? (vLLM's filter that drops
   them is gated on ``_has_mamba``; the worker's zeroing then races the READ.)

Run by ``scripts/release_check.py`` on the overlay it checks; each probe
returns a :class:`Finding` and never raises.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BLOCK = 16
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Finding:
    """``present``: True (the bug is there), False (fixed), None (the probe
    could not tell; ``detail`` says why)."""

    bug: str
    present: bool | None
    detail: str


def _let_the_cpu_platform_build_configs() -> None:
    # As tests/scheduler/conftest.py does: 0.34's CPU platform refuses a
    # VllmConfig on x86 without triton-cpu; the probes run no kernel.
    import inspect

    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if "HAS_TRITON" in inspect.getsource(CpuPlatform.check_and_update_config):
        vllm.triton_utils.HAS_TRITON = True


def _needs_zeroing_config() -> Any:
    from tests.helpers.vllm_factories import make_mixed_precision_kv_cache_config

    kv = make_mixed_precision_kv_cache_config(block_size=BLOCK, num_blocks=64)
    assert kv.needs_kv_cache_zeroing and not kv.has_mamba_layers
    return kv


def _zeroed(out: Any) -> set[int]:
    return set(out.new_block_ids_to_zero or ())


def async_load_partial_block() -> Finding:
    """Bug 1, with the async-load double (``tests/helpers/async_double.py``):
    a 50-token prompt, 40 tokens loaded asynchronously; block 2 of each group
    holds loaded tokens 32-39 and never-written slots 40-47."""
    from tests.helpers import async_double
    from tests.helpers.vllm_factories import make_request, make_scheduler, make_vllm_config

    bug = "async-load partial last block exempt from alloc-time zeroing"
    config = make_vllm_config(
        kv_connector=async_double.CONNECTOR_NAME, kv_connector_module_path=async_double.MODULE_PATH
    )
    scheduler = make_scheduler(config, _needs_zeroing_config())
    try:
        loaded = 40
        request = make_request(
            "r1",
            50,
            block_size=scheduler.hash_block_size,
            kv_transfer_params={"double_load_tokens": loaded, "double_finish_after_steps": 99},
        )
        scheduler.add_request(request)
        out = scheduler.schedule()
        if request.num_computed_tokens != loaded:
            return Finding(bug, None, f"the load was not admitted ({request.status})")
        groups = scheduler.kv_cache_manager.get_block_ids("r1")
        partial = {group[loaded // BLOCK] for group in groups}
        whole = {b for group in groups for b in group[: loaded // BLOCK]}
        zeroed = _zeroed(out)
        detail = (
            f"partial last blocks {sorted(partial)}, whole loaded blocks {sorted(whole)}; "
            f"new_block_ids_to_zero={sorted(zeroed)}"
        )
        return Finding(bug, not partial <= zeroed, detail)
    finally:
        scheduler.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def moriio_read_filter() -> Finding:
    """Bug 2, with vLLM's MoRIIOConnector in READ mode (scheduler side: no
    ``mori``, no peer): a 97-token remote prefill of 6 remote blocks a group,
    beside a local 40-token request."""
    from tests.helpers.vllm_factories import make_request, make_scheduler, make_vllm_config

    bug = "MoRIIO READ destinations left in new_block_ids_to_zero outside Mamba hybrids"
    extra = {
        "read_mode": "true",
        "host_ip": HOST,  # no get_ip(); the scheduler side binds none of the ports
        "handshake_port": _free_port(),
        "notify_port": _free_port(),
    }
    config = make_vllm_config(
        kv_connector="MoRIIOConnector", kv_role="kv_consumer", kv_connector_extra_config=extra
    )
    kv = _needs_zeroing_config()
    scheduler = make_scheduler(config, kv)
    try:
        port = _free_port()
        remote = [
            list(range(1000 * (g + 1), 1000 * (g + 1) + 6)) for g in range(len(kv.kv_cache_groups))
        ]
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": remote,
            "remote_engine_id": f"{HOST}:{port}",
            "remote_host": HOST,
            "remote_handshake_port": port,
            "remote_notify_port": _free_port(),
            "transfer_id": "xfer-read",
        }
        for req_id, tokens, kv_params in (("read", 97, params), ("other", 40, None)):
            scheduler.add_request(
                make_request(
                    req_id,
                    tokens,
                    block_size=scheduler.hash_block_size,
                    kv_transfer_params=kv_params,
                )
            )
        out = scheduler.schedule()
        recv = getattr(out.kv_connector_metadata, "reqs_to_recv", {})
        if "read" not in recv:
            return Finding(bug, None, "MoRIIO queued no READ for the remote prefill")
        dests = {b for group in recv["read"].local_block_ids for b in group}
        if out.new_block_ids_to_zero is None:
            return Finding(bug, None, "vLLM built no zeroing list on this config")
        left = dests & _zeroed(out)
        detail = (
            f"READ destinations {sorted(dests)}; still in new_block_ids_to_zero: {sorted(left)}"
        )
        return Finding(bug, bool(left), detail)
    finally:
        scheduler.shutdown()


PROBES: tuple[Callable[[], Finding], ...] = (async_load_partial_block, moriio_read_filter)


def run_all() -> list[Finding]:
    """Every probe's finding; a probe that fails to run reports present=None."""
    found = []
    _let_the_cpu_platform_build_configs()
    for probe in PROBES:
        try:
            found.append(probe())
        except Exception as exc:  # noqa: BLE001 - reported, not handled
            found.append(Finding(probe.__name__, None, f"{type(exc).__name__}: {exc}"))
    return found
