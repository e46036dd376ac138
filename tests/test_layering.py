"""The import graph: the gateway never imports the engine package (one mlx import there would
load mlx into the HTTP process), and the wire types import no role package. Read from the
source with `ast`, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

FLEET = Path(__file__).resolve().parents[1] / "fleet"
ROLES = ("fleet.gateway", "fleet.worker", "fleet.runner", "fleet.commands", "fleet.trace",
         "fleet.models", "fleet.cli")
# Still to move: the runner pipe protocol belongs with the wire types (issue 17 "The house");
# until it does, wire/schemas.py and wire/examples.py read it to write schemas/.
KNOWN = {("fleet.wire.schemas", "fleet.runner.protocol"),
         ("fleet.wire.examples", "fleet.runner.protocol")}


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


def edges(package: str) -> set[tuple[str, str]]:
    folder = FLEET / package
    return {
        (module_name(path), imported)
        for path in folder.rglob("*.py")
        for imported in imports_of(path)
    }


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_gateway_imports_nothing_from_the_runner_or_mlx() -> None:
    bad = {(a, b) for a, b in edges("gateway") if within(b, ("fleet.runner", "mlx", "mlx_lm"))}
    assert bad == set()


def test_the_wire_imports_no_role_package() -> None:
    bad = {
        (a, b) for a, b in edges("wire")
        if within(b, ROLES) and not any(a == k[0] and k[1].startswith(b) for k in KNOWN)
    }
    assert bad == set()
