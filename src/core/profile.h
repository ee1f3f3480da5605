// Per-step profile of a training step (`deltastack bench step --profile`): milliseconds per (op family, role)
// accumulated over steps from timed scopes (core/cuda/profile.h records them with CUDA events), the work each
// scope did (FLOPs or bytes moved) for a roofline fraction, and the table bench prints. Host only, no CUDA: the
// aggregation, the roofline arithmetic and the formatting are tested without a GPU (tests/test_profile.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ds {

// The op families in the order the table lists them; "gaps" (wall time minus the sum of scopes) comes last.
//   gemm: the projections by role (GDN in_proj / out_proj, attention qkv / o_proj, MLP gate_up / down), backward
//         roles with " (bwd)"; the LM head is in "loss";
//   gdn: the gated delta rule; attention: the SDPA kernel (cuDNN or the simple one); conv: conv1d + SiLU;
//   norm: RMSNorm, l2norm, gated RMSNorm; elementwise: SwiGLU, RoPE, output gate, residual adds, copy_rows,
//         the GDN gates; loss: fused LM head + cross-entropy (forward and backward in one call);
//   embedding: lookup and its backward; optimizer: zero grads, grad sum of squares, AdamW;
//   copy: host <-> device transfers of the batch and the loss.
const std::vector<std::string>& profile_families();

// The rate and roofline fraction of `ms` of work: FLOP/s against gemm_rate (FLOP/s) when flops > 0, else bytes/s
// against copy_bw (bytes/s, read + write) when bytes > 0; fraction < 0 (and rate "-") when neither is known or
// ms <= 0. rate: "512.3 TFLOP/s" or "3.12 TB/s".
struct Roofline {
  std::string rate = "-";
  double fraction = -1;
};
Roofline roofline(double ms, double flops, double bytes, double gemm_rate, double copy_bw);

class ProfileTable {
 public:
  // One timed scope of the current step: `ms` milliseconds, `flops` / `bytes` its work (0: unknown).
  void add(const std::string& family, const std::string& role, double ms, double flops = 0, double bytes = 0);
  // Closes the current step, whose wall time was wall_ms.
  void end_step(double wall_ms);

  // Per step means: sums over every scope added, divided by steps() (by 1 before the first end_step).
  struct Row {
    std::string family, role;
    double ms = 0, flops = 0, bytes = 0;  // per step
    double calls = 0;                     // scopes per step
  };
  // One row per (family, role): families in profile_families() order (unknown ones after, by first appearance),
  // roles by first appearance within the family.
  std::vector<Row> rows() const;
  int64_t steps() const { return steps_; }
  double scope_ms() const;  // sum of every row's ms: per step
  double wall_ms() const;   // mean wall time per step
  double gaps_ms() const { return wall_ms() - scope_ms(); }

  // The table: per family a total line (with the rows' summed work and its roofline), then one indented line per
  // role when the family has more than one; ms per step, % of the mean wall time, scopes per step, rate, roofline;
  // then the sum of scopes against the mean wall time (median_wall_ms beside it when > 0) and the gaps.
  std::string format(double gemm_rate, double copy_bw, double median_wall_ms = 0) const;

 private:
  struct Acc {
    std::string family, role;
    double ms = 0, flops = 0, bytes = 0;
    int64_t calls = 0;
  };
  std::vector<Acc> acc_;  // first-appearance order
  int64_t steps_ = 0;
  double wall_ms_sum_ = 0;
};

}  // namespace ds
