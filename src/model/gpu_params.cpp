#include "model/gpu_params.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>
#include <cstdlib>
#include <string>
#include <tuple>

#include "core/bf16.h"
#include "core/error.h"
#include "ops/adamw/cuda.h"
#include "ops/linear/fp8.h"

namespace ds {

namespace K = ds::ops::cuda;

namespace {

// Per parameter: its offset in the fp32 master (all of them in the fp32 layout; the small ones, compacted, in
// the bf16 layout; -1 for a GEMM weight there).
std::vector<int64_t> fp32_offsets(const std::vector<ParamSpec>& params, OptimizerState state) {
  std::vector<int64_t> out;
  int64_t next = 0;
  for (const ParamSpec& p : params) {
    const bool fp32 = state == OptimizerState::Fp32 || !is_matrix(p);
    out.push_back(fp32 ? (state == OptimizerState::Fp32 ? p.offset : next) : -1);
    if (fp32) next += p.numel;
  }
  return out;
}

}  // namespace

GpuParamStore::GpuParamStore(const ParamLayout& layout, const std::vector<ParamSpec>& params, OptimizerState state,
                             ParamShard shard, std::vector<ParamUnit> units, Gradients gradients, bool frozen,
                             std::vector<Fp8WeightUnit> fp8_units, int layer_slots)
    : layout_(layout),
      params_(params),
      f8units_(std::move(fp8_units)),
      compute_layout_(layout),
      state_(state),
      shard_(shard),
      fp32_offset_(fp32_offsets(params, state)),
      master_layout_(layout),
      grad_layout_(layout),
      units_(std::move(units)),
      gradients_(gradients),
      frozen_(frozen) {
  DS_CHECK(state == OptimizerState::Fp32 || bf16_weights(state),
           "gpu: the optimizer state must be resolved to fp32, bf16 or 8bit before the store is built");
  DS_CHECK(!params.empty(), "gpu: no parameters");
  DS_CHECK(shard.world >= 0 && (shard.world == 0 || (shard.rank >= 0 && shard.rank < shard.world)),
           "gpu: shard rank {} of {}", shard.rank, shard.world);
  P_ = params.back().offset + params.back().numel;
  const int64_t unit = share_align(state) * std::max(1, shard.world);
  Ppad_ = shard.world == 0 ? P_ : (P_ + unit - 1) / unit * unit;
  S_ = shard.world == 0 ? P_ : Ppad_ / shard.world;
  std::tie(lo_, hi_) = share_range(shard.rank);
  for (size_t k = 0; k < params.size(); ++k)
    if (fp32_offset_[k] >= 0) P32_ = std::max(P32_, fp32_offset_[k] + params[k].numel);
  if (state == OptimizerState::Fp32) P32_ = Ppad_;  // flat, padded like the other flat buffers
  if (bf16_weights(state))
    master_layout_ = layout.remapped([this](int64_t off) -> int64_t {
      const size_t k = param_at(off, 0);
      return fp32_offset_[k] < 0 ? -1 : fp32_offset_[k] + (off - params_[k].offset);
    });
  // The FP8-stored weights (a frozen base under --precision fp8) and the bf16 copy of the others.
  DS_CHECK(f8units_.empty() || (frozen && shard.world == 0), "internal: FP8-stored weights need a frozen, unsharded "
           "base (its bf16 copy is compacted, not the flat [P_pad] of a shard)");
  f8unit_of_.assign(params.size(), -1);
  for (size_t u = 0; u < f8units_.size(); ++u) {
    const Fp8WeightUnit& f = f8units_[u];
    const int64_t end = f.offset + f.numel();
    size_t k = param_at(f.offset, 0);
    DS_CHECK(params[k].offset == f.offset, "internal: FP8 unit {} starts inside {}", u, params[k].name);
    for (; k < params.size() && params[k].offset < end; ++k) {
      DS_CHECK(params[k].offset + params[k].numel <= end && f8unit_of_[k] < 0 && is_matrix(params[k]),
               "internal: FP8 unit {} (layer {} weight {}) does not cover {} whole", u, f.layer, f.weight,
               params[k].name);
      f8unit_of_[k] = static_cast<int>(u);
    }
    DS_CHECK(params[k - 1].offset + params[k - 1].numel == end, "internal: FP8 unit {} ends inside {}", u,
             params[k - 1].name);
    w8_at_.push_back(W8_);
    W8_ += (f.numel() + 255) / 256 * 256;
  }
  for (size_t k = 0; k < params.size(); ++k) {
    if (f8unit_of_[k] >= 0) {
      bf16_offset_.push_back(-1);
      continue;
    }
    if (f8units_.empty()) {  // flat, as the other buffers
      bf16_offset_.push_back(params[k].offset);
      continue;
    }
    // compacted, at the flat offset's alignment modulo 128 elements (256 bytes), as the flat layout places it
    Pb_ += ((params[k].offset - Pb_) % 128 + 128) % 128;
    bf16_offset_.push_back(Pb_);
    Pb_ += params[k].numel;
  }
  if (f8units_.empty()) Pb_ = Ppad_;
  if (units_.empty()) units_.push_back({0, P_});
  DS_CHECK(units_.front().lo == 0 && units_.back().hi == P_, "gpu: the parameter units do not tile the {} parameters", P_);
  for (size_t u = 1; u < units_.size(); ++u)
    DS_CHECK(units_[u].lo == units_[u - 1].hi, "gpu: parameter unit {} does not start where unit {} ends", u, u - 1);
  unit_slot_.assign(units_.size(), 0);
  unit_at_.resize(units_.size());
  partial_at_.assign(params.size() + 1, 0);
  for (size_t k = 0; k < params.size(); ++k)
    partial_at_[k + 1] = partial_at_[k] + K::sum_squares_partials_count(params[k].offset, params[k].numel);
  // The parameters whose first element lies in each unit (units hold whole ones): one sweep, the parameters being
  // in offset order (param_at's binary search relies on it too); an empty unit gets [size, size).
  for (size_t k = 1; k < params.size(); ++k)
    DS_CHECK(params[k].offset > params[k - 1].offset, "internal: parameters out of offset order at {}", params[k].name);
  size_t next = 0;
  for (const ParamUnit& u : units_) {
    while (next < params.size() && params[next].offset < u.lo) ++next;
    const size_t a = next;
    while (next < params.size() && params[next].offset < u.hi) ++next;
    unit_params_.emplace_back(a < next ? a : params.size(), a < next ? next : params.size());
  }
  if (frozen_) {
    DS_CHECK(state == OptimizerState::Bf16 && gradients_ == Gradients::Fp32 && shard.world == 0, "internal: a frozen "
             "base is kept in the bf16 layout, with the fp32 gradient mode and no shard");
    // Per unit, its small parameters compacted from 0 in one scratch.
    std::vector<int64_t> at(params.size(), -1);
    for (const auto& [first, last] : unit_params_) {
      int64_t n = 0;
      for (size_t k = first; k < last; ++k)
        if (!is_matrix(params[k])) at[k] = n, n += params[k].numel;
      G_ = std::max(G_, n);
    }
    G_ = std::max<int64_t>(G_, 1);
    std::fill(unit_at_.begin(), unit_at_.end(), 0);
    grad_layout_ = layout.remapped([this, at](int64_t off) -> int64_t {
      const size_t k = param_at(off, 0);
      return at[k] < 0 ? -1 : at[k] + (off - params_[k].offset);
    });
    return;
  }
  if (gradients_ == Gradients::Fp32) {
    G_ = Ppad_;
    for (size_t u = 0; u < units_.size(); ++u) unit_at_[u] = units_[u].lo;
    return;
  }
  DS_CHECK(shard.world == 0, "--gradients {} keeps no fp32 gradient buffer to shard: use --shard none or "
           "--gradients fp32", gradients_name(gradients_));
  // The slots (class comment): units 0 (embedding), 1 .. L (layers), L + 1 (head).
  const size_t U = units_.size(), head = U - 1;
  DS_CHECK(U >= 2, "gpu: --gradients {} needs the embedding and head units", gradients_name(gradients_));
  const bool tied = layout.model_offsets().lm_head == layout.model_offsets().embed_tokens;
  int64_t size[kMaxGradSlots] = {};
  const int n = layer_slots;
  DS_CHECK(n >= 2 && 2 + n <= kMaxGradSlots, "gpu: {} layer gradient slots (2 .. {})", n, kMaxGradSlots - 2);
  auto need = [&](size_t u, int slot) {
    unit_slot_[u] = slot;
    size[slot] = std::max(size[slot], units_[u].size() + 64);
  };
  need(0, 0);
  need(head, tied ? 1 : 0);
  for (size_t u = 1; u < head; ++u) need(u, 2 + static_cast<int>((u - 1) % static_cast<size_t>(n)));
  for (int s = 0; s < 2 + n; ++s) {
    slot_at_[s] = G_;
    slot_len_[s] = (size[s] + 63) / 64 * 64;
    G_ += slot_len_[s];
  }
  for (size_t u = 0; u < U; ++u) unit_at_[u] = slot_at_[unit_slot_[u]] + units_[u].lo % 64;
  grad_layout_ = layout.remapped([this](int64_t off) { return grad_at(off); });
}

int64_t GpuParamStore::grad_at(int64_t flat) const {
  if (gradients_ == Gradients::Fp32) return flat;
  const auto it = std::upper_bound(units_.begin(), units_.end(), flat, [](int64_t x, const ParamUnit& p) { return x < p.lo; });
  const size_t u = static_cast<size_t>(it - units_.begin()) - 1;
  return unit_at_[u] + (flat - units_[u].lo);
}

size_t GpuParamStore::param_at(int64_t first, int64_t count) const {
  DS_CHECK(first >= 0 && count >= 0 && first + count <= P_, "gpu: parameter range [{}, {}) outside the {} parameters",
           first, first + count, P_);
  auto it = std::upper_bound(params_.begin(), params_.end(), first,
                             [](int64_t x, const ParamSpec& p) { return x < p.offset; });
  const size_t k = static_cast<size_t>(it - params_.begin()) - 1;
  DS_CHECK(first + count <= params_[k].offset + params_[k].numel, "gpu: range [{}, {}) spans more than {}", first,
           first + count, params_[k].name);
  return k;
}

std::pair<int64_t, int64_t> GpuParamStore::share_range(int rank) const {
  const int64_t lo = std::min(P_, S_ * rank);
  return {lo, std::min(P_, lo + S_)};
}

std::pair<int64_t, int64_t> GpuParamStore::fp32_range_of(int rank) const {
  const auto [lo, hi] = share_range(rank);
  if (state_ == OptimizerState::Fp32) return {lo, hi};
  // The compacted master keeps ParamSpec order: the small parameters' elements inside [lo, hi) are one range.
  int64_t a = -1, b = -1;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (fp32_offset_[k] < 0) continue;
    const ParamSpec& p = params_[k];
    const int64_t x = std::max(p.offset, lo), y = std::min(p.offset + p.numel, hi);
    if (x >= y) continue;
    if (a < 0) a = fp32_offset_[k] + (x - p.offset);
    b = fp32_offset_[k] + (y - p.offset);
  }
  return a < 0 ? std::pair<int64_t, int64_t>{0, 0} : std::pair<int64_t, int64_t>{a, b};
}

void GpuParamStore::reserve(Arena& a) {
  a.use = MemoryUse::Parameters;
  w_ = a.take<float>(P32_);
  a.use = MemoryUse::Gradients;
  g_ = a.take<float>(G_);
  if (gradients_ == Gradients::Bf16) gb_ = a.take<bf16>(Ppad_);
  a.use = MemoryUse::Parameters;
  wb_ = a.take<bf16>(Pb_);
  if (!f8units_.empty()) {
    w8_ = a.take<uint8_t>(W8_);  // after wb_: the compute views below address the codes from wb_ forward
    w8_f_ = a.take<float>(2 * ops::cuda::kFp8Slot * f8units_.size());
    a.use = MemoryUse::Workspace;
    stage_ = a.take<bf16>(kUploadStage);
    if (a.base) {
      const uintptr_t from = reinterpret_cast<uintptr_t>(wb_);
      compute_layout_ = layout_.remapped([this, from](int64_t off) -> int64_t {
        const size_t k = param_at(off, 0);
        const int u = f8unit_of_[k];
        if (u < 0) return bf16_offset_[k] + (off - params_[k].offset);
        const uintptr_t at = reinterpret_cast<uintptr_t>(w8_ + w8_at_[u] + (off - f8units_[u].offset));
        DS_CHECK(at > from && (at - from) % 2 == 0, "internal: FP8 codes of {} not addressable from the bf16 copy",
                 params_[k].name);
        return static_cast<int64_t>((at - from) / 2);
      });
    }
  }
  a.use = MemoryUse::Workspace;
  sumsq_ = a.take<double>(static_cast<int64_t>(units_.size()));
  partials_ = a.take<double>(std::max<int64_t>(1, partial_at_.back()));
}

GpuParamStore::Layer GpuParamStore::layer_params(int64_t i) const {
  return {compute_layout_.layer<const bf16>(i, wb_), master_layout_.layer<const float>(i, w_), grad_layout_.layer(i, g_)};
}

GpuParamStore::Model GpuParamStore::model_params() const {
  return {compute_layout_.model<const bf16>(wb_), master_layout_.model<const float>(w_), grad_layout_.model(g_)};
}

ds::cuda::bf16* GpuParamStore::compute(size_t k) const {
  const int u = f8unit_of_[k];
  if (u < 0) return wb_ + bf16_offset_[k];
  return reinterpret_cast<bf16*>(w8_ + w8_at_[u] + (params_[k].offset - f8units_[u].offset));
}

std::vector<GpuFp8Linear::StoredWeight> GpuParamStore::fp8_stored_weights() const {
  std::vector<GpuFp8Linear::StoredWeight> out;
  for (size_t u = 0; u < f8units_.size(); ++u) out.push_back({f8units_[u], fp8_codes(u), fp8_scale(u)});
  return out;
}

void GpuParamStore::upload_fp8_unit(size_t u, const std::vector<uint16_t>& bits, cudaStream_t stream) {
  const Fp8WeightUnit& f = f8units_[u];
  // The amax of the bf16 values: |x|'s bits are ordered as the floats are (NaN's above inf's), as fp8_amax takes it.
  uint32_t m = 0;
  const int64_t n = f.numel();
#pragma omp parallel for reduction(max : m) schedule(static)
  for (int64_t i = 0; i < n; ++i) m = std::max<uint32_t>(m, bits[static_cast<size_t>(i)] & 0x7fffu);
  const uint32_t amax_bits = m << 16;
  float* amax = w8_f_ + 2 * u * ops::cuda::kFp8Slot;
  DS_CUDA_CHECK(cudaMemcpyAsync(amax, &amax_bits, sizeof(float), cudaMemcpyHostToDevice, stream));
  const int64_t rows_per = std::max<int64_t>(1, kUploadStage / f.cols);
  DS_CHECK(rows_per * f.cols <= kUploadStage, "gpu: FP8 weight of layer {} has rows of {} elements, more than the "
           "upload stage's {}", f.layer, f.cols, kUploadStage);
  for (int64_t r0 = 0; r0 < f.rows; r0 += rows_per) {
    const int64_t r = std::min(rows_per, f.rows - r0);
    DS_CUDA_CHECK(cudaMemcpyAsync(stage_, bits.data() + r0 * f.cols, r * f.cols * sizeof(uint16_t),
                                  cudaMemcpyHostToDevice, stream));
    K::fp8_quantize(stage_, r, f.cols, f.cols, amax, Fp8Format::E4M3, w8_ + w8_at_[u] + r0 * f.cols, f.cols,
                    w8_f_ + (2 * u + 1) * ops::cuda::kFp8Slot, stream);
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));  // amax_bits and the stage
}

void GpuParamStore::upload(const std::function<void(size_t k, float* dst)>& values, cudaStream_t stream) {
  int64_t largest = 0;
  for (const ParamSpec& p : params_) largest = std::max(largest, p.numel);
  std::vector<float> stage(static_cast<size_t>(largest));  // one parameter at a time: bounded host memory
  int64_t largest_unit = 0;
  for (const Fp8WeightUnit& f : f8units_) largest_unit = std::max(largest_unit, f.numel());
  std::vector<uint16_t> unit_bits(static_cast<size_t>(largest_unit));  // an FP8 unit's bf16 values
  for (size_t k = 0; k < params_.size(); ++k) {
    const ParamSpec& p = params_[k];
    values(k, stage.data());
    if (const int u = f8unit_of_[k]; u >= 0) {  // into its unit's bf16 values; cast when the unit is whole
      const Fp8WeightUnit& f = f8units_[static_cast<size_t>(u)];
      to_bf16_bits(stage.data(), p.numel, unit_bits.data() + (p.offset - f.offset));
      if (p.offset + p.numel == f.offset + f.numel()) upload_fp8_unit(static_cast<size_t>(u), unit_bits, stream);
      continue;
    }
    if (frozen_) {  // the gradient scratch is small: stage on the host (bf16 rounded to nearest there)
      upload_f32_as_bf16(stage.data(), p.numel, wb_ + bf16_offset_[k], stream);
      if (fp32_offset_[k] >= 0)
        DS_CUDA_CHECK(cudaMemcpyAsync(w_ + fp32_offset_[k], stage.data(), p.numel * sizeof(float),
                                      cudaMemcpyHostToDevice, stream));
    } else if (state_ == OptimizerState::Fp32) {
      DS_CUDA_CHECK(cudaMemcpyAsync(w_ + p.offset, stage.data(), p.numel * sizeof(float), cudaMemcpyHostToDevice, stream));
      K::to_bf16(w_ + p.offset, wb_ + p.offset, p.numel, stream);
    } else {
      // Through the start of the gradient buffer (fp32, zeroed below; at least the largest parameter's size in
      // either gradient mode): the bf16 weights by rounding to nearest, a small parameter's fp32 master by copy.
      DS_CUDA_CHECK(cudaMemcpyAsync(g_, stage.data(), p.numel * sizeof(float), cudaMemcpyHostToDevice, stream));
      K::to_bf16(g_, wb_ + p.offset, p.numel, stream);
      if (fp32_offset_[k] >= 0)
        DS_CUDA_CHECK(cudaMemcpyAsync(w_ + fp32_offset_[k], g_, p.numel * sizeof(float), cudaMemcpyDeviceToDevice,
                                      stream));
    }
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));  // the staging buffer is refilled next
  }
  zero_grads(stream);
  if (Ppad_ > P_ && f8units_.empty()) {  // the padding of the flat buffers: zeros, summed and gathered like the rest
    DS_CUDA_CHECK(cudaMemsetAsync(wb_ + P_, 0, (Ppad_ - P_) * sizeof(bf16), stream));
    if (state_ == OptimizerState::Fp32) DS_CUDA_CHECK(cudaMemsetAsync(w_ + P_, 0, (Ppad_ - P_) * sizeof(float), stream));
  }
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void GpuParamStore::read_weights(int64_t first, int64_t count, float* dst, cudaStream_t stream) const {
  const size_t k = param_at(first, count);
  if (count == 0) return;
  if (fp32_offset_[k] >= 0) {
    const float* src = w_ + fp32_offset_[k] + (first - params_[k].offset);
    DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    DS_CHECK(f8unit_of_[k] < 0, "gpu: {} of the frozen base is kept as its FP8 cast only (LoRA with --precision fp8); "
             "its bf16 values are in the base checkpoint, not on the device", params_[k].name);
    download_bf16_as_f32(wb_ + bf16_offset_[k] + (first - params_[k].offset), count, dst, stream);
  }
}

void GpuParamStore::zero_grads(cudaStream_t stream) {
  DS_CUDA_CHECK(cudaMemsetAsync(g_, 0, G_ * sizeof(float), stream));
  if (gb_) DS_CUDA_CHECK(cudaMemsetAsync(gb_, 0, Ppad_ * sizeof(bf16), stream));
}

void GpuParamStore::zero_unit_grads(size_t u, cudaStream_t stream) {
  if (gb_) DS_CUDA_CHECK(cudaMemsetAsync(gb_ + units_[u].lo, 0, units_[u].size() * sizeof(bf16), stream));
  else DS_CUDA_CHECK(cudaMemsetAsync(unit_grads(u), 0, units_[u].size() * sizeof(float), stream));
}

void GpuParamStore::accumulate_unit(size_t u, uint64_t key, cudaStream_t stream) {
  DS_CHECK(gb_, "internal: accumulate_unit() needs --gradients bf16");
  K::accumulate_grad_bf16(gb_ + units_[u].lo, unit_grads(u), units_[u].size(), key, units_[u].lo, stream);
}

void GpuParamStore::unit_sum_squares(size_t u, cudaStream_t stream, const std::function<bool(size_t k)>& fused) {
  const auto [k0, k1] = unit_params_[u];
  for (size_t k = k0; k < k1; ++k) {
    if (fused && fused(k)) continue;
    // The parameter's part inside this rank's share (all of it unsharded); its partials in the partition of that
    // part, the rest of its partials zero (sum_partials adds each thread's partials in index order, so trailing
    // zeros leave the sum's bits as they are).
    const ParamSpec& p = params_[k];
    const int64_t lo = std::max(p.offset, lo_), hi = std::min(p.offset + p.numel, hi_);
    const int64_t used = hi > lo ? K::sum_squares_partials_count(lo, hi - lo) : 0;
    const int64_t all = partial_at_[k + 1] - partial_at_[k];
    if (used > 0 && gb_) K::sum_squares_partials(gb_ + lo, hi - lo, lo, param_partials(k), stream);
    else if (used > 0) K::sum_squares_partials(g_ + grad_at(lo), hi - lo, lo, param_partials(k), stream);
    if (used < all)
      DS_CUDA_CHECK(cudaMemsetAsync(param_partials(k) + used, 0, (all - used) * sizeof(double), stream));
  }
  K::sum_partials(param_partials(k0), partial_at_[k1] - partial_at_[k0], sumsq_ + u, stream);
}

double GpuParamStore::share_grad_sum_squares(cudaStream_t stream) { return grad_sum_squares(stream, true); }

double GpuParamStore::grad_sum_squares(cudaStream_t stream, bool fresh) {
  if (fresh)
    for (size_t u = 0; u < units_.size(); ++u) unit_sum_squares(u, stream);
  std::vector<double> sums(units_.size());
  DS_CUDA_CHECK(cudaMemcpyAsync(sums.data(), sumsq_, sums.size() * sizeof(double), cudaMemcpyDeviceToHost, stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  double s = 0;
  for (double x : sums) s += x;
  return s;
}

namespace {
constexpr int64_t kStage = int64_t{1} << 22;  // bf16 values per host staging round (8 MiB)
}

void download_bf16_as_f32(const ds::cuda::bf16* src, int64_t count, float* dst, cudaStream_t stream) {
  std::vector<uint16_t> stage(static_cast<size_t>(std::min(count, kStage)));
  for (int64_t done = 0; done < count; done += kStage) {
    const int64_t n = std::min(kStage, count - done);
    DS_CUDA_CHECK(cudaMemcpyAsync(stage.data(), src + done, n * 2, cudaMemcpyDeviceToHost, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
    from_bf16_bits(stage.data(), n, dst + done);
  }
}

void upload_f32_as_bf16(const float* src, int64_t count, ds::cuda::bf16* dst, cudaStream_t stream) {
  std::vector<uint16_t> stage(static_cast<size_t>(std::min(count, kStage)));
  for (int64_t done = 0; done < count; done += kStage) {
    const int64_t n = std::min(kStage, count - done);
    to_bf16_bits(src + done, n, stage.data());
    DS_CUDA_CHECK(cudaMemcpyAsync(dst + done, stage.data(), n * 2, cudaMemcpyHostToDevice, stream));
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
}

}  // namespace ds
#endif
