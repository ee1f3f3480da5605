#include "model/gpu_params.h"

#ifdef DELTASTACK_CUDA
#include "ops/adamw/cuda.h"

namespace ds {

namespace K = ds::ops::cuda;

void GpuParamStore::reserve(Arena& a) {
  a.use = MemoryUse::Parameters;
  w_ = a.take<float>(P_);
  a.use = MemoryUse::Gradients;
  g_ = a.take<float>(P_);
  a.use = MemoryUse::Parameters;
  wb_ = a.take<bf16>(P_);
  a.use = MemoryUse::Workspace;
  sumsq_ = a.take<double>(1);
  sumsq_scratch_ = a.bytes(K::sum_squares_scratch_bytes(P_));
}

GpuParamStore::Layer GpuParamStore::layer_params(int64_t i) const {
  return {layout_.layer<const bf16>(i, wb_), layout_.layer<const float>(i, w_), layout_.layer(i, g_)};
}

GpuParamStore::Model GpuParamStore::model_params() const {
  return {layout_.model<const bf16>(wb_), layout_.model<const float>(w_), layout_.model(g_)};
}

void GpuParamStore::upload(const float* host, cudaStream_t stream) {
  DS_CUDA_CHECK(cudaMemcpyAsync(w_, host, P_ * sizeof(float), cudaMemcpyHostToDevice, stream));
  DS_CUDA_CHECK(cudaMemsetAsync(g_, 0, P_ * sizeof(float), stream));
  K::to_bf16(w_, wb_, P_, stream);
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuParamStore::zero_grads(cudaStream_t stream) {
  DS_CUDA_CHECK(cudaMemsetAsync(g_, 0, P_ * sizeof(float), stream));
}

double GpuParamStore::grad_sum_squares(cudaStream_t stream) {
  K::sum_squares(g_, P_, sumsq_, sumsq_scratch_, stream);
  double s = 0;
  DS_CUDA_CHECK(cudaMemcpyAsync(&s, sumsq_, sizeof(double), cudaMemcpyDeviceToHost, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  return s;
}

}  // namespace ds
#endif
