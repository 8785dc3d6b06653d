#!/usr/bin/env bash
# Build a jaxserve container image with whichever builder works here: a running Docker
# daemon, else buildah, else podman (`make image`; BUILDER=docker|buildah|podman forces one).
# Without any, buildah and mmdebstrap are installed with apt. When BASE cannot be pulled (no
# registry), a local Debian bookworm base with python3 is made with mmdebstrap and used.
#
#   TARGET=cpu|cpu-baked|cuda  TAG=jaxserve:cpu  BASE=...  MODEL=org/name  BAKE_ARGS="..."
#   STORAGE_DRIVER=vfs (buildah/podman)  LAYERS=true|false (cache layers; default off on vfs)
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=${TARGET:-cpu}
TAG=${TAG:-jaxserve:${TARGET}}
BASE=${BASE:-python:3.11-slim-bookworm}
LOCAL_BASE=localhost/debian-py:bookworm
STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

pick_builder() {
  if [[ -n "${BUILDER:-}" ]]; then echo "$BUILDER"; return; fi
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; return; fi
  if command -v buildah >/dev/null; then echo buildah; return; fi
  if command -v podman >/dev/null; then echo podman; return; fi
  echo "no docker daemon, buildah or podman: installing buildah and mmdebstrap with apt" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah mmdebstrap >&2
  echo buildah
}

BUILDER=$(pick_builder)
case "$BUILDER" in
  buildah) TOOL=(buildah --storage-driver "$STORAGE_DRIVER") ;;
  podman)  TOOL=(podman --storage-driver "$STORAGE_DRIVER") ;;
  docker)  TOOL=(docker) ;;
  *) echo "BUILDER must be docker, buildah or podman, not '$BUILDER'" >&2; exit 2 ;;
esac

# The local base: Debian bookworm's python3 (3.11), what python:3.11-slim-bookworm is.
make_local_base() {
  if "${TOOL[@]}" image exists "$LOCAL_BASE" 2>/dev/null \
     || "${TOOL[@]}" inspect --type image "$LOCAL_BASE" >/dev/null 2>&1; then return; fi
  command -v mmdebstrap >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap; }
  local tar
  tar=$(mktemp -d)/base.tar
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$tar"
  if [[ "$BUILDER" == buildah ]]; then
    command -v podman >/dev/null || {
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman; }
    podman --storage-driver "$STORAGE_DRIVER" import "$tar" "$LOCAL_BASE" >/dev/null
  else
    "${TOOL[@]}" import "$tar" "$LOCAL_BASE" >/dev/null
  fi
  rm -rf "$(dirname "$tar")"
}

if [[ "$TARGET" != cuda && "$BASE" != "$LOCAL_BASE" ]] \
   && ! "${TOOL[@]}" pull -q "$BASE" >/dev/null 2>&1; then
  echo "cannot pull $BASE: building on a local Debian bookworm base ($LOCAL_BASE)" >&2
  make_local_base
  BASE=$LOCAL_BASE
fi

ARGS=(--build-arg "BASE=$BASE"
      --build-arg "VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"
      --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)"
      --build-arg "BAKE_MODEL=${MODEL:-}" --build-arg "BAKE_ARGS=${BAKE_ARGS:-}"
      -f docker/Dockerfile --target "$TARGET" -t "$TAG")
if [[ "$BUILDER" == docker ]]; then
  BUILD=(docker build "${ARGS[@]}")
else
  # The machine's CA bundle reaches pip through a read-only mount, never a layer; the
  # docker format keeps HEALTHCHECK (OCI image configs have no field for it).
  # vfs copies every layer whole: one commit per stage (no layer cache) unless LAYERS=true.
  [[ "$STORAGE_DRIVER" == vfs ]] && LAYERS=${LAYERS:-false}
  BUILD=("${TOOL[@]}" build "--layers=${LAYERS:-true}" --format docker --isolation chroot "${ARGS[@]}")
  [[ -f "$CA_BUNDLE" ]] && BUILD+=(--volume "$CA_BUNDLE:$CA_BUNDLE:ro")
fi
echo "building $TAG ($TARGET) with $BUILDER on $BASE" >&2
start=$(date +%s)
"${BUILD[@]}" .
echo "built $TAG in $(( $(date +%s) - start )) s" >&2
