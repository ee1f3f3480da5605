#!/usr/bin/env bash
# Packs this machine's Release build (build/deltastack, build/deltastack_tests, stripped) into .prebuilt/bin.tar.gz
# for the device machine, so a device call can skip its ~2 minute build: carry ".deps" and ".prebuilt" and run
# `scripts/device_test.sh prebuilt <stages>` (the `prebuilt` stage unpacks it into build/, where the tests look for
# the deltastack binary, and points build-device at it). Both machines have CUDA 13.0 and the same Debian 12
# libraries (.deps), and the sources sit at the same path there, so the binaries run unchanged. Rebuild and rerun
# this after every change: the archive is whatever build/ held when it ran (its commit is written beside it).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build -j"$(nproc)" --target deltastack deltastack_tests
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
strip -o "$tmp/deltastack" build/deltastack
strip -o "$tmp/deltastack_tests" build/deltastack_tests
mkdir -p .prebuilt
tar -czf .prebuilt/bin.tar.gz -C "$tmp" deltastack deltastack_tests
{ git rev-parse HEAD; git status --short; } > .prebuilt/commit.txt
echo "packed $(du -h .prebuilt/bin.tar.gz | cut -f1) into .prebuilt/bin.tar.gz (commit $(head -1 .prebuilt/commit.txt), $(($(wc -l < .prebuilt/commit.txt) - 1)) changed files)"
