#!/usr/bin/env bash
# Build a Python sandbox image, gpushare/NAME:1 (images/python.Dockerfile): the sandbox base
# image plus the PyPI packages images/NAME/requirements.lock pins with hashes and the programs
# in images/NAME/bin, no registry pull.
#   notebook     JupyterLab, served on the sandbox's app socket
#   cuda-python  Numba's CUDA target with CUDA 12's runtime, NVRTC, NVVM and nvJitLink
# The wheels are downloaded on the host (its pip settings, proxy and CA apply), cached in
# var/wheels/NAME and installed offline in the image; apt's packages come over the host's
# network (dockerd here runs without a bridge). The image's sandboxes get none.
#
# Usage: scripts/build-python-image.sh NAME [--force]
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:-}"
if [[ ! "$name" =~ ^[a-z0-9-]+$ || ! -f "images/$name/requirements.lock" ]]; then
    echo "usage: scripts/build-python-image.sh NAME [--force]; NAME: $(cd images && ls -d */ | tr -d / | tr '\n' ' ')" >&2
    exit 2
fi
image="gpushare/$name:1"
label="io.gpushare.sandbox-image"
version="$name-1:$(find images/python.Dockerfile "images/$name" -type f -print0 | sort -z \
    | xargs -0 sha256sum | sha256sum | cut -c1-12)"
if [[ "${2:-}" != "--force" ]] \
    && [[ "$(docker image inspect -f "{{index .Config.Labels \"$label\"}}" "$image" 2>/dev/null)" == "$version" ]]; then
    echo "build-python-image: $image already exists (use --force to rebuild)"
    exit 0
fi
scripts/build-sandbox-image.sh
started=$(date +%s)
wheels="${GPUSHARE_VAR_DIR:-$PWD/var}/wheels/$name"
mkdir -p "$wheels"
# cp311 manylinux wheels: Debian bookworm's Python is 3.11, as the project's. The project's
# venv has pip (make install); a bare Debian's python3 may not.
python="python3"
[[ -x .venv/bin/python ]] && python=".venv/bin/python"
"$python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version 3.11 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --require-hashes -r "images/$name/requirements.lock" -d "$wheels"
context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT
cp images/python.Dockerfile "$context/Dockerfile"
cp "images/$name/requirements.lock" "$context/"
cp -r "images/$name/bin" "$context/bin"
cp -r "$wheels" "$context/wheels"
docker build --network host --label "$label=$version" -t "$image" "$context"
# What the build left untagged (its packages stage, the image it replaced): ours only, by label.
docker image prune --force --filter "label=$label" >/dev/null
echo "build-python-image: built $image in $(($(date +%s) - started)) s"
