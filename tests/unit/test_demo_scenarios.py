"""The demo's flags choose its scenario: a hybrid over NIXL unless told otherwise."""

import pytest

from demo.__main__ import parse_args, scenario_name
from demo.scenarios import scenario


@pytest.mark.parametrize(
    ("argv", "name", "backend", "zero_tails"),
    [
        ([], "hybrid_nixl", "nixl", "auto"),
        (["--model", "llama"], "nixl", "nixl", "always"),
        (["--backend", "mooncake"], "mooncake", "mooncake", "always"),
        (["--backend", "mooncake", "--model", "hybrid"], "hybrid", "mooncake", "auto"),
        (["--hybrid"], "hybrid", "mooncake", "auto"),
    ],
)
def test_flags_choose_the_scenario(argv, name, backend, zero_tails):
    got = scenario_name(parse_args(argv))
    assert got == name
    sc = scenario(got)
    assert (sc.backend, sc.zero_tails) == (backend, zero_tails)
