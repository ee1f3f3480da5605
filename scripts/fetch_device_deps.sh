#!/usr/bin/env bash
# Downloads (here, where apt works) the Debian 12 packages that the device machine's build needs into .deps/,
# which git ignores and the device tool carries (`carry: [".deps"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps && cd .deps
apt-get download nlohmann-json3-dev libfmt-dev libfmt9 libcli11-dev libpcre2-dev libpcre2-8-0 libpcre2-16-0 \
  libpcre2-32-0 libpcre2-posix3 libutf8proc-dev libutf8proc2 libopenblas-dev libopenblas0-pthread \
  libopenblas-pthread-dev libopenblas0 libgfortran5 libquadmath0 libgtest-dev libgmock-dev pkgconf pkgconf-bin libpkgconf3 \
  libhwloc-dev libhwloc15
