#!/usr/bin/env bash
# Downloads (here, where PyPI is reached) the peer stacks' pure-Python packages into .peers/site, which git ignores
# and the device tool carries (`carry: [".peers"]`); scripts/device_test.sh stages `peer` and `peer-step` put it on
# PYTHONPATH (the device machine has torch, triton and transformers, and no network).
# The strongest peer (scripts/peer_step.py) needs these two (and einops, fetched with fla), beside the device's torch, triton and transformers:
#   liger_kernel   liger-kernel's wheel (LIGER_VERSION, default 0.8.5: has apply_liger_kernel_to_qwen3_5: fused
#                  linear CE, RMSNorm, SwiGLU)
#   fla            fla-core's wheel (fla.ops' chunk_gated_delta_rule, fla.modules' causal_conv1d and
#                  FusedRMSNormGated: the peer's GDN layers; >= 0.5 for grouped value heads), FLA_VERSION (default
#                  0.5.2, the version of the 2026-12-01 peer numbers), only when .peers/site/fla is not there already
#                  (a source tree put there by hand is kept; FLA_REFETCH=1 replaces it), with einops, which it imports
#   pytest         pytest, pluggy, iniconfig, exceptiongroup: for python/tests on the device (stage `torch`)
#   peft           Hugging Face PEFT's wheel (PEFT_VERSION, default 0.21.2, the version of the tiny LoRA fixture) for
#                  the LoRA peer (scripts/peer_lora_step.py, stage `peer-lora`), with accelerate, which peft imports
#                  (pure Python), and psutil, which accelerate imports (its abi3 manylinux wheel, any CPython 3)
# Wheels only (--no-deps), unpacked with Python's zipfile: nothing is installed on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=.peers/site
WHL=$(mktemp -d)  # the wheels themselves are not carried
trap 'rm -rf "$WHL"' EXIT
mkdir -p "$SITE"
unpack() {  # unpack WHEEL: its packages and dist-info into $SITE
  python3 -m zipfile -e "$1" "$SITE"
  echo "fetch_peers: $(basename "$1") -> $SITE"
}
rm -rf "$SITE"/liger_kernel "$SITE"/liger_kernel-*.dist-info
pip download --no-deps --only-binary=:all: -d "$WHL" "liger-kernel==${LIGER_VERSION:-0.8.5}" >/dev/null
unpack "$(ls -t "$WHL"/liger_kernel-"${LIGER_VERSION:-0.8.5}"-*.whl | head -1)"
# pytest for python/tests (deltastack.torch; scripts/device_test.sh stage `torch`), with what it imports that the
# device's Python may lack (pure Python; exceptiongroup matters before Python 3.11 only, as tomli, not fetched).
for p in pytest pluggy iniconfig exceptiongroup; do
  rm -rf "$SITE/$p" "$SITE/_$p" "$SITE"/$p-*.dist-info "$SITE/py.py"
  pip download --no-deps --only-binary=:all: -d "$WHL" "$p" >/dev/null
  unpack "$(ls -t "$WHL"/$p-*.whl | head -1)"
done
# PEFT for the LoRA peer, and what it imports beyond the device's torch, transformers, numpy, pyyaml and safetensors.
for spec in "peft==${PEFT_VERSION:-0.21.2}" accelerate; do
  p=${spec%%=*}
  rm -rf "$SITE/$p" "$SITE"/$p-*.dist-info
  pip download --no-deps --only-binary=:all: -d "$WHL" "$spec" >/dev/null
  unpack "$(ls -t "$WHL"/$p-*.whl | head -1)"
done
rm -rf "$SITE"/psutil "$SITE"/psutil-*.dist-info
pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d "$WHL" psutil >/dev/null
unpack "$(ls -t "$WHL"/psutil-*.whl | head -1)"
if [ ! -d "$SITE/fla" ] || [ "${FLA_REFETCH:-0}" = 1 ]; then
  rm -rf "$SITE"/fla "$SITE"/fla_core-*.dist-info
  pip download --no-deps --only-binary=:all: -d "$WHL" "fla-core==${FLA_VERSION:-0.5.2}" >/dev/null
  unpack "$(ls -t "$WHL"/fla_core-"${FLA_VERSION:-0.5.2}"-*.whl | head -1)"
  # fla-core's one dependency outside torch and triton (pure Python)
  rm -rf "$SITE"/einops "$SITE"/einops-*.dist-info
  pip download --no-deps --only-binary=:all: -d "$WHL" einops >/dev/null
  unpack "$(ls -t "$WHL"/einops-*.whl | head -1)"
else
  echo "fetch_peers: $SITE/fla already there (kept; FLA_REFETCH=1 replaces it)"
fi
python3 - "$SITE" <<'PY'
import os, sys
site = sys.argv[1]
print("fetch_peers:", ", ".join(sorted(d for d in os.listdir(site) if not d.startswith("__"))))
PY
