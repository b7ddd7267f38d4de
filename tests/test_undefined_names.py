"""Every name a module's code reads is defined: in the module, by an import, or as a builtin.

The GPU tests, the CUDA-only paths and the benchmarks never run on the CI machine, so a name lost in a
refactor there (a module constant deleted with the block around it) would surface only on the device,
as a NameError in every test that reaches it. Python's own symbol tables (`symtable`) say which names
each scope reads from the module: this test checks them for every source file of the project."""
from __future__ import annotations

import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hybrid", "state_pool", "attention", "graphs", "tests", "bench")
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__loader__",
                  "__package__", "__path__", "__annotations__"}


def _scopes(table: symtable.SymbolTable):
    yield table
    for child in table.get_children():
        yield from _scopes(child)


def undefined_names(source: str, filename: str) -> list[tuple[str, str]]:
    """(scope, name) for each name read from module scope that nothing defines."""
    top = symtable.symtable(source, filename, "exec")
    defined = set(dir(builtins)) | MODULE_DUNDERS
    defined |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    for scope in _scopes(top):  # `global x` then `x = ...` inside a function defines a module name
        defined |= {s.get_name() for s in scope.get_symbols() if s.is_declared_global() and s.is_assigned()}
    if "*" in {s.get_name() for s in top.get_symbols()}:
        return []  # a star import: the names it brings are not known here
    missing = []
    for scope in _scopes(top):
        for sym in scope.get_symbols():
            reads_module = sym.is_global() if scope is not top else not (sym.is_assigned() or sym.is_imported())
            if sym.is_referenced() and reads_module and sym.get_name() not in defined:
                missing.append((scope.get_name(), sym.get_name()))
    return missing


SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts)


def test_the_check_sees_a_lost_constant():
    src = "X = 1\n\ndef f():\n    return X + LOST\n\nclass C:\n    y = [LOST2 for _ in range(3)]\n"
    assert sorted(n for _, n in undefined_names(src, "m.py")) == ["LOST", "LOST2"]
    assert undefined_names("def g():\n    global Z\n    Z = 1\n\ndef h():\n    return Z\n", "m.py") == []


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_no_undefined_names(path: Path):
    missing = undefined_names(path.read_text(), str(path))
    assert not missing, f"{path.relative_to(ROOT)} reads names nothing defines: {missing}"
