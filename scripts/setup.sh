#!/usr/bin/env bash
# Installs the Debian 12 packages deltastack builds against, when any is missing. Idempotent.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config nlohmann-json3-dev libpcre2-dev libutf8proc-dev libcli11-dev
      libfmt-dev libopenblas-dev libgtest-dev libgmock-dev libopenmpi-dev openmpi-bin libhwloc-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# cudnn-frontend headers for the cuDNN attention backend (optional: warns and continues without them).
"$(dirname "$0")/fetch_cudnn_frontend.sh"
