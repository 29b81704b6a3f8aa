"""The project's import graph: every cycle among its own modules and every import against the direction of the pure
rules, printed, and a non-zero exit when there is one.

A cycle is an owner and a collaborator that know each other: neither can be
read, tested or moved alone. The rule (``docs/design.md``) is that a
collaborator gets a narrow port (an explicit object, or a
``typing.Protocol``), never its owner.

The direction: kvpush's rules are pure machines (``kvpush/README.md``), so ``kvpush.core``, ``kvpush.prefill``,
``kvpush.decode`` and the settings they follow (``kvpush.config``) import only each other, each as ``PURE`` says,
and nothing of the shells (``transport``, ``engine``, ``observability``, ``integrations``, the backends): a name
a rule needs moves down into ``core``, or comes in as a value. A pure module breaks it with an import of its own
(of any kind: one under ``TYPE_CHECKING`` names a shell's type all the same), or by running such an import when
it is imported: through a module it may import (``config``), or through a package's ``__init__``, which Python
runs before any module of the package (``kvpush/__init__.py`` must stay lazy).

This check keeps both in CI::

    python -m kvpush_tools.imports kvpush tools/kvpush_tools backends/cuda/kvpush_cuda \
        backends/neuron/kvpush_neuron tests

Each argument is a package directory (its name is the package's: ``tools/kvpush_tools`` holds
``kvpush_tools.*``) or a plain directory of top-level modules (``tests``, whose helpers are imported
as ``procs``, ``helpers_layout``, ...). Modules are read with ``ast``, never imported.

Every import statement counts, wherever it stands, and each edge says which kind it is:

- ``module``: at module level (in a ``try`` or ``if`` too): runs when the module is imported;
- ``function``: inside a function or method: runs later, but it is still a dependency, and moving an
  import into a function is the usual way of hiding a cycle rather than removing it;
- ``typing``: under ``if TYPE_CHECKING:``: never runs, so it makes no cycle at run time, but a
  collaborator naming its owner's type is the very back-reference this rule forbids.

Only explicit imports make edges: importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``,
but that holds for every module of a package and is no dependency of the importer's own making.
``from a.b import c`` is an edge to the module ``a.b.c`` where there is one, else to ``a.b``.
Imports of modules outside the given directories (the standard library, vLLM, NIXL) are ignored. The direction
is checked where the modules ``PURE`` names are among them.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

KINDS = ("module", "function", "typing")
RUNS = frozenset({"module", "function"})
"""The kinds of import that run (when the module is imported, or when its function is called)."""

PURE: dict[str, tuple[str, ...]] = {
    "kvpush.core": ("kvpush.config",),
    "kvpush.config": ("kvpush.core",),
    "kvpush.prefill": ("kvpush.core", "kvpush.config"),
    "kvpush.decode": ("kvpush.core", "kvpush.config"),
}
"""kvpush's pure packages (and module), each with what it may import besides its own modules. ``core`` and
``config`` import each other's modules (a plan follows the settings, the settings raise ``core``'s errors),
never in a cycle; ``prefill`` (P's rules) and ``decode`` (D's) build on both and never on each other."""


@dataclass(frozen=True)
class Edge:
    """``src`` imports ``dst`` at ``path:line``; ``kind``: one of ``KINDS``."""

    src: str
    dst: str
    kind: str
    path: str
    line: int


def modules(roots: Iterable[Path]) -> dict[str, Path]:
    """Every module under the roots, by dotted name (a package by its own name, read from ``__init__.py``)."""
    found: dict[str, Path] = {}
    for root in roots:
        root = root.resolve()
        if not root.is_dir():
            raise SystemExit(f"imports: {root} is not a directory")
        package = (root / "__init__.py").is_file()
        base = root.parent if package else root
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if not parts or not all(p.isidentifier() for p in parts):
                continue  # a script in a directory whose name is no module's (``bench/ablation-x/``)
            if not package and len(parts) > 1 and not (path.parent / "__init__.py").is_file():
                continue  # a loose file below a plain directory: not importable by that name
            name = ".".join(parts)
            if parts[-1] == "conftest":  # pytest loads each by its path, and nothing imports one: keep them apart
                name = f"{path.parent}/{name}"
            elif name in found and found[name] != path:
                print(f"imports: {name} is both {found[name]} and {path}; the second is read", file=sys.stderr)
            found[name] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement with its kind."""

    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, kind
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(child, "function" if kind == "module" else kind)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    yield from walk(tree, "module")


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The project's modules one import statement of module ``name`` names."""

    def owning(dotted: str) -> str | None:  # the longest known module that ``dotted`` is or lies in
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            cand = ".".join(parts[:n])
            if cand in known:
                return cand
        return None

    if isinstance(node, ast.Import):
        return [m for a in node.names if (m := owning(a.name)) is not None]
    if node.level:
        here = name.split(".") if is_package else name.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)] if node.level > 1 else here
        base = ".".join([*here, node.module] if node.module else here)
    else:
        base = node.module or ""
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        m = sub if sub in known else owning(base)
        if m is not None:
            out.append(m)
    return out


def edges(known: dict[str, Path]) -> list[Edge]:
    """Every import edge between the project's modules (self-imports left out)."""
    out: dict[Edge, None] = {}  # one edge per statement and target, in order
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        shown = _shown(path)
        for node, kind in _imports(tree):
            for dst in _targets(node, name, path.name == "__init__.py", known):
                if dst != name:
                    out[Edge(name, dst, kind, shown, node.lineno)] = None
    return list(out)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def components(nodes: Iterable[str], graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def _one_cycle(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first within the component)."""
    start, inside = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, set()) & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def report(found: list[Edge], kinds: frozenset[str]) -> tuple[list[list[str]], str]:
    """The cycles among edges of ``kinds``, and the text that names each with the lines that make it."""
    used = [e for e in found if e.kind in kinds]
    graph: dict[str, set[str]] = {}
    for e in used:
        graph.setdefault(e.src, set()).add(e.dst)
    comps = components({e.src for e in used} | {e.dst for e in used}, graph)
    lines = []
    for i, comp in enumerate(comps, 1):
        lines.append(f"cycle {i}: {' -> '.join(_one_cycle(comp, graph))}")
        inside = set(comp)
        for e in sorted(used, key=lambda e: (e.src, e.dst, e.line)):
            if e.src in inside and e.dst in inside:
                lines.append(f"  {e.src} -> {e.dst}  ({e.kind}, {e.path}:{e.line})")
    return comps, "\n".join(lines)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def pure_rule(name: str) -> str | None:
    """The ``PURE`` package (or module) that module ``name`` lies in, if any."""
    return next((p for p in PURE if _within(name, p)), None)


def may_import(rule: str, dst: str) -> bool:
    """Whether a module under ``rule`` may import (or run) ``dst``: its own package's, those ``PURE`` lists, and
    the packages above them (whose ``__init__`` runs first anyway; what it imports is checked in turn)."""
    allowed = (rule, *PURE[rule])
    return any(_within(dst, a) or a.startswith(dst + ".") for a in allowed)


@dataclass(frozen=True)
class Breach:
    """``edge`` goes against ``rule``'s direction: an import of the pure module itself (``via`` empty), or one
    that runs when ``via[0]``, a module under ``rule``, is imported (``via``: the modules in between, each run
    by the one before: imported, or a package above it)."""

    edge: Edge
    rule: str
    via: tuple[str, ...] = ()


def breaches(found: list[Edge], known: dict[str, Path]) -> list[Breach]:
    """Every import against ``PURE``'s direction, with the shortest chain by which a pure module runs it."""
    out: dict[tuple[Edge, str], Breach] = {}
    by_src: dict[str, list[Edge]] = {}
    for e in found:
        by_src.setdefault(e.src, []).append(e)

    def parents(name: str) -> list[str]:  # the packages whose ``__init__`` runs before ``name``
        parts = name.split(".")
        return [p for n in range(len(parts) - 1, 0, -1) if (p := ".".join(parts[:n])) in known]

    for start in sorted(known):
        rule = pure_rule(start)
        if rule is None:
            continue
        for e in by_src.get(start, ()):  # its own imports, of every kind
            if not may_import(rule, e.dst):
                out.setdefault((e, rule), Breach(e, rule))
        paths: dict[str, tuple[str, ...]] = {start: (start,)}  # breadth first: the shortest chains
        frontier = [start]
        while frontier:
            nxt = []
            for v in frontier:
                for e in by_src.get(v, ()):
                    if e.kind not in RUNS or e.dst in paths:
                        continue
                    if not may_import(rule, e.dst):
                        known_via = out.get((e, rule))
                        if v != start and (known_via is None or len(paths[v]) < len(known_via.via)):
                            out[(e, rule)] = Breach(e, rule, paths[v])
                        continue
                    paths[e.dst] = (*paths[v], e.dst)
                    nxt.append(e.dst)
                for p in parents(v):
                    if p not in paths:
                        paths[p] = (*paths[v], p)
                        nxt.append(p)
            frontier = nxt
    return sorted(out.values(), key=lambda b: (b.edge.src, b.edge.dst, b.edge.line, b.rule, len(b.via), b.via))


def breach_report(found: list[Breach]) -> tuple[int, str]:
    """How many imports go against the direction, and the text that names each with what it breaks."""
    edges: dict[Edge, list[Breach]] = {}
    for b in found:
        edges.setdefault(b.edge, []).append(b)
    lines = []
    for i, (e, bs) in enumerate(edges.items(), 1):
        lines.append(f"forbidden import {i}: {e.src} -> {e.dst}  ({e.kind}, {e.path}:{e.line})")
        for b in bs:
            may = ", ".join((b.rule, *PURE[b.rule]))
            if not b.via:
                lines.append(f"  {b.rule} is pure: it may import only {may}")
        shown: set[str] = set()
        for b in sorted((b for b in bs if b.via), key=lambda b: (len(b.via), b.via)):
            if b.rule in shown:
                continue
            shown.add(b.rule)
            chain = " -> ".join((*b.via, e.dst))
            lines.append(f"  runs when pure {b.rule} is imported: {chain}")
    return len(edges), "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush_tools.imports", description=__doc__.split("\n")[0])
    ap.add_argument("roots", nargs="+", type=Path, help="package directories, or directories of top-level modules")
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"the import kinds that count, comma-separated (default: all of {','.join(KINDS)})",
    )
    args = ap.parse_args(argv)
    kinds = frozenset(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds <= set(KINDS):
        ap.error(f"unknown kinds {sorted(kinds - set(KINDS))}: pick from {', '.join(KINDS)}")
    known = modules(args.roots)
    found = edges(known)
    comps, text = report(found, kinds)
    forbidden, against = breach_report(breaches(found, known))
    if comps:
        print(text)
        print(f"imports: {len(comps)} import cycle(s) among {len(known)} modules")
    if forbidden:
        print(against)
        print(f"imports: {forbidden} import(s) against the direction of the pure rules (kvpush/README.md)")
    if comps or forbidden:
        return 1
    print(
        f"imports: no import cycle among {len(known)} modules ({len(found)} imports), "
        "and no import against the pure rules' direction"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
