#!/usr/bin/env python3
"""Times the peer's kernels at the shapes `deltastack bench ops` times ours, for a same-run ratio.

The peer is the strongest PyTorch stack's kernels (the ones scripts/peer_step.py installs): flash-linear-attention
(fla) for the Gated DeltaNet ops and liger-kernel for the norms, SwiGLU and the loss, run from PYTHONPATH
(scripts/device_test.sh stage `peer` puts the carried .peers/site there: scripts/fetch_peers.sh). Rows (bf16
inputs, CUDA events, median of --iters runs after warm-up; "fwd+bwd" is one forward then one backward):
  gated_delta_rule  fla.ops.gated_delta_rule.chunk_gated_delta_rule, q/k already l2-normalised (as ours receives
                    them), scale dk^-0.5, packed documents via cu_seqlens; shapes T32768 Hk16 Hv32, B2xT8192
                    Hk16 Hv16, and the 8-document packing of bench ops.
  conv1d+silu       fla.modules.conv.causal_conv1d(activation='silu', backend='triton'), T32768 C8192 K4.
  rmsnorm           Liger's RMSNorm as its Qwen3.5 patch runs it (zero-centered: offset 1, gemma casting), N32768 x
                    H 2560 / 4096 / 5120.
  swiglu            Liger's silu(gate) * up (LigerSiLUMulFunction), 16384 x I 9216 / 12288 / 17408.
  linear_cross_entropy  Liger's fused linear cross-entropy (LigerFusedLinearCrossEntropyLoss, mean over 16384
                    tokens), 16384 x 4096 x 248,320; fwd without gradients, fwd+bwd with (Liger computes the input
                    and weight gradients inside its forward).
A missing liger-kernel skips its rows with a line saying so.
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


def liger_rows(iters):
    try:
        import liger_kernel
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        print(f"peer liger rows: skipped, liger-kernel is not importable ({e})", flush=True)
        return
    note = f"liger {getattr(liger_kernel, '__version__', '?')}"
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return ((torch.rand(*shape, generator=gen, device="cuda") * 2 - 1) * scale).bfloat16().requires_grad_()

    for H in (2560, 4096, 5120):
        x, w, dy = rand(32768, H), rand(H, scale=0.1), rand(32768, H)

        def fwd():
            with torch.no_grad():
                return LigerRMSNormFunction.apply(x, w, 1e-6, 1.0, "gemma", False)

        def fwd_bwd():
            torch.autograd.backward(LigerRMSNormFunction.apply(x, w, 1e-6, 1.0, "gemma", False), dy, inputs=[x, w])

        print(f"peer rmsnorm 32768x{H} fwd {time_ms(fwd, iters):.3f} fwd+bwd {time_ms(fwd_bwd, iters):.3f} "
              f"({note} LigerRMSNormFunction, offset 1, gemma casting)", flush=True)
    for inner in (9216, 12288, 17408):
        g, u, dy = rand(16384, inner), rand(16384, inner), rand(16384, inner)

        def fwd():
            with torch.no_grad():
                return LigerSiLUMulFunction.apply(g, u)

        def fwd_bwd():
            torch.autograd.backward(LigerSiLUMulFunction.apply(g, u), dy, inputs=[g, u])

        print(f"peer swiglu 16384x{inner} fwd {time_ms(fwd, iters):.3f} fwd+bwd {time_ms(fwd_bwd, iters):.3f} "
              f"({note} LigerSiLUMulFunction)", flush=True)
    N, H, V = 16384, 4096, 248320
    h, w = rand(N, H), rand(V, H, scale=0.02)
    y = torch.randint(0, V, (N,), generator=gen, device="cuda")
    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def fwd():
        with torch.no_grad():
            return loss_fn(w, h, y)

    def fwd_bwd():
        loss_fn(w, h, y).backward(inputs=[h, w])

    torch.cuda.reset_peak_memory_stats()
    f, fb = time_ms(fwd, max(1, iters // 3)), time_ms(fwd_bwd, max(1, iters // 3))
    print(f"peer linear_cross_entropy {N}x{H}x{V} fwd {f:.3f} fwd+bwd {fb:.3f} ({note} "
          f"LigerFusedLinearCrossEntropyLoss; peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB with the "
          f"inputs and gradients)", flush=True)


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
    liger_rows(args.iters)


if __name__ == "__main__":
    main()
