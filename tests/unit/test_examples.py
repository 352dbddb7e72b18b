"""The GPU deployment examples stay valid: configs parse, and their launch scripts
put vllm-router in front of the servers they start."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvtail_connector.config import KVTailConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# kv_transfer_configs: every JSON file but Mooncake's own config and the Grafana dashboard
CONFIGS = sorted(
    p for p in EXAMPLES.rglob("*.json") if p.name != "mooncake.json" and p.parent.name != "grafana"
)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_kv_transfer_configs_parse_and_resolve(path):
    ktc = json.loads(path.read_text())
    assert ktc["kv_connector"] == "KVTailConnector"
    cfg = KVTailConfig.from_extra_config(ktc["kv_connector_extra_config"])
    pytest.importorskip("vllm")
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtail_connector.facade.inner import resolve

    resolved = resolve(KVTransferConfig(**ktc))
    assert resolved.cfg == cfg
    assert resolved.inner_transfer_config.kv_role == ktc["kv_role"]
    registered = KVConnectorFactory.get_connector_class_by_name(cfg.backend)
    assert resolved.inner_cls is registered


def _commands(script: Path) -> list[list[str]]:
    """The script's commands (continuation lines joined), each as argv without
    environment assignments and a trailing ``&``."""
    text = script.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        argv = [a for a in shlex.split(line) if a != "&"]
        while argv and "=" in argv[0] and not argv[0].startswith("-"):
            argv.pop(0)
        if argv:
            out.append(argv)
    return out


def _served(script: Path) -> dict[str, int]:
    """``vllm serve`` of each side: JSON file name (prefill, decode) -> --port."""
    out = {}
    for argv in _commands(script):
        if argv[:2] == ["vllm", "serve"]:
            port = int(argv[argv.index("--port") + 1])
            config = argv[argv.index("--kv-transfer-config") + 1]  # $(cat $here/SIDE.json)
            out[Path(config.removesuffix(")")).stem] = port
    return out


SCRIPTS = sorted(p for p in EXAMPLES.glob("*/run.sh") if len(_served(p)) == 2)


def test_every_pd_example_is_found():
    assert {p.parent.name for p in SCRIPTS} == {"nixl_1p1d", "moriio_read"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.parent.name)
def test_pd_examples_put_vllm_router_in_front_of_their_servers(script):
    """The router's own parser accepts the command, and it reaches the servers the
    script starts: by URL (NIXL) or by their MoRIIO registration (MoRIIO)."""
    launch = pytest.importorskip("vllm_router.launch_router")
    (router,) = [argv for argv in _commands(script) if argv[0] == "vllm-router"]
    args = launch.parse_router_args(router[1:])
    assert args.vllm_pd_disaggregation
    served = _served(script)
    assert args.port not in served.values()
    configs = {side: json.loads((script.parent / f"{side}.json").read_text()) for side in served}
    backend = {c["kv_connector_extra_config"]["backend"] for c in configs.values()}
    if backend == {"NixlConnector"}:
        assert args.kv_connector == "nixl"
        assert args.prefill_urls == [(f"http://127.0.0.1:{served['prefill']}", None)]
        assert args.decode_urls == [f"http://127.0.0.1:{served['decode']}"]
    else:
        assert backend == {"MoRIIOConnector"}
        assert args.kv_connector == "moriio"  # which needs discovery (the router refuses URLs)
        assert args.prefill_urls == [] and args.decode_urls == []
        for side, config in configs.items():
            extra = config["kv_connector_extra_config"]["backend_extra_config"]
            address = f"{extra['proxy_ip']}:{extra['proxy_ping_port']}"
            assert address == args.vllm_discovery_address, side
            assert extra["http_port"] == served[side], side
