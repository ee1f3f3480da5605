// The gated delta rule on CUDA as an op plan: the engine sees sizes, a per-micro-batch prepare and
// forward/backward, never a kernel's private layout (chunk size, per-chunk states, chunk indices). Math and
// tensor layouts: gated_delta_rule.h (q, k: bf16 [N, Hk, dk] l2-normalised; v, dv: bf16 rows of v_stride /
// dv_stride elements, value head h at + h*dv; g, beta, dg, dbeta: fp32 [N, Hv]; o, dout: bf16 [N, Hv, dv];
// dq, dk: bf16 [N, Hk, dk] summed over the value heads sharing a k-head, in a fixed order).
//
// Life cycle: make_gated_delta_rule_plan(limits) once (the backend the op registry selected for device "cuda":
// DELTASTACK_GATED_DELTA_RULE=auto|fast|reference, or a backend's name, see ops/registry.h); the engine reserves
// batch_bytes() once, saved_bytes() per GDN layer and workspace_bytes() shared; per micro-batch prepare() builds
// the plan's indices on the device from cu_seqlens (no host sync; shared by every layer); then forward() per
// layer writes o and the layer's saved buffer, and backward() reads it back.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/cuda/cuda_utils.h"
#include "ops/gated_delta_rule/gated_delta_rule.h"

namespace ds::ops::cuda {

struct GdnLimits {
  int64_t max_tokens = 0;  // N of any micro-batch
  int64_t max_seqs = 0;    // documents of any micro-batch
  int64_t Hk = 0, Hv = 0, dk = 0, dv = 0;
  double scale = 0;        // multiplies q (dk^-0.5)
};

struct GdnForwardIO {
  const ds::cuda::bf16 *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t v_stride = 0;
  const float *g = nullptr, *beta = nullptr;
  ds::cuda::bf16* o = nullptr;
};

struct GdnBackwardIO {
  const ds::cuda::bf16* dout = nullptr;
  ds::cuda::bf16 *dq = nullptr, *dk = nullptr, *dv = nullptr;  // overwritten
  int64_t dv_stride = 0;
  float *dg = nullptr, *dbeta = nullptr;                        // overwritten
};

class GatedDeltaRulePlan {
 public:
  virtual ~GatedDeltaRulePlan() = default;
  virtual std::string name() const = 0;      // the registry backend it implements
  virtual size_t batch_bytes() const = 0;    // per-micro-batch indices, shared by all layers
  virtual size_t saved_bytes() const = 0;    // what one layer's forward keeps for its backward
  virtual size_t workspace_bytes() const = 0;  // scratch of one call, shared by all layers
  // cu_seqlens: device int32 [num_seqs + 1] (0 .. N, empty documents allowed), alive until the next prepare;
  // batch: batch_bytes() of device memory. ds::Error when N or num_seqs exceed the limits.
  virtual void prepare(const int32_t* cu_seqlens, int64_t N, int64_t num_seqs, void* batch, cudaStream_t stream) = 0;
  virtual void forward(const GdnForwardIO& io, void* saved, void* workspace, cudaStream_t stream) = 0;
  // The same inputs as the forward of this layer (q, k, v, g, beta), its saved buffer, and the gradients.
  virtual void backward(const GdnForwardIO& in, const GdnBackwardIO& grads, const void* saved, void* workspace,
                        cudaStream_t stream) = 0;
};

// The plan of the backend the registry selected for "gated_delta_rule" on "cuda" (probed at first use).
// ds::Error when no CUDA backend is usable (DELTASTACK_GATED_DELTA_RULE=reference on the GPU engine, or every
// backend rejected by its probe) or the dimensions are outside the kernels' limits.
std::unique_ptr<GatedDeltaRulePlan> make_gated_delta_rule_plan(const GdnLimits& limits);

// Whether the chunked kernel (cuda-chunked) takes these shapes: dk = dv = 128, Hv a multiple of Hk, fewer than 2^31
// tokens and 2^28 documents per micro-batch. Other shapes run cuda-simple.
bool chunked_gated_delta_rule_supports(const GdnLimits& limits);

// The plan of one named backend ("cuda-simple" | "cuda-chunked"), without consulting the registry: the probes and
// tests use it to check a backend in isolation.
std::unique_ptr<GatedDeltaRulePlan> make_gated_delta_rule_plan(const std::string& backend, const GdnLimits& limits);

}  // namespace ds::ops::cuda
