#include "model/gpu_optimizer.h"

#ifdef DELTASTACK_CUDA
#include "core/error.h"
#include "ops/adamw/cuda.h"

namespace ds {

namespace K = ds::ops::cuda;

void GpuAdamW::reserve(Arena& a) {
  a.use = MemoryUse::Optimizer;
  m_ = a.take<float>(store_.fp32_size());
  v_ = a.take<float>(store_.fp32_size());
  if (store_.state() == OptimizerState::Bf16) {
    mb_ = a.take<bf16>(store_.size());
    vb_ = a.take<bf16>(store_.size());
  }
}

void GpuAdamW::zero_state(cudaStream_t stream) {
  DS_CUDA_CHECK(cudaMemsetAsync(m_, 0, store_.fp32_size() * sizeof(float), stream));
  DS_CUDA_CHECK(cudaMemsetAsync(v_, 0, store_.fp32_size() * sizeof(float), stream));
  if (mb_) {
    DS_CUDA_CHECK(cudaMemsetAsync(mb_, 0, store_.size() * sizeof(bf16), stream));
    DS_CUDA_CHECK(cudaMemsetAsync(vb_, 0, store_.size() * sizeof(bf16), stream));
  }
}

void GpuAdamW::step(GpuParamStore& store, const ops::AdamWParams& p, cudaStream_t stream) {
  const std::vector<ParamSpec>& params = store.params();
  for (size_t k = 0; k < params.size(); ++k) {
    const ParamSpec& s = params[k];
    ops::AdamWParams q = p;
    q.weight_decay = s.weight_decay ? p.weight_decay : 0.0;
    const int64_t o = store.fp32_offset(k);
    if (o >= 0)
      K::adamw_update(store.master(k), store.grads() + s.offset, m_ + o, v_ + o, store.compute(k), s.numel, q, stream);
    else
      K::adamw_update_bf16(store.compute(k), store.grads() + s.offset, mb_ + s.offset, vb_ + s.offset, s.numel, q,
                           s.offset, stream);
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuAdamW::read_state(int which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const {
  DS_CHECK(which == 0 || which == 1, "adamw: state tensor {} does not exist", which);
  const size_t k = store_.param_at(first, count);
  if (count == 0) return;
  const int64_t o = store_.fp32_offset(k);
  if (o >= 0) {
    const float* src = (which == 0 ? m_ : v_) + o + (first - store_.params()[k].offset);
    DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    download_bf16_as_f32((which == 0 ? mb_ : vb_) + first, count, dst, stream);
  }
}

void GpuAdamW::write_state(int which, int64_t first, int64_t count, const float* src, cudaStream_t stream) {
  DS_CHECK(which == 0 || which == 1, "adamw: state tensor {} does not exist", which);
  const size_t k = store_.param_at(first, count);
  if (count == 0) return;
  const int64_t o = store_.fp32_offset(k);
  if (o >= 0) {
    float* dst = (which == 0 ? m_ : v_) + o + (first - store_.params()[k].offset);
    DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyHostToDevice, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    upload_f32_as_bf16(src, count, (which == 0 ? mb_ : vb_) + first, stream);
  }
}

}  // namespace ds
#endif
