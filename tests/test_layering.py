"""The import graph, rule by rule. Read from the source with `ast`, so a lazy import inside a
function counts too; one rule is checked in a fresh interpreter, for what an import pulls in
transitively.

The layers: the wire types (`fleet.wire`) at the bottom; the libraries every process shares
(`fleet.bus`, `fleet.models`, `fleet.trace` and the top-level modules such as `fleet.errors`);
the roles, one per process kind (the HTTP side: gateway and the dashboard mounted on it; the
worker; the runner); and the composition roots that start roles (`fleet.commands`, `fleet.cli`).
Between packages (a subpackage of fleet, or one of its top-level modules) the imports form no
cycle: each package can be read, tested and changed knowing only what is below it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

FLEET = Path(__file__).resolve().parents[1] / "fleet"
HTTP_SIDE = ("fleet.gateway", "fleet.dashboard")
ROLES = {"http": HTTP_SIDE, "worker": ("fleet.worker",), "runner": ("fleet.runner",)}
ROOTS = ("fleet.commands", "fleet.cli")
ENGINES = ("mlx", "mlx_lm", "mflux", "torch")


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(FLEET.parent).with_suffix("").parts).removesuffix(
        ".__init__")


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


# Parsed once, when a test first asks, not at import: collection imports this module in every
# xdist worker, and parsing all of fleet cost 1.4 s of CPU there.
@cache
def all_edges() -> frozenset[tuple[str, str]]:
    return frozenset(
        (module_name(path), imported)
        for path in FLEET.rglob("*.py")
        for imported in imports_of(path)
    )


def edges_from(packages: tuple[str, ...]) -> set[tuple[str, str]]:
    return {(a, b) for a, b in all_edges() if within(a, packages)}


def test_the_gateway_imports_nothing_from_the_runner_the_worker_or_an_engine() -> None:
    bad = {(a, b) for a, b in edges_from(HTTP_SIDE)
           if within(b, ("fleet.runner", "fleet.worker", *ENGINES))}
    assert bad == set()


def test_importing_the_gateway_loads_no_engine_and_no_other_role() -> None:
    """Transitively: one mlx import anywhere below the gateway would load mlx into the HTTP
    process."""
    probe = (
        "import sys, fleet.gateway.app\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{ENGINES!r} or m.startswith(('fleet.runner', 'fleet.worker', 'fleet.commands'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_building_the_cli_loads_no_http_side() -> None:
    """Every `fleet` process builds the whole parser, each worker among them: the gateway,
    the dashboard and httpx load only in the commands that serve or call HTTP (0.35 s of CPU
    a process when they loaded here)."""
    probe = (
        "import sys, fleet.cli\n"
        "fleet.cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('httpx', 'starlette') "
        "or m.startswith(('fleet.gateway.app', 'fleet.dashboard'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_the_wire_imports_nothing_but_the_wire() -> None:
    bad = {(a, b) for a, b in edges_from(("fleet.wire",))
           if within(b, ("fleet",)) and not within(b, ("fleet.wire",))}
    assert bad == set()


def test_the_shared_libraries_import_no_role_and_no_command() -> None:
    roles = tuple(p for packages in ROLES.values() for p in packages) + ROOTS
    shared = {(a, b) for a, b in all_edges() if not within(a, roles)}
    bad = {(a, b) for a, b in shared if within(b, roles)}
    assert bad == set()


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_role_imports_no_other_role_and_no_command(role: str) -> None:
    """Roles meet only through the wire and the bus; commands start them, never the reverse."""
    others = tuple(p for name, packages in ROLES.items() if name != role for p in packages)
    bad = {(a, b) for a, b in edges_from(ROLES[role]) if within(b, (*others, *ROOTS))}
    assert bad == set()


def package_of(name: str) -> str | None:
    """`fleet.gateway.app` -> `fleet.gateway`; a top-level module is a package of its own."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "fleet" and len(parts) > 1 else None


def package_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The packages that import each other, directly or around a loop: each strongly
    connected part of the package graph bigger than one package, sorted (pure)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        pa, pb = package_of(a), package_of(b)
        if pa and pb and pa != pb:
            graph.setdefault(pa, set()).add(pb)

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            for nxt in graph.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    reach = {package: reachable(package) for package in graph}
    loops = {tuple(sorted(p for p in reach if p in reach[start] and start in reach[p]))
             for start in reach if start in reach[start]}
    return sorted(list(loop) for loop in loops)


@pytest.mark.parametrize(("edges", "cycles"), [
    (set(), []),
    ({("fleet.a.x", "fleet.b.y"), ("fleet.b.y", "fleet.c")}, []),
    ({("fleet.a.x", "fleet.a.y"), ("fleet.a.y", "fleet.a.x")}, []),  # within a package
    ({("fleet.a.x", "fleet.b.y"), ("fleet.b.z", "fleet.a.w")}, [["fleet.a", "fleet.b"]]),
    ({("fleet.a", "fleet.b.y"), ("fleet.b.y", "fleet.c.z"), ("fleet.c", "fleet.a.Name"),
      ("fleet.d", "fleet.a")}, [["fleet.a", "fleet.b", "fleet.c"]]),
    ({("fleet.a.x", "nats.aio"), ("nats", "fleet.a")}, []),  # only fleet's own packages
])
def test_package_cycles_finds_every_loop(
        edges: set[tuple[str, str]], cycles: list[list[str]]) -> None:
    assert package_cycles(edges) == cycles


def test_no_import_cycle_between_packages() -> None:
    assert package_cycles(set(all_edges())) == []


def test_the_dashboard_reaches_the_gateway_only_through_its_surface() -> None:
    """The gateway never imports the dashboard (fleet/commands/gateway.py mounts it); the
    dashboard imports one small module of the gateway's."""
    assert {(a, b) for a, b in edges_from(("fleet.gateway",))
            if within(b, ("fleet.dashboard",))} == set()
    bad = {(a, b) for a, b in edges_from(("fleet.dashboard",))
           if within(b, ("fleet.gateway",)) and not within(b, ("fleet.gateway.surface",))}
    assert bad == set()
