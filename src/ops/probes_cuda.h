// Numeric self-probes of the CUDA backends (one per op family), run by the op registry at first use of an op
// on device "cuda". Each probe draws fresh random inputs (seeded from the clock and std::random_device), rounds
// the bf16 ones to bf16 for the fp32 CPU reference (ds::ops::<op>_* in src/ops/<op>/<op>.h), runs the CUDA
// forward and backward on the device, and returns the largest relative L2 error over every output and gradient
// (+infinity when an output is NaN/inf, was left unwritten, a write landed outside its rows, or the probe could
// not run at all, e.g. a launcher threw). Packed cases use cu_seqlens lengths {1, 70, 0, 130} (partial chunks and
// an empty document). Accumulated gradients (+=) start from a random value that is subtracted afterwards, so an
// overwrite is caught.
//
// Plain C++ (no CUDA types). The functions are defined only when DELTASTACK_CUDA is defined
// (src/ops/probes_cuda.cpp); the registry references them only in that case. Each returns +infinity when no CUDA
// device is present. Set DELTASTACK_LOG=debug to see the error of every output.
#pragma once

namespace ds::ops {

double probe_cuda_rmsnorm();               // rows 64 x 256 zero-centered; 37 x 128 plain, dx aliasing dy
double probe_cuda_gated_rmsnorm();         // rows 64 x 128
double probe_cuda_l2norm();                // 48 tokens x 2 heads x 128, strided rows (stride 1024, offset 256)
double probe_cuda_swiglu();                // N 64, I 256
double probe_cuda_gdn_gate();              // N 64, Hv 32 (some a + dt_bias past the softplus threshold)
double probe_cuda_embedding();             // V 512, H 256, N 96 with repeated ids
double probe_cuda_conv1d();                // packed {1, 70, 0, 130}, C 96, K 4
double probe_cuda_rope();                  // packed {1, 70, 0, 130} (positions restart), H 3, hd 128, rot 32
double probe_cuda_output_gate();           // n 64 x 256; also add (in place), copy_rows, bf16_to_f32
double probe_cuda_linear();                // M 70, K 256, N 192: forward, backward data (both +/- accumulate), weight
double probe_cuda_linear_cross_entropy();  // N 64, H 128, V 1000, chunks of 24, z-loss, ignored targets
double probe_cuda_attention();             // packed {1, 70, 0, 130}, GQA 2: hd 64 (Hq 4), hd 256 (Hq 2)
double probe_cudnn_attention();            // cuDNN SDPA: packed {1, 70, 0, 130, 5} (3 length buckets), GQA 2 and 4,
                                           // hd 128 and 256; the backward twice must agree bitwise
double probe_cuda_gated_delta_rule();      // packed {1, 70, 0, 130}, GVA 2: dk = dv = 32 and 128; strided v/dv
double probe_cuda_adamw();                 // n 5003: update (deltas of param, m, v), bf16 copy, sum_squares, to_bf16

}  // namespace ds::ops
