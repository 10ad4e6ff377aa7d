#!/usr/bin/env bash
# make test-docker: engine, base image, wheels, image, then the compose test.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
    (dockerd >/tmp/dpex-dockerd.log 2>&1 &)
    for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
BASE=${BASE_IMAGE:-dpex-base:bookworm}
docker image inspect "$BASE" >/dev/null 2>&1 || docker/base.sh "$BASE"
docker/wheels.sh  # quick when the wheels are there already
DOCKER_BUILDKIT=0 docker build -q -f docker/Dockerfile --build-arg BASE_IMAGE="$BASE" -t dpex:test . >/dev/null
exec .venv/bin/python docker/compose_test.py
