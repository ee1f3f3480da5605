// Device-side helpers of the CUDA op checks (src/ops/*/cuda_check.cpp; contract in ops/check/check.h) and of the
// CUDA tests that drive launchers directly: a device buffer that frees itself (optionally shifted by some
// elements, for the unaligned scalar paths), a context holding one non-blocking stream and the case's seed
// (deterministic, multi-threaded random fills), bf16 upload / download, NaN poisoning, and the host-side
// bookkeeping of packed batches (cu_seqlens, document starts, positions, GDN chunk offsets, embedding id
// groups). Only for DELTASTACK_CUDA builds (includes cuda_runtime.h).
#pragma once
#ifdef DELTASTACK_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/error.h"
#include "core/numerics.h"
#include "core/rng.h"

namespace ds::ops::check {

using bf16 = ::ds::cuda::bf16;
using Vec = std::vector<float>;
using I32 = std::vector<int32_t>;
using Bits = std::vector<uint16_t>;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // what 0xFF bytes leave in a bf16 (a NaN)

// n elements of T on the device, freed on scope exit (also when a launcher throws). `offset` shifts the pointer by
// that many elements (unaligned-pointer cases); 64 spare bytes keep a zero-sized buffer a valid allocation.
template <typename T>
class Buf {
 public:
  explicit Buf(size_t n, size_t offset = 0) : n_(n) {
    DS_CUDA_CHECK(cudaMalloc(&base_, (n + offset) * sizeof(T) + 64));
    p_ = reinterpret_cast<T*>(base_) + offset;
  }
  Buf(Buf&& o) noexcept : base_(std::exchange(o.base_, nullptr)), p_(o.p_), n_(o.n_) {}
  ~Buf() {
    if (base_) cudaFree(base_);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf& operator=(Buf&&) = delete;
  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  void* base_ = nullptr;
  T* p_ = nullptr;
  size_t n_;
};

// One check's stream and random inputs. Every tensor draws from its own seed derived from the case's seed, in
// blocks of 2^16 values filled in parallel (the values do not depend on the thread count).
class Ctx {
 public:
  explicit Ctx(uint64_t seed) : seed_(seed) { DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Ctx() {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  Ctx(const Ctx&) = delete;
  Ctx& operator=(const Ctx&) = delete;

  cudaStream_t s = nullptr;

  uint64_t next_seed() { return seed_ + 0x9e3779b97f4a7c15ull * (++k_); }
  Rng rng() { return Rng(next_seed()); }

  // fp32 normal / uniform values (fp32 device inputs: master weights, gates, initial accumulators).
  Vec randn(size_t n, double stddev = 1.0, double mean = 0.0) {
    return fill(n, 2, [&](Rng& r) { return static_cast<float>(mean + stddev * r.normal()); });
  }
  Vec uniform(size_t n, double lo, double hi) {
    return fill(n, 1, [&](Rng& r) { return static_cast<float>(lo + (hi - lo) * r.uniform()); });
  }
  // The same rounded to bf16 (bf16 device inputs: the CPU reference sees exactly what the device sees).
  Vec randn_bf16(size_t n, double stddev = 1.0, double mean = 0.0);
  Vec uniform_bf16(size_t n, double lo, double hi);
  // Initial value of an accumulated (+=) output: random, of the size of the reference's rms, so a kernel that
  // overwrites instead of adding fails. The check subtracts it again before comparing.
  Vec accum_init(const Vec& ref);

  template <typename T>
  void upload(Buf<T>& d, const std::vector<T>& h) {
    DS_CHECK(d.size() == h.size(), "check: upload of {} values into {}", h.size(), d.size());
    copy(d.get(), h.data(), d.bytes(), cudaMemcpyHostToDevice);
  }
  void upload_bf16(Buf<bf16>& d, const Vec& h);
  template <typename T>
  Buf<T> up(const std::vector<T>& h, size_t offset = 0) {
    Buf<T> d(h.size(), offset);
    upload(d, h);
    return d;
  }
  Buf<bf16> up_bf16(const Vec& h, size_t offset = 0) {
    Buf<bf16> d(h.size(), offset);
    upload_bf16(d, h);
    return d;
  }
  // All-ones bytes: NaN in bf16, fp32 and fp64, so an element a kernel never wrote fails rel_l2.
  template <typename T>
  void poison(Buf<T>& d, int byte = 0xFF) {  // 0xFF: NaN in every float type; another byte: finite garbage
    DS_CUDA_CHECK(cudaMemsetAsync(d.get(), byte, d.bytes(), s));
  }
  template <typename T>
  Buf<T> poisoned(size_t n, size_t offset = 0) {
    Buf<T> d(n, offset);
    poison(d);
    return d;
  }

  // Downloads wait for the stream and surface any launch error first.
  template <typename T>
  std::vector<T> down(const Buf<T>& d) {
    std::vector<T> h(d.size());
    copy(h.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost);
    return h;
  }
  Bits bits(const Buf<bf16>& d) {
    Bits h(d.size());
    copy(h.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost);
    return h;
  }
  Vec down_bf16(const Buf<bf16>& d);

 private:
  template <typename F>
  Vec fill(size_t n, uint64_t draws_per_value, F&& draw) {
    Vec v(n);
    constexpr size_t kBlock = size_t(1) << 16;
    const uint64_t seed = next_seed();
#pragma omp parallel for schedule(static) if (n > 4 * kBlock)
    for (size_t b = 0; b < (n + kBlock - 1) / kBlock; ++b) {
      Rng r(seed);
      r.set_counter(draws_per_value * b * kBlock);
      for (size_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) v[i] = draw(r);
    }
    return v;
  }
  void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);

  uint64_t seed_, k_ = 0;
};

// ------------------------------------------------------------------------------------------------ host helpers

Vec rounded(Vec x);                     // every value rounded to bf16
Vec to_f32(const Bits& bits);           // bf16 bits -> fp32
Vec minus(const Vec& a, const Vec& b);  // a - b (the increment of an accumulated output)

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Two runs of a check bitwise equal: every output its Out struct lists in tie().
template <typename Out>
bool same_runs(const Out& a, const Out& b) {
  const auto ta = a.tie(), tb = b.tie();
  return [&]<size_t... I>(std::index_sequence<I...>) { return (same_bits(std::get<I>(ta), std::get<I>(tb)) && ...); }
  (std::make_index_sequence<std::tuple_size_v<decltype(ta)>>{});
}

// Columns [col0, col0 + cols) of every row of a [rows, stride] buffer, as [rows, cols]: a slice of a wider row
// buffer (q / k / v inside the conv output, l2norm dx, GDN dv).
template <typename T>
std::vector<T> columns(const std::vector<T>& buf, int64_t stride, int64_t col0, int64_t cols) {
  const int64_t rows = static_cast<int64_t>(buf.size()) / stride;
  std::vector<T> out(static_cast<size_t>(rows * cols));
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t(1) << 22))
  for (int64_t r = 0; r < rows; ++r) std::copy_n(buf.begin() + r * stride + col0, cols, out.begin() + r * cols);
  return out;
}
// The inverse: rows of `cols` values placed at column col0 of [rows, stride] rows, `fill` elsewhere.
Vec widen(const Vec& x, int64_t cols, int64_t stride, int64_t col0, float fill);
// Whether every bf16 element outside those columns still holds the poison (nothing was written there).
bool poisoned_outside(const Bits& bits, int64_t stride, int64_t col0, int64_t cols);

// Packed documents: cu_seqlens from lengths (a length may be 0); random lengths filling N tokens (a quarter of
// them 1..3 tokens, the rest up to max_len); first token of each token's document; position inside it; GDN
// chunk offsets (prefix sums of ceil(len / chunk)).
I32 cu_from_lengths(const std::vector<int>& lens);
std::vector<int> random_lengths(int64_t N, int64_t max_len, Rng& r);
I32 seq_starts(const I32& cu);
I32 positions_in_docs(const I32& cu);
I32 chunk_offsets(const I32& cu, int64_t chunk);
std::string lengths_str(const std::vector<int>& lens);  // "{1,70,0,130}", long lists shortened

// Turns ds::cuda::division_sigmoid() on (the kernels' sigmoids as one IEEE division each) for its lifetime, then
// back to what it was: the *SigmoidForms* checks run once with it.
struct DivisionSigmoid {
  bool was = ds::cuda::division_sigmoid();
  DivisionSigmoid() { ds::cuda::division_sigmoid() = true; }
  ~DivisionSigmoid() { ds::cuda::division_sigmoid() = was; }
  DivisionSigmoid(const DivisionSigmoid&) = delete;
  DivisionSigmoid& operator=(const DivisionSigmoid&) = delete;
};

// Host grouping for embedding_backward (as the GPU model builds it): positions sorted by id (stable), the unique
// ids, and starts[uniq.size() + 1] offsets into positions.
struct IdGroups {
  I32 uniq, starts, positions;
};
IdGroups group_ids(const I32& ids);

// "64x256"
std::string shape(std::initializer_list<int64_t> dims);

// Runs f and adds its wall time to *seconds.
template <typename F>
void timed(double* seconds, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  *seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace ds::ops::check

#endif  // DELTASTACK_CUDA
