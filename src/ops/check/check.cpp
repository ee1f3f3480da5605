// Result bookkeeping and the registry's probe runner (ops/check/check.h), and the device helpers of
// ops/check/device.h (DELTASTACK_CUDA builds only).
#include "ops/check/check.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>

#include "core/cuda/device.h"
#include "core/log.h"
#include "ops/check/device.h"

#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>
#endif

namespace ds::ops::check {

void Result::add(std::string name, double error, double band) { values.push_back(Value{std::move(name), error, band}); }

double Result::worst() const {
  double w = 0;
  for (const Value& v : values) w = std::isnan(v.error) ? INFINITY : std::max(w, v.error);
  return w;
}

bool Result::ok() const {
  return std::all_of(values.begin(), values.end(), [](const Value& v) { return v.error <= v.band; });
}

std::string Result::str() const {
  std::string s = what + ":";
  for (size_t i = 0; i < values.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, " %.2e", values[i].error);
    s += i ? ", " : " ";
    s += values[i].name;
    s += buf;
  }
  return s;
}

double probe_cases(const char* op, size_t count, const std::function<Result(size_t)>& check) {
  if (cuda_device_count() == 0) return INFINITY;
  const auto t0 = std::chrono::steady_clock::now();
  double worst = 0;
  std::string worst_what = "-";
  try {
    for (size_t i = 0; i < count; ++i) {
      const Result r = check(i);
      for (const Value& v : r.values) log_debug("cuda probe {}: {}: {} rel. error {:.3e}", op, r.what, v.name, v.error);
      const double w = r.worst();
      if (w > worst || worst_what == "-") worst_what = r.what;
      worst = std::max(worst, w);
    }
    log_debug("cuda probe {}: worst {:.3e} ({}), {:.1f} ms", op, worst, worst_what,
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  } catch (const std::exception& ex) {
    log_warn("{}: the CUDA self-probe could not run: {}", op, ex.what());
    worst = INFINITY;
  }
#ifdef DELTASTACK_CUDA
  cudaGetLastError();  // clear a non-sticky error so the next probe starts clean
#endif
  return std::isfinite(worst) ? worst : INFINITY;
}

#ifdef DELTASTACK_CUDA

void Ctx::copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  DS_CUDA_CHECK(cudaStreamSynchronize(s));
  DS_CUDA_CHECK(cudaGetLastError());
  if (!bytes) return;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s));
  DS_CUDA_CHECK(cudaStreamSynchronize(s));  // the host vector may die right after
}

Vec Ctx::randn_bf16(size_t n, double stddev, double mean) { return rounded(randn(n, stddev, mean)); }
Vec Ctx::uniform_bf16(size_t n, double lo, double hi) { return rounded(uniform(n, lo, hi)); }

Vec Ctx::accum_init(const Vec& ref) {
  double ss = 0;
  for (float v : ref) ss += static_cast<double>(v) * v;
  double rms = ref.empty() ? 1.0 : std::sqrt(ss / static_cast<double>(ref.size()));
  if (!(rms > 0) || !std::isfinite(rms)) rms = 1.0;
  return uniform(ref.size(), -rms, rms);
}

void Ctx::upload_bf16(Buf<bf16>& d, const Vec& h) {
  DS_CHECK(d.size() == h.size(), "check: upload of {} values into {}", h.size(), d.size());
  Bits b(h.size());
#pragma omp parallel for schedule(static) if (h.size() > (size_t(1) << 22))
  for (size_t i = 0; i < h.size(); ++i) b[i] = f32_to_bf16_bits(h[i]);
  copy(d.get(), b.data(), d.bytes(), cudaMemcpyHostToDevice);
}

Vec Ctx::down_bf16(const Buf<bf16>& d) { return to_f32(bits(d)); }

Vec rounded(Vec x) {
#pragma omp parallel for schedule(static) if (x.size() > (size_t(1) << 22))
  for (size_t i = 0; i < x.size(); ++i) x[i] = round_bf16(x[i]);
  return x;
}

Vec to_f32(const Bits& bits) {
  Vec x(bits.size());
#pragma omp parallel for schedule(static) if (bits.size() > (size_t(1) << 22))
  for (size_t i = 0; i < bits.size(); ++i) x[i] = bf16_bits_to_f32(bits[i]);
  return x;
}

Vec minus(const Vec& a, const Vec& b) {
  Vec r(a.size());
#pragma omp parallel for schedule(static) if (a.size() > (size_t(1) << 22))
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

Vec widen(const Vec& x, int64_t cols, int64_t stride, int64_t col0, float fill) {
  const int64_t rows = cols ? static_cast<int64_t>(x.size()) / cols : 0;
  Vec out(static_cast<size_t>(rows * stride), fill);
#pragma omp parallel for schedule(static) if (rows * stride > (int64_t(1) << 22))
  for (int64_t r = 0; r < rows; ++r) std::copy_n(x.begin() + r * cols, cols, out.begin() + r * stride + col0);
  return out;
}

bool poisoned_outside(const Bits& bits, int64_t stride, int64_t col0, int64_t cols) {
  for (size_t i = 0; i < bits.size(); ++i) {
    const int64_t j = static_cast<int64_t>(i % static_cast<size_t>(stride));
    if ((j < col0 || j >= col0 + cols) && bits[i] != kPoisonBf16) return false;
  }
  return true;
}

I32 cu_from_lengths(const std::vector<int>& lens) {
  I32 cu{0};
  for (int l : lens) cu.push_back(cu.back() + l);
  return cu;
}

std::vector<int> random_lengths(int64_t N, int64_t max_len, Rng& r) {
  std::vector<int> lens;
  int64_t total = 0;
  while (total < N) {
    int64_t len = r.below(4) == 0 ? 1 + static_cast<int64_t>(r.below(3)) : 1 + static_cast<int64_t>(r.below(max_len));
    len = std::min<int64_t>(len, N - total);
    lens.push_back(static_cast<int>(len));
    total += len;
  }
  return lens;
}

I32 seq_starts(const I32& cu) {
  I32 s(static_cast<size_t>(cu.back()));
  for (size_t q = 0; q + 1 < cu.size(); ++q)
    for (int32_t t = cu[q]; t < cu[q + 1]; ++t) s[t] = cu[q];
  return s;
}

I32 positions_in_docs(const I32& cu) {
  I32 pos = seq_starts(cu);
  for (size_t t = 0; t < pos.size(); ++t) pos[t] = static_cast<int32_t>(t) - pos[t];
  return pos;
}

I32 chunk_offsets(const I32& cu, int64_t chunk) {
  I32 off{0};
  for (size_t q = 0; q + 1 < cu.size(); ++q)
    off.push_back(off.back() + static_cast<int32_t>((cu[q + 1] - cu[q] + chunk - 1) / chunk));
  return off;
}

std::string lengths_str(const std::vector<int>& lens) {
  std::string s = "{";
  for (size_t i = 0; i < lens.size() && i < 12; ++i) {
    if (i) s += ',';
    s += std::to_string(lens[i]);
  }
  if (lens.size() > 12) s += ",... (" + std::to_string(lens.size()) + " documents)";
  return s + "}";
}

IdGroups group_ids(const I32& ids) {
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

std::string shape(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t d : dims) {
    if (!s.empty()) s += 'x';
    s += std::to_string(d);
  }
  return s;
}

#endif  // DELTASTACK_CUDA

}  // namespace ds::ops::check
