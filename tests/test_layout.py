"""The code's shape: the import graph of the project's own modules has no cycle (imports inside
functions counted, TYPE_CHECKING-only ones not), and the engine never imports the server."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxsched", "serving", "pallas_kernels")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):  # written by grpcio-tools
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports anywhere in its body (`from pkg import mod` counts
    as importing pkg.mod; `from mod import name` as importing mod)."""
    mods = _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    dep = full if full in mods else known(base)
                    if dep:
                        deps.add(dep)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 60 and "jaxsched.engine.core" in graph["jaxsched.engine.core_client"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    """A cycle through a function-level import is one: the check can fail."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_and_type_checking_imports(tmp_path, monkeypatch):
    """Imports inside functions count; those under `if TYPE_CHECKING:` do not."""
    pkg = tmp_path / "jaxsched"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from jaxsched import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jaxsched.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("jaxsched",))
    graph = import_graph()
    assert graph["jaxsched.a"] == {"jaxsched.b"} and graph["jaxsched.b"] == set()


def test_the_engine_and_the_benchmarks_do_not_import_the_server():
    graph = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith(("jaxsched", "pallas_kernels"))
                 for d in deps if d.split(".")[0] == "serving")
    assert not bad, bad


DOC = ROOT / "docs" / "PERFORMANCE.md"
# a pointer: the docs file, then the section's name in double quotes (a comment may wrap inside it)
_POINTER = re.compile(r'PERFORMANCE\.md(?:,|\'s)?\s*(?:#\s*)?"([^"]{1,100})"')


def _headings(text: str) -> set[str]:
    return {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")}


def test_performance_doc_is_a_reference():
    text = DOC.read_text()
    assert len(text.splitlines()) < 500
    assert not re.search(r"\b(?:[A-Z][a-z]+-)?[a-z]*(?:st|nd|rd|th) pass\b", text, re.IGNORECASE), "a dated pass in the docs"
    assert "## Decisions in the code" in text


def test_code_points_only_at_sections_that_exist():
    """Comments and docstrings that cite docs/PERFORMANCE.md name one of its headings (the decisions
    table, or a platform's section), never a dated pass."""
    headings = _headings(DOC.read_text())
    bad = []
    for path in [*(p for pkg in (*PACKAGES, "scripts", "tests") for p in (ROOT / pkg).rglob("*.py")),
                 ROOT / "Makefile", ROOT / "pyproject.toml"]:
        if path == Path(__file__):
            continue
        text = path.read_text()
        for m in _POINTER.finditer(text):
            if re.sub(r"\s*\n\s*#?\s*", " ", m.group(1)) not in headings:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(1)!r}")
        if re.search(r'"[A-Z][a-z]+(?:-[a-z]+)? pass"', text):
            bad.append(f"{path.relative_to(ROOT)}: names a pass")
    assert not bad, "\n".join(bad)


_ENV_READ = re.compile(r"\bos\.(environ|getenv|putenv|unsetenv)\b|\bfrom os import\b.*\b(environ|getenv)\b")


def test_environment_variables_are_read_in_envs_only():
    """Every variable the engine, the server or the kernels read or set goes through jaxsched/envs.py,
    where each is named and explained."""
    home = ROOT / "jaxsched" / "envs.py"
    found = []
    for pkg in ("jaxsched", "serving", "pallas_kernels"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path == home:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _ENV_READ.search(line.split("#", 1)[0]):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
    for code in ('x = os.environ.get("A")', "os.getenv('B')", "from os import environ", "os.environ['C'] = '1'"):
        assert _ENV_READ.search(code), code
