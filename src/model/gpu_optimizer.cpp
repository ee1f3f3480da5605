#include "model/gpu_optimizer.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>

#include "core/error.h"
#include "ops/adamw/cuda.h"

namespace ds {

namespace K = ds::ops::cuda;

// The moments of this rank's share only (model/gpu_params.h ParamShard; the whole state unsharded): fp32 moments
// of the fp32-master elements in the share (indexed by master offset − the share's first), bf16 moments of the
// share's flat elements (bf16 layout; indexed by flat offset − share_lo).
void GpuAdamW::reserve(Arena& a) {
  a.use = MemoryUse::Optimizer;
  const auto [f0, f1] = store_.fp32_range_of(store_.shard().rank);
  f0_ = f0;
  n32_ = store_.sharded() || store_.state() == OptimizerState::Bf16 ? f1 - f0 : store_.fp32_size();
  if (!store_.sharded()) f0_ = 0;
  m_ = a.take<float>(n32_);
  v_ = a.take<float>(n32_);
  if (store_.state() == OptimizerState::Bf16) {
    nb_ = store_.share_hi() - store_.share_lo();
    mb_ = a.take<bf16>(nb_);
    vb_ = a.take<bf16>(nb_);
  }
}

void GpuAdamW::zero_state(cudaStream_t stream) {
  DS_CUDA_CHECK(cudaMemsetAsync(m_, 0, n32_ * sizeof(float), stream));
  DS_CUDA_CHECK(cudaMemsetAsync(v_, 0, n32_ * sizeof(float), stream));
  if (mb_) {
    DS_CUDA_CHECK(cudaMemsetAsync(mb_, 0, nb_ * sizeof(bf16), stream));
    DS_CUDA_CHECK(cudaMemsetAsync(vb_, 0, nb_ * sizeof(bf16), stream));
  }
}

// Each parameter's part inside the share [share_lo, share_hi) (all of it unsharded): the same per-element update
// whatever the share, so a sharded run takes the unsharded run's steps element for element.
void GpuAdamW::step(GpuParamStore& store, const ops::AdamWParams& p, cudaStream_t stream) {
  step_params(store, p, 0, store.params().size(), stream);
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuAdamW::step_params(GpuParamStore& store, const ops::AdamWParams& p, size_t first, size_t last,
                           cudaStream_t stream) {
  const std::vector<ParamSpec>& params = store.params();
  const int64_t lo = store.share_lo(), hi = store.share_hi();
  for (size_t k = first; k < last && k < params.size(); ++k) {
    const ParamSpec& s = params[k];
    const int64_t a = std::max(s.offset, lo), b = std::min(s.offset + s.numel, hi);
    if (a >= b) continue;
    ops::AdamWParams q = p;
    q.weight_decay = s.weight_decay ? p.weight_decay : 0.0;
    const int64_t o = store.fp32_offset(k), in = a - s.offset;
    if (o >= 0)
      K::adamw_update(store.master(k) + in, store.grads() + a, m_ + (o + in - f0_), v_ + (o + in - f0_),
                      store.compute(k) + in, b - a, q, stream);
    else
      K::adamw_update_bf16(store.compute(k) + in, store.grads() + a, mb_ + (a - lo), vb_ + (a - lo), b - a, q, a,
                           stream);
  }
}

// A slab inside one parameter: its part inside the share is read (written); a read of elements outside it is an
// error (a sharded state is gathered for checkpoints by the engine), a write skips them (a resume hands every
// rank the whole tensor).
void GpuAdamW::read_state(int which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const {
  DS_CHECK(which == 0 || which == 1, "adamw: state tensor {} does not exist", which);
  const size_t k = store_.param_at(first, count);
  if (count == 0) return;
  DS_CHECK(first >= store_.share_lo() && first + count <= store_.share_hi(), "adamw: state [{}, {}) is not this "
           "rank's share [{}, {})", first, first + count, store_.share_lo(), store_.share_hi());
  const int64_t o = store_.fp32_offset(k);
  if (o >= 0) {
    const float* src = (which == 0 ? m_ : v_) + o + (first - store_.params()[k].offset) - f0_;
    DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    download_bf16_as_f32((which == 0 ? mb_ : vb_) + (first - store_.share_lo()), count, dst, stream);
  }
}

void GpuAdamW::write_state(int which, int64_t first, int64_t count, const float* src, cudaStream_t stream) {
  DS_CHECK(which == 0 || which == 1, "adamw: state tensor {} does not exist", which);
  const size_t k = store_.param_at(first, count);
  const int64_t a = std::max(first, store_.share_lo()), b = std::min(first + count, store_.share_hi());
  if (a >= b) return;
  src += a - first;
  const int64_t o = store_.fp32_offset(k), n = b - a;
  if (o >= 0) {
    float* dst = (which == 0 ? m_ : v_) + o + (a - store_.params()[k].offset) - f0_;
    DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyHostToDevice, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    upload_f32_as_bf16(src, n, (which == 0 ? mb_ : vb_) + (a - store_.share_lo()), stream);
  }
}

}  // namespace ds
#endif
