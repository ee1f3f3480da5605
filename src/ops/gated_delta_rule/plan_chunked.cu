// The chunked tensor-core gated delta rule (ops/gated_delta_rule/chunked_cuda.h) as an op plan (plan.h): its chunk
// table, saved chunk states / T / cumulative gates and workspace stay behind this interface.
#include "core/cuda/cuda_utils.h"
#include "ops/gated_delta_rule/chunked_cuda.h"
#include "ops/gated_delta_rule/plan.h"

namespace ds::ops::cuda {

namespace {

class ChunkedPlan final : public GatedDeltaRulePlan {
 public:
  explicit ChunkedPlan(const GdnLimits& l)
      : l_(l), p_(gdn_chunked_plan(l.max_tokens, l.max_seqs, l.Hk, l.Hv, l.dk, l.dv)) {}
  std::string name() const override { return "cuda-chunked"; }
  size_t batch_bytes() const override { return p_.index_bytes(); }
  size_t saved_bytes() const override { return p_.saved_bytes(); }
  size_t workspace_bytes() const override { return p_.workspace_bytes(); }
  void prepare(const int32_t* cu_seqlens, int64_t N, int64_t num_seqs, void* batch, cudaStream_t stream) override {
    DS_CUDA_REQUIRE(N >= 0 && N <= l_.max_tokens && num_seqs >= 0 && num_seqs <= l_.max_seqs,
                    "gated_delta_rule plan: batch exceeds the plan's limits");
    N_ = N;
    num_seqs_ = num_seqs;
    index_ = batch;
    gdn_chunked_prepare(p_, cu_seqlens, num_seqs, N, batch, stream);
  }
  void forward(const GdnForwardIO& io, void* saved, void* workspace, cudaStream_t stream) override {
    gdn_chunked_forward(p_, dims(), index_, io.q, io.k, io.v, io.v_stride, io.g, io.beta, nullptr, io.o, nullptr,
                        saved, workspace, stream);
  }
  void backward(const GdnForwardIO& in, const GdnBackwardIO& gr, const void* saved, void* workspace,
                cudaStream_t stream) override {
    gdn_chunked_backward(p_, dims(), index_, in.q, in.k, in.v, in.v_stride, in.g, in.beta, saved, gr.dout, nullptr,
                         gr.dq, gr.dk, gr.dv, gr.dv_stride, gr.dg, gr.dbeta, nullptr, workspace, stream);
  }

 private:
  GdnDims dims() const {
    GdnDims d;
    d.N = N_;
    d.num_seqs = num_seqs_;
    d.Hk = l_.Hk, d.Hv = l_.Hv, d.dk = l_.dk, d.dv = l_.dv;
    d.scale = l_.scale;
    d.chunk_size = 64;
    return d;
  }
  GdnLimits l_;
  GdnChunkedPlan p_;
  int64_t N_ = 0, num_seqs_ = 0;
  const void* index_ = nullptr;
};

}  // namespace

bool chunked_gated_delta_rule_supports(const GdnLimits& l) {
  // gdn_chunked_plan's own conditions (chunked_cuda.h), so that a shape it refuses falls back instead of failing.
  return l.dk == 128 && l.dv == 128 && l.Hk > 0 && l.Hv > 0 && l.Hv % l.Hk == 0 && l.max_tokens >= 0 &&
         l.max_tokens < (int64_t{1} << 31) && l.max_seqs >= 0 && l.max_seqs < (int64_t{1} << 28) &&
         (l.max_tokens + 63) / 64 + l.max_seqs < (int64_t{1} << 31);
}

std::unique_ptr<GatedDeltaRulePlan> make_chunked_gated_delta_rule_plan(const GdnLimits& limits) {
  return std::make_unique<ChunkedPlan>(limits);
}

}  // namespace ds::ops::cuda
