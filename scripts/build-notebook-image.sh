#!/usr/bin/env bash
# Build the notebook image (gpushare/notebook:1): the sandbox base image plus JupyterLab
# from PyPI, pinned with hashes (images/notebook/requirements.lock), no registry pull.
# The wheels are downloaded on the host (its pip settings, proxy and CA apply), cached in
# var/wheels/notebook and installed offline in the image; apt's packages come over the
# host's network (dockerd here runs without a bridge). The image's sandboxes get none.
#
# Usage: scripts/build-notebook-image.sh [--force]
set -euo pipefail
cd "$(dirname "$0")/.."
image="gpushare/notebook:1"
label="io.gpushare.sandbox-image"
version="notebook-1:$(sha256sum images/notebook/* | sha256sum | cut -c1-12)"
if [[ "${1:-}" != "--force" ]] \
    && [[ "$(docker image inspect -f "{{index .Config.Labels \"$label\"}}" "$image" 2>/dev/null)" == "$version" ]]; then
    echo "build-notebook-image: $image already exists (use --force to rebuild)"
    exit 0
fi
scripts/build-sandbox-image.sh
started=$(date +%s)
wheels="${GPUSHARE_VAR_DIR:-$PWD/var}/wheels/notebook"
mkdir -p "$wheels"
# cp311 manylinux wheels: Debian bookworm's Python is 3.11, as the project's. The project's
# venv has pip (make install); a bare Debian's python3 may not.
python="python3"
[[ -x .venv/bin/python ]] && python=".venv/bin/python"
"$python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version 3.11 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --require-hashes -r images/notebook/requirements.lock -d "$wheels"
context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT
cp images/notebook/* "$context/"
cp -r "$wheels" "$context/wheels"
docker build --network host --label "$label=$version" -t "$image" "$context"
echo "build-notebook-image: built $image in $(($(date +%s) - started)) s"
