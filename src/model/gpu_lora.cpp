#include "model/gpu_lora.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>

#include "core/error.h"
#include "ops/adamw/cuda.h"
#include "ops/elementwise/dropout.h"
#include "ops/linear/cuda.h"

namespace ds {

namespace K = ds::ops::cuda;

GpuLora::GpuLora(const ModelConfig& c, const LoraConfig& config, int64_t max_tokens)
    : config_(config), specs_(lora_tensor_specs(c, config)), max_tokens_(max_tokens) {
  n_ = lora_num_values(specs_, config_.r);
  for (const LoraTensorSpec& s : specs_) max_in_ = std::max(max_in_, s.in);
}

void GpuLora::reserve(Arena& a) {
  const size_t n = static_cast<size_t>(n_), nr = static_cast<size_t>(max_tokens_ * config_.r);
  a.use = MemoryUse::Parameters;
  w_ = a.take<float>(n);
  wb_ = a.take<bf16>(n);
  a.use = MemoryUse::Gradients;
  g_ = a.take<float>(n);
  a.use = MemoryUse::Optimizer;
  m_ = a.take<float>(n);
  v_ = a.take<float>(n);
  a.use = MemoryUse::Workspace;
  sumsq_ = a.take<double>(1);
  sumsq_scratch_ = a.bytes(K::sum_squares_scratch_bytes(n_));
  u_ = a.take<bf16>(nr);
  du_ = a.take<bf16>(nr);
  if (config_.lora_dropout > 0) {
    xd_ = a.take<bf16>(static_cast<size_t>(max_tokens_ * max_in_));
    dxd_ = a.take<bf16>(static_cast<size_t>(max_tokens_ * max_in_));
  }
}

void GpuLora::upload(const std::vector<float>& values, cudaStream_t stream) {
  DS_CHECK(static_cast<int64_t>(values.size()) == n_, "gpu LoRA: the host adapter holds {} values, expected {}",
           values.size(), n_);
  write(Buffer::Values, 0, n_, values.data(), stream);
  for (float* p : {g_, m_, v_}) DS_CUDA_CHECK(cudaMemsetAsync(p, 0, n_ * sizeof(float), stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuLora::zero_grads(cudaStream_t stream) { DS_CUDA_CHECK(cudaMemsetAsync(g_, 0, n_ * sizeof(float), stream)); }

double GpuLora::grad_sum_squares(cudaStream_t stream) {
  K::sum_squares(g_, n_, sumsq_, sumsq_scratch_, stream);
  double s = 0;
  DS_CUDA_CHECK(cudaMemcpyAsync(&s, sumsq_, sizeof(double), cudaMemcpyDeviceToHost, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  return s;
}

void GpuLora::step(const ops::AdamWParams& p, cudaStream_t stream) {
  K::adamw_update(w_, g_, m_, v_, wb_, n_, p, stream);
}

namespace {
float* buffer_of(GpuLora::Buffer which, float* w, float* g, float* m, float* v) {
  switch (which) {
    case GpuLora::Buffer::Values: return w;
    case GpuLora::Buffer::Grads: return g;
    case GpuLora::Buffer::ExpAvg: return m;
    case GpuLora::Buffer::ExpAvgSq: return v;
  }
  return nullptr;
}
}  // namespace

void GpuLora::read(Buffer which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const {
  DS_CHECK(first >= 0 && count >= 0 && first + count <= n_, "gpu LoRA: read of [{}, {}) outside the {} adapter values",
           first, first + count, n_);
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, buffer_of(which, w_, g_, m_, v_) + first, count * sizeof(float),
                                cudaMemcpyDeviceToHost, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuLora::write(Buffer which, int64_t first, int64_t count, const float* src, cudaStream_t stream) {
  DS_CHECK(first >= 0 && count >= 0 && first + count <= n_, "gpu LoRA: write of [{}, {}) outside the {} adapter "
           "values", first, first + count, n_);
  if (count == 0) return;
  float* dst = buffer_of(which, w_, g_, m_, v_) + first;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyHostToDevice, stream));
  if (which == Buffer::Values) K::to_bf16(dst, wb_ + first, count, stream);
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));  // src is the caller's, free after return
}

const GpuLora::bf16* GpuLora::input(size_t k, const bf16* x, int64_t N, std::optional<uint64_t> drop, float& keep,
                                    cudaStream_t stream) {
  keep = 1.0f;
  if (!drop) return x;
  DS_CHECK(xd_, "internal: LoRA dropout without its scratch (the plan was made for lora_dropout 0)");
  keep = static_cast<float>(1.0 / (1.0 - config_.lora_dropout));
  K::dropout_select(x, xd_, N * specs_[k].in, *drop, config_.lora_dropout, stream);
  return xd_;
}

void GpuLora::forward(size_t k, const bf16* x, int64_t N, bf16* y, int64_t ldy, std::optional<uint64_t> drop,
                      cudaStream_t stream) {
  DS_CHECK(N <= max_tokens_, "internal: LoRA term over {} tokens, planned for {}", N, max_tokens_);
  const LoraTensorSpec& s = specs_[k];
  const int64_t r = config_.r;
  const bf16 *A = wb_ + s.a_offset, *B = wb_ + s.b_offset;
  float keep = 1.0f;
  const bf16* xa = input(k, x, N, drop, keep, stream);
  K::gemm(false, true, N, r, s.in, keep, xa, s.in, A, s.in, 0.0f, u_, false, r, stream);  // u [N, r]
  K::gemm(false, true, N, s.out, r, static_cast<float>(config_.scaling()), u_, r, B, r, 1.0f, y, false, ldy, stream);
}

void GpuLora::backward(size_t k, const bf16* x, int64_t N, const bf16* dy, int64_t ldy, bf16* dx,
                       std::optional<uint64_t> drop, cudaStream_t stream) {
  DS_CHECK(N <= max_tokens_, "internal: LoRA term over {} tokens, planned for {}", N, max_tokens_);
  const LoraTensorSpec& s = specs_[k];
  const int64_t r = config_.r;
  const float scaling = static_cast<float>(config_.scaling());
  const bf16 *A = wb_ + s.a_offset, *B = wb_ + s.b_offset;
  float *dA = g_ + s.a_offset, *dB = g_ + s.b_offset;
  float keep = 1.0f;
  const bf16* xa = input(k, x, N, drop, keep, stream);
  K::gemm(false, true, N, r, s.in, keep, xa, s.in, A, s.in, 0.0f, u_, false, r, stream);      // u [N, r] again
  K::gemm(true, false, s.out, r, N, scaling, dy, ldy, u_, r, 1.0f, dB, true, r, stream);      // dB += s dy^T u
  K::gemm(false, false, N, r, s.out, scaling, dy, ldy, B, r, 0.0f, du_, false, r, stream);    // du = s dy B
  K::gemm(true, false, r, s.in, N, keep, du_, r, xa, s.in, 1.0f, dA, true, s.in, stream);     // dA += keep du^T x'
  if (!drop) {
    K::gemm(false, false, N, s.in, r, 1.0f, du_, r, A, s.in, 1.0f, dx, false, s.in, stream);  // dx += du A
    return;
  }
  K::gemm(false, false, N, s.in, r, keep, du_, r, A, s.in, 0.0f, dxd_, false, s.in, stream);  // keep du A
  K::dropout_select_add(dxd_, dx, N * s.in, *drop, config_.lora_dropout, stream);             // dx += m ⊙ that
}

}  // namespace ds
#endif
