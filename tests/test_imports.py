"""Every module imports on its own, first, in a fresh process (no import loop depends on what
happened to be imported before), and the layering holds: state_pool/ and attention/ import
nothing from hybrid/ (and state_pool/, the lowest package, nothing from attention/ or graphs/
either), and importing one module of hybrid/ does not load the whole runtime.

A child process preloads the third-party libraries once (torch takes seconds to import and is
not what is checked here), then forks one grandchild per module, which imports that module first
and reports what it loaded. Optional packages may be absent (the [gpu] and [serve] extras): a
module that needs one is skipped, not failed.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("state_pool", "attention", "graphs", "hybrid")
# must not load any hybrid module
RUNTIME_FREE = ("state_pool", "attention")
# package -> the project packages it must not load (state_pool/ is the bottom of the import graph)
FORBIDDEN = {"state_pool": ("hybrid", "attention", "graphs"), "attention": ("hybrid", "graphs")}
# extras that may be missing: flashinfer, triton, mamba_ssm, causal_conv1d ([gpu]); fastapi, ... ([serve])
OPTIONAL = {"flashinfer", "triton", "mamba_ssm", "causal_conv1d", "fastapi", "starlette", "uvicorn",
            "prometheus_client"}

_CHILD = r"""
import importlib, json, os, sys
import numpy, torch  # preloaded: third-party, slow to import
names = json.loads(sys.argv[1])
results = {}
for name in names:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            out = {"ok": True, "modules": sorted(m for m in sys.modules if m.split(".")[0] in %r)}
        except ModuleNotFoundError as e:
            out = {"ok": False, "missing": e.name, "error": repr(e)}
        except BaseException as e:
            out = {"ok": False, "missing": None, "error": repr(e)}
        with os.fdopen(w, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    results[name] = json.loads(data) if data else {"ok": False, "missing": None, "error": "no report"}
print(json.dumps(results))
"""


def _modules() -> dict[str, str]:
    """Module name -> file, for every .py file of the packages (found on disk, not by importing)."""
    found = {}
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            for f in sorted(files):
                if not f.endswith(".py") or f == "__main__.py":  # __main__ runs the CLI
                    continue
                path = os.path.join(root, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


@pytest.fixture(scope="module")
def imported() -> dict[str, dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _CHILD % (PACKAGES,), json.dumps(sorted(MODULES))], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_first_and_alone(name, imported):
    r = imported[name]
    if not r["ok"] and r["missing"] and r["missing"].split(".")[0] in OPTIONAL:
        pytest.skip(f"{name} needs {r['missing']}, an optional package that is not installed")
    assert r["ok"], f"importing {name} first, in a fresh process, fails: {r['error']}"
    if name.split(".")[0] in RUNTIME_FREE:
        loaded = [m for m in r["modules"] if m == "hybrid" or m.startswith("hybrid.")]
        assert not loaded, f"importing {name} loads the runtime: {loaded}"
    forbidden = FORBIDDEN.get(name.split(".")[0], ())
    loaded = [m for m in r["modules"] if m.split(".")[0] in forbidden]
    assert not loaded, f"importing {name} loads packages above it: {loaded}"


def test_hybrid_batch_and_errors_do_not_load_the_runtime(imported):
    """What a kernel or a subsystem imports from hybrid/ brings the step contract, not the engine."""
    for name in ("hybrid", "hybrid.batch", "hybrid.errors"):
        loaded = {m for m in imported[name]["modules"] if m.split(".")[0] == "hybrid"}
        assert loaded <= {"hybrid", "hybrid.batch", "hybrid.errors"}, (name, sorted(loaded))


def test_public_names_resolve_lazily():
    import hybrid

    assert {"LLM", "SamplingParams", "RequestOutput", "HybridError"} <= set(dir(hybrid))
    from hybrid import LLM, SamplingParams  # noqa: F401
    from hybrid.llm import LLM as llm_class

    assert LLM is llm_class
    with pytest.raises(AttributeError):
        hybrid.no_such_name  # noqa: B018


def _static_imports(path: str) -> set[str]:
    """Project modules a file imports anywhere (module level, functions, TYPE_CHECKING blocks)."""
    deps = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            deps.add(node.module)
            deps.update(f"{node.module}.{a.name}" for a in node.names)
    return {d for d in deps if d in MODULES}


def test_layering_and_no_import_loops():
    """Statically, lazy and type-checking imports included: the runtime-free packages name nothing
    in hybrid/, and no two modules import each other, directly or around a loop."""
    graph = {name: _static_imports(path) - {name} for name, path in MODULES.items()}
    for name, deps in graph.items():
        if name.split(".")[0] in RUNTIME_FREE:
            assert not {d for d in deps if d.split(".")[0] == "hybrid"}, (name, sorted(deps))
        forbidden = FORBIDDEN.get(name.split(".")[0], ())
        assert not {d for d in deps if d.split(".")[0] in forbidden}, (name, sorted(deps))
    # strongly connected components (Tarjan): each one with more than one module is an import loop
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert loops == []
