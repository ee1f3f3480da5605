#include "model/gpu_optimizer.h"

#ifdef DELTASTACK_CUDA
#include "core/error.h"
#include "ops/adamw/cuda.h"

namespace ds {

namespace K = ds::ops::cuda;

void GpuAdamW::reserve(Arena& a) {
  a.use = MemoryUse::Optimizer;
  m_ = a.take<float>(P_);
  v_ = a.take<float>(P_);
}

void GpuAdamW::zero_state(cudaStream_t stream) {
  DS_CUDA_CHECK(cudaMemsetAsync(m_, 0, P_ * sizeof(float), stream));
  DS_CUDA_CHECK(cudaMemsetAsync(v_, 0, P_ * sizeof(float), stream));
}

void GpuAdamW::step(GpuParamStore& store, const ops::AdamWParams& p, cudaStream_t stream) {
  for (const ParamSpec& s : params_) {
    ops::AdamWParams q = p;
    q.weight_decay = s.weight_decay ? p.weight_decay : 0.0;
    K::adamw_update(store.master() + s.offset, store.grads() + s.offset, m_ + s.offset, v_ + s.offset,
                    store.compute() + s.offset, s.numel, q, stream);
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuAdamW::read_state(int which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const {
  DS_CHECK(which >= 0 && which < 2 && first >= 0 && count >= 0 && first + count <= P_, "adamw: state read out of range");
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, buf(which) + first, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuAdamW::write_state(int which, int64_t first, int64_t count, const float* src, cudaStream_t stream) {
  DS_CHECK(which >= 0 && which < 2 && first >= 0 && count >= 0 && first + count <= P_, "adamw: state write out of range");
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(buf(which) + first, src, count * sizeof(float), cudaMemcpyHostToDevice, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace ds
#endif
