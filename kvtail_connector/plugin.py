"""``vllm.general_plugins`` entry point: make ``KVTailConnector`` a known name.

vLLM runs general plugins in every process it starts, without a try
(``EngineArgs.__post_init__`` among others), so whatever goes wrong here
would stop every engine of the machine, also those that never use the
wrapper. This therefore never raises: it registers a lazy (module, class)
pair, imports nothing heavy, and only warns when the installed vLLM is one
the wrapper does not support. The refusal belongs to ``KVTailConnector``
itself, at start-up of an engine that asked for it. With the plugin,
``kv_connector_module_path`` is optional.

It is also the only wrapper code that runs before vLLM's CPU platform picks
the Mamba conv-state layout by connector name (see
:mod:`kvtail_connector.name_keyed`): in an API server's front end it runs while
vLLM builds its argument parser, so it reads the command line's
``--kv-transfer-config`` and sets what vLLM would set for the connector inside
the wrapper, before vLLM reads the environment.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVTailConnector"

_warned = False


def register() -> None:
    """Register ``KVTailConnector`` with vLLM's connector factory (idempotent),
    and apply the name-keyed environment of the command line's connector.

    Never raises. Warns once per process when the installed vLLM is outside
    the supported range, or when registering fails.
    """
    import sys

    from kvtail_connector import _compat
    from kvtail_connector.log import get_logger

    logger = get_logger(__name__)
    try:
        from kvtail_connector import name_keyed

        applied = name_keyed.apply_early_environment(sys.argv)
        if applied:
            logger.info(
                "kvtail-connector set %s: what vLLM sets for the connector inside "
                "KVTailConnector, which it sees only by name.",
                ", ".join(f"{k}={v}" for k, v in applied.items()),
            )
    except Exception as e:  # noqa: BLE001 - a plugin must not take vLLM down
        logger.warning(
            "kvtail-connector could not read the command line's --kv-transfer-config "
            "(%s: %s); KVTailConnector will refuse at start-up if that matters.",
            type(e).__name__,
            e,
        )
    global _warned
    if not _compat.is_supported_vllm() and not _warned:
        _warned = True
        logger.warning(
            "%s Engines that do not name KVTailConnector are unaffected.",
            _compat.unsupported_vllm_message(),
        )
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(
                CONNECTOR_NAME, "kvtail_connector.connector", CONNECTOR_NAME
            )
    except Exception as e:  # noqa: BLE001 - a plugin must not take vLLM down
        logger.warning(
            "kvtail-connector could not register %s with vLLM %s (%s: %s); an engine that "
            'uses it can still set "kv_connector_module_path": "kvtail_connector".',
            CONNECTOR_NAME,
            _compat.installed_vllm(),
            type(e).__name__,
            e,
        )
