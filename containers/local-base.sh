#!/usr/bin/env bash
# Makes a Debian bookworm base image from Debian packages alone, for hosts that reach no image
# registry (the test machines): debootstrap + `docker import`. The container tests build the
# CPU serving image and the pipeline image on it (build argument BASE_IMAGE, given as the
# image's content-addressed id, so even this base is pinned by digest).
#   bash containers/local-base.sh [NAME]      # default draftline-local-base:bookworm
# Prints the image id (sha256:...). Needs root, debootstrap and a running dockerd.
set -euo pipefail
name=${1:-draftline-local-base:bookworm}
if ! docker image inspect "$name" >/dev/null 2>&1; then
  rootfs=$(mktemp -d /var/tmp/draftline-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >&2
  # Trust the same extra CAs as this host: where egress goes through a TLS-inspecting proxy,
  # pip inside `docker build` must accept that proxy's certificate just as pip here does.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >&2
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' - "$name" >&2
fi
docker image inspect --format '{{.Id}}' "$name"
