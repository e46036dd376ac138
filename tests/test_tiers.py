"""The tier rules of tests/tiers.py, as a table."""

from __future__ import annotations

import pytest

from tests.tiers import cost_rank, tier_of


@pytest.mark.parametrize(
    ("parts", "fixtures", "marked", "tier"),
    [
        (("wire", "test_codec.py"), ["tmp_path"], [], "pure"),
        (("gateway", "test_streams.py"), ["client", "app", "nats_url", "nats_server"], [], "bus"),
        (("runner", "test_text_engine.py"), ["tiny_llm_dir"], [], "process"),
        (("bus", "test_x.py"), ["nats_url", "start_worker"], [], "process"),
        (("integration", "test_ask.py"), [], [], "process"),
        (("integration", "test_x.py"), ["nats_url"], ["faults"], "faults"),
        (("faults", "test_broker_faults.py"), ["tmp_path"], [], "faults"),
        (("dashboard", "test_dashboard_browser.py"), ["tiny_llm_dir"], [], "browser"),
        (("gateway", "test_docs_browser.py"), ["nats_server"], [], "browser"),
        (("commands", "test_exits.py"), ["tmp_path"], ["process"], "process"),
        (("commands", "test_exits.py"), ["nats_url"], ["pure", "process"], "process"),
        (("test_config.py",), [], [], "pure"),
        (("bus", "test_retry_policy.py"), [], [], "bus"),
        (("worker", "test_supervisor.py"), ["tmp_path"], [], "process"),
        (("commands", "test_settings_connect.py"), ["nats_url"], [], "process"),
        (("integration.py",), ["nats_url"], [], "bus"),  # a file, not the folder
    ],
)
def test_a_tier_follows_from_the_folder_the_fixtures_and_explicit_marks(
    parts: tuple[str, ...], fixtures: list[str], marked: list[str], tier: str
) -> None:
    assert tier_of(parts, fixtures, marked) == tier


def test_one_test_of_a_module_can_have_its_own_tier() -> None:
    fuzz = "test_fuzzed_requests_never_get_a_server_error"
    assert tier_of(("gateway", "test_openapi.py"), ["nats_url"], name=fuzz) == "process"
    assert tier_of(("gateway", "test_openapi.py"), ["nats_url"], name="test_other") == "bus"


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (("browser", "dashboard/test_dashboard_browser.py"), ("faults", "faults/test_x.py")),
        (("faults", "faults/test_broker_faults.py"), ("faults", "faults/test_full_rate.py")),
        (("process", "integration/test_sharded.py"), ("process", "bench/test_scale_hearing.py")),
        (("process", "integration/test_sharded.py"), ("process", "integration/test_routing.py")),
        (("process", "bench/test_other.py"), ("bus", "faults/test_broker_faults.py")),
        (("bus", "bus/test_roles.py"), ("pure", "integration/test_sharded.py")),
    ],
)
def test_costly_tiers_then_long_files_come_first(
    first: tuple[str, str], then: tuple[str, str]
) -> None:
    assert cost_rank(*first) < cost_rank(*then)
