#!/usr/bin/env python3
"""Times the peer's kernels at the shapes `deltastack bench ops` times ours, for a same-run ratio.

The peer is flash-linear-attention (fla), run from its source on PYTHONPATH (scripts/device_test.sh stage
`peer` puts a carried copy in .peers/site there). Rows (bf16 inputs, CUDA events, median of --iters runs after
warm-up; "fwd+bwd" is one forward then one backward):
  gated_delta_rule  fla.ops.gated_delta_rule.chunk_gated_delta_rule, q/k already l2-normalised (as ours receives
                    them), scale dk^-0.5, packed documents via cu_seqlens; shapes T32768 Hk16 Hv32, B2xT8192
                    Hk16 Hv16, and the 8-document packing of bench ops.
  conv1d+silu       fla.modules.conv.causal_conv1d(activation='silu', backend='triton'), T32768 C8192 K4.
fla refuses its gated backward on Hopper with Triton 3.4 .. 3.7.0 (its issue #640: wrong results there); for
timing only, --bypass-640 lifts that guard, and the row is marked so. Its values are not checked here.
Output: one line per row, `peer <op> <shape> fwd <ms> fwd+bwd <ms> (<note>)`.
"""
import argparse
import os
import statistics
import sys

import torch

from peer_common import bypass_fla_640  # scripts/peer_common.py


def time_ms(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gdn_rows(iters, bypass):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    note = "fla chunk_gated_delta_rule"
    if bypass:
        bypass_fla_640()
        note += "; #640 guard bypassed (timing only)"
    shapes = [([32768], 16, 32, "T32768 Hk16 Hv32 d128"),
              ([8192, 8192], 16, 16, "B2xT8192 Hk16 Hv16 d128"),
              ([7463, 1021, 5810, 39, 9000, 2601, 4316, 2518], 16, 32, "8docs T32768 Hk16 Hv32 d128")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for lengths, Hk, Hv, label in shapes:
        N, D = sum(lengths), 128
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.long, device="cuda")

        def rand(*shape, lo, hi, dtype=torch.bfloat16):
            return (torch.rand(*shape, generator=gen, device="cuda") * (hi - lo) + lo).to(dtype)

        q = torch.nn.functional.normalize(rand(1, N, Hk, D, lo=-1, hi=1).float(), dim=-1).bfloat16()
        k = torch.nn.functional.normalize(rand(1, N, Hk, D, lo=-1, hi=1).float(), dim=-1).bfloat16()
        v = rand(1, N, Hv, D, lo=-1, hi=1)
        g = rand(1, N, Hv, lo=-1.0, hi=-0.01, dtype=torch.float32)
        beta = rand(1, N, Hv, lo=0.1, hi=0.9, dtype=torch.float32)
        leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
        do = rand(1, N, Hv, D, lo=-1, hi=1)

        def fwd():
            with torch.no_grad():
                return chunk_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, cu_seqlens=cu)

        def fwd_bwd():
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, cu_seqlens=cu)
            torch.autograd.backward(o, do, inputs=leaves)

        f = time_ms(fwd, iters)
        try:
            fb = f"{time_ms(fwd_bwd, iters):.3f}"
        except RuntimeError as e:  # the #640 guard without --bypass-640
            fb = "n/a"
            note_row = f"{note}; backward refused: {str(e).splitlines()[0][:80]}"
        else:
            note_row = note
        print(f"peer gated_delta_rule {label} fwd {f:.3f} fwd+bwd {fb} ({note_row})", flush=True)
        del q, k, v, g, beta, leaves, do
        torch.cuda.empty_cache()


def conv_rows(iters):
    from fla.modules.conv.causal_conv1d import causal_conv1d

    T, C, K = 32768, 8192, 4
    x = (torch.rand(1, T, C, device="cuda") * 4 - 2).bfloat16().requires_grad_()
    w = (torch.rand(C, K, device="cuda") - 0.5).bfloat16().requires_grad_()
    dy = torch.rand(1, T, C, device="cuda").bfloat16()
    cu = torch.tensor([0, T], dtype=torch.long, device="cuda")

    def fwd():
        with torch.no_grad():
            return causal_conv1d(x, w, activation="silu", backend="triton", cu_seqlens=cu)

    def fwd_bwd():
        y = causal_conv1d(x, w, activation="silu", backend="triton", cu_seqlens=cu)
        y = y[0] if isinstance(y, tuple) else y
        torch.autograd.backward(y, dy, inputs=[x, w])

    f, fb = time_ms(fwd, iters), time_ms(fwd_bwd, iters)
    print(f"peer conv1d+silu T{T} C{C} K{K} fwd {f:.3f} fwd+bwd {fb:.3f} (fla causal_conv1d, triton)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--bypass-640", action="store_true", help="lift fla's #640 guard (timing only)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peer_bench: no CUDA device")
    os.environ.setdefault("FLA_TILELANG", "0")
    import triton
    import fla

    print(f"peer: torch {torch.__version__}, triton {triton.__version__}, fla {getattr(fla, '__version__', '?')}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    gdn_rows(args.iters, args.bypass_640)
    conv_rows(args.iters)


if __name__ == "__main__":
    main()
