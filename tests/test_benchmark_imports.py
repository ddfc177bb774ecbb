"""The benchmarks share code through ``benchmarks/benchlib`` only: no benchmark changes the
module path to reach another script or the tests, and none imports another script. The one
path change allowed is the peer trainer's subprocess adding the peer's own install folder."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

BENCHMARKS = REPO / "benchmarks"
SHARED = "benchlib"
# (file under benchmarks/, enclosing function): the peer loader, whose subprocess imports
# speculators from the folder it was installed into
ALLOWED_PATH_CHANGES = {("benchlib/peer.py", "worker_main")}
PATH_CHANGES = {"insert", "append", "extend", "remove", "__setitem__", "__iadd__"}


def path_changes(path: Path) -> list[tuple[str, int]]:
    """(enclosing function or "<module>", line) of each ``sys.path.<change>(...)`` call and
    each assignment to ``sys.path`` in one file."""
    found = []

    def is_sys_path(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    def visit(node, where: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            where = node.name
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in PATH_CHANGES and is_sys_path(node.func.value)):
            found.append((where, node.lineno))
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        for target in targets:
            if is_sys_path(target) or (isinstance(target, ast.Subscript)
                                       and is_sys_path(target.value)):
                found.append((where, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def scripts() -> list[Path]:
    return sorted(BENCHMARKS.glob("*.py"))


def imported_top_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_finder_sees_path_changes(tmp_path):
    """The check can fail: each way of changing the path in a file is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, 'x')\n\ndef f():\n    sys.path.append('y')\n"
                   "    sys.path[:0] = ['z']\n    sys.path += ['w']\n")
    assert path_changes(bad) == [("<module>", 2), ("f", 5), ("f", 6), ("f", 7)]
    assert path_changes(BENCHMARKS / "benchlib" / "peer.py")  # the allowed one is seen


def test_no_benchmark_changes_the_module_path_but_the_peer_loader():
    changes = {(str(path.relative_to(BENCHMARKS)), where)
               for path in sorted(BENCHMARKS.rglob("*.py")) if ".peer" not in path.parts
               for where, _ in path_changes(path)}
    assert changes == ALLOWED_PATH_CHANGES


def test_no_benchmark_imports_another_script():
    """Code two benchmarks need lives in benchlib: a script imports no other script (nor the
    tests' conftest), and benchlib imports no script."""
    names = {path.stem for path in scripts()} | {"conftest"}
    offenders = {str(path.relative_to(BENCHMARKS)): sorted(imported_top_modules(path) & names)
                 for path in [*scripts(), *(BENCHMARKS / SHARED).rglob("*.py")]}
    assert {file: found for file, found in offenders.items() if found} == {}
    assert (BENCHMARKS / SHARED / "__init__.py").is_file()
