// Numeric self-probes of the CUDA backends against the fp32 CPU references (contract: probes_cuda.h).
// Compiled by the host compiler; everything is inside DELTASTACK_CUDA.
#include "ops/probes_cuda.h"

#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"
#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/cuda.h"
#include "ops/attention/attention.h"
#include "ops/attention/cuda.h"
#include "ops/attention/cudnn.h"
#include "ops/conv1d/conv1d.h"
#include "ops/conv1d/cuda.h"
#include "ops/elementwise/cuda.h"
#include "ops/embedding/cuda.h"
#include "ops/embedding/embedding.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/gated_delta_rule.h"
#include "ops/gated_rmsnorm/cuda.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"
#include "ops/gdn_gate/cuda.h"
#include "ops/gdn_gate/gdn_gate.h"
#include "ops/l2norm/cuda.h"
#include "ops/l2norm/l2norm.h"
#include "ops/linear/cuda.h"
#include "ops/linear/linear.h"
#include "ops/linear_cross_entropy/cuda.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/rmsnorm/cuda.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/rope/cuda.h"
#include "ops/rope/rope.h"
#include "ops/swiglu/cuda.h"
#include "ops/swiglu/swiglu.h"

namespace ds::ops {

namespace {

using ds::cuda::bf16;
namespace K = ds::ops::cuda;
using Vec = std::vector<float>;
using I32 = std::vector<int32_t>;

constexpr uint16_t kPoisonBf16 = 0xffff;  // what cudaMemset(0xff) leaves in a bf16 (a NaN)

uint64_t fresh_seed() {
  std::random_device rd;
  uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  return s ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

// Device allocation of n elements (at least one, so no launcher sees a null pointer); freed on scope exit, also
// when a launcher throws.
template <typename T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) {
    DS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<size_t>(n, 1) * sizeof(T)));
  }
  Dev(Dev&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  Dev& operator=(Dev&&) = delete;
  ~Dev() {
    if (p_) cudaFree(p_);
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// One probe's stream, random generator and transfers. All work goes to a non-blocking stream of its own.
class Ctx {
 public:
  Ctx() : rng(fresh_seed()) { DS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Ctx() {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  Ctx(const Ctx&) = delete;
  Ctx& operator=(const Ctx&) = delete;

  cudaStream_t s = nullptr;
  Rng rng;

  // fp32 values uniform in [lo, hi) (for fp32 device inputs: master weights, gates, states).
  Vec uniform(size_t n, double lo, double hi) {
    Vec x(n);
    for (auto& e : x) e = static_cast<float>(lo + (hi - lo) * rng.uniform());
    return x;
  }
  // The same, rounded to bf16 (for bf16 device inputs; the CPU reference sees exactly what the GPU sees).
  Vec bf(size_t n, double lo, double hi) {
    Vec x = uniform(n, lo, hi);
    for (auto& e : x) e = round_bf16(e);
    return x;
  }
  // Initial value of an accumulated (+=) gradient: random, of the size of the reference, so that a kernel that
  // overwrites instead of adding fails the probe. The caller subtracts it again before comparing.
  Vec accum_init(const Vec& ref) {
    double ss = 0;
    for (float v : ref) ss += static_cast<double>(v) * v;
    double rms = ref.empty() ? 1.0 : std::sqrt(ss / static_cast<double>(ref.size()));
    if (!(rms > 0) || !std::isfinite(rms)) rms = 1.0;
    return uniform(ref.size(), -rms, rms);
  }

  Dev<bf16> up_bf16(const Vec& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16_bits(x[i]);
    Dev<bf16> d(x.size());
    copy_in(d.get(), b.data(), b.size() * sizeof(uint16_t));
    return d;
  }
  template <typename T>
  Dev<T> up(const std::vector<T>& x) {
    Dev<T> d(x.size());
    copy_in(d.get(), x.data(), x.size() * sizeof(T));
    return d;
  }
  // Outputs are poisoned with NaN (all bits set) before a run, so an element left unwritten fails the probe.
  template <typename T>
  Dev<T> poisoned(size_t n) {
    Dev<T> d(n);
    DS_CUDA_CHECK(cudaMemsetAsync(d.get(), 0xff, std::max<size_t>(n, 1) * sizeof(T), s));
    return d;
  }

  std::vector<uint16_t> bits(const Dev<bf16>& d) {
    std::vector<uint16_t> b(d.size());
    copy_out(b.data(), d.get(), b.size() * sizeof(uint16_t));
    return b;
  }
  Vec down(const Dev<bf16>& d) {
    std::vector<uint16_t> b = bits(d);
    Vec x(b.size());
    for (size_t i = 0; i < b.size(); ++i) x[i] = bf16_bits_to_f32(b[i]);
    return x;
  }
  template <typename T>
  std::vector<T> down(const Dev<T>& d) {
    std::vector<T> x(d.size());
    copy_out(x.data(), d.get(), x.size() * sizeof(T));
    return x;
  }

 private:
  void copy_in(void* dst, const void* src, size_t bytes) {
    if (!bytes) return;
    DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    DS_CUDA_CHECK(cudaStreamSynchronize(s));  // the host vector may die right after
  }
  void copy_out(void* dst, const void* src, size_t bytes) {
    DS_CUDA_CHECK(cudaStreamSynchronize(s));
    DS_CUDA_CHECK(cudaGetLastError());
    if (!bytes) return;
    DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    DS_CUDA_CHECK(cudaStreamSynchronize(s));
  }
};

// Relative L2 error ||got - ref|| / ||ref||; +infinity when got holds a NaN/inf (or the reference does).
template <typename A, typename B>
double rel_l2(const std::vector<A>& got, const std::vector<B>& ref) {
  if (got.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double x = static_cast<double>(got[i]), y = static_cast<double>(ref[i]);
    if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  if (num == 0) return 0;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

double rel_scalar(double got, double ref) {
  if (!std::isfinite(got) || !std::isfinite(ref)) return INFINITY;
  if (got == ref) return 0;
  return std::fabs(got - ref) / std::max(std::fabs(ref), 1e-30);
}

Vec minus(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

Vec rounded(Vec x) {
  for (auto& e : x) e = round_bf16(e);
  return x;
}

// The worst error of one probe; every component is logged at debug level.
struct Worst {
  const char* op;
  double e = 0;
  std::string what = "-";
  void add(const std::string& name, double x) {
    if (std::isnan(x)) x = INFINITY;
    log_debug("cuda probe {}: {} rel. error {:.3e}", op, name, x);
    if (what == "-" || x > e) {
      e = std::max(e, x);
      what = name;
    }
  }
};

// Runs a probe body: +infinity without a device, or when the body throws (a launcher's argument check, a CUDA
// error); the message is logged once so a rejection can be traced.
template <typename F>
double guarded(const char* op, F&& body) {
  if (cuda_device_count() == 0) return INFINITY;
  const auto t0 = std::chrono::steady_clock::now();
  double e;
  try {
    Worst w{op};
    body(w);
    e = w.e;
    log_debug("cuda probe {}: worst {:.3e} ({}), {:.1f} ms", op, e, w.what,
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  } catch (const std::exception& ex) {
    log_warn("{}: the CUDA self-probe could not run: {}", op, ex.what());
    e = INFINITY;
  }
  cudaGetLastError();  // clear a non-sticky error so the next probe starts clean
  return std::isfinite(e) ? e : INFINITY;
}

// Packed test batch: lengths {1, 70, 0, 130} (a one-token document, a partial 64-chunk, an empty document, a
// document over two chunks).
struct Packed {
  I32 lens = {1, 70, 0, 130};
  I32 cu{0};
  I32 positions, seq_start;
  int64_t N = 0, S = 0, max_len = 0;
  Packed() {
    for (int32_t l : lens) {
      for (int32_t i = 0; i < l; ++i) {
        positions.push_back(i);
        seq_start.push_back(cu.back());
      }
      cu.push_back(cu.back() + l);
      max_len = std::max<int64_t>(max_len, l);
    }
    N = cu.back();
    S = static_cast<int64_t>(lens.size());
  }
};

// Gathers a strided [tokens, heads, dim] view (row t*heads+h at base + t*stride + h*dim) into contiguous rows.
Vec gather(const Vec& buf, int64_t base, int64_t stride, int64_t tokens, int64_t heads, int64_t dim) {
  Vec r(static_cast<size_t>(tokens * heads * dim));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < heads * dim; ++j) r[t * heads * dim + j] = buf[base + t * stride + j];
  return r;
}
// True when every element outside the strided view still holds the poison (nothing written out of bounds).
bool untouched_outside(const std::vector<uint16_t>& bits, int64_t base, int64_t stride, int64_t tokens, int64_t width) {
  for (int64_t i = 0; i < static_cast<int64_t>(bits.size()); ++i) {
    const int64_t t = i / stride, c = i % stride;
    const bool inside = t < tokens && c >= base && c < base + width;
    if (!inside && bits[i] != kPoisonBf16) return false;
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

double probe_cuda_rmsnorm() {
  return guarded("rmsnorm", [](Worst& w) {
    Ctx c;
    struct Case {
      int64_t rows, dim;
      bool zero_centered, alias;
    };
    for (const Case cs : {Case{64, 256, true, false}, Case{37, 128, false, true}}) {
      const int64_t R = cs.rows, D = cs.dim;
      const float eps = 1e-6f;
      const std::string tag = cs.zero_centered ? "zero-centered " : "plain (dx = dy) ";
      Vec x = c.bf(R * D, -2, 2), dy = c.bf(R * D, -1, 1);
      Vec wt = cs.zero_centered ? c.uniform(D, -0.5, 0.5) : c.uniform(D, 0.5, 1.5);
      Vec y(x.size()), rstd(R), dx(x.size()), dw(D, 0.f);
      rmsnorm_forward<float>(x.data(), wt.data(), y.data(), rstd.data(), R, D, eps, cs.zero_centered);
      rmsnorm_backward<float>(x.data(), wt.data(), rstd.data(), dy.data(), dx.data(), dw.data(), R, D,
                              cs.zero_centered);
      Vec dw0 = c.accum_init(dw);

      auto x_d = c.up_bf16(x), dy_d = c.up_bf16(dy);
      auto w_d = c.up(wt), dw_d = c.up(dw0);
      auto y_d = c.poisoned<bf16>(x.size());
      auto rstd_d = c.poisoned<float>(R);
      auto dx_d = c.poisoned<bf16>(cs.alias ? 1 : x.size());
      Dev<unsigned char> scratch(K::rmsnorm_scratch_bytes(R, D));
      K::rmsnorm_forward(x_d.get(), w_d.get(), y_d.get(), rstd_d.get(), R, D, eps, cs.zero_centered, c.s);
      K::rmsnorm_backward(x_d.get(), w_d.get(), rstd_d.get(), dy_d.get(), cs.alias ? dy_d.get() : dx_d.get(),
                          dw_d.get(), R, D, cs.zero_centered, scratch.get(), c.s);
      w.add(tag + "y", rel_l2(c.down(y_d), y));
      w.add(tag + "rstd", rel_l2(c.down(rstd_d), rstd));
      w.add(tag + "dx", rel_l2(c.down(cs.alias ? dy_d : dx_d), dx));
      w.add(tag + "dw (accumulated)", rel_l2(minus(c.down(dw_d), dw0), dw));
    }
  });
}

double probe_cuda_gated_rmsnorm() {
  return guarded("gated_rmsnorm", [](Worst& w) {
    Ctx c;
    const int64_t R = 64, D = 128;
    const float eps = 1e-6f;
    Vec x = c.bf(R * D, -2, 2), z = c.bf(R * D, -3, 3), dy = c.bf(R * D, -1, 1), wt = c.uniform(D, 0.5, 1.5);
    Vec y(x.size()), rstd(R), dx(x.size()), dz(x.size()), dw(D, 0.f);
    gated_rmsnorm_forward<float>(x.data(), z.data(), wt.data(), y.data(), rstd.data(), R, D, eps);
    gated_rmsnorm_backward<float>(x.data(), z.data(), wt.data(), rstd.data(), dy.data(), dx.data(), dz.data(),
                                  dw.data(), R, D);
    Vec dw0 = c.accum_init(dw);

    auto x_d = c.up_bf16(x), z_d = c.up_bf16(z), dy_d = c.up_bf16(dy);
    auto w_d = c.up(wt), dw_d = c.up(dw0);
    auto y_d = c.poisoned<bf16>(x.size()), dx_d = c.poisoned<bf16>(x.size()), dz_d = c.poisoned<bf16>(x.size());
    auto rstd_d = c.poisoned<float>(R);
    Dev<unsigned char> scratch(K::gated_rmsnorm_scratch_bytes(R, D));
    K::gated_rmsnorm_forward(x_d.get(), z_d.get(), w_d.get(), y_d.get(), rstd_d.get(), R, D, eps, c.s);
    K::gated_rmsnorm_backward(x_d.get(), z_d.get(), w_d.get(), rstd_d.get(), dy_d.get(), dx_d.get(), dz_d.get(),
                              dw_d.get(), R, D, scratch.get(), c.s);
    w.add("y", rel_l2(c.down(y_d), y));
    w.add("rstd", rel_l2(c.down(rstd_d), rstd));
    w.add("dx", rel_l2(c.down(dx_d), dx));
    w.add("dz", rel_l2(c.down(dz_d), dz));
    w.add("dw (accumulated)", rel_l2(minus(c.down(dw_d), dw0), dw));
  });
}

double probe_cuda_l2norm() {
  return guarded("l2norm", [](Worst& w) {
    Ctx c;
    // As in the GDN layer: k rows taken out of a conv output [T, q | k | v] (stride 1024, k at offset 256).
    const int64_t T = 48, Hk = 2, D = 128, stride = 2 * Hk * D + 4 * D, base = Hk * D, rows = T * Hk;
    const float eps = 1e-6f;
    Vec buf = c.bf(T * stride, -1, 1), dy = c.bf(rows * D, -1, 1);
    Vec x = gather(buf, base, stride, T, Hk, D);
    Vec y(x.size()), rnorm(rows), dx(x.size());
    l2norm_forward<float>(x.data(), y.data(), rnorm.data(), rows, D, eps);
    Vec y_saved = rounded(y);  // the backward reads the bf16 y the forward stored
    l2norm_backward<float>(y_saved.data(), rnorm.data(), dy.data(), dx.data(), rows, D);

    auto buf_d = c.up_bf16(buf), dy_d = c.up_bf16(dy);
    auto y_d = c.poisoned<bf16>(y.size());
    auto rnorm_d = c.poisoned<float>(rows);
    auto dbuf_d = c.poisoned<bf16>(buf.size());
    K::l2norm_forward(buf_d.get() + base, stride, y_d.get(), rnorm_d.get(), T, Hk, D, eps, c.s);
    K::l2norm_backward(y_d.get(), rnorm_d.get(), dy_d.get(), dbuf_d.get() + base, stride, T, Hk, D, c.s);
    w.add("y", rel_l2(c.down(y_d), y));
    w.add("rnorm", rel_l2(c.down(rnorm_d), rnorm));
    auto dbits = c.bits(dbuf_d);
    Vec dbuf(dbits.size());
    for (size_t i = 0; i < dbits.size(); ++i) dbuf[i] = bf16_bits_to_f32(dbits[i]);
    w.add("dx (strided)", rel_l2(gather(dbuf, base, stride, T, Hk, D), dx));
    w.add("dx writes outside its rows", untouched_outside(dbits, base, stride, T, Hk * D) ? 0.0 : INFINITY);
  });
}

double probe_cuda_swiglu() {
  return guarded("swiglu", [](Worst& w) {
    Ctx c;
    const int64_t N = 64, I = 256;
    Vec gu = c.bf(N * 2 * I, -4, 4), dh = c.bf(N * I, -1, 1);
    Vec gate(N * I), up(N * I);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t i = 0; i < I; ++i) {
        gate[t * I + i] = gu[t * 2 * I + i];
        up[t * I + i] = gu[t * 2 * I + I + i];
      }
    Vec h(N * I), dgate(N * I), dup(N * I), dgu(N * 2 * I);
    swiglu_forward<float>(gate.data(), up.data(), h.data(), N * I);
    swiglu_backward<float>(gate.data(), up.data(), dh.data(), dgate.data(), dup.data(), N * I);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t i = 0; i < I; ++i) {
        dgu[t * 2 * I + i] = dgate[t * I + i];
        dgu[t * 2 * I + I + i] = dup[t * I + i];
      }

    auto gu_d = c.up_bf16(gu), dh_d = c.up_bf16(dh);
    auto h_d = c.poisoned<bf16>(h.size()), dgu_d = c.poisoned<bf16>(gu.size());
    K::swiglu_forward(gu_d.get(), h_d.get(), N, I, c.s);
    K::swiglu_backward(gu_d.get(), dh_d.get(), dgu_d.get(), N, I, c.s);
    w.add("h", rel_l2(c.down(h_d), h));
    w.add("dgu", rel_l2(c.down(dgu_d), dgu));
  });
}

double probe_cuda_gdn_gate() {
  return guarded("gdn_gate", [](Worst& w) {
    Ctx c;
    const int64_t N = 64, Hv = 32;
    Vec a = c.bf(N * Hv, -4, 4), b = c.bf(N * Hv, -5, 5);
    for (int64_t i = 0; i < 4 * Hv; ++i)
      a[i] = round_bf16(static_cast<float>(15 + 10 * c.rng.uniform()));  // softplus threshold
    Vec A_log = c.uniform(Hv, 0.0, std::log(16.0)), dt_bias = c.uniform(Hv, -1, 1);
    Vec dg = c.uniform(N * Hv, -1, 1), dbeta = c.uniform(N * Hv, -1, 1);
    Vec g(N * Hv), beta(N * Hv), da(N * Hv), db(N * Hv), dA(Hv, 0.f), ddt(Hv, 0.f);
    gdn_gate_forward<float>(a.data(), b.data(), A_log.data(), dt_bias.data(), g.data(), beta.data(), N, Hv);
    gdn_gate_backward<float>(a.data(), b.data(), A_log.data(), dt_bias.data(), dg.data(), dbeta.data(), da.data(),
                             db.data(), dA.data(), ddt.data(), N, Hv);
    Vec ab(N * 2 * Hv), dab(N * 2 * Hv);  // per token: b then a
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < Hv; ++h) {
        ab[t * 2 * Hv + h] = b[t * Hv + h];
        ab[t * 2 * Hv + Hv + h] = a[t * Hv + h];
        dab[t * 2 * Hv + h] = db[t * Hv + h];
        dab[t * 2 * Hv + Hv + h] = da[t * Hv + h];
      }
    Vec dA0 = c.accum_init(dA), ddt0 = c.accum_init(ddt);

    auto ab_d = c.up_bf16(ab);
    auto A_d = c.up(A_log), dt_d = c.up(dt_bias), dg_d = c.up(dg), dbeta_d = c.up(dbeta), dA_d = c.up(dA0),
         ddt_d = c.up(ddt0);
    auto g_d = c.poisoned<float>(g.size()), beta_d = c.poisoned<float>(g.size());
    auto dab_d = c.poisoned<bf16>(ab.size());
    Dev<unsigned char> scratch(K::gdn_gate_scratch_bytes(N, Hv));
    K::gdn_gate_forward(ab_d.get(), A_d.get(), dt_d.get(), g_d.get(), beta_d.get(), N, Hv, c.s);
    K::gdn_gate_backward(ab_d.get(), A_d.get(), dt_d.get(), dg_d.get(), dbeta_d.get(), dab_d.get(), dA_d.get(),
                         ddt_d.get(), N, Hv, scratch.get(), c.s);
    w.add("g", rel_l2(c.down(g_d), g));
    w.add("beta", rel_l2(c.down(beta_d), beta));
    w.add("dab", rel_l2(c.down(dab_d), dab));
    w.add("dA_log (accumulated)", rel_l2(minus(c.down(dA_d), dA0), dA));
    w.add("ddt_bias (accumulated)", rel_l2(minus(c.down(ddt_d), ddt0), ddt));
  });
}

double probe_cuda_embedding() {
  return guarded("embedding", [](Worst& w) {
    Ctx c;
    const int64_t V = 512, H = 256, N = 96;
    I32 ids(N);
    for (int64_t t = 0; t < N; ++t)  // half the tokens from 16 ids (repeats), half from the whole vocabulary
      ids[t] = static_cast<int32_t>(t % 2 ? c.rng.below(16) : c.rng.below(V));
    Vec table = c.bf(V * H, -1, 1), dout = c.bf(N * H, -1, 1);
    Vec out(N * H), dtable(V * H, 0.f);
    embedding_forward<float>(ids.data(), N, table.data(), V, H, out.data());
    embedding_backward<float>(ids.data(), N, dout.data(), V, H, dtable.data());
    Vec dtable0 = c.accum_init(dtable);
    // Grouping by id as the GPU model builds it: positions sorted by id (stable), unique ids with offsets.
    I32 pos(N), uniq, starts;
    for (int64_t t = 0; t < N; ++t) pos[t] = static_cast<int32_t>(t);
    std::stable_sort(pos.begin(), pos.end(), [&](int32_t x, int32_t y) { return ids[x] < ids[y]; });
    for (int64_t i = 0; i < N; ++i)
      if (i == 0 || ids[pos[i]] != ids[pos[i - 1]]) {
        uniq.push_back(ids[pos[i]]);
        starts.push_back(static_cast<int32_t>(i));
      }
    starts.push_back(static_cast<int32_t>(N));

    auto ids_d = c.up(ids), uniq_d = c.up(uniq), starts_d = c.up(starts), pos_d = c.up(pos);
    auto table_d = c.up_bf16(table), dout_d = c.up_bf16(dout);
    auto dtable_d = c.up(dtable0);
    auto out_d = c.poisoned<bf16>(out.size());
    K::embedding_forward(ids_d.get(), table_d.get(), out_d.get(), N, H, c.s);
    K::embedding_backward(uniq_d.get(), starts_d.get(), pos_d.get(), static_cast<int64_t>(uniq.size()), dout_d.get(),
                          dtable_d.get(), H, c.s);
    w.add("out", rel_l2(c.down(out_d), out));
    w.add("dtable (accumulated)", rel_l2(minus(c.down(dtable_d), dtable0), dtable));
  });
}

double probe_cuda_conv1d() {
  return guarded("conv1d", [](Worst& w) {
    Ctx c;
    const Packed p;
    const int64_t N = p.N, C = 96, Kw = 4;
    Vec x = c.bf(N * C, -2, 2), dy = c.bf(N * C, -1, 1), wt = c.uniform(C * Kw, -0.6, 0.6);
    Vec y(x.size()), dx(x.size()), dw(C * Kw, 0.f);
    conv1d_silu_forward<float>(x.data(), wt.data(), p.cu.data(), p.S, N, C, Kw, y.data());
    conv1d_silu_backward<float>(x.data(), wt.data(), dy.data(), p.cu.data(), p.S, N, C, Kw, dx.data(), dw.data());
    Vec dw0 = c.accum_init(dw);

    auto x_d = c.up_bf16(x), dy_d = c.up_bf16(dy);
    auto w_d = c.up(wt), dw_d = c.up(dw0);
    auto ss_d = c.up(p.seq_start);
    auto y_d = c.poisoned<bf16>(x.size()), dx_d = c.poisoned<bf16>(x.size());
    Dev<unsigned char> scratch(K::conv1d_scratch_bytes(N, C, Kw));
    K::conv1d_silu_forward(x_d.get(), w_d.get(), ss_d.get(), y_d.get(), N, C, Kw, c.s);
    K::conv1d_silu_backward(x_d.get(), w_d.get(), dy_d.get(), ss_d.get(), dx_d.get(), dw_d.get(), N, C, Kw,
                            scratch.get(), c.s);
    w.add("y", rel_l2(c.down(y_d), y));
    w.add("dx", rel_l2(c.down(dx_d), dx));
    w.add("dw (accumulated)", rel_l2(minus(c.down(dw_d), dw0), dw));
  });
}

double probe_cuda_rope() {
  return guarded("rope", [](Worst& w) {
    Ctx c;
    const Packed p;  // positions restart at every document
    const int64_t N = p.N, H = 3, hd = 128, rot = 32;
    const double theta = 1e7;
    Vec ct(N * rot / 2), st(ct.size());
    rope_tables<float>(p.positions.data(), N, rot, theta, ct.data(), st.data());
    Vec x = c.bf(N * H * hd, -2, 2), dy = c.bf(N * H * hd, -1, 1);
    Vec y = x, dx = dy;
    rope_apply<float>(y.data(), N, H, hd, rot, ct.data(), st.data(), false);
    rope_apply<float>(dx.data(), N, H, hd, rot, ct.data(), st.data(), true);

    auto ct_d = c.up(ct), st_d = c.up(st);
    auto x_d = c.up_bf16(x), dy_d = c.up_bf16(dy);
    K::rope_apply(x_d.get(), N, H, hd, rot, ct_d.get(), st_d.get(), false, c.s);
    K::rope_apply(dy_d.get(), N, H, hd, rot, ct_d.get(), st_d.get(), true, c.s);
    w.add("forward", rel_l2(c.down(x_d), y));
    w.add("inverse (backward)", rel_l2(c.down(dy_d), dx));
  });
}

double probe_cuda_output_gate() {
  return guarded("output_gate", [](Worst& w) {
    Ctx c;
    const int64_t n = 64 * 256;
    Vec o = c.bf(n, -2, 2), gate = c.bf(n, -4, 4), dy = c.bf(n, -1, 1);
    Vec y(n), dout(n), dgate(n);
    output_gate_forward<float>(o.data(), gate.data(), y.data(), n);
    output_gate_backward<float>(o.data(), gate.data(), dy.data(), dout.data(), dgate.data(), n);

    auto o_d = c.up_bf16(o), gate_d = c.up_bf16(gate), dy_d = c.up_bf16(dy);
    auto y_d = c.poisoned<bf16>(n), dout_d = c.poisoned<bf16>(n), dgate_d = c.poisoned<bf16>(n);
    K::output_gate_forward(o_d.get(), gate_d.get(), y_d.get(), n, c.s);
    K::output_gate_backward(o_d.get(), gate_d.get(), dy_d.get(), dout_d.get(), dgate_d.get(), n, c.s);
    w.add("y", rel_l2(c.down(y_d), y));
    w.add("dout", rel_l2(c.down(dout_d), dout));
    w.add("dgate", rel_l2(c.down(dgate_d), dgate));

    // The other elementwise helpers the GPU model relies on: the residual add in place (y aliases a), the
    // strided row copy, the bf16 -> fp32 copy.
    Vec sum(n);
    for (int64_t i = 0; i < n; ++i) sum[i] = o[i] + gate[i];
    K::add(o_d.get(), gate_d.get(), o_d.get(), n, c.s);
    w.add("add (in place)", rel_l2(c.down(o_d), sum));

    const int64_t rows = 64, cols = 128, src_stride = 256, dst_stride = 384;
    auto cp_d = c.poisoned<bf16>(rows * dst_stride);
    K::copy_rows(dy_d.get() + cols, src_stride, cp_d.get() + 64, dst_stride, rows, cols, c.s);
    auto cp_bits = c.bits(cp_d);
    Vec cp(cp_bits.size());
    for (size_t i = 0; i < cp.size(); ++i) cp[i] = bf16_bits_to_f32(cp_bits[i]);
    w.add("copy_rows", rel_l2(gather(cp, 64, dst_stride, rows, 1, cols), gather(dy, cols, src_stride, rows, 1, cols)));
    w.add("copy_rows writes outside its rows", untouched_outside(cp_bits, 64, dst_stride, rows, cols) ? 0.0 : INFINITY);

    auto f_d = c.poisoned<float>(n);
    K::bf16_to_f32(dy_d.get(), f_d.get(), n, c.s);
    w.add("bf16_to_f32", rel_l2(c.down(f_d), dy));
  });
}

double probe_cuda_linear() {
  return guarded("linear", [](Worst& w) {
    Ctx c;
    const int64_t M = 70, Kd = 256, N = 192;
    Vec x = c.bf(M * Kd, -1, 1), W = c.bf(N * Kd, -0.1, 0.1), dy = c.bf(M * N, -1, 1);
    Vec y0 = c.bf(M * N, -0.5, 0.5), dx0 = c.bf(M * Kd, -0.5, 0.5);
    Vec y(M * N), dx(M * Kd), dW(N * Kd, 0.f);
    linear_forward<float>(x.data(), W.data(), y.data(), M, Kd, N, false);
    linear_backward<float>(x.data(), W.data(), dy.data(), dx.data(), dW.data(), M, Kd, N, false);
    Vec y_acc(y.size()), dx_acc(dx.size());
    for (size_t i = 0; i < y.size(); ++i) y_acc[i] = y0[i] + y[i];
    for (size_t i = 0; i < dx.size(); ++i) dx_acc[i] = dx0[i] + dx[i];
    Vec dW0 = c.accum_init(dW);

    auto x_d = c.up_bf16(x), W_d = c.up_bf16(W), dy_d = c.up_bf16(dy);
    auto y1_d = c.poisoned<bf16>(y.size()), dx1_d = c.poisoned<bf16>(dx.size());
    auto y2_d = c.up_bf16(y0), dx2_d = c.up_bf16(dx0);
    auto dW_d = c.up(dW0);
    K::linear_forward(x_d.get(), W_d.get(), y1_d.get(), M, Kd, N, false, c.s);
    K::linear_forward(x_d.get(), W_d.get(), y2_d.get(), M, Kd, N, true, c.s);
    K::linear_backward_data(dy_d.get(), W_d.get(), dx1_d.get(), M, Kd, N, false, c.s);
    K::linear_backward_data(dy_d.get(), W_d.get(), dx2_d.get(), M, Kd, N, true, c.s);
    K::linear_backward_weight(dy_d.get(), x_d.get(), dW_d.get(), M, Kd, N, c.s);
    w.add("y", rel_l2(c.down(y1_d), y));
    w.add("y (accumulate)", rel_l2(c.down(y2_d), y_acc));
    w.add("dx", rel_l2(c.down(dx1_d), dx));
    w.add("dx (accumulate)", rel_l2(c.down(dx2_d), dx_acc));
    w.add("dW (accumulated)", rel_l2(minus(c.down(dW_d), dW0), dW));
  });
}

double probe_cuda_linear_cross_entropy() {
  return guarded("linear_cross_entropy", [](Worst& w) {
    Ctx c;
    const int64_t N = 64, H = 128, V = 1000;
    Vec h = c.bf(N * H, -2, 2), W = c.bf(V * H, -0.2, 0.2);
    I32 targets(N);
    int64_t valid = 0;
    for (int64_t t = 0; t < N; ++t) {
      const bool ignore = t != 0 && c.rng.below(8) == 0;
      targets[t] = ignore ? -100 : static_cast<int32_t>(c.rng.below(V));
      valid += !ignore;
    }
    LinearCeOptions opt;
    opt.z_loss = 1e-4;
    opt.grad_scale = 1.0 / static_cast<double>(valid);
    opt.chunk_tokens = 24;  // three chunks, the last one partial
    Vec dh(N * H), dW(V * H, 0.f);
    const LinearCeResult ref =
        linear_cross_entropy<float>(h.data(), W.data(), targets.data(), N, H, V, opt, dh.data(), dW.data());
    Vec dW0 = c.accum_init(dW);

    auto h_d = c.up_bf16(h), W_d = c.up_bf16(W);
    auto t_d = c.up(targets);
    auto dW_d = c.up(dW0);
    auto dh_d = c.poisoned<bf16>(dh.size());
    auto loss_d = c.poisoned<double>(2), loss_fwd_d = c.poisoned<double>(2);
    Dev<unsigned char> scratch(K::linear_cross_entropy_scratch_bytes(N, H, V, opt.chunk_tokens));
    K::linear_cross_entropy(h_d.get(), W_d.get(), t_d.get(), N, H, V, opt, loss_d.get(), dh_d.get(), dW_d.get(),
                            scratch.get(), c.s);
    K::linear_cross_entropy(h_d.get(), W_d.get(), t_d.get(), N, H, V, opt, loss_fwd_d.get(), nullptr, nullptr,
                            scratch.get(), c.s);
    auto loss = c.down(loss_d), loss_fwd = c.down(loss_fwd_d);
    w.add("loss sum", rel_scalar(loss[0], ref.loss_sum));
    w.add("z-loss sum", rel_scalar(loss[1], ref.z_loss_sum));
    w.add("loss sum (forward only)", rel_scalar(loss_fwd[0], ref.loss_sum));
    w.add("dh", rel_l2(c.down(dh_d), dh));
    w.add("dW (accumulated)", rel_l2(minus(c.down(dW_d), dW0), dW));
  });
}

// One attention probe case over documents `cu`: fresh bf16-rounded inputs and the fp32 CPU reference forward; the
// reference backward takes the o the GPU backward reads (the bf16 o the GPU forward stored).
struct AttnCase {
  AttnDims d;
  const I32& cu;
  size_t nq = 0, nk = 0;
  Vec q, k, v, dout, o, lse;
  std::string tag;
  AttnCase(Ctx& c, const I32& cu_seqlens, int64_t Hq, int64_t Hkv, int64_t hd) : cu(cu_seqlens) {
    d.N = cu.back();
    d.num_seqs = static_cast<int64_t>(cu.size()) - 1;
    d.Hq = Hq;
    d.Hkv = Hkv;
    d.head_dim = hd;
    d.scale = 1.0 / std::sqrt(static_cast<double>(hd));
    tag = "hd " + std::to_string(hd) + ": ";
    nq = static_cast<size_t>(d.N * Hq * hd);
    nk = static_cast<size_t>(d.N * Hkv * hd);
    q = c.bf(nq, -2, 2), k = c.bf(nk, -2, 2), v = c.bf(nk, -1, 1), dout = c.bf(nq, -1, 1);
    o.resize(nq);
    lse.resize(static_cast<size_t>(d.N * Hq));
    attention_forward<float>(d, q.data(), k.data(), v.data(), cu.data(), o.data(), lse.data());
  }
  void backward(const Vec& o_read, Vec& dq, Vec& dk, Vec& dv) const {
    dq.resize(nq), dk.resize(nk), dv.resize(nk);
    attention_backward<float>(d, q.data(), k.data(), v.data(), o_read.data(), lse.data(), dout.data(), cu.data(),
                              dq.data(), dk.data(), dv.data());
  }
};

double probe_cuda_attention() {
  return guarded("attention", [](Worst& w) {
    Ctx c;
    const Packed p;
    // GQA 2 at head_dim 64, and at Qwen3.5's head_dim 256 (each head_dim is its own kernel instantiation).
    for (const int64_t hd : {64, 256}) {
      const AttnCase a(c, p.cu, hd == 64 ? 4 : 2, hd == 64 ? 2 : 1, hd);
      Vec dq, dk, dv;
      a.backward(rounded(a.o), dq, dk, dv);
      auto q_d = c.up_bf16(a.q), k_d = c.up_bf16(a.k), v_d = c.up_bf16(a.v), dout_d = c.up_bf16(a.dout);
      auto cu_d = c.up(p.cu);
      auto o_d = c.poisoned<bf16>(a.nq), dq_d = c.poisoned<bf16>(a.nq), dk_d = c.poisoned<bf16>(a.nk),
           dv_d = c.poisoned<bf16>(a.nk);
      auto lse_d = c.poisoned<float>(a.lse.size());
      Dev<unsigned char> scratch(K::attention_scratch_bytes(a.d));
      K::attention_forward(a.d, q_d.get(), k_d.get(), v_d.get(), cu_d.get(), p.max_len, o_d.get(), lse_d.get(), c.s);
      K::attention_backward(a.d, q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), dout_d.get(), cu_d.get(),
                            p.max_len, dq_d.get(), dk_d.get(), dv_d.get(), scratch.get(), c.s);
      w.add(a.tag + "o", rel_l2(c.down(o_d), a.o));
      w.add(a.tag + "lse", rel_l2(c.down(lse_d), a.lse));
      w.add(a.tag + "dq", rel_l2(c.down(dq_d), dq));
      w.add(a.tag + "dk", rel_l2(c.down(dk_d), dk));
      w.add(a.tag + "dv", rel_l2(c.down(dv_d), dv));
    }
  });
}

double probe_cudnn_attention() {
  return guarded("attention", [](Worst& w) {
    Ctx c;
    // Lengths {1, 70, 0, 130, 5}: three length buckets (1..64, 65..128, 129..130) whose documents interleave in
    // memory, unused (length-0) entries in two of them, an empty document.
    const I32 lens = {1, 70, 0, 130, 5};
    I32 cu{0};
    for (int32_t l : lens) cu.push_back(cu.back() + l);
    const int64_t max_len = *std::max_element(lens.begin(), lens.end());
    for (const auto& [hd, Hq, Hkv] : {std::tuple<int64_t, int64_t, int64_t>{128, 4, 2}, {256, 4, 1}}) {
      const AttnCase a(c, cu, Hq, Hkv, hd);
      cudnn::Attention att({a.d.N, a.d.num_seqs, max_len, Hq, Hkv, hd, a.d.scale});
      auto q_d = c.up_bf16(a.q), k_d = c.up_bf16(a.k), v_d = c.up_bf16(a.v), dout_d = c.up_bf16(a.dout);
      auto o_d = c.poisoned<bf16>(a.nq);
      auto lse_d = c.poisoned<float>(a.lse.size());
      auto ws = c.poisoned<unsigned char>(att.workspace_bytes());  // as the engine's shared scratch may hold NaN
      Dev<unsigned char> meta(att.meta_bytes());
      if (!att.set_batch(cu.data(), a.d.num_seqs, meta.get(), c.s)) throw Error("cuDNN attention refused the batch");
      att.forward(q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), ws.get(), c.s);
      const Vec o_gpu = c.down(o_d);
      Vec dq, dk, dv;
      a.backward(o_gpu, dq, dk, dv);
      Vec runs[2][3];
      for (auto& r : runs) {
        auto dq_d = c.poisoned<bf16>(a.nq), dk_d = c.poisoned<bf16>(a.nk), dv_d = c.poisoned<bf16>(a.nk);
        att.backward(q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), dout_d.get(), dq_d.get(), dk_d.get(),
                     dv_d.get(), ws.get(), c.s);
        r[0] = c.down(dq_d), r[1] = c.down(dk_d), r[2] = c.down(dv_d);
      }
      w.add(a.tag + "o", rel_l2(o_gpu, a.o));
      w.add(a.tag + "lse", rel_l2(c.down(lse_d), a.lse));
      w.add(a.tag + "dq", rel_l2(runs[0][0], dq));
      w.add(a.tag + "dk", rel_l2(runs[0][1], dk));
      w.add(a.tag + "dv", rel_l2(runs[0][2], dv));
      const bool same = runs[0][0] == runs[1][0] && runs[0][1] == runs[1][1] && runs[0][2] == runs[1][2];
      w.add(a.tag + "backward run twice (0: bitwise equal)", same ? 0.0 : INFINITY);
    }
  });
}

double probe_cuda_gated_delta_rule() {
  return guarded("gated_delta_rule", [](Worst& w) {
    Ctx c;
    const Packed p;
    // GVA 2 at dk = dv = 32, and at Qwen3.5's dk = dv = 128 (each size is its own kernel instantiation).
    for (const int64_t dim : {32, 128}) {
      GdnDims d;
      d.N = p.N;
      d.num_seqs = p.S;
      d.Hk = dim == 32 ? 2 : 1;
      d.Hv = 2 * d.Hk;
      d.dk = dim;
      d.dv = dim;
      d.scale = 1.0 / std::sqrt(static_cast<double>(dim));
      d.chunk_size = 64;
      const std::string tag = "dk = dv = " + std::to_string(dim) + ": ";
      const int64_t N = d.N, KD = d.Hk * d.dk, VD = d.Hv * d.dv;
      // v is read out of a conv output [N, q | k | v] (stride CD, v at offset 2*KD) and dv written back the same way.
      const int64_t CD = 2 * KD + VD, v_off = 2 * KD;
      auto unit_rows = [&](int64_t rows, int64_t width) {  // l2-normalised, then rounded to bf16
        Vec x = c.uniform(rows * width, -1, 1);
        for (int64_t r = 0; r < rows; ++r) {
          double s = 0;
          for (int64_t j = 0; j < width; ++j) s += static_cast<double>(x[r * width + j]) * x[r * width + j];
          for (int64_t j = 0; j < width; ++j)
            x[r * width + j] = round_bf16(static_cast<float>(x[r * width + j] / std::sqrt(s + 1e-6)));
        }
        return x;
      };
      Vec q = unit_rows(N * d.Hk, d.dk), k = unit_rows(N * d.Hk, d.dk);
      Vec vbuf = c.bf(N * CD, -1, 1), dout = c.bf(N * VD, -1, 1);
      Vec v = gather(vbuf, v_off, CD, N, d.Hv, d.dv);
      Vec g = c.uniform(N * d.Hv, -2.0, -0.01), beta = c.uniform(N * d.Hv, 0.05, 0.95);
      Vec o(N * VD), dq(q.size()), dk(k.size()), dv(v.size()), dg(g.size()), dbeta(g.size());
      recurrent_gated_delta_rule_forward<float>(d, q.data(), k.data(), v.data(), g.data(), beta.data(), p.cu.data(),
                                                nullptr, o.data(), nullptr);
      recurrent_gated_delta_rule_backward<float>(d, q.data(), k.data(), v.data(), g.data(), beta.data(), p.cu.data(),
                                                 nullptr, dout.data(), nullptr, dq.data(), dk.data(), dv.data(),
                                                 dg.data(), dbeta.data(), nullptr);
      I32 chunk_off{0};
      for (int32_t l : p.lens)
        chunk_off.push_back(chunk_off.back() + static_cast<int32_t>((l + d.chunk_size - 1) / d.chunk_size));
      const int64_t total_chunks = chunk_off.back();

      auto q_d = c.up_bf16(q), k_d = c.up_bf16(k), vbuf_d = c.up_bf16(vbuf), dout_d = c.up_bf16(dout);
      auto g_d = c.up(g), beta_d = c.up(beta);
      auto cu_d = c.up(p.cu), co_d = c.up(chunk_off);
      auto o_d = c.poisoned<bf16>(o.size()), dq_d = c.poisoned<bf16>(q.size()), dk_d = c.poisoned<bf16>(k.size()),
           dvbuf_d = c.poisoned<bf16>(vbuf.size());
      auto dg_d = c.poisoned<float>(g.size()), dbeta_d = c.poisoned<float>(g.size());
      auto states_d = c.poisoned<float>(static_cast<size_t>(total_chunks * d.Hv * d.dk * d.dv));
      Dev<unsigned char> scratch(K::gated_delta_rule_scratch_bytes(d, total_chunks));
      K::gated_delta_rule_forward(d, q_d.get(), k_d.get(), vbuf_d.get() + v_off, CD, g_d.get(), beta_d.get(),
                                  cu_d.get(), co_d.get(), total_chunks, o_d.get(), states_d.get(), c.s);
      K::gated_delta_rule_backward(d, q_d.get(), k_d.get(), vbuf_d.get() + v_off, CD, g_d.get(), beta_d.get(),
                                   cu_d.get(), co_d.get(), total_chunks, states_d.get(), dout_d.get(), dq_d.get(),
                                   dk_d.get(), dvbuf_d.get() + v_off, CD, dg_d.get(), dbeta_d.get(), scratch.get(),
                                   c.s);
      w.add(tag + "o", rel_l2(c.down(o_d), o));
      w.add(tag + "dq", rel_l2(c.down(dq_d), dq));
      w.add(tag + "dk", rel_l2(c.down(dk_d), dk));
      auto dv_bits = c.bits(dvbuf_d);
      Vec dvbuf(dv_bits.size());
      for (size_t i = 0; i < dv_bits.size(); ++i) dvbuf[i] = bf16_bits_to_f32(dv_bits[i]);
      w.add(tag + "dv (strided)", rel_l2(gather(dvbuf, v_off, CD, N, d.Hv, d.dv), dv));
      w.add(tag + "dv writes outside its rows", untouched_outside(dv_bits, v_off, CD, N, VD) ? 0.0 : INFINITY);
      w.add(tag + "dg", rel_l2(c.down(dg_d), dg));
      w.add(tag + "dbeta", rel_l2(c.down(dbeta_d), dbeta));
      // The state saved at the start of each sequence's first chunk is the (zero) initial state.
      auto states = c.down(states_d);
      const size_t per_chunk = static_cast<size_t>(d.Hv * d.dk * d.dv);
      double s0 = 0;
      for (size_t s = 0; s + 1 < chunk_off.size(); ++s) {
        if (chunk_off[s + 1] == chunk_off[s]) continue;
        for (size_t i = 0; i < per_chunk; ++i) {
          const float e = states[static_cast<size_t>(chunk_off[s]) * per_chunk + i];
          s0 = std::isfinite(e) ? std::max(s0, static_cast<double>(std::fabs(e))) : INFINITY;
        }
      }
      w.add(tag + "first-chunk states (max abs, expect 0)", s0);
    }
  });
}

double probe_cuda_adamw() {
  return guarded("adamw", [](Worst& w) {
    Ctx c;
    const int64_t n = 5003;
    AdamWParams hp;
    hp.lr = 1e-3;
    hp.beta1 = 0.9;
    hp.beta2 = 0.95;
    hp.eps = 1e-8;
    hp.weight_decay = 0.1;
    hp.step = 3;
    hp.grad_scale = 0.7;
    Vec p0 = c.uniform(n, -1, 1), grad = c.uniform(n, -0.1, 0.1), m0 = c.uniform(n, -0.05, 0.05),
        v0 = c.uniform(n, 0, 0.01);
    Vec p = p0, m = m0, v = v0;
    adamw_update(p.data(), grad.data(), m.data(), v.data(), n, hp);
    const double ss = sum_squares(grad.data(), n);

    auto p_d = c.up(p0), g_d = c.up(grad), m_d = c.up(m0), v_d = c.up(v0);
    auto pb_d = c.poisoned<bf16>(n), gb_d = c.poisoned<bf16>(n);
    auto ss_d = c.poisoned<double>(1);
    Dev<unsigned char> scratch(K::sum_squares_scratch_bytes(n));
    K::adamw_update(p_d.get(), g_d.get(), m_d.get(), v_d.get(), pb_d.get(), n, hp, c.s);
    K::sum_squares(g_d.get(), n, ss_d.get(), scratch.get(), c.s);
    K::to_bf16(g_d.get(), gb_d.get(), n, c.s);
    // The update is small next to the parameter: compare the changes, not the new values.
    w.add("param update", rel_l2(minus(c.down(p_d), p0), minus(p, p0)));
    w.add("m update", rel_l2(minus(c.down(m_d), m0), minus(m, m0)));
    w.add("v update", rel_l2(minus(c.down(v_d), v0), minus(v, v0)));
    w.add("param bf16 copy", rel_l2(c.down(pb_d), rounded(p)));
    w.add("sum_squares", rel_scalar(c.down(ss_d)[0], ss));
    w.add("to_bf16", rel_l2(c.down(gb_d), rounded(grad)));
  });
}

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
