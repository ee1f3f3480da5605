#include "model/gpu_optimizer.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>

#include "core/error.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/cuda.h"
#include "ops/adamw/q8_state.h"

namespace ds {

namespace K = ds::ops::cuda;

namespace Q = ds::ops::q8_state;

std::pair<int64_t, int64_t> GpuAdamW::piece(size_t k) const {
  const ParamSpec& s = store_.params()[k];
  return {std::max(s.offset, store_.share_lo()), std::min(s.offset + s.numel, store_.share_hi())};
}

// The moments of this rank's share only (model/gpu_params.h ParamShard; the whole state unsharded): fp32 moments
// of the fp32-master elements in the share (indexed by master offset − the share's first), bf16 moments (bf16
// state) or 8-bit codes (8bit state) of the share's flat elements (indexed by flat offset − share_lo), and the 8bit
// state's block scales, parameter after parameter.
void GpuAdamW::reserve(Arena& a) {
  a.use = MemoryUse::Optimizer;
  const OptimizerState st = store_.state();
  const auto [f0, f1] = store_.fp32_range_of(store_.shard().rank);
  f0_ = f0;
  n32_ = store_.sharded() || bf16_weights(st) ? f1 - f0 : store_.fp32_size();
  if (!store_.sharded()) f0_ = 0;
  m_ = a.take<float>(n32_);
  v_ = a.take<float>(n32_);
  nb_ = store_.share_hi() - store_.share_lo();
  if (st == OptimizerState::Bf16) {
    mb_ = a.take<bf16>(nb_);
    vb_ = a.take<bf16>(nb_);
  }
  if (st == OptimizerState::EightBit) {
    q0_.assign(store_.params().size(), -1);
    nq_ = 0;
    for (size_t k = 0; k < q0_.size(); ++k) {
      const auto [x, y] = piece(k);
      if (x >= y || store_.fp32_offset(k) >= 0) continue;
      q0_[k] = nq_;
      nq_ += Q::num_blocks(x, y - x);
    }
    mq_ = a.take<uint8_t>(nb_);
    vq_ = a.take<uint8_t>(nb_);
    ma_ = a.take<float>(nq_);
    va_ = a.take<float>(nq_);
  }
}

void GpuAdamW::zero_state(cudaStream_t stream) {
  DS_CUDA_CHECK(cudaMemsetAsync(m_, 0, n32_ * sizeof(float), stream));
  DS_CUDA_CHECK(cudaMemsetAsync(v_, 0, n32_ * sizeof(float), stream));
  if (mb_) {
    DS_CUDA_CHECK(cudaMemsetAsync(mb_, 0, nb_ * sizeof(bf16), stream));
    DS_CUDA_CHECK(cudaMemsetAsync(vb_, 0, nb_ * sizeof(bf16), stream));
  }
  if (mq_) {  // code 0 with scale 0: the moments 0
    DS_CUDA_CHECK(cudaMemsetAsync(mq_, 0, nb_, stream));
    DS_CUDA_CHECK(cudaMemsetAsync(vq_, 0, nb_, stream));
    DS_CUDA_CHECK(cudaMemsetAsync(ma_, 0, nq_ * sizeof(float), stream));
    DS_CUDA_CHECK(cudaMemsetAsync(va_, 0, nq_ * sizeof(float), stream));
  }
}

// Each parameter's part inside the share [share_lo, share_hi) (all of it unsharded): the same per-element update
// whatever the share, so a sharded run takes the unsharded run's steps element for element.
void GpuAdamW::step(GpuParamStore& store, const ops::AdamWParams& p, cudaStream_t stream) {
  step_params(store, p, 0, store.params().size(), stream);
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuAdamW::step_params(GpuParamStore& store, const ops::AdamWParams& p, size_t first, size_t last,
                           cudaStream_t stream, bool fuse_sums, const ChunkSelect* select) {
  const std::vector<ParamSpec>& params = store.params();
  const int64_t lo = store.share_lo(), hi = store.share_hi();
  for (size_t k = first; k < last && k < params.size(); ++k) {
    const ParamSpec& s = params[k];
    const int64_t a = std::max(s.offset, lo), b = std::min(s.offset + s.numel, hi);
    if (a >= b) continue;
    ops::AdamWParams q = p;
    q.weight_decay = s.weight_decay ? p.weight_decay : 0.0;
    const int64_t o = store.fp32_offset(k), in = a - s.offset;
    DS_CHECK(!select || (selects(k) && fuse_sums), "internal: adamw: a chunk selection for {}, whose update does not "
             "fuse its sum", s.name);
    // The gradients: fp32 (the flat buffer, or the unit's slot with Gradients::InBackward) or bf16 (Gradients::Bf16,
    // the kernels widen them exactly).
    auto update = [&](const auto* g) {
      if (o >= 0)
        K::adamw_update(store.master(k) + in, g, m_ + (o + in - f0_), v_ + (o + in - f0_), store.compute(k) + in,
                        b - a, q, stream);
      else if (mq_)
        K::adamw_update_8bit(store.compute(k) + in, select && select->zero_grads ? nullptr : g, mq_ + (a - lo),
                             vq_ + (a - lo), ma_ + q0_[k], va_ + q0_[k], b - a, q, a, stream,
                             fuse_sums && fuses_sum(k) ? store.param_partials(k) : nullptr,
                             select ? select->mask : nullptr, select ? select->want : uint8_t{0});
      else
        K::adamw_update_bf16(store.compute(k) + in, g, mb_ + (a - lo), vb_ + (a - lo), b - a, q, a, stream);
    };
    if (store.grads_bf16()) update(store.grad_bf16(k) + in);
    else update(static_cast<const float*>(store.grad(k) + in));
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
  } else if (mq_) {
    read_q8(which, k, first, count, dst, stream);
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
  } else if (mq_) {
    write_q8(which, k, a, n, src, stream);
  } else {
    upload_f32_as_bf16(src, n, (which == 0 ? mb_ : vb_) + (a - store_.share_lo()), stream);
  }
}

namespace {
constexpr int64_t kQ8Stage = int64_t{1} << 22;  // elements per host staging round (a multiple of the block)
}

// In rounds of at most kQ8Stage elements ending on block boundaries: the codes and their blocks' scales to the host,
// dequantized there (ops::dequantize_moment_8bit, the kernel's own decode).
void GpuAdamW::read_q8(int which, size_t k, int64_t first, int64_t count, float* dst, cudaStream_t stream) const {
  const int64_t a = piece(k).first, lo = store_.share_lo();
  std::vector<uint8_t> code;
  std::vector<float> scale;
  for (int64_t x = first; x < first + count;) {
    const int64_t y = std::min(first + count, x / Q::kBlock * Q::kBlock + kQ8Stage);
    const int64_t nb = Q::num_blocks(x, y - x), b0 = q0_[k] + (x / Q::kBlock - a / Q::kBlock);
    code.resize(static_cast<size_t>(y - x));
    scale.resize(static_cast<size_t>(nb));
    DS_CUDA_CHECK(cudaMemcpyAsync(code.data(), (which == 0 ? mq_ : vq_) + (x - lo), y - x, cudaMemcpyDeviceToHost,
                                  stream));
    DS_CUDA_CHECK(cudaMemcpyAsync(scale.data(), (which == 0 ? ma_ : va_) + b0, nb * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
    ops::dequantize_moment_8bit(which, code.data(), scale.data(), y - x, x, dst + (x - first));
    x = y;
  }
}

uint8_t* GpuAdamW::codes(int which, int64_t first, int64_t count) const {
  DS_CHECK(which == 0 || which == 1, "adamw: state tensor {} does not exist", which);
  const size_t k = store_.param_at(first, count);
  DS_CHECK(codes_8bit(k), "adamw: {} has no 8-bit codes (state {}, sharded {})", store_.params()[k].name,
           optimizer_state_name(store_.state()), store_.sharded());
  return (which == 0 ? mq_ : vq_) + (first - store_.share_lo());
}

void GpuAdamW::read_codes(int which, int64_t first, int64_t count, uint8_t* dst, cudaStream_t stream) const {
  const uint8_t* src = codes(which, first, count);
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToHost, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

float* GpuAdamW::block_scales(int which, size_t k, int64_t first_block, int64_t count) const {
  DS_CHECK(which == 0 || which == 1, "adamw: state tensor {} does not exist", which);
  DS_CHECK(codes_8bit(k), "adamw: {} has no 8-bit codes", store_.params()[k].name);
  const auto [a, b] = piece(k);
  DS_CHECK(first_block >= 0 && count >= 0 && first_block + count <= Q::num_blocks(a, b - a),
           "adamw: block scales [{}, {}) outside the {} of {}", first_block, first_block + count,
           Q::num_blocks(a, b - a), store_.params()[k].name);
  return (which == 0 ? ma_ : va_) + q0_[k] + first_block;
}

void GpuAdamW::read_block_scales(int which, size_t k, int64_t first_block, int64_t count, float* dst,
                                 cudaStream_t stream) const {
  const float* src = block_scales(which, k, first_block, count);
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuAdamW::write_codes(int which, int64_t first, int64_t count, const uint8_t* src, cudaStream_t stream) {
  uint8_t* dst = codes(which, first, count);
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count, cudaMemcpyHostToDevice, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));  // src is the caller's (pageable) buffer
}

void GpuAdamW::write_block_scales(int which, size_t k, int64_t first_block, int64_t count, const float* src,
                                  cudaStream_t stream) {
  float* dst = block_scales(which, k, first_block, count);
  if (count == 0) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyHostToDevice, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// Whole blocks only (a block's scale depends on all of its elements): the slab must start and end on a block
// boundary of the parameter (its ends, or multiples of 256, which every share boundary is).
void GpuAdamW::write_q8(int which, size_t k, int64_t first, int64_t count, const float* src, cudaStream_t stream) {
  const ParamSpec& p = store_.params()[k];
  const int64_t a = piece(k).first, lo = store_.share_lo(), end = first + count;
  DS_CHECK((first == p.offset || first % Q::kBlock == 0) && (end == p.offset + p.numel || end % Q::kBlock == 0),
           "adamw: the 8-bit state of {} is written in whole {}-element blocks; [{}, {}) cuts one", p.name, Q::kBlock,
           first - p.offset, end - p.offset);
  std::vector<uint8_t> code;
  std::vector<float> scale;
  for (int64_t x = first; x < end;) {
    const int64_t y = std::min(end, x / Q::kBlock * Q::kBlock + kQ8Stage);
    const int64_t nb = Q::num_blocks(x, y - x), b0 = q0_[k] + (x / Q::kBlock - a / Q::kBlock);
    code.resize(static_cast<size_t>(y - x));
    scale.resize(static_cast<size_t>(nb));
    ops::quantize_moment_8bit(which, src + (x - first), y - x, x, code.data(), scale.data());
    DS_CUDA_CHECK(cudaMemcpyAsync((which == 0 ? mq_ : vq_) + (x - lo), code.data(), y - x, cudaMemcpyHostToDevice,
                                  stream));
    DS_CUDA_CHECK(cudaMemcpyAsync((which == 0 ? ma_ : va_) + b0, scale.data(), nb * sizeof(float),
                                  cudaMemcpyHostToDevice, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
    x = y;
  }
}

}  // namespace ds
#endif
