"""Which library files a stage runs, found by reading its imports; and their content hash.

A stage's code is the transitive closure of the ``draftline`` modules its entry script (or module)
imports, at module top or inside functions, plus the modules it names in a string (``python -m
draftline.serving.server``, the vLLM connector module path): edit any of them and the stage is
stale.
Imports under ``if TYPE_CHECKING:`` are left out (they never run).

Standard library only, and never imports draftline: ``rules/common.smk`` loads this file by its
path so that the workflow parses with only Snakemake installed. Parsing is kept off the parse
time of the workflow by ``ImportCache`` (each file version is parsed once, then read from disk).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

PACKAGE = "draftline"
# a whole string literal naming a module: "-m", "draftline.serving.server" or a connector module
# path
_MODULE_STRING = re.compile(rf"""["'](?P<name>{PACKAGE}(?:\.[A-Za-z_]\w*)+)["']""")


class ImportResolutionError(ValueError):
    """A file imports a draftline module that does not exist."""


def module_file(src_root: Path, name: str) -> Path | None:
    """The file defining module ``name`` under ``src_root``: ``a/b.py`` or ``a/b/__init__.py``."""
    base = Path(src_root, *name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def module_name(src_root: Path, path: Path) -> str | None:
    """The dotted name of a file under ``src_root`` (None for a file outside it, e.g. a script)."""
    try:
        rel = Path(path).resolve().relative_to(Path(src_root).resolve())
    except ValueError:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_statements(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Every statement, nested ones included (function and class bodies, branches, handlers),
    except those under ``if TYPE_CHECKING:`` (its ``else`` runs). Expressions are not entered:
    an import is always a statement, and this is much faster than walking every node."""
    stack = list(body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, name, ()):
                # handlers (except) and match cases are not statements but hold a body
                stack.extend(child.body if not isinstance(child, ast.stmt) else [child])


def _absolute(base: str | None, level: int, package: str | None, path: Path) -> str | None:
    """The absolute module name of ``from <level dots><base> import ...`` in ``package``."""
    if level == 0:
        return base
    if package is None:
        raise ImportResolutionError(f"{path}: relative import outside the {PACKAGE} package")
    parts = package.split(".")
    if level - 1 >= len(parts):
        raise ImportResolutionError(f"{path}: relative import beyond the top of {package}")
    anchor = ".".join(parts[: len(parts) - (level - 1)])
    return f"{anchor}.{base}" if base else anchor


def _ours(name: str | None) -> bool:
    return name is not None and (name == PACKAGE or name.startswith(PACKAGE + "."))


def import_statements(source: bytes | str, filename: str = "<source>") -> list[list]:
    """The draftline imports a source runs, unresolved and JSON-ready: ``["import", name]``,
    ``["from", level, module, [names]]`` (relative ones kept: the package is not known here) and
    ``["named", name]`` for a module named in a string literal."""
    tree = ast.parse(source, filename=filename)
    found: list[list] = []
    for node in _runtime_statements(tree.body):
        if isinstance(node, ast.Import):
            found += [["import", a.name] for a in node.names if _ours(a.name)]
        elif isinstance(node, ast.ImportFrom) and (node.level or _ours(node.module)):
            found.append(["from", node.level, node.module or "", [a.name for a in node.names]])
    text = source.decode() if isinstance(source, bytes) else source
    found += [["named", m.group("name")] for m in _MODULE_STRING.finditer(text)]
    return found


class ImportCache:
    """Import statements by file content (sha256), kept in a JSON file between workflow parses:
    parsing is nearly all the cost. An unreadable file starts empty, an unwritable one is not
    kept; a stale entry cannot be hit (the key is the content)."""

    VERSION = 1

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path else None
        self.entries: dict[str, list] = {}
        self.used: set[str] = set()
        self.dirty = False
        if self.path is not None:
            try:
                data = json.loads(self.path.read_text())
                if data.get("version") == self.VERSION:
                    self.entries = dict(data["files"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass

    def statements(self, path: Path) -> list[list]:
        source = path.read_bytes()
        key = hashlib.sha256(source).hexdigest()
        if key not in self.entries:
            self.entries[key] = import_statements(source, str(path))
            self.dirty = True
        self.used.add(key)
        return self.entries[key]

    def save(self) -> None:
        """Write the entries used so far (dropping those of old file versions), if any is new."""
        if self.path is None or not self.dirty:
            return
        data = {"version": self.VERSION,
                "files": {k: v for k, v in self.entries.items() if k in self.used}}
        # Not draftline.core.atomic: rules/common.smk loads this module by its file path, where the
        # draftline package need not be importable; a cache needs no fsync either.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)  # concurrent parses: last one wins, none is torn
            self.dirty = False
        except OSError:
            tmp.unlink(missing_ok=True)


def imported_modules(path: Path | str, src_root: Path | str,
                     cache: ImportCache | None = None) -> set[str]:
    """The draftline modules one file imports or names, as dotted names (no transitivity).

    ``from a.b import c`` yields ``a.b``, and ``a.b.c`` too when ``c`` is a submodule.
    """
    path, src_root = Path(path), Path(src_root)
    statements = (cache or ImportCache()).statements(path)
    own = module_name(src_root, path)
    package = own if own is not None and path.name == "__init__.py" else (
        own.rpartition(".")[0] if own else None)
    found: set[str] = set()
    for kind, *rest in statements:
        if kind == "import":
            found.add(rest[0])
        elif kind == "from":
            level, module, names = rest
            base = _absolute(module or None, level, package, path)
            if not _ours(base):
                continue
            found.add(base)
            found.update(f"{base}.{n}" for n in names
                         if n != "*" and module_file(src_root, f"{base}.{n}"))
        elif module_file(src_root, rest[0]):  # named in a string: only when it is a module
            found.add(rest[0])
    return found


def _with_parents(name: str) -> list[str]:
    """Importing ``a.b.c`` runs ``a/__init__``, ``a/b/__init__`` and ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def import_closure(entries: Iterable[Path | str], src_root: Path | str,
                   cache: ImportCache | None = None) -> list[Path]:
    """The entry files and every draftline file they can run, sorted."""
    src_root = Path(src_root)
    cache = cache or ImportCache()
    seen: set[Path] = set()
    todo = [Path(e) for e in entries]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        if not path.is_file():
            raise ImportResolutionError(f"{path}: no such file")
        seen.add(path)
        for name in imported_modules(path, src_root, cache):
            for part in _with_parents(name):
                found = module_file(src_root, part)
                if found is None:
                    raise ImportResolutionError(f"{path} imports {name}: no module {part} "
                                                f"under {src_root}")
                todo.append(found)
    return sorted(seen)


def files_hash(paths: Iterable[Path | str], root: Path | str) -> str:
    """Content hash of files, each named by its path under ``root`` (a rename counts)."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def stage_code_hash(entry: Path | str, src_root: Path | str, root: Path | str,
                    extra: Iterable[Path | str] = (), cache: ImportCache | None = None) -> str:
    """The code hash of the stage run by ``entry``: its import closure and ``extra`` files."""
    closure = import_closure([entry], src_root, cache)
    if cache is not None:
        cache.save()
    return files_hash([*closure, *map(Path, extra)], root)
