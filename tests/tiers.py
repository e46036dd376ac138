"""The suite's tiers by cost, assigned from where a test lives and which fixtures it uses, so a
new test gets one without anyone marking it (tests/conftest.py applies them).

    pure     no server, no subprocess, no model: milliseconds
    bus      a real nats-server (a temporary one per test): tenths of a second
    process  `fleet` processes, runners or real models (mlx-lm, mflux): seconds
    faults   broker faults: servers and clusters killed, paused, restarted: a minute each
    browser  Debian's chromium against a real stack

A module can name its own tier (`pytestmark = pytest.mark.process`) where the rules cannot see
the cost (a subprocess started by hand); an explicit tier wins.
"""

from __future__ import annotations

from collections.abc import Iterable

TIERS = ("pure", "bus", "process", "faults", "browser")

# Fixtures that start a nats-server (directly or through the fixtures built on them).
BUS_FIXTURES = frozenset({"nats_server", "nats_url", "provisioned_nc"})
# Fixtures that build or load a model, or start `fleet worker` processes.
PROCESS_FIXTURES = frozenset(
    {"start_worker", "tiny_llm_dir", "tiny_embed_dir", "smollm2_dir", "tiny_flux2_dir",
     "tiny_vlm_dir"}
)
# Folders whose tests start processes or servers of their own: the least tier of each.
FOLDER_TIERS = {"bus": "bus", "integration": "process", "faults": "faults"}
# Modules (or one test: `path::name`) that start processes by hand (`fleet` commands,
# runners) or load a model without the fixtures above, or fuzz: what `--durations` showed.
FILE_TIERS = {
    "bus/test_auth_gen.py": "process",
    "bus/test_consumer_guard.py::test_a_running_worker_restores_its_durable_and_tasks_flow":
        "process",
    "bus/test_weights_resume.py": "process",
    "gateway/test_openapi.py::test_fuzzed_requests_never_get_a_server_error": "process",
    "commands/test_cli.py": "process",
    "commands/test_cli_settings.py": "process",
    "commands/test_demo.py": "process",
    "commands/test_exits.py": "process",
    "commands/test_proc.py": "process",
    "commands/test_settings_connect.py": "process",
    "commands/test_up_placement.py": "process",
    "dashboard/test_dashboard_demo.py": "process",
    "gateway/test_load.py": "process",
    "models/test_tiny_flux.py": "process",
    "runner/test_image_engine.py": "process",
    "runner/test_ring_watchdog.py": "process",  # its child imports mlx-lm: 2.5 s of CPU
    "test_layering.py": "process",
    "wire/test_schemas.py": "process",
    "worker/test_supervisor.py": "process",
}
# Tiers whose tests start processes: tests/conftest.py runs only a few of them at once.
HEAVY = ("process", "faults", "browser")
# The order in which xdist hands tests out: the longest first, so the short ones fill the
# gaps at the end instead of one worker finishing a minute-long test alone.
COST_ORDER = {"browser": 0, "faults": 1, "process": 2, "bus": 3, "pure": 4}
# Within a tier, the files that take minutes go first, longest first (`--durations` of the
# clean-clone runs, 2026-12-04): handed out last, as their folder's place in the alphabet had
# them (tests/integration/test_sharded*.py after everything else), they ran on alone at the
# end while the other workers had nothing left.
LONG_FILES = (
    "faults/test_broker_faults.py",
    "integration/test_sharded.py",
    "integration/test_sharded_reform.py",
    "integration/test_routing.py",
    "integration/test_continuation.py",
    "integration/test_continuation_kinds.py",
    "integration/test_text_flow.py",
    "integration/test_fair_stack.py",
    "integration/test_weights_flow.py",
    "integration/test_liveness.py",
    "gateway/test_load.py",
    "gateway/test_openai_stack.py",
    "integration/test_tracing.py",
    "integration/test_image_flow.py",
    "integration/test_continuation_chaos.py",
    "bench/test_sweeper_lease.py",
)


def cost_rank(tier: str, path: str) -> tuple[int, int]:
    """Where a test of `tier` in `path` (under tests/) comes in the run: costly tiers first,
    and within a tier the long files first. Pure."""
    long = LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)
    return COST_ORDER[tier], long


def tier_of(
    parts: tuple[str, ...], fixtures: Iterable[str], marked: Iterable[str] = (), name: str = ""
) -> str:
    """The tier of a test: `parts` is its file's path under tests/ (folders, then the file
    name), `fixtures` every fixture it uses (transitively), `marked` the marks it carries,
    `name` its function's name."""
    explicit = [name for name in TIERS if name in set(marked)]
    if explicit:
        return max(explicit, key=TIERS.index)
    if parts and "browser" in parts[-1]:
        return "browser"
    used = set(fixtures)
    found = ["pure"]
    if len(parts) > 1 and parts[0] in FOLDER_TIERS:
        found.append(FOLDER_TIERS[parts[0]])
    path = "/".join(parts)
    found.append(FILE_TIERS.get(f"{path}::{name}", FILE_TIERS.get(path, "pure")))
    if used & PROCESS_FIXTURES:
        found.append("process")
    if used & BUS_FIXTURES:
        found.append("bus")
    return max(found, key=TIERS.index)
