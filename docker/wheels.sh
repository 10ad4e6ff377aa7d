#!/usr/bin/env bash
# Fetches every wheel the image needs into docker/wheels/, torch's CPU build
# first, so that `docker build` needs no network.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-../.venv/bin/python}
mkdir -p wheels
$PY -m pip download --quiet --dest wheels --only-binary=:all: torch==2.13.0
$PY -m pip download --quiet --dest wheels --only-binary=:all: \
    "grpcio>=1.60" "grpcio-tools>=1.60" "grpcio-health-checking>=1.60" "protobuf>=4.25" "msgpack>=1.0" "numpy>=1.24" "click>=8.1" \
    "cloudpickle>=3.0" "pillow>=10.0" "tqdm>=4.66" "prometheus-client>=0.17" "lz4>=4.0" "zstandard>=0.22" "uvloop>=0.19" \
    "setuptools>=77" wheel
echo "wheels in docker/wheels: $(ls wheels | wc -l)"
