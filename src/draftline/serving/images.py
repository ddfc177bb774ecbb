"""The image lock (containers/images.lock): every image reference, pinned by digest.

* ``check(repo)`` - every Dockerfile FROM (its ``ARG`` default), every ``containers.*`` and
  ``server.image`` in the config files is pinned by digest and is a locked reference, and every
  locked image is used. Returns the problems (tests and ``python -m draftline.serving.images
  check``).
* ``placeholders(config)`` - the images a config would pull that still carry the all-zero
  placeholder digest (``check --config FILE``: refuse a production config before its run).
* ``resolve`` - read the digest of each entry's tag from its registry (Docker Registry HTTP
  API v2, anonymous pull token) and write it wherever the old reference was used.
* ``set NAME REPO@sha256:...`` - record an image you built and pushed.

Light on purpose (PyYAML and httpx only): it runs on the orchestrator.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
LOCK = Path("containers") / "images.lock"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
LOCAL_ID = re.compile(r"^sha256:[0-9a-f]{64}$")
PLACEHOLDER_DIGEST = "@sha256:" + "0" * 64
MANIFEST_TYPES = ", ".join([
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])


def load_lock(repo: Path = REPO) -> dict[str, dict]:
    return yaml.safe_load((repo / LOCK).read_text())["images"]


def reference(entry: dict) -> str:
    """``image@digest``: the form every user of the lock writes (no tag: apptainer's docker
    transport rejects references with both a tag and a digest)."""
    return f"{entry['image']}@{entry['digest']}"


def is_pinned(ref: str) -> bool:
    return bool(DIGEST.search(ref) or LOCAL_ID.match(ref))


def dockerfile_bases(path: Path) -> list[str]:
    """Images of the FROM lines, with ``${ARG}`` replaced by the ARG's default."""
    args: dict[str, str] = {}
    bases = []
    stages = set()
    for line in path.read_text().splitlines():
        words = line.split()
        if not words:
            continue
        if words[0].upper() == "ARG" and len(words) > 1 and "=" in words[1]:
            name, _, default = words[1].partition("=")
            args[name] = default
        elif words[0].upper() == "FROM":
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)),
                           words[1])
            if image not in stages:  # "FROM build AS ..." refers to an earlier stage
                bases.append(image)
            if len(words) > 3 and words[2].upper() == "AS":
                stages.add(words[3])
    return bases


def config_images(config: dict) -> list[tuple[str, str]]:
    """(key, reference) of the images a config names (containers.* without docker://)."""
    found = []
    for key, value in (config.get("containers") or {}).items():
        if value:
            found.append((f"containers.{key}", value.removeprefix("docker://")))
    image = (config.get("server") or {}).get("image")
    if image:
        found.append(("server.image", image))
    return found


def dockerfiles(repo: Path = REPO) -> list[Path]:
    return sorted((repo / "containers").glob("*.Dockerfile"))


def config_files(repo: Path = REPO) -> list[Path]:
    return sorted((repo / "config").glob("*.yaml"))


def used_references(repo: Path = REPO) -> list[tuple[str, str]]:
    """(where, reference) of every image use in Dockerfiles and config files."""
    uses = [(f"{p.relative_to(repo)} FROM", ref) for p in dockerfiles(repo)
            for ref in dockerfile_bases(p)]
    for path in config_files(repo):
        if path.exists():
            config = yaml.safe_load(path.read_text()) or {}
            uses += [(f"{path.relative_to(repo)} {key}", ref) for key, ref in config_images(config)]
    return uses


def check(repo: Path = REPO) -> list[str]:
    """Problems: unpinned or unlocked references, unused lock entries, malformed entries."""
    lock = load_lock(repo)
    problems = []
    for name, entry in lock.items():
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(entry.get("digest", ""))):
            problems.append(f"{LOCK} {name}: digest is not sha256:<64 hex>")
    locked = {reference(e): name for name, e in lock.items()}
    used = set()
    for where, ref in used_references(repo):
        if not is_pinned(ref):
            problems.append(f"{where}: {ref} is not pinned by digest")
        elif ref not in locked:
            problems.append(f"{where}: {ref} is not in {LOCK}")
        else:
            used.add(locked[ref])
    problems += [f"{LOCK} {name}: not used by any Dockerfile or config"
                 for name in lock if name not in used]
    return problems


def placeholders(config: dict) -> list[str]:
    """Problems: images of ``config`` whose digest is the all-zero placeholder of the lock.

    The repository may hold placeholders (no registry is reachable where it is developed);
    a config about to run must not: its first pull would fail, hours into the run.
    """
    return [f"config key '{key}': {ref} carries the placeholder digest; run "
            "`python -m draftline.serving.images resolve` (public images) or build, push and "
            "`python -m draftline.serving.images set NAME REPO@sha256:...` (draftline's images) "
            "first"
            for key, ref in config_images(config) if ref.endswith(PLACEHOLDER_DIGEST)]


def unverified(repo: Path = REPO) -> list[str]:
    return [name for name, e in load_lock(repo).items() if not e.get("verified")]


# ----------------------------------------------------------------------------- registries


def _registry_and_path(image: str) -> tuple[str, str]:
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = "docker.io", image
    if registry == "docker.io":
        registry = "registry-1.docker.io"
        path = path if "/" in path else f"library/{path}"
    return registry, path


def resolve_digest(image: str, tag: str, timeout_s: float = 30.0) -> str:
    """Digest of ``image:tag`` (the multi-platform index where there is one)."""
    import httpx

    registry, path = _registry_and_path(image)
    url = f"https://{registry}/v2/{path}/manifests/{tag}"
    headers = {"Accept": MANIFEST_TYPES}
    with httpx.Client(timeout=timeout_s, follow_redirects=True) as client:
        resp = client.head(url, headers=headers)
        if resp.status_code == 401:
            headers["Authorization"] = f"Bearer {_token(client, resp, path)}"
            resp = client.head(url, headers=headers)
        resp.raise_for_status()
        digest = resp.headers.get("Docker-Content-Digest", "")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise RuntimeError(f"{image}:{tag}: registry sent no digest")
    return digest


def _token(client, challenge, path: str) -> str:
    """Anonymous pull token from the Bearer challenge of a 401 answer."""
    header = challenge.headers.get("WWW-Authenticate", "")
    params = dict(re.findall(r'(\w+)="([^"]*)"', header))
    query = {"service": params.get("service", ""),
             "scope": params.get("scope", f"repository:{path}:pull")}
    resp = client.get(params["realm"], params=query)
    resp.raise_for_status()
    body = resp.json()
    return body.get("token") or body["access_token"]


# ----------------------------------------------------------------------------- updating


def _rewrite_entry(lock_text: str, name: str, fields: dict) -> str:
    """Change ``fields`` of one entry, keeping comments and layout."""
    lines = lock_text.splitlines()
    start = lines.index(f"  {name}:")
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].startswith("  ") and not lines[i].startswith("    ")), len(lines))
    for i in range(start + 1, end):
        key = lines[i].strip().split(":", 1)[0]
        if key in fields and not lines[i].strip().startswith("#"):
            lines[i] = f"    {key}: {fields[key]}"
    return "\n".join(lines) + "\n"


def update_entry(name: str, fields: dict, repo: Path = REPO) -> list[Path]:
    """Update one lock entry and every file that used its old reference; returns those files."""
    lock = load_lock(repo)
    old = reference(lock[name])
    new = reference({**lock[name], **fields})
    lock_path = repo / LOCK
    lock_path.write_text(_rewrite_entry(lock_path.read_text(), name, fields))
    changed = [lock_path]
    for path in [*dockerfiles(repo), *config_files(repo)]:
        if path.exists() and old in (text := path.read_text()):
            path.write_text(text.replace(old, new))
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftline.serving.images", description=__doc__)
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="repository root")
    sub = parser.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="every image pinned, locked and used")
    chk.add_argument("--config", type=Path, action="append", default=[],
                     help="a config about to run: its images must not be placeholders")
    res = sub.add_parser("resolve", help="read digests of the locked tags from their registries")
    res.add_argument("names", nargs="*", help="lock entries (default: all with a public image)")
    put = sub.add_parser("set", help="record a built and pushed image: NAME REPO@sha256:...")
    put.add_argument("name")
    put.add_argument("ref")
    args = parser.parse_args(argv)
    if args.cmd == "check":
        problems = check(args.repo)
        for path in args.config:
            problems += [f"{path}: {p}" for p in placeholders(yaml.safe_load(path.read_text()))]
        print("\n".join(problems) or "all image references pinned, locked and used")
        if unverified(args.repo):
            print(f"unverified digests: {', '.join(unverified(args.repo))}")
        return 1 if problems else 0
    if args.cmd == "set":
        if not DIGEST.search(args.ref):
            parser.error(f"{args.ref}: expected REPO@sha256:<64 hex>")
        image, _, digest = args.ref.rpartition("@")
        fields = {"image": image, "digest": digest, "verified": "true",
                  "source": "set from a pushed build"}
        print("updated", *update_entry(args.name, fields, args.repo))
        return 0
    lock = load_lock(args.repo)
    for name in args.names or [n for n, e in lock.items() if "registry.invalid" not in e["image"]]:
        entry = lock[name]
        digest = resolve_digest(entry["image"], entry["tag"])
        fields = {"digest": digest, "verified": "true", "source": "resolved from the registry"}
        print(f"{name}: {entry['image']}:{entry['tag']} -> {digest}")
        update_entry(name, fields, args.repo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
