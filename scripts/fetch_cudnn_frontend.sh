#!/usr/bin/env bash
# Fetches NVIDIA's cudnn-frontend (header-only C++ graph API over cuDNN 9; MIT) into third_party/cudnn_frontend/
# (git-ignored): a pinned release wheel from PyPI through pip, checked against its sha256, of which only include/
# and the licenses are kept. The attention op's cuDNN backend is built when these headers exist; without them
# the build still works and attention runs on the simple CUDA kernel. Idempotent; exits 0 with a warning when
# the download is impossible (no pip, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=1.32.0
WHEEL=nvidia_cudnn_frontend-${VERSION}-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
SHA256=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0
DEST=third_party/cudnn_frontend
if [ -f "$DEST/include/cudnn_frontend.h" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
warn() { echo "fetch_cudnn_frontend: $*; attention will use the simple CUDA kernel" >&2; exit 0; }
PY=$(command -v python3 || true)
[ -n "$PY" ] && "$PY" -m pip --version >/dev/null 2>&1 || warn "python3 -m pip is not available"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 -d "$tmp" "nvidia-cudnn-frontend==${VERSION}" >/dev/null 2>&1 ||
  warn "pip could not download nvidia-cudnn-frontend==${VERSION}"
[ -f "$tmp/$WHEEL" ] || warn "unexpected wheel name in $(ls "$tmp")"
echo "$SHA256  $tmp/$WHEEL" | sha256sum -c --quiet - || { echo "fetch_cudnn_frontend: checksum mismatch" >&2; exit 1; }
"$PY" - "$tmp/$WHEEL" "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith("include/") or "/licenses/" in n:
            z.extract(n, sys.argv[2])
PY
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
mv "$tmp/x/include" "$DEST.tmp/include"
cp "$tmp"/x/nvidia_cudnn_frontend-*.dist-info/licenses/* "$DEST.tmp/"
echo "$VERSION" >"$DEST.tmp/VERSION"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "fetch_cudnn_frontend: cudnn-frontend $VERSION headers in $DEST"
