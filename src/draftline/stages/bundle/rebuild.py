"""The rebuild check: does this bundle come from that results folder?

The bundle is rebuilt from the results folder, with the config the bundle itself carries
(``resolved_config.yaml``), into a temporary place; the two are then compared member by member.
Only the artifact's inputs reach the bundle's bytes (the command line, host and time go to the
build record), so a bundle built from the same results is byte for byte the same.

Paths the bundle records (a built-in target's folder, the serving commands' draft path, input
sources) are spelt from the config's ``results`` key, as the workflow spells them, so the
rebuild runs from the folder in which that key names ``RESULTS_DIR``: the workflow directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from draftline.core.atomic import sha256_file
from draftline.core.builtin_targets import is_builtin
from draftline.core.layout import Layout
from draftline.stages.bundle.archive import (
    MANIFEST,
    README,
    VerifyError,
    sort_key,
    walk_files,
)
from draftline.stages.bundle.build import build_bundle
from draftline.stages.bundle.inputs import BundleInputs
from draftline.stages.bundle.verify import checked, verify_bundle

CONFIG_NAME = "resolved_config.yaml"
DERIVED = (README, MANIFEST)  # written from the other members: they differ whenever those do


@dataclass
class RebuildResult:
    """How a bundle compares with its rebuild. ``differing`` lists the members that differ,
    the most telling first: inputs in archive order, then the card and the manifest."""

    bundle: Path
    rebuilt_sha256: str
    bundle_sha256: str | None  # None for a bundle folder
    differing: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differing


def rebuild_check(results_dir: str | Path, bundle: str | Path,
                  env: Mapping[str, str] | None = None) -> RebuildResult:
    """Rebuild ``bundle`` (a folder or an archive) from ``results_dir`` in a temporary place and
    compare. Raises VerifyError when the bundle fails its own manifest (its config would not be
    trustworthy), FileNotFoundError when either is missing."""
    bundle, results_dir = Path(bundle), Path(results_dir)
    if not results_dir.is_dir():
        raise FileNotFoundError(f"{results_dir}: no such results folder")
    verify_bundle(bundle)
    config = yaml.safe_load(_read_member(bundle, CONFIG_NAME))
    with tempfile.TemporaryDirectory(prefix="draftline-rebuild-") as tmp, \
            _in_workflow_dir(results_dir, config["results"]) as results:
        lay, out = Layout(results), Layout(tmp)
        model = (str(lay.target) if is_builtin(config["target"]["model"])
                 else config["target"]["model"])
        draft_ref = config.get("bundle", {}).get("hf_repo") or lay.bundle.as_posix()
        build_bundle(BundleInputs.from_results(results), out.bundle, out.bundle_tar,
                     config=config, model=model, draft_ref=draft_ref, env=env,
                     build_record=out.bundle_build_record)
        rebuilt = out.bundle if bundle.is_dir() else out.bundle_tar
        return RebuildResult(
            bundle=bundle, rebuilt_sha256=sha256_file(out.bundle_tar),
            bundle_sha256=None if bundle.is_dir() else sha256_file(bundle),
            differing=_differing(_members(bundle), _members(rebuilt)))


@contextlib.contextmanager
def _in_workflow_dir(results_dir: Path, results_key: str) -> Iterator[Path]:
    """Run from the folder in which the config's ``results`` names ``results_dir``, and yield
    that name: the bundle records paths as the workflow spelt them."""
    named = Path(results_key)
    actual = results_dir.resolve()
    if named.is_absolute():
        if named.resolve() != actual:
            raise VerifyError(f"the bundle was built from the results folder {results_key} "
                              f"(config key results, an absolute path, recorded in the "
                              f"bundle); {results_dir} is another folder")
        yield named
        return
    tail = actual.parts[len(actual.parts) - len(named.parts):]
    if ".." in named.parts or tuple(tail) != named.parts:
        raise VerifyError(f"the bundle was built from the results folder {results_key!r} (config "
                          f"key results, recorded in the bundle); {results_dir} is not named so")
    workflow_dir = Path(*actual.parts[:len(actual.parts) - len(named.parts)])
    with contextlib.chdir(workflow_dir):
        yield named


def _read_member(bundle: Path, name: str) -> bytes:
    if bundle.is_dir():
        return (bundle / name).read_bytes()
    with tarfile.open(bundle) as tar:
        manifest = next(m.name for m in tar if Path(m.name).name == MANIFEST)
        return tar.extractfile(manifest[: -len(MANIFEST)] + name).read()


def _members(path: Path) -> dict[str, tuple]:
    """Member name (below the bundle's top folder) -> what its bytes in the archive depend on:
    the header fields draftline sets and the content's SHA-256. In archive order."""
    if path.is_dir():
        return {rel: ("file", sha256_file(path / rel))
                for rel in sorted(walk_files(path), key=sort_key)}
    members: dict[str, tuple] = {}
    with tarfile.open(path) as tar:
        for m in tar:
            digest = (hashlib.sha256(tar.extractfile(m).read()).hexdigest() if m.isfile()
                      else None)
            name = m.name.partition("/")[2] if "/" in m.name else "."
            members[name] = (m.type, m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname, m.size,
                             digest)
    return members


def _differing(given: dict[str, tuple], rebuilt: dict[str, tuple]) -> list[str]:
    names = list(rebuilt) + [n for n in given if n not in rebuilt]
    differ = [n for n in names if given.get(n) != rebuilt.get(n)]
    if not differ and list(given) != list(rebuilt):
        return ["(member order)"]
    return ([n for n in differ if n not in DERIVED] + [n for n in DERIVED if n in differ])


def main_rebuild(results_dir: str, bundle: str) -> int:
    """``draftline verify --rebuild RESULTS_DIR BUNDLE``: 0 when the bundle's bytes equal its
    rebuild, 1 naming the first differing member, 2 when there is nothing to compare."""
    result = checked(rebuild_check, results_dir, bundle)
    if isinstance(result, int):
        return result
    if result.equal:
        digest = f" (sha256 {result.bundle_sha256})" if result.bundle_sha256 else ""
        print(f"OK: {bundle} equals its rebuild from {results_dir}{digest}")
        return 0
    print(f"draftline verify: FAILED: {bundle} differs from its rebuild from {results_dir}: "
          f"first differing member {result.differing[0]} (all {len(result.differing)}: "
          f"{', '.join(result.differing)})", file=sys.stderr)
    return 1


__all__ = ["RebuildResult", "main_rebuild", "rebuild_check"]
