// Shared helpers of the CUDA op tests (tests/test_cuda_*.cpp; conventions in docs/cuda_backend.md "Tests"):
// a device buffer that frees itself and can be poisoned with NaN, bf16 upload (round to nearest even) and
// download, fresh seeds from std::random_device, the skip-without-device macro, the all-written (finite)
// check, column slices of wider row buffers (with a check that nothing outside them was written), and the
// host-side bookkeeping several ops need (cu_seqlens, document starts and positions, GDN chunk offsets, the
// embedding-backward grouping). Random fills here give the same values as ds::test::randn /
// randu for the same seed (the generator is counter-based), only filled on several threads.
#pragma once
#ifdef DELTASTACK_CUDA

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"
#include "core/rng.h"
#include "test_util.h"

// Every CUDA test starts with this: skipped (not failed) on a machine without a device.
#define DS_SKIP_WITHOUT_GPU()                                             \
  do {                                                                    \
    if (::ds::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace ds::test::cuda {

using bf16 = ::ds::cuda::bf16;

// ------------------------------------------------------------------------------------------------ seeds

// A fresh 64-bit seed per call: inputs differ from run to run (print it in a SCOPED_TRACE to reproduce).
inline uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// A fresh base seed per test; every tensor takes its own derived seed.
struct Seeds {
  uint64_t base = fresh_seed();
  uint64_t k = 0;
  uint64_t next() { return base + 0x9e3779b97f4a7c15ull * (++k); }
  std::string str() const { return "base seed " + std::to_string(base); }
};

// ------------------------------------------------------------------------------------------------ device memory

// Device buffer of n elements of T, freed on scope exit; offset shifts the pointer by that many elements (tests
// of the unaligned scalar paths). 64 spare bytes, so a zero-sized buffer is still a valid allocation.
template <typename T>
class DevBuf {
 public:
  explicit DevBuf(size_t n, size_t offset = 0) : n_(n) {
    DS_CUDA_CHECK(cudaMalloc(&base_, (n + offset) * sizeof(T) + 64));
    p_ = reinterpret_cast<T*>(base_) + offset;
  }
  ~DevBuf() { cudaFree(base_); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }
  // All-ones bytes: NaN in bf16, fp32 and fp64, so an element a kernel never wrote fails all_finite / rel_l2.
  void poison() { DS_CUDA_CHECK(cudaMemset(p_, 0xFF, bytes())); }
  void zero() { DS_CUDA_CHECK(cudaMemset(p_, 0, bytes())); }

 private:
  void* base_ = nullptr;
  T* p_ = nullptr;
  size_t n_;
};

inline void device_sync() { DS_CUDA_CHECK(cudaDeviceSynchronize()); }

template <typename T>
void upload(DevBuf<T>& d, const std::vector<T>& h) {
  ASSERT_EQ(d.size(), h.size());
  DS_CUDA_CHECK(cudaMemcpy(d.get(), h.data(), d.bytes(), cudaMemcpyHostToDevice));
}
template <typename T>
std::vector<T> download(const DevBuf<T>& d) {
  std::vector<T> h(d.size());
  DS_CUDA_CHECK(cudaMemcpy(h.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

// fp32 values -> device bf16, rounded to nearest even (the test inputs are already bf16-exact).
inline void upload_bf16(DevBuf<bf16>& d, const std::vector<float>& h) {
  ASSERT_EQ(d.size(), h.size());
  std::vector<uint16_t> bits(h.size());
#pragma omp parallel for schedule(static) if (h.size() > (size_t(1) << 22))
  for (size_t i = 0; i < h.size(); ++i) bits[i] = ::ds::f32_to_bf16_bits(h[i]);
  DS_CUDA_CHECK(cudaMemcpy(d.get(), bits.data(), d.bytes(), cudaMemcpyHostToDevice));
}
// Raw bf16 bits (for bitwise determinism checks and poison checks).
inline std::vector<uint16_t> download_bits(const DevBuf<bf16>& d) {
  std::vector<uint16_t> bits(d.size());
  DS_CUDA_CHECK(cudaMemcpy(bits.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost));
  return bits;
}
inline std::vector<float> bits_to_f32(const std::vector<uint16_t>& bits) {
  std::vector<float> h(bits.size());
#pragma omp parallel for schedule(static) if (bits.size() > (size_t(1) << 22))
  for (size_t i = 0; i < bits.size(); ++i) h[i] = ::ds::bf16_bits_to_f32(bits[i]);
  return h;
}
inline std::vector<float> download_bf16(const DevBuf<bf16>& d) { return bits_to_f32(download_bits(d)); }

// ------------------------------------------------------------------------------------------------ comparisons

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
template <typename T>
bool same_bits(const DevBuf<T>& a, const DevBuf<T>& b) {
  return a.size() == b.size() && same_bits(download(a), download(b));
}
// Every element finite: after poison(), proof that a kernel wrote all of its output.
template <typename T>
bool all_finite(const std::vector<T>& x) {
  for (const auto& e : x)
    if (!std::isfinite(static_cast<double>(e))) return false;
  return true;
}

// Columns [col0, col0 + cols) of every row of a [rows, stride] buffer, as [rows, cols]: inputs read from, and
// outputs written into, a slice of a wider buffer (q / k / v inside the conv output, l2norm dx, GDN dv).
template <typename T>
std::vector<T> columns(const std::vector<T>& buf, int64_t stride, int64_t col0, int64_t cols) {
  const int64_t rows = static_cast<int64_t>(buf.size()) / stride;
  std::vector<T> out(rows * cols);
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t(1) << 22))
  for (int64_t r = 0; r < rows; ++r) std::copy_n(buf.begin() + r * stride + col0, cols, out.begin() + r * cols);
  return out;
}
// Whether every bf16 element outside those columns still holds the 0xFFFF poison (nothing was written there).
inline bool poisoned_outside(const std::vector<uint16_t>& bits, int64_t stride, int64_t col0, int64_t cols) {
  for (size_t i = 0; i < bits.size(); ++i) {
    const int64_t j = static_cast<int64_t>(i % stride);
    if ((j < col0 || j >= col0 + cols) && bits[i] != 0xFFFF) return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------------ random inputs

// ds::test::randn / randu, bit for bit, filled on several threads (Box-Muller draws two counters per value).
template <typename T>
std::vector<T> randn_par(size_t n, uint64_t seed, double stddev = 1.0, double mean = 0.0) {
  std::vector<T> v(n);
  constexpr size_t kBlock = size_t(1) << 16;
#pragma omp parallel for schedule(static) if (n > 4 * kBlock)
  for (size_t b = 0; b < (n + kBlock - 1) / kBlock; ++b) {
    ::ds::Rng r(seed);
    r.set_counter(2 * b * kBlock);
    for (size_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
      v[i] = static_cast<T>(mean + stddev * r.normal());
  }
  return v;
}
template <typename T>
std::vector<T> randu_par(size_t n, uint64_t seed, double lo, double hi) {
  std::vector<T> v(n);
  constexpr size_t kBlock = size_t(1) << 16;
#pragma omp parallel for schedule(static) if (n > 4 * kBlock)
  for (size_t b = 0; b < (n + kBlock - 1) / kBlock; ++b) {
    ::ds::Rng r(seed);
    r.set_counter(b * kBlock);
    for (size_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
      v[i] = static_cast<T>(lo + (hi - lo) * r.uniform());
  }
  return v;
}

// Values rounded to bf16: what the GPU sees, as fp32 for the CPU references.
inline std::vector<float> rounded(std::vector<float> v) {
#pragma omp parallel for schedule(static) if (v.size() > (size_t(1) << 22))
  for (size_t i = 0; i < v.size(); ++i) v[i] = ::ds::round_bf16(v[i]);
  return v;
}
// Normal values rounded to bf16.
inline std::vector<float> rand_bf16(size_t n, uint64_t seed, double stddev = 1.0, double mean = 0.0) {
  return rounded(randn_par<float>(n, seed, stddev, mean));
}
// rows x dim normal values, each row l2-normalised (eps 1e-6, in double) then rounded to bf16: GDN q and k.
inline std::vector<float> l2_normalized_bf16(int64_t rows, int64_t dim, uint64_t seed) {
  auto x = randn_par<float>(static_cast<size_t>(rows * dim), seed);
#pragma omp parallel for schedule(static) if (rows * dim > (int64_t(1) << 20))
  for (int64_t row = 0; row < rows; ++row) {
    float* r = x.data() + row * dim;
    double s = 0;
    for (int64_t a = 0; a < dim; ++a) s += double(r[a]) * r[a];
    const double inv = 1.0 / std::sqrt(s + 1e-6);
    for (int64_t a = 0; a < dim; ++a) r[a] = ::ds::round_bf16(static_cast<float>(r[a] * inv));
  }
  return x;
}

// ------------------------------------------------------------------------------------------------ packed sequences

// cu_seqlens [lens.size() + 1] from document lengths (a length may be 0).
inline std::vector<int32_t> cu_from_lengths(const std::vector<int>& lens) {
  std::vector<int32_t> cu{0};
  for (int l : lens) cu.push_back(cu.back() + l);
  return cu;
}
// seq_start[t] = first token of t's document (the conv1d kernels' form of cu_seqlens).
inline std::vector<int32_t> seq_starts(const std::vector<int32_t>& cu) {
  std::vector<int32_t> s(cu.back());
  for (size_t q = 0; q + 1 < cu.size(); ++q)
    for (int32_t t = cu[q]; t < cu[q + 1]; ++t) s[t] = cu[q];
  return s;
}
// Position of every token inside its document (RoPE positions).
inline std::vector<int32_t> positions_in_docs(const std::vector<int32_t>& cu) {
  auto pos = seq_starts(cu);
  for (size_t t = 0; t < pos.size(); ++t) pos[t] = static_cast<int32_t>(t) - pos[t];
  return pos;
}
// Prefix sums of the GDN chunk counts ceil(len / chunk) per document (gated_delta_rule chunk_offsets).
inline std::vector<int32_t> chunk_offsets(const std::vector<int32_t>& cu, int64_t chunk) {
  std::vector<int32_t> off{0};
  for (size_t q = 0; q + 1 < cu.size(); ++q)
    off.push_back(off.back() + static_cast<int32_t>((cu[q + 1] - cu[q] + chunk - 1) / chunk));
  return off;
}

// Host grouping for embedding_backward: positions sorted by id, then by position; unique ids with offsets.
struct IdGroups {
  std::vector<int32_t> uniq, starts, positions;  // starts: [uniq.size() + 1] offsets into positions
};
inline IdGroups group_ids(const std::vector<int32_t>& ids) {
  IdGroups g;
  const size_t N = ids.size();
  g.positions.resize(N);
  std::iota(g.positions.begin(), g.positions.end(), 0);
  std::stable_sort(g.positions.begin(), g.positions.end(), [&](int32_t p, int32_t q) { return ids[p] < ids[q]; });
  for (size_t i = 0; i < N; ++i)
    if (i == 0 || ids[g.positions[i]] != ids[g.positions[i - 1]]) {
      g.uniq.push_back(ids[g.positions[i]]);
      g.starts.push_back(static_cast<int32_t>(i));
    }
  g.starts.push_back(static_cast<int32_t>(N));
  return g;
}

// "4096x2048"
inline std::string shape(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t d : dims) {
    if (!s.empty()) s += 'x';
    s += std::to_string(d);
  }
  return s;
}

}  // namespace ds::test::cuda

#endif  // DELTASTACK_CUDA
