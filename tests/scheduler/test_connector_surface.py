"""Every question vLLM can ask a connector, answered by the wrapper as by the connector inside.

The installed release's ``KVConnectorBase_V1`` and its mixins are enumerated
(``tests/helpers/connector_surface.py``): a public name that the wrapper
neither forwards (a behaviour check below) nor lists as its own
(``connector.OWN_ANSWERS``, with the reason) fails here, so a method a new
vLLM release adds fails CI until it is forwarded or deliberately answered.
"""

from __future__ import annotations

import pytest

from kvtail_connector.facade.forwarding import ForwardingConnector
from tests.helpers import connector_surface as surface


def test_every_public_name_is_forwarded_or_the_wrappers_own() -> None:
    missing = surface.unclassified()
    assert missing == [], (
        "public names of vLLM's connector base classes the wrapper neither forwards nor "
        "answers itself: forward each in kvtail_connector/facade/connector.py and add its check to "
        "tests/helpers/connector_surface.py, or list it in connector.OWN_ANSWERS with the "
        "reason:\n" + "\n".join(f"  {n.name} ({n.kind} of {n.owner})" for n in missing)
    )


def test_own_answers_are_base_names_with_reasons() -> None:
    names = surface.public_names()
    checked = set(surface.CLASS_QUESTIONS) | set(surface.INSTANCE_QUESTIONS) | set(surface.HOOKS)
    for name, reason in surface.own_answers().items():
        assert name in names, f"OWN_ANSWERS lists {name!r}, which this release's base lacks"
        assert name not in checked, f"{name!r} is both checked as forwarded and listed as ours"
        assert len(reason.split()) >= 5, f"OWN_ANSWERS[{name!r}]: say why"


def test_the_enumeration_sees_the_names_vllm_asks() -> None:
    names = surface.public_names()
    # A few names every supported release has, of each kind the enumeration tells apart.
    assert names["get_required_kvcache_layout"].kind == "classmethod"
    assert names["requires_kv_delivery"].kind == "property"
    assert names["request_finished_all_groups"].owner == "SupportsHMA"
    assert names["get_finished"].answers and not names["wait_for_save"].answers


@pytest.mark.parametrize("role", surface.ROLES)
@pytest.mark.parametrize("name", surface.CASE_NAMES)
def test_class_questions_answer_as_the_inner_class(name: str, role: str) -> None:
    assert surface.class_question_mismatches(surface.case(name, role)) == []


@pytest.mark.parametrize("role", surface.ROLES)
@pytest.mark.parametrize("name", surface.CASE_NAMES)
def test_instance_questions_answer_as_the_inner_connector(name: str, role: str) -> None:
    assert surface.instance_question_mismatches(surface.case(name, role)) == []


@pytest.mark.parametrize("role", surface.ROLES)
def test_hooks_reach_the_inner_connector_and_return_its_answer(role: str) -> None:
    assert surface.hook_mismatches(role) == []


def test_the_checks_tell_a_wrapper_that_does_not_forward(monkeypatch) -> None:
    """The checks fail on the base class's default answer: a forward removed
    (here supports_divergent_local_hybrid_hits, a property every release has)
    is found by each kind of check that covers it."""
    monkeypatch.delattr(ForwardingConnector, "supports_divergent_local_hybrid_hits")
    name = "supports_divergent_local_hybrid_hits"
    found = surface.instance_question_mismatches(
        surface.case("recording_double", "kv_consumer"), [name]
    )
    assert len(found) == 1 and found[0].startswith(name)
    # NIXL answers True, the base class False.
    assert surface.instance_question_mismatches(surface.case("nixl", "kv_consumer"), [name])
