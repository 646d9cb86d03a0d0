#!/usr/bin/env bash
# Build rollflow:latest, the image the GPU work pools name (workpools/*), from the Dockerfile.
#   bash scripts/build_image.sh [TAG]            # default tag: rollflow:latest
set -euo pipefail
cd "$(dirname "$0")/.."
command -v docker >/dev/null || { echo "build_image: docker is not installed" >&2; exit 1; }
docker build -t "${1:-rollflow:latest}" .
