#include "ops/attention/plan.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "ops/attention/cuda.h"
#include "ops/attention/cudnn.h"
#include "ops/registry.h"

namespace ds::ops::cuda {

AttentionPlan::AttentionPlan(const AttnLimits& l) : l_(l) {
  DS_CHECK(l.max_tokens > 0 && l.max_seqs > 0 && l.max_seqlen > 0 && l.max_seqlen <= l.max_tokens,
           "attention plan: invalid limits (tokens {}, documents {}, max_seqlen {})", l.max_tokens, l.max_seqs,
           l.max_seqlen);
  const Backend& chosen = select_backend("attention", "cuda");
  if (chosen.name.rfind("cudnn", 0) != 0) return;
  try {
    cudnn_ = std::make_unique<ops::cudnn::Attention>(l);
  } catch (const std::exception& e) {
    // Chosen by auto: fall back with one warning. Named by DELTASTACK_ATTENTION: an error, never a silent fallback.
    if (knob_setting("attention").mode == KnobMode::Named) throw;
    log_warn("attention: {}; using the simple attention kernel", e.what());
  }
}

AttentionPlan::~AttentionPlan() = default;

std::string AttentionPlan::name() const { return cudnn_ ? "cudnn (fused SDPA)" : "cuda-simple"; }

size_t AttentionPlan::batch_bytes() const { return cudnn_ ? cudnn_->meta_bytes() : 0; }

size_t AttentionPlan::workspace_bytes() const {
  return std::max(attention_scratch_bytes(dims(l_.max_tokens, l_.max_seqs)),
                  cudnn_ ? cudnn_->workspace_bytes() : size_t{0});
}

bool AttentionPlan::drop_to_simple() {
  if (!cudnn_) return false;
  DS_CHECK(knob_setting("attention").mode != KnobMode::Named,
           "attention: DELTASTACK_ATTENTION names {}, but its workspace does not fit in device memory; lower "
           "--micro-batch or --seq-len, or unset it", name());
  cudnn_.reset();
  cudnn_batch_ = false;
  return true;
}

AttnDims AttentionPlan::dims(int64_t N, int64_t S) const {
  AttnDims d;
  d.N = N;
  d.num_seqs = S;
  d.Hq = l_.Hq;
  d.Hkv = l_.Hkv;
  d.head_dim = l_.head_dim;
  d.scale = l_.scale;
  return d;
}

void AttentionPlan::prepare(const int32_t* cu_host, const int32_t* cu_dev, int64_t N, int64_t num_seqs, void* batch,
                            cudaStream_t stream) {
  DS_CHECK(N <= l_.max_tokens && num_seqs <= l_.max_seqs, "attention: batch of {} tokens / {} documents exceeds the "
           "plan ({} / {})", N, num_seqs, l_.max_tokens, l_.max_seqs);
  N_ = N;
  num_seqs_ = num_seqs;
  cu_ = cu_dev;
  max_seqlen_ = 0;
  for (int64_t s = 0; s < num_seqs; ++s) max_seqlen_ = std::max<int64_t>(max_seqlen_, cu_host[s + 1] - cu_host[s]);
  cudnn_batch_ = false;
  if (!cudnn_) return;
  DS_CHECK(max_seqlen_ <= l_.max_seqlen, "gpu: a document of {} tokens exceeds the plan's max_seqlen {}", max_seqlen_,
           l_.max_seqlen);
  cudnn_batch_ = cudnn_->set_batch(cu_host, num_seqs, batch, stream);
  if (!cudnn_batch_ && !warned_) {
    warned_ = true;
    log_warn("attention: a batch holds more short documents than cuDNN's smallest length buckets were built for; "
             "such batches use the simple attention kernel");
  }
}

void AttentionPlan::forward(const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v,
                            ds::cuda::bf16* o, float* lse, void* workspace, cudaStream_t stream) {
  if (cudnn_batch_) cudnn_->forward(q, k, v, o, lse, workspace, stream);
  else attention_forward(dims(N_, num_seqs_), q, k, v, cu_, max_seqlen_, o, lse, stream);
}

void AttentionPlan::backward(const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v,
                             const ds::cuda::bf16* o, const float* lse, const ds::cuda::bf16* dout, ds::cuda::bf16* dq,
                             ds::cuda::bf16* dk, ds::cuda::bf16* dv, void* workspace, cudaStream_t stream) {
  if (cudnn_batch_) cudnn_->backward(q, k, v, o, lse, dout, dq, dk, dv, workspace, stream);
  else attention_backward(dims(N_, num_seqs_), q, k, v, o, lse, dout, cu_, max_seqlen_, dq, dk, dv, workspace, stream);
}

}  // namespace ds::ops::cuda
#endif
