"""Installs the locked requirements an image's base does not already have.

    python install_locked.py LOCK

A base image's own packages stay as they are (the PyTorch image's torch, the vLLM image's
whole vLLM stack: upgrading one of them under the other breaks it); everything else comes
from LOCK at its locked version, with --no-deps: no resolver runs, so an image built from the
same base digest and lock holds the same packages. Standard library only (runs on bare bases).
"""

import re
import subprocess
import sys
from importlib import metadata


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(lock_path: str) -> int:
    present = {canonical(d.metadata["Name"]) for d in metadata.distributions()
               if d.metadata["Name"]}
    wanted = []
    for line in open(lock_path):
        line = line.split("#", 1)[0].strip()
        if line and canonical(line.split("==", 1)[0]) not in present:
            wanted.append(line)
    print(f"{len(present)} packages in the base; installing {len(wanted)} from {lock_path}")
    pip = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--no-deps"]
    if wanted:
        subprocess.run(pip + wanted, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
