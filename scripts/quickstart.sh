#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds, and runs the main job: `deltastack train` on its embedded default
# (the tiny Qwen3.5 preset on the bundled tiny Shakespeare with the bundled Qwen3 tokenizer), then samples
# from the final checkpoint. Extra arguments go to `deltastack train`.
set -euo pipefail
cd "$(dirname "$0")/.."
DELTASTACK_BUILD_TARGET=deltastack ./scripts/build.sh  # the tests are built by scripts/test.sh
./build/deltastack train --move-aside "$@"  # a rerun keeps the previous run in runs/default/previous-N
last=$(ls -d runs/default/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -n 1 || true)
if [ -n "$last" ] && [ $# -eq 0 ]; then
  echo "--- sample from $last"
  ./build/deltastack generate --model "$last" --prompt "ROMEO:" --max-new-tokens 60
fi
