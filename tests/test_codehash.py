"""A stage's code hash covers exactly the code it runs: the closure of its draftline imports.

Unit tests of the closure on a made-up package (every import form) and on the real stages, then
the real Snakemake: a workflow whose every job has run (``--touch`` records the same provenance
as a run), a library edit, and the jobs a dry run would execute.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import CONFIG, REPO, copy_workflow, write_workflow_config

from draftline.core.codehash import (
    ImportCache,
    ImportResolutionError,
    import_closure,
    imported_modules,
    stage_code_hash,
)

SRC = REPO / "src"
LIB = SRC / "draftline"


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


# Every way a module can be reached, in a made-up draftline package.
FAKE = {
    "src/draftline/__init__.py": "",
    "src/draftline/a.py": """\
        import json
        from typing import TYPE_CHECKING

        from draftline import b
        from draftline.pkg import store, helper_function

        if TYPE_CHECKING:
            from draftline import typing_only
        else:
            from draftline import not_typing

        def later():
            try:
                import draftline.deep.leaf
            except ImportError:
                from draftline import fallback
            return "draftline.launched", "draftline.stages.bench/1", "draftline.missing"
        """,
    "src/draftline/b.py": "x = 1\n",
    "src/draftline/pkg/__init__.py": "from .store import save\nfrom . import sibling\n"
                                     "def helper_function():\n    pass\n",
    "src/draftline/pkg/store.py": "from ..b import x\nfrom .. import c\n",
    "src/draftline/pkg/sibling.py": "",
    "src/draftline/c.py": "",
    "src/draftline/typing_only.py": "",
    "src/draftline/not_typing.py": "",
    "src/draftline/deep/__init__.py": "",
    "src/draftline/deep/leaf.py": "",
    "src/draftline/fallback.py": "",
    "src/draftline/launched.py": "",
    "src/draftline/unused.py": "",
    "scripts/entry.py": "from draftline.a import later\n",
}


def rel(paths, root):
    return {str(p.relative_to(root)) for p in paths}


def test_closure_follows_every_import_form(tmp_path):
    write_tree(tmp_path, FAKE)
    closure = import_closure([tmp_path / "scripts/entry.py"], tmp_path / "src")
    assert rel(closure, tmp_path) == {
        "scripts/entry.py",
        "src/draftline/__init__.py",
        "src/draftline/a.py",
        "src/draftline/b.py",  # from draftline import b (a module)
        "src/draftline/pkg/__init__.py",  # a package: its __init__
        "src/draftline/pkg/store.py",  # from draftline.pkg import store (a submodule)
        "src/draftline/pkg/sibling.py",  # from . import sibling
        "src/draftline/c.py",  # from .. import c
        "src/draftline/not_typing.py",  # the else of if TYPE_CHECKING runs
        "src/draftline/deep/__init__.py",  # import draftline.deep.leaf runs the parents
        "src/draftline/deep/leaf.py",  # imported inside a function
        "src/draftline/fallback.py",  # inside an except handler
        "src/draftline/launched.py",  # named in a string ("-m draftline.launched")
    }


def test_imported_modules_resolves_relative_imports_in_a_package(tmp_path):
    write_tree(tmp_path, FAKE)
    src = tmp_path / "src"
    assert imported_modules(src / "draftline/pkg/__init__.py", src) == {
        "draftline.pkg.store", "draftline.pkg", "draftline.pkg.sibling"}
    assert imported_modules(src / "draftline/pkg/store.py", src) == {
        "draftline.b", "draftline", "draftline.c"}


def test_an_import_of_a_missing_module_names_the_file(tmp_path):
    write_tree(tmp_path, {"src/draftline/__init__.py": "",
                          "src/draftline/a.py": "from draftline.hidden_connector import x\n"})
    with pytest.raises(ImportResolutionError, match=r"a\.py imports draftline.hidden_connector"):
        import_closure([tmp_path / "src/draftline/a.py"], tmp_path / "src")


def test_real_stages_reach_the_modules_they_run():
    def closure(script):
        entry = REPO / "scripts" / script
        paths = set(import_closure([entry], SRC))
        assert entry in paths  # the script itself counts
        return rel(paths - {entry}, LIB) - PACKAGE_INITS

    # small stages, exactly
    assert closure("prompt_shards.py") == {"stages/prompts.py", "core/records.py",
                                           "core/atomic.py", "core/layout.py", "core/runlog.py"}
    # the toy takes its defaults from the schema through draftline.core.config (and its checks)
    assert closure("toy_target.py") == {"stages/toy.py", "core/atomic.py", "core/runlog.py",
                                        "core/config.py", "core/config_check.py", "core/hub.py",
                                        "core/target.py", "core/secret_names.py",
                                        "core/variants.py", "core/builtin_targets.py",
                                        "core/config_layers.py"}
    # the wheel's pinned sha256 lives in builtin_targets: a new pin makes the target stale
    assert closure("smollm2_target.py") == {"stages/smollm2.py", "core/builtin_targets.py",
                                            "core/atomic.py", "core/runlog.py"}
    # what the hand-kept lists missed
    generate = closure("generate.py")
    assert {"stages/generate.py", "serving/loadgen.py", "serving/server.py", "core/atomic.py",
            "serving/docker_launcher.py", "stages/dataset.py", "core/split.py"} <= generate
    assert {"stages/train/loop.py", "drafts/eagle3/model.py", "stages/prompts.py",
            "stages/toy.py"}.isdisjoint(generate)
    assert {"stages/export.py", "core/target.py", "drafts/eagle3/model.py",
            "drafts/dflash/export.py"} <= closure("export_draft.py")
    # the eval split's prompts: the split's module, not the dataset stage
    assert {"stages/bench.py", "core/split.py", "serving/loadgen.py",
            "serving/server.py"} <= closure("bench.py")
    assert {"stages/hidden/__init__.py", "stages/hidden/store.py",
            "stages/hidden/hf_backend.py", "stages/hidden/vllm_backend.py",
            "stages/hidden/vllm_connector.py"} <= closure("hidden_states.py")


# the package and its three architecture packages: every stage imports them
PACKAGE_INITS = {"__init__.py", "core/__init__.py", "serving/__init__.py", "stages/__init__.py"}


def test_import_cache_skips_parsing_and_never_serves_an_old_version(tmp_path, monkeypatch):
    write_tree(tmp_path, FAKE)
    entry, src = tmp_path / "scripts/entry.py", tmp_path / "src"
    cache_file = tmp_path / "cache.json"
    first = stage_code_hash(entry, src, tmp_path, cache=ImportCache(cache_file))
    assert cache_file.exists()

    import draftline.core.codehash as codehash

    def no_parsing(*args):
        raise AssertionError("parsed although cached")

    with monkeypatch.context() as m:
        m.setattr(codehash, "import_statements", no_parsing)
        assert stage_code_hash(entry, src, tmp_path, cache=ImportCache(cache_file)) == first
    # an edit: a new content, parsed again; the new import counts
    (src / "draftline/b.py").write_text("from draftline import unused\n")
    edited = stage_code_hash(entry, src, tmp_path, cache=ImportCache(cache_file))
    assert edited != first
    assert "src/draftline/unused.py" in rel(
        import_closure([entry], src, ImportCache(cache_file)), tmp_path)
    # an unreadable cache is no error
    cache_file.write_text("{not json")
    assert stage_code_hash(entry, src, tmp_path, cache=ImportCache(cache_file)) == edited


def test_every_rule_hashes_the_script_it_runs():
    for smk in sorted((REPO / "rules").glob("*.smk")):
        for block in re.split(r"(?m)^(?=\s*rule )", smk.read_text()):
            script = re.search(r'"\.\./scripts/(\w+\.py)"', block)
            code = re.search(r"code=code_hash\(([^)]*)\)", block)
            if script and code:
                assert code.group(1) == f'"{script.group(1)}"', (smk.name, block[:40])


# ----------------------------------------------------------------------------- the real Snakemake

STAGES_AFTER_GENERATE = {"generate", "generation_summary", "dataset", "vocab_map",
                         "hidden_states", "train_draft", "export_draft", "bench", "bundle", "all"}


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("snakemake")
    return subprocess.run([str(exe), "--snakefile", str(workdir / "Snakefile"), "--directory",
                           str(workdir), "--cores", "1", *args],
                          capture_output=True, text=True, timeout=600)


def jobs_to_run(workdir: Path) -> set[str]:
    result = snakemake(workdir, "-n", "--quiet", "rules")
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-3000:]
    if "Nothing to be done" in text:
        return set()
    table = text[text.index("Job stats"):]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+\s*$", table, re.M)} - {"total"}


@pytest.fixture(scope="module")
def completed_workflow(tmp_path_factory):
    """A copy of the workflow in which every job has run, as far as Snakemake knows: every
    output exists and carries the provenance (params, code hash) a real run records."""
    workdir = tmp_path_factory.mktemp("wf")
    copy_workflow(workdir)
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.setdefault("generate", {})["concurrency"] = 4  # no concurrency profile in the DAG
    write_workflow_config(workdir, cfg)
    summary = snakemake(workdir, "--summary")
    assert summary.returncode == 0, summary.stderr[-3000:]
    for line in summary.stdout.splitlines()[1:]:
        path = workdir / line.split("\t")[0]
        if "." in path.name:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("x")
        else:  # the directory outputs: results/target, results/dataset, results/draft/best
            path.mkdir(parents=True, exist_ok=True)
    touched = snakemake(workdir, "--touch", "--forceall")
    assert touched.returncode == 0, touched.stderr[-3000:]
    assert jobs_to_run(workdir) == set()
    return workdir


def jobs_after_editing(workdir: Path, module: str) -> set[str]:
    path = workdir / "src" / "draftline" / module
    original = path.read_text()
    path.write_text(original + "\n# an edit\n")
    try:
        return jobs_to_run(workdir)
    finally:
        path.write_text(original)


def test_editing_loadgen_makes_generate_and_downstream_stale_and_nothing_upstream(
        completed_workflow):
    assert jobs_after_editing(completed_workflow, "serving/loadgen.py") == STAGES_AFTER_GENERATE


def test_editing_the_docker_launcher_makes_the_serving_stages_stale(completed_workflow):
    # server.py imports it inside a function: generate (and bench) run it
    edited = jobs_after_editing(completed_workflow, "serving/docker_launcher.py")
    assert edited == STAGES_AFTER_GENERATE


def test_editing_train_makes_export_stale_too(completed_workflow):
    assert jobs_after_editing(completed_workflow, "stages/train/loop.py") == {
        "train_draft", "export_draft", "bench", "bundle", "all"}


def test_editing_the_vllm_connector_makes_hidden_states_stale(completed_workflow):
    assert jobs_after_editing(completed_workflow, "stages/hidden/vllm_connector.py") == {
        "hidden_states", "train_draft", "export_draft", "bench", "bundle", "all"}


def test_an_unused_module_makes_nothing_stale(completed_workflow):
    assert jobs_after_editing(completed_workflow, "plan.py") == set()


# rules that read part of a section (or of another stage's section), by one output each
PARTIAL_READERS = {"generate": "results/responses/shard-0.jsonl",
                   "hidden_states": "results/hidden/index.json",
                   "train_draft": "results/draft/eval.json",
                   "bench": "results/bench/results.json"}


def rules_whose_params_change(workdir: Path, **changes: dict) -> set[str]:
    """Rules that would rerun for their own params after merging ``changes`` per section into
    the workflow's config: each rule's output asked for with only that rule allowed to run (so
    nothing upstream reruns and hides the reason), and params the only rerun trigger."""
    cfg = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    for section, values in changes.items():
        cfg.setdefault(section, {}).update(values)
    changed = workdir / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    exe = Path(sys.executable).with_name("snakemake")
    dry_runs = {rule: subprocess.Popen(  # side by side: each is seconds of Snakemake start-up
        [str(exe), "--snakefile", str(workdir / "Snakefile"), "--directory", str(workdir),
         "--cores", "1", "-n", "--rerun-triggers", "params", "--configfile", str(changed),
         "--allowed-rules", rule, "--", output],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rule, output in PARTIAL_READERS.items()}
    rerun = set()
    for rule, proc in dry_runs.items():
        text, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, text[-3000:]
        if re.search(rf"^rule {rule}:$", text, re.M):
            rerun.add(rule)
    return rerun


@pytest.mark.parametrize(("changes", "expected"), [
    # the benchmark reads generate's sampling settings and concurrency, not its retry policy
    ({"generate": {"max_retries": 2}}, {"generate"}),
    ({"generate": {"request_timeout_s": 60}}, {"generate"}),
    # ... and the hidden-state gate checks the stored states against that sampling
    ({"generate": {"top_p": 0.9}}, {"generate", "hidden_states", "bench"}),
    # the hf backend of hidden-state extraction starts no vLLM: server settings are not its own
    ({"server": {"max_num_seqs": 128}}, {"generate", "bench"}),
    # offline, online-mode settings are nobody's; the stored index stands for the hidden keys
    ({"hidden": {"online": {"prefetch": 4, "max_buffer_bytes": 1 << 24}}}, set()),
    ({"hidden": {"samples_per_file": 8}}, {"hidden_states"}),
])
def test_a_rule_gets_only_the_config_keys_it_reads(completed_workflow, changes, expected):
    assert rules_whose_params_change(completed_workflow, **changes) == expected


BLOCK_IMPORTS = """
import sys
BLOCKED = {"draftline", "torch", "transformers", "vllm", "datasets", "numpy", "openai"}
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"imported at workflow parse time: {name}")
sys.meta_path.insert(0, Blocker())
from snakemake.cli import main
sys.argv = ["snakemake", *sys.argv[1:]]
main()
"""


def test_workflow_parses_without_importing_the_library(tmp_path):
    """Code hashes are read from the source: a dry run needs Snakemake only."""
    copy_workflow(tmp_path)
    write_workflow_config(tmp_path, yaml.safe_load(CONFIG.read_text()))
    result = subprocess.run([sys.executable, "-c", BLOCK_IMPORTS, "--snakefile",
                             str(tmp_path / "Snakefile"), "--directory", str(tmp_path),
                             "--cores", "1", "-n", "--quiet", "rules"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "generate" in result.stdout + result.stderr
    assert (tmp_path / ".snakemake/draftline-imports.json").exists()


def test_a_completed_run_moved_to_another_folder_has_nothing_to_do(completed_workflow,
                                                                   tmp_path):
    """Snakemake compares each job's recorded input paths with today's: none may name the
    checkout's folder (the bundled prompts, the toy's sentences), or a moved run replans all."""
    moved = tmp_path / "moved"
    shutil.copytree(completed_workflow, moved, symlinks=True)
    assert jobs_to_run(moved) == set()
