#!/usr/bin/env bash
# Configures and builds deltastack into ./build (Release). Extra arguments go to cmake's configure step;
# DELTASTACK_BUILD_TARGET=T builds only target T (scripts/quickstart.sh: the deltastack binary, not the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j"$(nproc)" ${DELTASTACK_BUILD_TARGET:+--target "$DELTASTACK_BUILD_TARGET"}
