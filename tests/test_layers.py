"""The supervisor's rooms and the packages' arrows (docs/architecture.md).

Read from the source with ``ast`` (no import runs): every ``import`` and
``from ... import`` of the product packages, resolved to a module name.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("supervisor", "engine", "watchdogs", "consensus", "dumps")
DECIDER = {"core", "multinode", "arbitration", "restart", "cli", "drills"}
ROOMS = ("processes", "observers", "incidents", "nodes", "relay")
# The relay is a process the supervisor runs, not part of the engine: of engine/ it imports only the stdlib-only
# definitions it shares with the built-in engine (the run dir's files, the OpenAI error vocabulary, the line format
# of the run's processes; ``engine`` itself: its __init__, which imports nothing), never a module that could pull
# torch or the engine's internals.
RELAY_SHARES_WITH_THE_ENGINE = {"engine", "engine.runfiles", "engine.openai_api", "engine.log"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run at import time: the module body, into ``try``/``if`` blocks except
    ``if TYPE_CHECKING:`` (functions and classes are not entered: a lazy import is no import-time edge)."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") != "TYPE_CHECKING":
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def _imports(path: Path, import_time: bool = False) -> set[str]:
    """Modules (``supervisor.processes.spawn``, ``dumps.bundle``, ...) a product file imports: anywhere
    in it, or (``import_time``) only those that run when it is imported."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in _top_level(tree) if import_time else ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            name = name.removeprefix("tp_supervise.")
            if name.split(".")[0] in PRODUCT:
                out.add(name)
    return out


def _product_files() -> list[Path]:
    return [p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py") if "_hook" not in p.parts]


def _graph(import_time: bool = False) -> dict[str, set[str]]:
    modules = {_module(p) for p in _product_files()}
    graph = {}
    for p in _product_files():
        graph[_module(p)] = {m for m in _imports(p, import_time) if m in modules and m != _module(p)}
    return graph


def test_the_top_of_supervisor_is_small():
    top = sorted(p.name for p in (ROOT / "supervisor").glob("*.py"))
    assert len(top) <= 14, top


def test_every_room_says_what_lives_there():
    for room in (*ROOMS, "rank"):
        doc = ast.get_docstring(ast.parse((ROOT / "supervisor" / room / "__init__.py").read_text()))
        assert doc and len(doc) > 200, f"supervisor/{room}/__init__.py needs its docstring"


def test_no_two_product_modules_share_a_file_name():
    seen: dict[str, list[str]] = defaultdict(list)
    for p in _product_files():
        if p.name not in ("__init__.py", "__main__.py"):
            seen[p.name].append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}


def test_arrows_point_down():
    graph = _graph()
    wrong = []
    for mod, deps in graph.items():
        top = mod.split(".")[0]
        for dep in deps:
            # the other packages use only the rank side of supervisor/
            if top in ("dumps", "watchdogs", "consensus", "engine") and dep.startswith("supervisor.") \
                    and not dep.startswith("supervisor.rank"):
                wrong.append(f"{mod} -> {dep}")
            # the rank side imports nothing outside itself
            if mod.startswith("supervisor.rank") and not dep.startswith("supervisor.rank"):
                wrong.append(f"{mod} -> {dep}")
            # rooms never import the decider
            parts = mod.split(".")
            if len(parts) > 2 and parts[1] in ROOMS and dep.split(".")[:2] in (["supervisor", d] for d in DECIDER):
                wrong.append(f"{mod} -> {dep}")
    assert wrong == []


def test_the_relay_uses_only_what_it_shares_with_the_engine():
    graph = _graph()
    used = {d for mod, deps in graph.items() if mod.startswith("supervisor.relay") for d in deps if d.startswith("engine")}
    assert used <= RELAY_SHARES_WITH_THE_ENGINE
    rank_side = {m for m in graph if m.startswith("supervisor.rank")}
    for shared in RELAY_SHARES_WITH_THE_ENGINE:
        assert graph[shared] <= RELAY_SHARES_WITH_THE_ENGINE | rank_side, shared
    assert sorted(p.name for p in (ROOT / "engine").glob("*relay*")) == [], "the relay lives in supervisor/relay/"


def test_the_spec_does_not_import_the_engine():
    assert not {d for d in _graph()["supervisor.spec"] if d.startswith("engine")}


def test_no_import_circle_between_modules():
    """Counting every import, a lazy one inside a function included: a circle broken only by deferring an
    import is still two modules that need each other."""
    graph = _graph()
    state: dict[str, int] = {}
    circle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                circle.extend(stack[stack.index(dep):] + [node, dep] if dep in stack else [node, dep])
                return True
            if dep not in state and visit(dep, stack + [node]):
                return True
        state[node] = 2
        return False

    for node in sorted(graph):
        if node not in state and visit(node, []):
            break
    assert circle == []

