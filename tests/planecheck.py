"""A static check of who writes what: every statement of the package that writes a table
(``insert`` / ``update`` / ``delete`` / ``pg_insert`` calls, ``Table.insert()`` /
``.update()`` / ``.delete()``, ``text("INSERT|UPDATE|DELETE|TRUNCATE …")``, ``COPY … FROM``
texts, ``func.setval``, and calls of a helper that sends a ``TRUNCATE`` of the tables it is
given), the tables it writes, and whether the module that builds it is the module of their
plane (:func:`qstore.storage.planes.writer`).

Tables are found by evaluating the expressions that name them against a real
:class:`~qstore.schema.StorageSchema`: a parameter annotated ``StorageSchema`` /
``StorageContext`` is the declaration (or its context), one annotated ``Ring`` /
``RingFamily`` any ring / family of it, and simple local bindings are followed (``t =
sch.deferred``, ``c, le = sch.claims.parent, sch.leases.parent``, ``r, t, *_ =
ring.children(k)``, ``for ring in sch.rings``, ``[t for t, n in zip(kids, sizes) if n]``).
A write whose table cannot be found that way is reported too: name the table plainly.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Sequence as SaSequence
from sqlalchemy import Table

from qstore import QueueStorageConfig
from qstore.schema import storage_schema
from qstore.schema.rings import PARTITION_OF
from qstore.storage.context import StorageContext
from qstore.storage.planes import MODULES, writer

__all__ = ["EXCLUDED", "Write", "package_sources", "violations", "writes"]

ROOT = Path(__file__).resolve().parent.parent
#: Packages whose statements are the declaration itself (DDL, seed rows, revisions).
EXCLUDED = ("qstore.schema", "qstore.sql", "qstore.migrations")

SCH = storage_schema(QueueStorageConfig())
CTX = StorageContext(SCH)
_ANNOTATED: dict[str, list[Any]] = {
    "StorageSchema": [SCH],
    "StorageContext": [CTX],
    "Ring": list(SCH.rings),
    "RingFamily": [f for ring in SCH.rings for f in ring.families],
}
_DML = {"insert": "INSERT", "update": "UPDATE", "delete": "DELETE"}
_TEXT_WRITES = ("INSERT", "UPDATE", "DELETE", "TRUNCATE")
_PLANE_OF_MODULE = {module: plane for plane, module in MODULES.items()}


class Group:
    """A tuple or list literal (or a comprehension): each item's candidates."""

    def __init__(self, items: list[list[Any] | None]) -> None:
        self.items = items


Value = list[Any] | None  # the candidate objects an expression may be; None: unknown


@dataclass
class Env:
    """One scope: parameters (by annotation) and local bindings, evaluated on demand."""

    parent: Env | None
    params: dict[str, Value] = field(default_factory=dict)
    bindings: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    function: str | None = None
    positions: dict[str, int] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    _busy: set[str] = field(default_factory=set)

    def lookup(self, name: str) -> Value:
        if name in self.params:
            return self.params[name]
        if name in self.bindings:
            if name in self._busy:
                return None
            self._busy.add(name)
            try:
                out: list[Any] = []
                for source in self.bindings[name]:
                    got = self.source(source)
                    if got is None:
                        return None
                    out.extend(got)
                return out
            finally:
                self._busy.discard(name)
        return self.parent.lookup(name) if self.parent is not None else None

    def source(self, source: tuple[Any, ...]) -> Value:
        kind = source[0]
        if kind == "expr":
            return evaluate(source[1], self)
        if kind == "unknown":
            return None
        if kind == "elem":
            return elements(self.source(source[1]))
        # ("index", inner source, i)
        inner, i = source[1], source[2]
        if inner[0] == "expr" and isinstance(inner[1], ast.Tuple | ast.List) and len(inner[1].elts) > i:
            return evaluate(inner[1].elts[i], self)
        got = self.source(inner)
        if got is None:
            return None
        out: list[Any] = []
        for c in got:
            if isinstance(c, Group) and len(c.items) > i and c.items[i] is not None:
                out.extend(c.items[i] or [])
            elif isinstance(c, list | tuple) and len(c) > i:
                out.append(c[i])
            else:
                return None
        return out


def elements(value: Value) -> Value:
    """The elements of each candidate collection (None if one is not a collection)."""
    if value is None:
        return None
    out: list[Any] = []
    for c in value:
        if isinstance(c, Group):
            for item in c.items:
                if item is None:
                    return None
                out.extend(item)
        elif isinstance(c, list | tuple):
            out.extend(c)
        else:
            return None
    return out


def _slot_call(c: Any, method: str) -> Any:
    # any slot stands for the family: every child of a family has the family's owner
    return getattr(c, method)(0)


def evaluate(node: ast.AST, env: Env) -> Value:
    """The candidates of expression ``node`` in ``env`` (None when it cannot be told)."""
    if isinstance(node, ast.Name):
        return env.lookup(node.id)
    if isinstance(node, ast.Attribute):
        base = evaluate(node.value, env)
        if base is None:
            return None
        out = [getattr(c, node.attr) for c in base if not isinstance(c, Group) and hasattr(c, node.attr)]
        return out if len(out) == len(base) and out else None
    if isinstance(node, ast.Subscript):
        base = evaluate(node.value, env)
        if base is None:
            return None
        index = node.slice.value if isinstance(node.slice, ast.Constant) else None
        if index is not None and not isinstance(index, int):
            return None
        out = []
        for c in base:
            items = c.items if isinstance(c, Group) else c if isinstance(c, list | tuple) else None
            if items is None:
                return None
            picked = [items[index]] if index is not None and index < len(items) else list(items)
            for item in picked:
                if isinstance(c, Group):
                    if item is None:
                        return None
                    out.extend(item)
                else:
                    out.append(item)
        return out
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("children", "child"):
            base = evaluate(node.func.value, env)
            if base is None or not all(hasattr(c, node.func.attr) for c in base):
                return None
            return [_slot_call(c, node.func.attr) for c in base]
        if isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple", "sorted", "regclass") \
                and len(node.args) == 1:
            return evaluate(node.args[0], env)
        return None
    if isinstance(node, ast.Tuple | ast.List):
        items: list[list[Any] | None] = []
        for elt in node.elts:
            if isinstance(elt, ast.Starred):
                items.append(elements(evaluate(elt.value, env)))
            else:
                items.append(evaluate(elt, env))
        return [Group(items)]
    if isinstance(node, ast.ListComp | ast.GeneratorExp | ast.SetComp):
        if len(node.generators) != 1 or not isinstance(node.elt, ast.Name):
            return None
        gen = node.generators[0]
        if isinstance(gen.target, ast.Name) and gen.target.id == node.elt.id:
            return [Group([elements(evaluate(gen.iter, env))])]
        if isinstance(gen.target, ast.Tuple) and isinstance(gen.iter, ast.Call) \
                and isinstance(gen.iter.func, ast.Name) and gen.iter.func.id == "zip":
            for i, t in enumerate(gen.target.elts):
                if isinstance(t, ast.Name) and t.id == node.elt.id and i < len(gen.iter.args):
                    return [Group([elements(evaluate(gen.iter.args[i], env))])]
        return None
    if isinstance(node, ast.IfExp):
        a, b = evaluate(node.body, env), evaluate(node.orelse, env)
        return None if a is None or b is None else a + b
    if isinstance(node, ast.Starred):
        return elements(evaluate(node.value, env))
    return None


def writable(value: Value) -> list[Table | SaSequence] | None:
    """The tables and sequences ``value`` stands for (None if anything else is in it)."""
    if value is None:
        return None
    out: list[Table | SaSequence] = []
    for c in value:
        if isinstance(c, Table | SaSequence):
            out.append(c)
            continue
        if isinstance(c, Group):
            parts = [writable(item) for item in c.items]
        elif isinstance(c, list | tuple):
            parts = [writable(list(c))]
        else:
            return None
        for part in parts:
            if part is None:
                return None
            out.extend(part)
    return out


def mentioned(node: ast.AST, env: Env, depth: int = 3) -> list[Table | SaSequence]:
    """The tables and sequences any part of ``node`` stands for, following the local
    bindings of the names it uses (a text that quotes a table's name)."""
    out: list[Table | SaSequence] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and depth > 0:
            scope: Env | None = env
            while scope is not None and sub.id not in scope.bindings and sub.id not in scope.params:
                scope = scope.parent
            if scope is not None:
                for source in scope.bindings.get(sub.id, []):
                    if source[0] == "expr":
                        out.extend(mentioned(source[1], scope, depth - 1))
        if isinstance(sub, ast.Attribute | ast.Subscript | ast.Name):
            got = evaluate(sub, env)
            if got is not None:
                out.extend(c for c in got if isinstance(c, Table | SaSequence))
    return list({id(t): t for t in out}.values())


def _leading_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def _all_text(node: ast.Constant | ast.JoinedStr) -> str:
    """The literal parts of a string (the formatted values left out)."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    return "".join(str(v.value) if isinstance(v, ast.Constant) else " " for v in node.values)


def _params_used(node: ast.AST, env: Env) -> list[str]:
    """Names in ``node`` that are parameters of the innermost function with no known value
    (a connection aside)."""
    return sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in env.params
                   and env.params[n.id] is None and "Connection" not in env.annotations.get(n.id, "")})


@dataclass(frozen=True)
class Write:
    """One statement that writes: where it is built, what it does and to what."""

    module: str
    line: int
    kind: str  # INSERT | UPDATE | DELETE | TRUNCATE | COPY | setval
    targets: tuple[Table | SaSequence, ...] | None  # None: not resolved
    what: str

    def where(self) -> str:
        return f"{self.module.replace('.', '/')}.py:{self.line}"


@dataclass(frozen=True)
class Helper:
    """A function that sends a write of the tables one of its parameters holds."""

    name: str
    kind: str
    param: str
    position: int


def _imports(tree: ast.Module) -> dict[str, str]:
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name
    return names


def _bind(bindings: dict[str, list[tuple[Any, ...]]], target: ast.AST, source: tuple[Any, ...]) -> None:
    if isinstance(target, ast.Name):
        bindings.setdefault(target.id, []).append(source)
    elif isinstance(target, ast.Tuple | ast.List):
        for i, elt in enumerate(target.elts):
            if isinstance(elt, ast.Starred):
                _bind(bindings, elt.value, ("unknown",))
            else:
                _bind(bindings, elt, ("index", source, i))


def _collect(body: Iterable[ast.AST], bindings: dict[str, list[tuple[Any, ...]]]) -> None:
    """The bindings a scope's statements make (nested scopes excluded)."""
    for stmt in body:
        for node in _scope_nodes(stmt):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    _bind(bindings, t, ("expr", node.value))
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                _bind(bindings, node.target, ("expr", node.value))
            elif isinstance(node, ast.For | ast.AsyncFor):
                _bind(bindings, node.target, ("elem", ("expr", node.iter)))
            elif isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    if item.optional_vars is not None:
                        _bind(bindings, item.optional_vars, ("unknown",))
            elif isinstance(node, ast.NamedExpr):
                _bind(bindings, node.target, ("expr", node.value))


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp,
           ast.GeneratorExp, ast.DictComp)


def _scope_nodes(node: ast.AST) -> Iterator[ast.AST]:
    yield node
    if isinstance(node, _SCOPES):
        return
    for child in ast.iter_child_nodes(node):
        yield from _scope_nodes(child)


def _annotation(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(".")[-1]
    return None


def _function_env(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, parent: Env) -> Env:
    args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
    if node.args.vararg:
        args.append(node.args.vararg)
    if node.args.kwarg:
        args.append(node.args.kwarg)
    params: dict[str, Value] = {}
    for a in args:
        known = _ANNOTATED.get(_annotation(a.annotation) or "")
        params[a.arg] = list(known) if known is not None else None
    env = Env(parent, params, function=getattr(node, "name", None),
              positions={a.arg: i for i, a in enumerate([*node.args.posonlyargs, *node.args.args])},
              annotations={a.arg: ast.unparse(a.annotation) for a in args if a.annotation is not None})
    _collect(node.body if isinstance(node.body, list) else [node.body], env.bindings)
    return env


class _Scan:
    """Finds the writes (and the write helpers) of one module."""

    def __init__(self, module: str, tree: ast.Module, helpers: dict[str, Helper]) -> None:
        self.module = module
        self.imports = _imports(tree)
        self.helpers = helpers
        self.found: list[Write] = []
        self.new_helpers: dict[str, Helper] = {}
        env = Env(None)
        _collect(tree.body, env.bindings)
        self.visit(tree, env)

    def _sqlalchemy(self, name: str) -> str | None:
        full = self.imports.get(name)
        return full if full is not None and full.startswith("sqlalchemy") else None

    def visit(self, node: ast.AST, env: Env) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            for d in getattr(node, "decorator_list", []):
                self.visit(d, env)
            inner = _function_env(node, env)
            for child in (node.body if isinstance(node.body, list) else [node.body]):
                self.visit(child, inner)
            return
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            inner = Env(env)
            for gen in node.generators:
                self.visit(gen.iter, env if gen is node.generators[0] else inner)
                _bind(inner.bindings, gen.target, ("elem", ("expr", gen.iter)))
                for cond in gen.ifs:
                    self.visit(cond, inner)
            for part in ((node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,)):
                self.visit(part, inner)
            return
        if isinstance(node, ast.Call):
            self.call(node, env)
        if isinstance(node, ast.Constant | ast.JoinedStr):
            self.copy_text(node, env)
            if isinstance(node, ast.JoinedStr):
                return
        for child in ast.iter_child_nodes(node):
            self.visit(child, env)

    def add(self, node: ast.AST, kind: str, value: list[Table | SaSequence] | None, what: str) -> None:
        targets = tuple(value) if value else None
        self.found.append(Write(self.module, getattr(node, "lineno", 0), kind, targets, what))

    def call(self, node: ast.Call, env: Env) -> None:
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name is None:
            return
        src = ast.unparse(node)[:120]
        if isinstance(f, ast.Name) and (full := self._sqlalchemy(f.id)) is not None:
            last = full.rsplit(".", 1)[-1]
            if last in _DML and node.args:
                self.add(node, _DML[last], writable(evaluate(node.args[0], env)), src)
                return
            if last == "text" and node.args:
                self.text(node, node.args[0], env, src)
                return
        if isinstance(f, ast.Attribute):
            base = f.value
            module_alias = isinstance(base, ast.Name) and self._sqlalchemy(base.id) is not None \
                and base.id not in ("func",)
            if f.attr in _DML and module_alias and node.args:
                self.add(node, _DML[f.attr], writable(evaluate(node.args[0], env)), src)
                return
            if f.attr in _DML and not module_alias and not node.args and not node.keywords:
                self.add(node, _DML[f.attr], writable(evaluate(base, env)), src)
                return
            if f.attr == "setval" and node.args:
                self.add(node, "setval", writable(evaluate(node.args[0], env)), src)
                return
            if f.attr == "text" and module_alias and node.args:
                self.text(node, node.args[0], env, src)
                return
        helper = self.helpers.get(name)
        if helper is not None:
            arg = next((k.value for k in node.keywords if k.arg == helper.param), None)
            if arg is None and helper.position < len(node.args):
                arg = node.args[helper.position]
            self.add(node, helper.kind, writable(evaluate(arg, env)) if arg is not None else None,
                     f"{src} (sends {helper.kind})")

    def text(self, node: ast.Call, sql: ast.AST, env: Env, src: str) -> None:
        lead = _leading_text(sql)
        if lead is None:
            return
        kind = next((k for k in _TEXT_WRITES if lead.lstrip().upper().startswith(k)), None)
        if kind is None:
            return
        tables = mentioned(sql, env)
        if not tables:
            params = _params_used(sql, env)
            if params and env.function is not None and params[0] in env.positions:
                self.new_helpers[env.function] = Helper(env.function, kind, params[0], env.positions[params[0]])
                return
        self.add(node, kind, tables or None, src)

    def copy_text(self, node: ast.Constant | ast.JoinedStr, env: Env) -> None:
        lead = _leading_text(node)
        if lead is None or not re.match(r"\s*COPY\s.*\bFROM\b", _all_text(node), re.I | re.S):
            return
        self.add(node, "COPY", mentioned(node, env) or None, ast.unparse(node)[:120])


def writes(sources: dict[str, str]) -> list[Write]:
    """Every write built in ``sources`` (module name -> source text)."""
    trees = {m: ast.parse(s) for m, s in sources.items()}
    helpers: dict[str, Helper] = {}
    while True:  # a helper may call a helper: scan until no new one turns up
        scans = [_Scan(m, t, helpers) for m, t in trees.items()]
        found = {h.name: h for s in scans for h in s.new_helpers.values()}
        if found.keys() <= helpers.keys():
            return [w for s in scans for w in s.found]
        helpers.update(found)


def violations(sources: dict[str, str]) -> list[str]:
    """One line per write built outside its table's plane (or whose table is not named
    plainly enough to tell)."""
    out = []
    for w in writes(sources):
        plane = _PLANE_OF_MODULE.get(w.module)
        if w.targets is None:
            out.append(f"{w.where()}: cannot tell which table this {w.kind} writes ({w.what}); name the "
                       f"table plainly (e.g. `t = sch.deferred`, `insert(sch.done.parent)`, "
                       f"`ring.children(slot)`) so the plane check can see it")
            continue
        seen: set[str] = set()
        for target in w.targets:
            owner = writer(SCH, target, truncate=w.kind == "TRUNCATE")
            parent = target.info.get(PARTITION_OF) if isinstance(target, Table) else None
            name = f"{parent.name} (slot children)" if parent is not None else target.name
            if name in seen:
                continue
            seen.add(name)
            label = f"{w.kind} of {name}"
            if owner is None:
                out.append(f"{w.where()}: {label} writes an object of no plane ({w.what})")
            elif plane != owner:
                built = f"the {plane} plane" if plane is not None else w.module
                out.append(f"{w.where()}: {label} is the {owner} plane's write ({MODULES[owner]}) but is "
                           f"built in {built}: {w.what}")
    return out


def package_sources(root: Path = ROOT) -> dict[str, str]:
    """Every module of the package outside the declaration (:data:`EXCLUDED`)."""
    out = {}
    for path in sorted((root / "qstore").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        if not module.startswith(EXCLUDED):
            out[module] = path.read_text()
    return out

