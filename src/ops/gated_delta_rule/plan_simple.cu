// The simple CUDA gated delta rule (ops/gated_delta_rule/cuda.h) as an op plan (plan.h). Its private contract stays
// here: chunks of kChunk tokens, per-chunk fp32 states [chunks, Hv, dk, dv] saved by the forward, chunk offsets
// (prefix sums of ceil(len_s / kChunk)) built on the device by prepare().
#include <algorithm>

#include "core/cuda/cuda_utils.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/plan.h"

namespace ds::ops::cuda {

namespace {

constexpr int64_t kChunk = 64;

// offsets[s + 1] = sum over documents s' <= s of ceil(len_s' / chunk); offsets[0] = 0. One thread: the
// document count of a micro-batch is small (at most a few thousand) and this runs once per micro-batch.
__global__ void chunk_offsets_kernel(const int32_t* cu, int64_t num_seqs, int32_t chunk, int32_t* offsets) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int32_t acc = 0;
  offsets[0] = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t len = cu[s + 1] - cu[s];
    acc += (len + chunk - 1) / chunk;
    offsets[s + 1] = acc;
  }
}

class SimplePlan final : public GatedDeltaRulePlan {
 public:
  explicit SimplePlan(const GdnLimits& l) : l_(l) {
    DS_CUDA_REQUIRE(l.max_tokens > 0 && l.max_seqs > 0, "gated_delta_rule plan: limits must be positive");
  }
  std::string name() const override { return "cuda-simple"; }
  // Every document adds at most one partial chunk.
  int64_t max_chunks() const { return l_.max_tokens / kChunk + l_.max_seqs + 1; }
  size_t batch_bytes() const override { return static_cast<size_t>(l_.max_seqs + 1) * sizeof(int32_t); }
  size_t saved_bytes() const override {
    return static_cast<size_t>(max_chunks() * l_.Hv * l_.dk * l_.dv) * sizeof(float);
  }
  size_t workspace_bytes() const override { return gated_delta_rule_scratch_bytes(dims(l_.max_tokens, l_.max_seqs), max_chunks()); }
  void prepare(const int32_t* cu_seqlens, int64_t N, int64_t num_seqs, void* batch, cudaStream_t stream) override {
    DS_CUDA_REQUIRE(N >= 0 && N <= l_.max_tokens && num_seqs >= 0 && num_seqs <= l_.max_seqs,
                    "gated_delta_rule plan: batch exceeds the plan's limits");
    N_ = N;
    num_seqs_ = num_seqs;
    cu_ = cu_seqlens;
    offsets_ = static_cast<int32_t*>(batch);
    chunk_offsets_kernel<<<1, 1, 0, stream>>>(cu_seqlens, num_seqs, static_cast<int32_t>(kChunk), offsets_);
    DS_CUDA_CHECK(cudaGetLastError());
  }
  void forward(const GdnForwardIO& io, void* saved, void*, cudaStream_t stream) override {
    gated_delta_rule_forward(dims(N_, num_seqs_), io.q, io.k, io.v, io.v_stride, io.g, io.beta, cu_, offsets_,
                             max_chunks(), io.o, static_cast<float*>(saved), stream);
  }
  void backward(const GdnForwardIO& in, const GdnBackwardIO& gr, const void* saved, void* workspace,
                cudaStream_t stream) override {
    gated_delta_rule_backward(dims(N_, num_seqs_), in.q, in.k, in.v, in.v_stride, in.g, in.beta, cu_, offsets_,
                              max_chunks(), static_cast<const float*>(saved), gr.dout, gr.dq, gr.dk, gr.dv,
                              gr.dv_stride, gr.dg, gr.dbeta, workspace, stream);
  }

 private:
  GdnDims dims(int64_t N, int64_t S) const {
    GdnDims d;
    d.N = N;
    d.num_seqs = S;
    d.Hk = l_.Hk, d.Hv = l_.Hv, d.dk = l_.dk, d.dv = l_.dv;
    d.scale = l_.scale;
    d.chunk_size = kChunk;
    return d;
  }
  GdnLimits l_;
  int64_t N_ = 0, num_seqs_ = 0;
  const int32_t* cu_ = nullptr;
  int32_t* offsets_ = nullptr;
};

}  // namespace

std::unique_ptr<GatedDeltaRulePlan> make_simple_gated_delta_rule_plan(const GdnLimits& limits) {
  return std::make_unique<SimplePlan>(limits);
}

}  // namespace ds::ops::cuda
