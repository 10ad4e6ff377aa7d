#!/usr/bin/env bash
# Builds a Debian bookworm base image with python3 locally (debootstrap +
# docker import), for machines that cannot pull the official Python image.
set -euo pipefail
TAG=${1:-dpex-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" >/dev/null
tar -C "$root" -c . | docker import - "$TAG" >/dev/null
echo "built $TAG"
