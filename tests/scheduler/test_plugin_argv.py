"""The plugin reads the command line's --kv-transfer-config as vLLM's parser does
(issue 36, review item 9).

vLLM's ``FlexibleArgumentParser`` accepts the option with underscores for
dashes, abbreviated (argparse's ``allow_abbrev``), and as dotted keys, which it
merges into one JSON appended after every other argument (so they replace an
earlier JSON whole). The plugin sets the Mamba conv-state layout NIXL needs
(CPU platform) from what it reads, before vLLM picks the layout: a form it
missed left a wrapped NIXL engine without it, and a form it misread set it
for a command line whose dotted keys name another backend. vLLM's own parser
(an API server's, ``vllm serve``'s arguments) is the reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from kvtail_connector import _compat, plugin
from kvtail_connector.facade import name_keyed
from kvtail_connector.facade.inner import wrap_kv_transfer_config

LAYOUT = name_keyed.CONV_STATE_LAYOUT_ENV
FLAG = "--kv-transfer-config"


def _wrapped(backend: str) -> dict[str, Any]:
    return wrap_kv_transfer_config(
        {"kv_connector": backend, "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    )


NIXL = json.dumps(_wrapped("NixlConnector"))
STORE = json.dumps(_wrapped("MooncakeStoreConnector"))


def _dotted(option: str, backend: str, sep: str = " ") -> list[str]:
    """A wrapped ``backend`` as dotted keys of ``option``."""
    out: list[str] = []
    for key, value in (
        ("kv_connector", "KVTailConnector"),
        ("kv_role", "kv_consumer"),
        ("kv_connector_extra_config.backend", backend),
    ):
        out += [f"{option}.{key}={value}"] if sep == "=" else [f"{option}.{key}", value]
    return out


# name: (the arguments vLLM parses, whether its config wraps NIXL)
FORMS: dict[str, tuple[list[str], bool]] = {
    "json": ([FLAG, NIXL], True),
    "json=": ([f"{FLAG}={NIXL}"], True),
    "underscores": (["--kv_transfer_config", NIXL], True),
    "one_underscore": (["--kv-transfer_config", NIXL], True),
    "underscores=": ([f"--kv_transfer-config={NIXL}"], True),
    "abbreviated": (["--kv-transfer-conf", NIXL], True),
    "abbreviated_short=": ([f"--kv-t={NIXL}"], True),
    "dotted": (_dotted(FLAG, "NixlConnector"), True),
    "dotted=": (_dotted(FLAG, "NixlConnector", "="), True),
    "dotted_underscores": (_dotted("--kv_transfer_config", "NixlConnector"), True),
    "dotted_abbreviated": (_dotted("--kv-transfer-conf", "NixlConnector"), True),
    "dotted_whole_extra_config": (
        [
            f"{FLAG}.kv_connector",
            "KVTailConnector",
            f"{FLAG}.kv_role=kv_consumer",
            f"{FLAG}.kv_connector_extra_config",
            '{"backend": "NixlConnector"}',
        ],
        True,
    ),
    "human_readable_number": (
        [FLAG, NIXL[:-1] + ', "kv_port": 14k}'],  # vLLM expands 14k; plain JSON fails
        True,
    ),
    "with_other_arguments": (
        ["--model", "m", "-O3", "--max-num-seqs", "4", FLAG, NIXL, "--enforce-eager"],
        True,
    ),
    # The dotted keys come after every other argument: they replace the JSON.
    "dotted_override_to_store": ([FLAG, NIXL, *_dotted(FLAG, "MooncakeStoreConnector")], False),
    "dotted_key_replaces_the_json": ([FLAG, NIXL, f"{FLAG}.kv_role", "kv_consumer"], False),
    "dotted_before_a_store_json": ([*_dotted(FLAG, "NixlConnector"), FLAG, STORE], True),
    # Each spelling of the option is its own dotted group, appended in order.
    "two_dotted_spellings": (
        [*_dotted("--kv-transfer-conf", "NixlConnector"), *_dotted(FLAG, "MooncakeStoreConnector")],
        False,
    ),
    "last_json_wins": ([FLAG, NIXL, "--kv_transfer_config", STORE], False),
    "store": ([FLAG, STORE], False),
    "none": ([f"{FLAG}=None"], False),
    "absent": (["--max-num-seqs", "4"], False),
}


@pytest.fixture(scope="module")
def vllm_parser() -> FlexibleArgumentParser:
    """An API server's parser (``vllm serve``'s arguments, its model optional)."""
    try:  # 0.33, 0.34
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:  # 0.32
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


def _vllm_reads(parser: FlexibleArgumentParser, args: list[str]) -> dict[str, Any] | None:
    config = parser.parse_args(args).kv_transfer_config
    return None if config is None else dataclasses.asdict(config)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_plugin_reads_what_vllms_parser_reads(vllm_parser, form) -> None:
    args, wraps_nixl = FORMS[form]
    theirs = _vllm_reads(vllm_parser, args)
    ours = plugin.transfer_config_from_argv(["vllm", *args])
    if theirs is None:
        assert ours is None
        assert not wraps_nixl
        return
    assert ours is not None
    # Every field the command line sets, as vLLM parsed it (vLLM adds defaults).
    assert {k: theirs[k] for k in ours} == ours
    want = {LAYOUT: "DS"} if wraps_nixl else {}
    assert name_keyed.early_environment(theirs, True) == want  # the table is right
    assert name_keyed.early_environment(ours, True) == want


def test_no_other_option_of_vllm_is_a_prefix_of_the_flag(vllm_parser) -> None:
    # What lets the plugin read any prefix of the flag as the flag: argparse
    # takes an exact option first, and fails on a prefix of several.
    options = vllm_parser._option_string_actions
    assert {o for o in options if FLAG.startswith(o)} == {FLAG}


@pytest.fixture
def clean_environ() -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.pop(LAYOUT, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.skipif(not _compat.platform_is_cpu(), reason="CPU platform rule")
@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_plugin_sets_the_layout_exactly_for_a_wrapped_nixl(
    monkeypatch, clean_environ, form
) -> None:
    # Before: the underscore, abbreviated, dotted and human-readable forms got
    # no layout, and the dotted overrides got DS for a store.
    args, wraps_nixl = FORMS[form]
    monkeypatch.setattr("sys.argv", ["vllm", "serve", "m", *args])
    plugin.register()
    assert os.environ.get(LAYOUT) == ("DS" if wraps_nixl else None)


def test_a_config_file_is_not_read(vllm_parser, tmp_path) -> None:
    # vLLM splices a --config file's settings in, dotted keys included, and
    # they can replace the command line's JSON; the plugin reads no file and
    # sets nothing (KVTailConnector refuses at start-up, naming the layout
    # variable, where that matters).
    config = tmp_path / "serve.yaml"
    config.write_text("kv-transfer-config.kv_connector_extra_config.backend: MooncakeStore\n")
    args = [FLAG, NIXL, "--config", str(config)]
    theirs = _vllm_reads(vllm_parser, args)
    assert theirs is not None and theirs["kv_connector_extra_config"] == {
        "backend": "MooncakeStore"
    }
    assert plugin.transfer_config_from_argv(["vllm", *args]) is None


@pytest.mark.parametrize(
    "args",
    [
        [FLAG],
        [f"{FLAG}.kv_connector"],
        [FLAG, "{bad"],
        [FLAG, "[1, 2]"],
        [f"{FLAG}.kv_connector=", FLAG],
        ["-O"],
        ["--kv", NIXL],
        ["--", FLAG, NIXL],
        [FLAG, "[" * 100_000],
        ["serve", "--model"],
    ],
    ids=repr,
)
def test_the_plugin_never_raises_on_a_command_line(monkeypatch, clean_environ, args) -> None:
    monkeypatch.setattr("sys.argv", ["vllm", *args])
    plugin.register()  # a plugin must not take vLLM down, whatever it is given
    assert os.environ.get(LAYOUT) in (None, "DS")
