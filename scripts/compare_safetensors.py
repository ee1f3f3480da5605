#!/usr/bin/env python3
"""Relative L2 error of every tensor of A against B (pairs of files), for GPU-vs-fixture parity checks.

usage: compare_safetensors.py GOT1 WANT1 [GOT2 WANT2 ...]
Prints one row per tensor (name, shape, rel L2) and exits 1 if the logits exceed 1e-2
(docs/cuda_backend.md "Numerics contract").
"""
import sys

import numpy as np
from safetensors.numpy import load_file


def rel_l2(a, b):
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def main(argv):
    bad = False
    worst = 0.0
    for got_path, want_path in zip(argv[1::2], argv[2::2]):
        got, want = load_file(got_path), load_file(want_path)
        for name in sorted(want):
            if name not in got:
                print(f"{name:<60} MISSING")
                bad = True
                continue
            e = rel_l2(got[name], want[name])
            worst = max(worst, e)
            print(f"{name:<60} {str(list(want[name].shape)):<16} {e:.3e}")
            if name == "logits" and not e <= 1e-2:
                bad = True
    print(f"worst rel L2 {worst:.3e}; logits band 1e-2: {'FAIL' if bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
