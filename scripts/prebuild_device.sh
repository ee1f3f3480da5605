#!/usr/bin/env bash
# Packs a Release build of this machine into .prebuilt/bin.tar.xz for the device machine, so a device call can skip
# its ~2 minute build: carry ".prebuilt" and run `scripts/device_test.sh prebuilt <stages>` (the
# `prebuilt` stage unpacks build-prebuilt/ at the repo root, where the tests look for the deltastack binary, and
# points build-device at it). The build folder is configured like the device's own build (CUDA on, no -march=native,
# no Open MPI: .deps carries no MPI runtime), not like build/. Both machines have CUDA 13.0 and the same Debian 12
# libraries (.deps), and the sources sit at the same path there, so the binaries run unchanged. Rerun this after
# every change: the archive is what the sources were when it ran (their commit and changed files are written
# beside it, in .prebuilt/commit.txt). The pack is self-sufficient, so that one carry of ".prebuilt" stays under the
# device tool's 64 MiB: the binaries (xz), the Debian runtime libraries they link (the non -dev .deb files of .deps,
# unpacked there into the sysroot in place of .deps) and, where scripts/fetch_peers.sh has filled .peers/site, the
# peers' Python packages with any Triton autotune records in .peers/triton_cache (xz; unpacked there into .peers/
# when .peers is not carried).
set -euo pipefail
cd "$(dirname "$0")/.."
B=build-prebuilt
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DDELTASTACK_CUDA=ON -DDELTASTACK_NATIVE=OFF \
      -DDELTASTACK_MPI=OFF "${launcher[@]}" >/dev/null
cmake --build $B -j"$(nproc)" --target deltastack deltastack_tests
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/$B"
strip -o "$tmp/$B/deltastack" $B/deltastack
strip -o "$tmp/$B/deltastack_tests" $B/deltastack_tests
rm -rf .prebuilt && mkdir -p .prebuilt/deps
tar -cJf .prebuilt/bin.tar.xz -C "$tmp" $B
for f in .deps/*.deb; do case $f in *-dev_*|*pkgconf*|*nlohmann*) ;; *) cp "$f" .prebuilt/deps/ ;; esac; done
peers=()
for d in site triton_cache; do [ -d .peers/$d ] && peers+=("$d"); done
[ ${#peers[@]} -gt 0 ] && tar -cJf .prebuilt/peers.tar.xz -C .peers "${peers[@]}"
# BASE_PACK=<dir>: a copy of an earlier pack's .prebuilt (its bin.tar.xz and commit.txt) whose deltastack travels
# too, as .prebuilt/base.tar.xz (build-base/deltastack there), for device_test.sh's comparisons against an earlier
# binary (base-modes, train). Keep the copy before this script replaces .prebuilt.
if [ -n "${BASE_PACK:-}" ]; then
  mkdir -p "$tmp/base" "$tmp/build-base"
  tar -xJf "$BASE_PACK/bin.tar.xz" -C "$tmp/base" build-prebuilt/deltastack
  mv "$tmp/base/build-prebuilt/deltastack" "$tmp/build-base/deltastack"
  tar -cJf .prebuilt/base.tar.xz -C "$tmp" build-base
  head -1 "$BASE_PACK/commit.txt" > .prebuilt/base_commit.txt
fi
{ git rev-parse HEAD; git status --short; } > .prebuilt/commit.txt
echo "packed $(du -sh --apparent-size .prebuilt | cut -f1) into .prebuilt (commit $(head -1 .prebuilt/commit.txt), $(($(wc -l < .prebuilt/commit.txt) - 1)) changed files)"
