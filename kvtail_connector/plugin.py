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
:mod:`kvtail_connector.facade.name_keyed`): in an API server's front end it runs while
vLLM builds its argument parser, so it reads the command line's
``--kv-transfer-config`` as that parser will (:func:`transfer_config_from_argv`)
and sets what vLLM would set for the connector inside the wrapper, before vLLM
reads the environment.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import MutableMapping, Sequence
from typing import Any

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
        applied = apply_command_line_environment(getattr(sys, "argv", ()))
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
                CONNECTOR_NAME, "kvtail_connector.facade.connector", CONNECTOR_NAME
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


# ------------------------------------------- the command line, as vLLM reads it

KV_TRANSFER_CONFIG_FLAG = "--kv-transfer-config"


def apply_command_line_environment(
    argv: Sequence[str],
    environ: MutableMapping[str, str] = os.environ,
    is_cpu: bool | None = None,
) -> dict[str, str]:
    """:func:`kvtail_connector.facade.name_keyed.prepare_environment` for the
    ``--kv-transfer-config`` vLLM's parser will build from ``argv``
    (:func:`transfer_config_from_argv`). Returns what was set: nothing where
    ``argv`` sets no such config or the plugin cannot tell which (a ``--config``
    file); where that matters, KVTailConnector refuses at start-up naming the
    variable. ``is_cpu``: the platform (None: vLLM's, asked only once a config
    is found)."""
    config = transfer_config_from_argv(argv)
    if config is None:
        return {}
    from kvtail_connector.facade import name_keyed

    return name_keyed.prepare_environment(config, environ, is_cpu)


def transfer_config_from_argv(argv: Sequence[str]) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` (as its JSON dict) that vLLM's argument
    parser builds from the command line ``argv`` (``sys.argv``: the program,
    then what vLLM parses), or None: no config, or one vLLM refuses (it then
    exits and nothing here matters), or a command line with a ``--config``
    file (not read here: the plugin runs in every process and reads no file).

    Every form vLLM's ``FlexibleArgumentParser`` accepts (0.32, 0.33, 0.34)
    counts: ``--kv-transfer-config JSON`` and ``=JSON``; underscores for dashes
    in the option's name (``--kv_transfer-config``); any abbreviation argparse
    takes (``--kv-transfer-conf``, ``--kv-t``: ``allow_abbrev``, no other vLLM
    option is a prefix of it); dotted keys (``--kv-transfer-config.kv_connector
    NAME``, ``--kv-transfer-config.kv_connector_extra_config.backend=NAME``,
    ``key+`` list items), which vLLM merges per spelling of the option into one
    JSON it appends after every other argument, so they replace an earlier
    JSON whole; the last occurrence wins, as argparse stores it. The value is
    read as vLLM reads it: ``""`` or ``None`` for none, JSON with human-readable
    numbers (``80m``)."""
    args = _vllm_serve_model(list(argv[1:]))
    if "--config" in args:
        # vLLM splices the file's settings in here; they may set the transfer
        # config, or override it with dotted keys, and this plugin reads no file.
        return None
    processed = _vllm_argument_names(args)
    if processed is None:
        return None
    value = _last_flag_value(processed, KV_TRANSFER_CONFIG_FLAG)
    if value is None or value in ("", "None"):
        return None
    return _vllm_json(value)


def _vllm_serve_model(args: list[str]) -> list[str]:
    """``vllm serve ... --model M ...`` as vLLM reorders it (``serve M ...``)."""
    if not args or args[0] != "serve":
        return args
    for i, arg in enumerate(args):
        if arg == "--model":
            # Last, without its value: vLLM fails on it (nothing here matters).
            return ["serve", args[i + 1], *args[1:i], *args[i + 2 :]] if i + 1 < len(args) else args
        if arg.startswith("--model=") and arg != "--model=":
            return ["serve", arg.removeprefix("--model="), *args[1:i], *args[i + 1 :]]
    return args


def _vllm_argument_names(args: list[str]) -> list[str] | None:
    """``args`` as ``FlexibleArgumentParser.parse_args`` hands them to argparse:
    underscores to dashes in each option's name up to its first dot, ``-O``
    forms spelled out, and dotted keys taken out, merged per option, and
    appended as one JSON each. None where vLLM's own pass would fail (a
    dotted key without a value)."""
    named: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--help="):
            named.append("--help")
        elif arg.startswith("--"):
            name, eq, given = arg.partition("=")
            head, dot, tail = name[2:].partition(".")
            named.append("--" + head.replace("_", "-") + dot + tail + eq + given)
        elif arg.startswith("-O") and arg != "-O":
            named += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            named.append("--optimization-level")
        else:
            named.append(arg)
    taken: set[int] = set()
    dotted: defaultdict[str, dict[str, Any]] = defaultdict(dict)
    for i, arg in enumerate(named):
        if i in taken or (arg.startswith("--") and "." not in arg):
            continue
        if not (arg.startswith("-") and "." in arg):
            continue
        if "=" in arg:
            arg, text = arg.split("=", 1)
            if "." not in arg:
                continue  # the dot was in the value
        elif i + 1 < len(named):
            text = named[i + 1]
            taken.add(i + 1)
        else:
            return None
        if arg.endswith("+"):
            arg = arg[:-1]
            text = json.dumps(text.split(","))
        option, *keys = arg.split(".")
        value: Any = _dotted_value(text)
        for key in reversed(keys):
            value = {key: value}
        _merge(dotted[option], value)
        taken.add(i)
    kept = [arg for i, arg in enumerate(named) if i not in taken]
    for option, merged in dotted.items():
        kept += [option, json.dumps(merged)]
    return kept


def _dotted_value(text: str) -> Any:
    """A dotted key's value as vLLM reads it: JSON, else a human-readable
    integer (``80g``), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    from argparse import ArgumentTypeError

    from vllm.utils.argparse_utils import human_readable_int

    try:
        return human_readable_int(text)
    except (ValueError, ArgumentTypeError):
        return text


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """vLLM's merge of dotted keys: dicts merged, lists extended, else replaced."""
    for key, value in update.items():
        have = into.get(key)
        if isinstance(value, dict) and isinstance(have, dict):
            _merge(have, value)
        elif isinstance(value, list) and isinstance(have, list):
            have += value
        else:
            into[key] = value


def _last_flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last occurrence of ``flag`` in ``args`` as argparse
    reads them: ``flag VALUE`` or ``flag=VALUE``, the flag spelled out or
    abbreviated (argparse's ``allow_abbrev``: an abbreviation that fits
    another option too is an error, and vLLM exits), nothing after ``--``."""
    value = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        option, eq, explicit = arg.partition("=")
        if len(option) > 2 and flag.startswith(option):
            if eq:
                value = explicit
            elif i + 1 < len(args):
                value = args[i + 1]
                i += 1
            else:
                return None  # argparse: expected one argument
        i += 1
    return value


def _vllm_json(text: str) -> dict[str, Any] | None:
    """The config JSON as vLLM reads it (None where vLLM refuses it): with
    human-readable numbers expanded (valid JSON has none, so that vLLM helper
    is asked only when plain JSON fails)."""
    try:
        config = json.loads(text)
    except ValueError:
        from vllm.engine.arg_utils import _expand_json_human_readable_numbers

        try:
            config = json.loads(_expand_json_human_readable_numbers(text))
        except ValueError:
            return None
    return config if isinstance(config, dict) else None
