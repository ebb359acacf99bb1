"""Run a module as a fresh install without the test extras would: `python runtime_only.py MODULE ARGS...`.

Every distribution that only the project's test extras bring in (torch, pytest, openai, ...) is
made invisible before MODULE runs, as if it were not installed: `import torch` raises
ModuleNotFoundError, `importlib.util.find_spec("torch")` is None and importlib.metadata does not
list it, so libraries that probe for optional packages (transformers does) take the same path as
on a machine where `make serve` installed only the runtime dependencies.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import runpy
import sys

from packaging.requirements import Requirement

PROJECT = "jaxsched"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots: list[Requirement], extra: str = "") -> set[str]:
    """Distributions `roots` pull in (installed ones only), following requirements whose markers hold."""
    seen: set[str] = set()
    todo = [r for r in roots if r.marker is None or r.marker.evaluate({"extra": extra})]
    while todo:
        name = _norm(todo.pop().name)
        if name in seen:
            continue
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [r for r in map(Requirement, reqs) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen


def test_only_distributions() -> set[str]:
    reqs = [Requirement(r) for r in md.requires(PROJECT) or []]
    runtime = _closure(reqs)
    extras = {e for r in reqs if r.marker is not None for e in re.findall(r'extra == "([^"]+)"', str(r.marker))}
    test_extras = [e for e in extras if e not in ("cuda",)]  # cuda is a runtime variant, not a test tool
    with_tests = set().union(*(_closure(reqs, e) for e in test_extras)) if test_extras else set()
    # a virtualenv's own tooling (setuptools loads a .pth hook at start-up) is not the project's choice
    return with_tests - runtime - {"pip", "setuptools", "wheel"}


def hidden_modules(dists: set[str]) -> set[str]:
    """Top-level import names of `dists`."""
    names = set()
    for top, owners in md.packages_distributions().items():
        if any(_norm(o) in dists for o in owners):
            names.add(top)
    return names


class _Hide:
    """Wraps one sys.meta_path finder so that it does not see the hidden modules or distributions."""

    def __init__(self, finder, modules: set[str], dists: set[str]) -> None:
        self.finder, self.modules, self.dists = finder, modules, dists

    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] in self.modules:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def find_distributions(self, context=None):
        context = context if context is not None else md.DistributionFinder.Context()
        find = getattr(self.finder, "find_distributions", None)
        for d in find(context) if find else ():
            if _norm(d.metadata["Name"] or "") not in self.dists:
                yield d

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


def main() -> None:
    dists = test_only_distributions()
    modules = hidden_modules(dists)
    assert {"pytest", "openai"} <= modules, f"pytest and openai should be test-only, found {sorted(dists)}"
    loaded = sorted(m for m in sys.modules if m.split(".", 1)[0] in modules)
    assert not loaded, f"already imported before hiding: {loaded}"
    sys.meta_path[:] = [_Hide(f, modules, dists) for f in sys.meta_path]
    importlib.invalidate_caches()
    assert importlib.util.find_spec("torch") is None, "hiding torch did not work"
    print(f"runtime_only: hiding {', '.join(sorted(modules))}", file=sys.stderr, flush=True)
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
