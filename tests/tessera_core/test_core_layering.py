"""The layers import downward only: tessera_core (the shared database, object store, context and
Celery configuration) imports none of the parts built on it; the adapter registry does not import
the platform; the engine imports neither the registry, the platform nor the core. A newcomer who
adds such an import gets the file, the line and the name here rather than an import cycle later."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: package folder -> the top-level packages it must never import.
FORBIDDEN = {
    "tessera_core": {"adapter_registry", "tessera", "engine", "punica_kernels"},
    "adapter_registry": {"tessera"},
    "engine": {"adapter_registry", "tessera", "tessera_core"},
}


def _imported_packages(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `tree`, at module level or inside a
    function: `import a.b` and `from a.b import c` both give `a`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _violations(package: str) -> list[str]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    return [f"{p.relative_to(ROOT)}:{line} imports {name}"
            for p in files for line, name in _imported_packages(ast.parse(p.read_text(), str(p)))
            if name in FORBIDDEN[package]]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_the_layers_below_it(package):
    leaks = _violations(package)
    assert not leaks, "\n".join(leaks)


def test_the_scan_sees_an_upward_import():
    """The negative control: every form an import can take is seen, by its top-level package,
    and tessera_core is not mistaken for tessera."""
    for src, package in (("from adapter_registry.db import Base", "adapter_registry"),
                         ("import tessera.settings", "tessera"),
                         ("def f():\n    from engine.lora import source", "engine"),
                         ("from tessera import services", "tessera")):
        assert package in {name for _, name in _imported_packages(ast.parse(src))}, src
    assert {name for _, name in _imported_packages(ast.parse("from tessera_core.db import Base"))} == {"tessera_core"}
