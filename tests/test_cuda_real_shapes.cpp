// Every CUDA op at the real Qwen3.5-2B and 9B layer shapes (ModelConfig::preset "2b" / "9b") against its fp32
// CPU reference on the same bf16-rounded inputs: the memory-bound ops at T = 8192 and 32768 tokens, the
// linear layers at M = 8192 rows, the gated delta rule at T = 8192 (both presets' head counts, packed and
// unpacked) and T = 32768 (9B heads) against the CPU chunked form, attention at the 2B shape (B2 x T4096 packed
// and one T8192 document), and the fused linear + cross-entropy at N = 4096, H = 2048, V = 248320.
// Conventions of docs/cuda_backend.md "Tests": fresh random inputs (seed printed on failure), outputs poisoned
// with NaN (every element must be written), relative L2 error within forward 5e-3 / gradients 1e-2 (dg, dbeta
// 2e-2), two identical GPU runs bitwise equal. Gradient buffers start at zero here, so the comparison is of the
// gradient itself (accumulation is covered by the small-shape tests). Each case prints one "[ measured ]" line
// with its errors and the CPU reference time.
// Slow (CPU references at full size, up to ~20 GB of host memory): every test skips unless a device exists AND
// DELTASTACK_REAL_SHAPES=1. On a GPU machine:
//   DELTASTACK_REAL_SHAPES=1 deltastack_tests --gtest_filter='*CudaRealShapes*'
#ifdef DELTASTACK_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/cuda/cuda_utils.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "model/config.h"
#include "ops/attention/attention.h"
#include "ops/attention/cuda.h"
#include "ops/attention/cudnn.h"
#include "ops/conv1d/conv1d.h"
#include "ops/conv1d/cuda.h"
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
#include "test_util.h"

namespace {

using ds::ModelConfig;
using ds::test::rel_l2;
using namespace ds::test::cuda;
namespace gpu = ds::ops::cuda;

constexpr double kFwdTol = 5e-3;
constexpr double kGradTol = 1e-2;
constexpr double kGateGradTol = 2e-2;  // dg, dbeta of the gated delta rule

bool real_shapes_enabled() {
  const char* e = std::getenv("DELTASTACK_REAL_SHAPES");
  return e != nullptr && std::string(e) == "1";
}

#define DS_REQUIRE_REAL_SHAPES()                                                             \
  do {                                                                                       \
    if (!real_shapes_enabled()) GTEST_SKIP() << "slow: set DELTASTACK_REAL_SHAPES=1 to run"; \
    DS_SKIP_WITHOUT_GPU();                                                                   \
  } while (0)

template <typename F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The errors of one op at one shape: each asserted against its band and collected into one "[ measured ]" line,
// printed when the case ends.
class Measured {
 public:
  explicit Measured(std::string what) : what_(std::move(what)) {}
  Measured(const Measured&) = delete;
  Measured& operator=(const Measured&) = delete;
  ~Measured() {
    std::printf("[ measured ] %s:%s (cpu ref %.1f s)\n", what_.c_str(), line_.c_str(), cpu_s_);
    std::fflush(stdout);
  }
  void check(const char* name, double err, double tol) {
    EXPECT_LE(err, tol) << what_ << ": " << name;
    char buf[96];
    std::snprintf(buf, sizeof buf, " %s %.2e", name, err);
    line_ += buf;
  }
  void deterministic(bool same) {
    EXPECT_TRUE(same) << what_ << ": two identical GPU runs differ";
    if (!same) line_ += " NOT-DETERMINISTIC";
  }
  template <typename F>
  void cpu(F&& f) {
    cpu_s_ += seconds(f);
  }

 private:
  std::string what_, line_;
  double cpu_s_ = 0;
};

// Packed documents: {3000, 1, 4000, 1191} repeated to fill T (a multiple of 8192).
std::vector<int> packed_lengths(int64_t T) {
  std::vector<int> lens;
  for (int64_t t = 0; t < T; t += 8192)
    for (int len : {3000, 1, 4000, 1191}) lens.push_back(len);
  return lens;
}

// ------------------------------------------------------------------------------------------------ memory-bound ops

void check_rmsnorm(const std::string& what, int64_t rows, int64_t dim, float eps) {
  Seeds s;
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  const int64_t n = rows * dim;
  const auto x = rand_bf16(n, s.next());
  const auto w = randn_par<float>(dim, s.next(), 0.2);  // zero-centered: the scale is 1 + w
  const auto dy = rand_bf16(n, s.next());
  std::vector<float> y_ref(n), rstd_ref(rows), dx_ref(n), dw_ref(dim, 0.0f);
  m.cpu([&] {
    ds::ops::rmsnorm_forward<float>(x.data(), w.data(), y_ref.data(), rstd_ref.data(), rows, dim, eps, true);
    ds::ops::rmsnorm_backward<float>(x.data(), w.data(), rstd_ref.data(), dy.data(), dx_ref.data(), dw_ref.data(), rows,
                                     dim, true);
  });
  DevBuf<bf16> x_(n), dy_(n), y_(n), dx_(n);
  DevBuf<float> w_(dim), rstd_(rows), rstd_in(rows), dw_(dim);
  DevBuf<char> scratch(gpu::rmsnorm_scratch_bytes(rows, dim));
  upload_bf16(x_, x);
  upload(w_, w);
  upload_bf16(dy_, dy);
  upload(rstd_in, rstd_ref);  // the backward sees the reference rstd (identical inputs on both sides)
  struct Out {
    std::vector<uint16_t> y, dx;
    std::vector<float> rstd, dw;
  };
  auto run = [&] {
    y_.poison(), rstd_.poison(), dx_.poison(), dw_.zero();
    gpu::rmsnorm_forward(x_.get(), w_.get(), y_.get(), rstd_.get(), rows, dim, eps, true, nullptr);
    gpu::rmsnorm_backward(x_.get(), w_.get(), rstd_in.get(), dy_.get(), dx_.get(), dw_.get(), rows, dim, true,
                          scratch.get(), nullptr);
    device_sync();
    return Out{download_bits(y_), download_bits(dx_), download(rstd_), download(dw_)};
  };
  const Out a = run(), b = run();
  m.check("y", rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
  m.check("rstd", rel_l2(a.rstd, rstd_ref), kFwdTol);
  m.check("dx", rel_l2(bits_to_f32(a.dx), dx_ref), kGradTol);
  m.check("dw", rel_l2(a.dw, dw_ref), kGradTol);
  m.deterministic(same_bits(a.y, b.y) && same_bits(a.rstd, b.rstd) && same_bits(a.dx, b.dx) && same_bits(a.dw, b.dw));
}

void check_gated_rmsnorm(const std::string& what, int64_t rows, int64_t d, float eps) {
  Seeds s;
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  const int64_t n = rows * d;
  const auto x = rand_bf16(n, s.next());
  const auto z = rand_bf16(n, s.next(), 2.0);
  const auto w = randn_par<float>(d, s.next(), 0.3, 1.0);
  const auto dy = rand_bf16(n, s.next());
  std::vector<float> y_ref(n), rstd_ref(rows), dx_ref(n), dz_ref(n), dw_ref(d, 0.0f);
  m.cpu([&] {
    ds::ops::gated_rmsnorm_forward<float>(x.data(), z.data(), w.data(), y_ref.data(), rstd_ref.data(), rows, d, eps);
    ds::ops::gated_rmsnorm_backward<float>(x.data(), z.data(), w.data(), rstd_ref.data(), dy.data(), dx_ref.data(),
                                           dz_ref.data(), dw_ref.data(), rows, d);
  });
  DevBuf<bf16> x_(n), z_(n), y_(n), dy_(n), dx_(n), dz_(n);
  DevBuf<float> w_(d), rstd_(rows), rstd_in(rows), dw_(d);
  DevBuf<char> scratch(gpu::gated_rmsnorm_scratch_bytes(rows, d));
  upload_bf16(x_, x);
  upload_bf16(z_, z);
  upload(w_, w);
  upload_bf16(dy_, dy);
  upload(rstd_in, rstd_ref);
  struct Out {
    std::vector<uint16_t> y, dx, dz;
    std::vector<float> rstd, dw;
  };
  auto run = [&] {
    y_.poison(), rstd_.poison(), dx_.poison(), dz_.poison(), dw_.zero();
    gpu::gated_rmsnorm_forward(x_.get(), z_.get(), w_.get(), y_.get(), rstd_.get(), rows, d, eps, nullptr);
    gpu::gated_rmsnorm_backward(x_.get(), z_.get(), w_.get(), rstd_in.get(), dy_.get(), dx_.get(), dz_.get(), dw_.get(),
                                rows, d, scratch.get(), nullptr);
    device_sync();
    return Out{download_bits(y_), download_bits(dx_), download_bits(dz_), download(rstd_), download(dw_)};
  };
  const Out a = run(), b = run();
  m.check("y", rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
  m.check("rstd", rel_l2(a.rstd, rstd_ref), kFwdTol);
  m.check("dx", rel_l2(bits_to_f32(a.dx), dx_ref), kGradTol);
  m.check("dz", rel_l2(bits_to_f32(a.dz), dz_ref), kGradTol);
  m.check("dw", rel_l2(a.dw, dw_ref), kGradTol);
  m.deterministic(same_bits(a.y, b.y) && same_bits(a.rstd, b.rstd) && same_bits(a.dx, b.dx) && same_bits(a.dz, b.dz) &&
                  same_bits(a.dw, b.dw));
}

// gate | up halves of the fused [N, 2I] projection output.
void check_swiglu(const std::string& what, int64_t N, int64_t I) {
  Seeds s;
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  const int64_t n = N * I;
  const auto gu = rand_bf16(2 * n, s.next(), 1.5);
  const auto dh = rand_bf16(n, s.next());
  std::vector<float> h_ref(n), dgu_ref(2 * n);
  m.cpu([&] {  // row by row over the two halves of each row (each call is OpenMP-parallel inside)
    for (int64_t t = 0; t < N; ++t) {
      const float* g = gu.data() + t * 2 * I;
      float* dg = dgu_ref.data() + t * 2 * I;
      ds::ops::swiglu_forward<float>(g, g + I, h_ref.data() + t * I, I);
      ds::ops::swiglu_backward<float>(g, g + I, dh.data() + t * I, dg, dg + I, I);
    }
  });
  DevBuf<bf16> gu_(2 * n), h_(n), dh_(n), dgu_(2 * n);
  upload_bf16(gu_, gu);
  upload_bf16(dh_, dh);
  struct Out {
    std::vector<uint16_t> h, dgu;
  };
  auto run = [&] {
    h_.poison(), dgu_.poison();
    gpu::swiglu_forward(gu_.get(), h_.get(), N, I, nullptr);
    gpu::swiglu_backward(gu_.get(), dh_.get(), dgu_.get(), N, I, nullptr);
    device_sync();
    return Out{download_bits(h_), download_bits(dgu_)};
  };
  const Out a = run(), b = run();
  m.check("h", rel_l2(bits_to_f32(a.h), h_ref), kFwdTol);
  m.check("dgate|dup", rel_l2(bits_to_f32(a.dgu), dgu_ref), kGradTol);
  m.deterministic(same_bits(a.h, b.h) && same_bits(a.dgu, b.dgu));
}

void check_conv1d(const std::string& what, int64_t C, int64_t K, const std::vector<int32_t>& cu) {
  Seeds s;
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  const int64_t N = cu.back(), num_seqs = static_cast<int64_t>(cu.size()) - 1;
  const auto x = rand_bf16(N * C, s.next());
  const auto w = randn_par<float>(C * K, s.next(), 0.5);
  const auto dy = rand_bf16(N * C, s.next());
  std::vector<float> y_ref(N * C), dx_ref(N * C), dw_ref(C * K, 0.0f);
  m.cpu([&] {
    ds::ops::conv1d_silu_forward<float>(x.data(), w.data(), cu.data(), num_seqs, N, C, K, y_ref.data());
    ds::ops::conv1d_silu_backward<float>(x.data(), w.data(), dy.data(), cu.data(), num_seqs, N, C, K, dx_ref.data(),
                                         dw_ref.data());
  });
  DevBuf<bf16> x_(N * C), y_(N * C), dy_(N * C), dx_(N * C);
  DevBuf<float> w_(C * K), dw_(C * K);
  DevBuf<int32_t> ss_(N);
  DevBuf<char> scratch(gpu::conv1d_scratch_bytes(N, C, K));
  upload_bf16(x_, x);
  upload(w_, w);
  upload_bf16(dy_, dy);
  upload(ss_, seq_starts(cu));
  struct Out {
    std::vector<uint16_t> y, dx;
    std::vector<float> dw;
  };
  auto run = [&] {
    y_.poison(), dx_.poison(), dw_.zero();
    gpu::conv1d_silu_forward(x_.get(), w_.get(), ss_.get(), y_.get(), N, C, K, nullptr);
    gpu::conv1d_silu_backward(x_.get(), w_.get(), dy_.get(), ss_.get(), dx_.get(), dw_.get(), N, C, K, scratch.get(),
                              nullptr);
    device_sync();
    return Out{download_bits(y_), download_bits(dx_), download(dw_)};
  };
  const Out a = run(), b = run();
  m.check("y", rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
  m.check("dx", rel_l2(bits_to_f32(a.dx), dx_ref), kGradTol);
  m.check("dw", rel_l2(a.dw, dw_ref), kGradTol);
  m.deterministic(same_bits(a.y, b.y) && same_bits(a.dx, b.dx) && same_bits(a.dw, b.dw));
}

// q (col0 = 0) and k (col0 = key_dim) heads read straight out of the conv output [T, conv_dim], as in the model;
// dx written back into a [T, conv_dim] buffer whose other columns must stay untouched.
void check_l2norm(const std::string& what, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, int64_t col0) {
  Seeds s;
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  const float eps = 1e-6f;
  const int64_t rows = tokens * heads, n = rows * dim, nbuf = tokens * stride;
  const auto xbuf = rand_bf16(nbuf, s.next());
  const auto dy = rand_bf16(n, s.next());
  const auto xg = columns(xbuf, stride, col0, heads * dim);
  std::vector<float> y_ref(n), rn_ref(rows), yb, dx_ref(n);
  m.cpu([&] {
    ds::ops::l2norm_forward<float>(xg.data(), y_ref.data(), rn_ref.data(), rows, dim, eps);
    yb = rounded(y_ref);  // the backward reads the stored bf16 y, as the GPU does
    ds::ops::l2norm_backward<float>(yb.data(), rn_ref.data(), dy.data(), dx_ref.data(), rows, dim);
  });
  DevBuf<bf16> x_(nbuf), y_(n), yin_(n), dy_(n), dx_(nbuf);
  DevBuf<float> rn_(rows), rnin_(rows);
  upload_bf16(x_, xbuf);
  upload_bf16(yin_, yb);
  upload(rnin_, rn_ref);
  upload_bf16(dy_, dy);
  struct Out {
    std::vector<uint16_t> y, dxbuf;
    std::vector<float> rn;
  };
  auto run = [&] {
    y_.poison(), rn_.poison(), dx_.poison();
    gpu::l2norm_forward(x_.get() + col0, stride, y_.get(), rn_.get(), tokens, heads, dim, eps, nullptr);
    gpu::l2norm_backward(yin_.get(), rnin_.get(), dy_.get(), dx_.get() + col0, stride, tokens, heads, dim, nullptr);
    device_sync();
    return Out{download_bits(y_), download_bits(dx_), download(rn_)};
  };
  const Out a = run(), b = run();
  const auto dx = bits_to_f32(columns(a.dxbuf, stride, col0, heads * dim));
  EXPECT_TRUE(poisoned_outside(a.dxbuf, stride, col0, heads * dim)) << "l2norm_backward wrote outside its columns";
  m.check("y", rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
  m.check("rnorm", rel_l2(a.rn, rn_ref), kFwdTol);
  m.check("dx", rel_l2(dx, dx_ref), kGradTol);
  m.deterministic(same_bits(a.y, b.y) && same_bits(a.rn, b.rn) && same_bits(a.dxbuf, b.dxbuf));
}

// ab: the [N, 2Hv] output of the fused in_proj_b | in_proj_a projection.
void check_gdn_gate(const std::string& what, int64_t N, int64_t Hv) {
  Seeds s;
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  const int64_t n = N * Hv;
  const auto a = rand_bf16(n, s.next(), 8.0);  // a + dt_bias crosses the softplus threshold 20 for some entries
  const auto b = rand_bf16(n, s.next(), 3.0);
  const auto A_log = randu_par<float>(Hv, s.next(), 0.0, 2.7);
  const auto dt_bias = randn_par<float>(Hv, s.next(), 1.0);
  const auto dg = randn_par<float>(n, s.next());
  const auto dbeta = randn_par<float>(n, s.next());
  std::vector<float> ab(2 * n);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < Hv; ++h) ab[t * 2 * Hv + h] = b[t * Hv + h], ab[t * 2 * Hv + Hv + h] = a[t * Hv + h];
  std::vector<float> g_ref(n), beta_ref(n), da_ref(n), db_ref(n), dA_ref(Hv, 0.0f), ddt_ref(Hv, 0.0f);
  m.cpu([&] {
    ds::ops::gdn_gate_forward<float>(a.data(), b.data(), A_log.data(), dt_bias.data(), g_ref.data(), beta_ref.data(), N,
                                     Hv);
    ds::ops::gdn_gate_backward<float>(a.data(), b.data(), A_log.data(), dt_bias.data(), dg.data(), dbeta.data(),
                                      da_ref.data(), db_ref.data(), dA_ref.data(), ddt_ref.data(), N, Hv);
  });
  DevBuf<bf16> ab_(2 * n), dab_(2 * n);
  DevBuf<float> A_(Hv), dt_(Hv), g_(n), beta_(n), dg_(n), dbeta_(n), dA_(Hv), ddt_(Hv);
  DevBuf<char> scratch(gpu::gdn_gate_scratch_bytes(N, Hv));
  upload_bf16(ab_, ab);
  upload(A_, A_log);
  upload(dt_, dt_bias);
  upload(dg_, dg);
  upload(dbeta_, dbeta);
  struct Out {
    std::vector<float> g, beta, dA, ddt;
    std::vector<uint16_t> dab;
  };
  auto run = [&] {
    g_.poison(), beta_.poison(), dab_.poison(), dA_.zero(), ddt_.zero();
    gpu::gdn_gate_forward(ab_.get(), A_.get(), dt_.get(), g_.get(), beta_.get(), N, Hv, nullptr);
    gpu::gdn_gate_backward(ab_.get(), A_.get(), dt_.get(), dg_.get(), dbeta_.get(), dab_.get(), dA_.get(), ddt_.get(),
                           N, Hv, scratch.get(), nullptr);
    device_sync();
    return Out{download(g_), download(beta_), download(dA_), download(ddt_), download_bits(dab_)};
  };
  const Out x = run(), y = run();
  const auto dab = bits_to_f32(x.dab);
  std::vector<float> da(n), db(n);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < Hv; ++h) db[t * Hv + h] = dab[t * 2 * Hv + h], da[t * Hv + h] = dab[t * 2 * Hv + Hv + h];
  m.check("g", rel_l2(x.g, g_ref), kFwdTol);
  m.check("beta", rel_l2(x.beta, beta_ref), kFwdTol);
  m.check("da", rel_l2(da, da_ref), kGradTol);
  m.check("db", rel_l2(db, db_ref), kGradTol);
  m.check("dA_log", rel_l2(x.dA, dA_ref), kGradTol);
  m.check("ddt_bias", rel_l2(x.ddt, ddt_ref), kGradTol);
  m.deterministic(same_bits(x.g, y.g) && same_bits(x.beta, y.beta) && same_bits(x.dab, y.dab) &&
                  same_bits(x.dA, y.dA) && same_bits(x.ddt, y.ddt));
}

// Partial RoPE (rotary_dim of head_dim) on q or k, positions restarting at every document; forward and inverse.
void check_rope(const std::string& what, int64_t H, int64_t hd, int64_t rd, double theta,
                const std::vector<int32_t>& cu) {
  Seeds s;
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  const int64_t N = cu.back(), half = rd / 2, n = N * H * hd;
  const auto pos = positions_in_docs(cu);
  std::vector<float> cos_t(N * half), sin_t(N * half);
  ds::ops::rope_tables<float>(pos.data(), N, rd, theta, cos_t.data(), sin_t.data());
  const auto x = rand_bf16(n, s.next());
  DevBuf<bf16> x_(n);
  DevBuf<float> c_(N * half), s_(N * half);
  upload(c_, cos_t);
  upload(s_, sin_t);
  for (bool inverse : {false, true}) {
    auto ref = x;
    m.cpu([&] { ds::ops::rope_apply<float>(ref.data(), N, H, hd, rd, cos_t.data(), sin_t.data(), inverse); });
    auto run = [&] {
      upload_bf16(x_, x);
      gpu::rope_apply(x_.get(), N, H, hd, rd, c_.get(), s_.get(), inverse, nullptr);
      device_sync();
      return download_bits(x_);
    };
    const auto a = run(), b = run();
    m.check(inverse ? "inverse" : "forward", rel_l2(bits_to_f32(a), ref), inverse ? kGradTol : kFwdTol);
    m.deterministic(same_bits(a, b));
  }
}

// Token ids: every fifth token one frequent id, the rest uniform over the vocabulary.
void check_embedding(const std::string& what, int64_t N, int64_t V, int64_t H) {
  Seeds s;
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  ds::Rng r(s.next());
  std::vector<int32_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[i] = i % 5 == 0 ? 13 : static_cast<int32_t>(r.below(static_cast<uint64_t>(V)));
  ids[N - 1] = static_cast<int32_t>(V - 1);  // the last table row
  const auto table = rand_bf16(V * H, s.next());
  const auto dout = rand_bf16(N * H, s.next());
  std::vector<float> out_ref(N * H), dtable_ref(V * H, 0.0f);
  m.cpu([&] {
    ds::ops::embedding_forward<float>(ids.data(), N, table.data(), V, H, out_ref.data());
    ds::ops::embedding_backward<float>(ids.data(), N, dout.data(), V, H, dtable_ref.data());
  });
  const IdGroups grp = group_ids(ids);
  const int64_t U = static_cast<int64_t>(grp.uniq.size());
  DevBuf<int32_t> ids_(N), uniq_(U), starts_(U + 1), pos_(N);
  DevBuf<bf16> table_(V * H), out_(N * H), dout_(N * H);
  DevBuf<float> dtable_(V * H);
  upload(ids_, ids);
  upload(uniq_, grp.uniq);
  upload(starts_, grp.starts);
  upload(pos_, grp.positions);
  upload_bf16(table_, table);
  upload_bf16(dout_, dout);
  auto run = [&] {
    out_.poison(), dtable_.zero();
    gpu::embedding_forward(ids_.get(), table_.get(), out_.get(), N, H, nullptr);
    gpu::embedding_backward(uniq_.get(), starts_.get(), pos_.get(), U, dout_.get(), dtable_.get(), H, nullptr);
    device_sync();
  };
  run();
  const auto out = download_bits(out_);
  const auto dtable = download(dtable_);
  m.check("out", rel_l2(bits_to_f32(out), out_ref), kFwdTol);
  m.check("dtable", rel_l2(dtable, dtable_ref), kGradTol);
  run();  // second run compared in place (the [V, H] fp32 gradient is 2-4 GB)
  m.deterministic(same_bits(out, download_bits(out_)) && same_bits(dtable, download(dtable_)));
}

struct RealShape {
  const char* preset;
  int64_t T;
};

// The memory-bound ops at T tokens of one preset (a fixture per op keeps each test's CPU time short).
class CudaRealShapesTokens : public ::testing::TestWithParam<RealShape> {
 protected:
  void SetUp() override { DS_REQUIRE_REAL_SHAPES(); }
  ModelConfig cfg() const { return ModelConfig::preset(GetParam().preset); }
  int64_t T() const { return GetParam().T; }
  std::string tag(const std::string& op, std::initializer_list<int64_t> dims) const {
    return op + " " + GetParam().preset + " T=" + std::to_string(T()) + " [" + shape(dims) + "]";
  }
  std::vector<int32_t> packed_cu() const { return cu_from_lengths(packed_lengths(T())); }
};

TEST_P(CudaRealShapesTokens, RmsNorm) {
  const ModelConfig c = cfg();
  const auto eps = static_cast<float>(c.rms_norm_eps);
  check_rmsnorm(tag("rmsnorm hidden", {T(), c.hidden_size}), T(), c.hidden_size, eps);
  const int64_t qrows = T() * c.num_attention_heads;  // attention q norm: rows = tokens x heads
  check_rmsnorm(tag("rmsnorm q-heads", {qrows, c.head_dim}), qrows, c.head_dim, eps);
}

TEST_P(CudaRealShapesTokens, SwiGlu) {
  const ModelConfig c = cfg();
  check_swiglu(tag("swiglu", {T(), c.intermediate_size}), T(), c.intermediate_size);
}

TEST_P(CudaRealShapesTokens, Conv1dPacked) {
  const ModelConfig c = cfg();
  check_conv1d(tag("conv1d packed", {T(), c.conv_dim(), c.linear_conv_kernel_dim}), c.conv_dim(),
               c.linear_conv_kernel_dim, packed_cu());
}

TEST_P(CudaRealShapesTokens, L2Norm) {
  const ModelConfig c = cfg();
  const int64_t Hk = c.linear_num_key_heads, dk = c.linear_key_head_dim;
  check_l2norm(tag("l2norm q", {T(), Hk, dk}), T(), Hk, dk, c.conv_dim(), 0);
  check_l2norm(tag("l2norm k", {T(), Hk, dk}), T(), Hk, dk, c.conv_dim(), c.key_dim());
}

TEST_P(CudaRealShapesTokens, GatedRmsNorm) {
  const ModelConfig c = cfg();
  const int64_t rows = T() * c.linear_num_value_heads, d = c.linear_value_head_dim;
  check_gated_rmsnorm(tag("gated_rmsnorm", {rows, d}), rows, d, static_cast<float>(c.rms_norm_eps));
}

TEST_P(CudaRealShapesTokens, GdnGate) {
  const ModelConfig c = cfg();
  check_gdn_gate(tag("gdn_gate", {T(), c.linear_num_value_heads}), T(), c.linear_num_value_heads);
}

TEST_P(CudaRealShapesTokens, RopePacked) {
  const ModelConfig c = cfg();
  for (int64_t H : {c.num_attention_heads, c.num_key_value_heads})
    check_rope(tag("rope packed", {T(), H, c.head_dim}) + " rotary " + std::to_string(c.rotary_dim()), H, c.head_dim,
               c.rotary_dim(), c.rope_theta, packed_cu());
}

TEST_P(CudaRealShapesTokens, Embedding) {
  const ModelConfig c = cfg();
  check_embedding(tag("embedding", {T(), c.vocab_size, c.hidden_size}), T(), c.vocab_size, c.hidden_size);
}

INSTANTIATE_TEST_SUITE_P(Qwen35, CudaRealShapesTokens,
                         ::testing::Values(RealShape{"2b", 8192}, RealShape{"2b", 32768}, RealShape{"9b", 8192},
                                           RealShape{"9b", 32768}),
                         [](const ::testing::TestParamInfo<RealShape>& p) {
                           return std::string(p.param.preset) + "_T" + std::to_string(p.param.T);
                         });

// ------------------------------------------------------------------------------------------------ linear layers

// Every distinct [K -> N] projection of a layer (GDN qkv / z / b|a / out, attention q|gate / k, v / o, MLP
// gate|up / down) at M = 8192 rows: y = x W^T, dx = dy W, dW = dy^T x.
void check_linear_layers(const std::string& preset) {
  const ModelConfig c = ModelConfig::preset(preset);
  const int64_t M = 8192, H = c.hidden_size, I = c.intermediate_size, Hq = c.num_attention_heads,
                Hkv = c.num_key_value_heads, hd = c.head_dim, Hv = c.linear_num_value_heads;
  const std::vector<std::pair<int64_t, int64_t>> all = {{H, c.conv_dim()},  {H, c.value_dim()}, {H, 2 * Hv},
                                                        {c.value_dim(), H}, {H, 2 * Hq * hd},   {H, Hkv * hd},
                                                        {Hq * hd, H},       {H, 2 * I},         {I, H}};
  std::vector<std::pair<int64_t, int64_t>> layers;
  for (const auto& kn : all)
    if (std::find(layers.begin(), layers.end(), kn) == layers.end()) layers.push_back(kn);
  for (const auto& [K, N] : layers) {
    Seeds s;
    const std::string what =
        "linear " + preset + " M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" + std::to_string(N);
    SCOPED_TRACE(what + ", " + s.str());
    Measured m(what);
    const auto x = rand_bf16(M * K, s.next());
    const auto W = rand_bf16(N * K, s.next(), 1.0 / std::sqrt(double(K)));
    const auto dy = rand_bf16(M * N, s.next());
    std::vector<float> y_ref(M * N), dx_ref(M * K), dW_ref(N * K, 0.0f);
    m.cpu([&] {
      ds::ops::linear_forward<float>(x.data(), W.data(), y_ref.data(), M, K, N);
      ds::ops::linear_backward<float>(x.data(), W.data(), dy.data(), dx_ref.data(), dW_ref.data(), M, K, N);
    });
    DevBuf<bf16> x_(M * K), W_(N * K), dy_(M * N), y_(M * N), dx_(M * K);
    DevBuf<float> dW_(N * K);
    upload_bf16(x_, x);
    upload_bf16(W_, W);
    upload_bf16(dy_, dy);
    struct Out {
      std::vector<uint16_t> y, dx;
      std::vector<float> dW;
    };
    auto run = [&] {
      y_.poison(), dx_.poison(), dW_.zero();
      gpu::linear_forward(x_.get(), W_.get(), y_.get(), M, K, N, false, nullptr);
      gpu::linear_backward_data(dy_.get(), W_.get(), dx_.get(), M, K, N, false, nullptr);
      gpu::linear_backward_weight(dy_.get(), x_.get(), dW_.get(), M, K, N, nullptr);
      device_sync();
      return Out{download_bits(y_), download_bits(dx_), download(dW_)};
    };
    const Out a = run(), b = run();
    m.check("y", rel_l2(bits_to_f32(a.y), y_ref), kFwdTol);
    m.check("dx", rel_l2(bits_to_f32(a.dx), dx_ref), kGradTol);
    m.check("dW", rel_l2(a.dW, dW_ref), kGradTol);
    m.deterministic(same_bits(a.y, b.y) && same_bits(a.dx, b.dx) && same_bits(a.dW, b.dW));
  }
}

TEST(CudaRealShapes, Linear2B) {
  DS_REQUIRE_REAL_SHAPES();
  check_linear_layers("2b");
}

TEST(CudaRealShapes, Linear9B) {
  DS_REQUIRE_REAL_SHAPES();
  check_linear_layers("9b");
}

// ------------------------------------------------------------------------------------------------ gated delta rule

// One GDN layer of the preset over documents `lens`, with the model's layout: v read from, and dv written into,
// [N, conv_dim] rows at column 2 * key_dim (the other columns hold garbage / must stay untouched). CPU reference:
// the chunked form (forward and backward), zero initial state, no final-state gradient.
void check_gdn(const std::string& preset, const std::vector<int>& lens) {
  const ModelConfig c = ModelConfig::preset(preset);
  ds::ops::GdnDims d;
  d.Hk = c.linear_num_key_heads, d.Hv = c.linear_num_value_heads;
  d.dk = c.linear_key_head_dim, d.dv = c.linear_value_head_dim;
  d.scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  d.chunk_size = 64;
  const auto cu = cu_from_lengths(lens), coff = chunk_offsets(cu, d.chunk_size);
  d.N = cu.back();
  d.num_seqs = static_cast<int64_t>(lens.size());
  const int64_t N = d.N, Hk = d.Hk, Hv = d.Hv, dk = d.dk, dv = d.dv, total_chunks = coff.back();
  const int64_t stride = c.conv_dim(), v_col = 2 * c.key_dim();
  Seeds s;
  const std::string what = "gated_delta_rule " + preset + " T=" + std::to_string(N) + " docs " +
                           std::to_string(lens.size()) + " Hk=" + std::to_string(Hk) + " Hv=" + std::to_string(Hv) +
                           " dk=dv=" + std::to_string(dk);
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);

  const auto q = l2_normalized_bf16(N * Hk, dk, s.next()), k = l2_normalized_bf16(N * Hk, dk, s.next());
  const auto v = rand_bf16(N * Hv * dv, s.next()), dO = rand_bf16(N * Hv * dv, s.next());
  const auto g = randu_par<float>(N * Hv, s.next(), -2.0, -0.001);  // slow (long memory) to fast decay
  const auto beta = randu_par<float>(N * Hv, s.next(), 0.01, 0.99);
  std::vector<float> o_ref(N * Hv * dv), dq_ref(N * Hk * dk), dk_ref(N * Hk * dk), dv_ref(N * Hv * dv), dg_ref(N * Hv),
      db_ref(N * Hv);
  m.cpu([&] {
    ds::ops::chunk_gated_delta_rule_forward<float>(d, q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(),
                                                   nullptr, o_ref.data(), nullptr);
    ds::ops::chunk_gated_delta_rule_backward<float>(d, q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(),
                                                    nullptr, dO.data(), nullptr, dq_ref.data(), dk_ref.data(),
                                                    dv_ref.data(), dg_ref.data(), db_ref.data(), nullptr);
  });

  std::vector<float> v_rows(N * stride, 1e30f);
  for (int64_t t = 0; t < N; ++t) std::copy_n(v.begin() + t * Hv * dv, Hv * dv, v_rows.begin() + t * stride + v_col);
  DevBuf<bf16> q_(q.size()), k_(k.size()), vrows_(v_rows.size()), dO_(dO.size());
  DevBuf<float> g_(g.size()), b_(beta.size());
  DevBuf<int32_t> cu_(cu.size()), coff_(coff.size());
  upload_bf16(q_, q);
  upload_bf16(k_, k);
  upload_bf16(vrows_, v_rows);
  upload_bf16(dO_, dO);
  upload(g_, g);
  upload(b_, beta);
  upload(cu_, cu);
  upload(coff_, coff);
  DevBuf<unsigned char> scratch(gpu::gated_delta_rule_scratch_bytes(d, total_chunks));
  DevBuf<bf16> o_(N * Hv * dv), dq_(N * Hk * dk), dk_(N * Hk * dk), dvrows_(N * stride);
  DevBuf<float> states_(total_chunks * Hv * dk * dv), dg_(N * Hv), dbeta_(N * Hv);
  struct Out {
    std::vector<uint16_t> o, dq, dk, dvrows;
    std::vector<float> states, dg, dbeta;
  };
  auto run = [&] {
    o_.poison(), dq_.poison(), dk_.poison(), dvrows_.poison(), states_.poison(), dg_.poison(), dbeta_.poison();
    scratch.poison();
    gpu::gated_delta_rule_forward(d, q_.get(), k_.get(), vrows_.get() + v_col, stride, g_.get(), b_.get(), cu_.get(),
                                  coff_.get(), total_chunks, o_.get(), states_.get(), nullptr);
    gpu::gated_delta_rule_backward(d, q_.get(), k_.get(), vrows_.get() + v_col, stride, g_.get(), b_.get(), cu_.get(),
                                   coff_.get(), total_chunks, states_.get(), dO_.get(), dq_.get(), dk_.get(),
                                   dvrows_.get() + v_col, stride, dg_.get(), dbeta_.get(), scratch.get(), nullptr);
    device_sync();
    return Out{download_bits(o_), download_bits(dq_), download_bits(dk_), download_bits(dvrows_),
               download(states_), download(dg_),      download(dbeta_)};
  };
  const Out a = run(), b = run();

  const auto dvv = bits_to_f32(columns(a.dvrows, stride, v_col, Hv * dv));
  EXPECT_TRUE(poisoned_outside(a.dvrows, stride, v_col, Hv * dv)) << "dv written outside its columns";
  EXPECT_TRUE(all_finite(a.states)) << "chunk states not fully written";
  m.check("o", rel_l2(bits_to_f32(a.o), o_ref), kFwdTol);
  m.check("dq", rel_l2(bits_to_f32(a.dq), dq_ref), kGradTol);
  m.check("dk", rel_l2(bits_to_f32(a.dk), dk_ref), kGradTol);
  m.check("dv", rel_l2(dvv, dv_ref), kGradTol);
  m.check("dg", rel_l2(a.dg, dg_ref), kGateGradTol);
  m.check("dbeta", rel_l2(a.dbeta, db_ref), kGateGradTol);
  m.deterministic(same_bits(a.o, b.o) && same_bits(a.dq, b.dq) && same_bits(a.dk, b.dk) &&
                  same_bits(a.dvrows, b.dvrows) && same_bits(a.states, b.states) && same_bits(a.dg, b.dg) &&
                  same_bits(a.dbeta, b.dbeta));
}

TEST(CudaRealShapes, GatedDeltaRule2B_T8192_Packed) {
  DS_REQUIRE_REAL_SHAPES();
  check_gdn("2b", packed_lengths(8192));
}
TEST(CudaRealShapes, GatedDeltaRule2B_T8192_OneDoc) {
  DS_REQUIRE_REAL_SHAPES();
  check_gdn("2b", {8192});
}
TEST(CudaRealShapes, GatedDeltaRule9B_T8192_Packed) {
  DS_REQUIRE_REAL_SHAPES();
  check_gdn("9b", packed_lengths(8192));
}
TEST(CudaRealShapes, GatedDeltaRule9B_T8192_OneDoc) {
  DS_REQUIRE_REAL_SHAPES();
  check_gdn("9b", {8192});
}
// T = 32768 with the 9B heads (Hv = 2 Hk: the GVA group sums of dq / dk over the longest state chain).
TEST(CudaRealShapes, GatedDeltaRule9B_T32768_OneDoc) {
  DS_REQUIRE_REAL_SHAPES();
  check_gdn("9b", {32768});
}

// ------------------------------------------------------------------------------------------------ attention

// Causal GQA attention at the 2B shape (Hq 8, Hkv 2, head_dim 256) over documents `lens`. The CPU backward sees
// what the GPU backward saw: the GPU's bf16 o and the reference lse.
void check_attention(const std::string& preset, const std::vector<int>& lens, bool cudnn = false) {
  const ModelConfig c = ModelConfig::preset(preset);
  const auto cu = cu_from_lengths(lens);
  ds::ops::AttnDims d;
  d.N = cu.back();
  d.num_seqs = static_cast<int64_t>(lens.size());
  d.Hq = c.num_attention_heads, d.Hkv = c.num_key_value_heads, d.head_dim = c.head_dim;
  d.scale = 1.0 / std::sqrt(static_cast<double>(d.head_dim));
  const int64_t N = d.N, hd = d.head_dim, nq = N * d.Hq * hd, nkv = N * d.Hkv * hd;
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  Seeds s;
  const std::string what = "attention " + preset + " T=" + std::to_string(N) + " docs " + std::to_string(lens.size()) +
                           " Hq=" + std::to_string(d.Hq) + " Hkv=" + std::to_string(d.Hkv) +
                           " hd=" + std::to_string(hd) + (cudnn ? " (cuDNN)" : "");
  SCOPED_TRACE(what + ", " + s.str());
  std::unique_ptr<ds::ops::cudnn::Attention> att;
  if (cudnn) att = std::make_unique<ds::ops::cudnn::Attention>(ds::ops::cudnn::AttnBounds{
                 N, d.num_seqs, max_len, d.Hq, d.Hkv, d.head_dim, d.scale});
  DevBuf<unsigned char> ws(att ? att->workspace_bytes() : 0), meta(att ? att->meta_bytes() : 0);
  if (att) {
    ASSERT_TRUE(att->set_batch(cu.data(), d.num_seqs, meta.get(), nullptr));
  }
  Measured m(what);
  const auto q = rand_bf16(nq, s.next()), k = rand_bf16(nkv, s.next()), v = rand_bf16(nkv, s.next());
  const auto dout = rand_bf16(nq, s.next());
  std::vector<float> o_ref(nq), lse_ref(N * d.Hq);
  m.cpu([&] {
    ds::ops::attention_forward<float>(d, q.data(), k.data(), v.data(), cu.data(), o_ref.data(), lse_ref.data());
  });

  DevBuf<bf16> q_(nq), k_(nkv), v_(nkv), dout_(nq), o_(nq), dq_(nq), dk_(nkv), dv_(nkv);
  DevBuf<float> lse_(N * d.Hq);
  DevBuf<int32_t> cu_(cu.size());
  DevBuf<unsigned char> scratch(gpu::attention_scratch_bytes(d));
  upload_bf16(q_, q);
  upload_bf16(k_, k);
  upload_bf16(v_, v);
  upload_bf16(dout_, dout);
  upload(cu_, cu);
  struct Out {
    std::vector<uint16_t> o, dq, dk, dv;
    std::vector<float> lse;
  };
  auto run = [&] {
    o_.poison(), lse_.poison(), dq_.poison(), dk_.poison(), dv_.poison(), scratch.poison();
    if (att) {
      att->forward(q_.get(), k_.get(), v_.get(), o_.get(), lse_.get(), ws.get(), nullptr);
      att->backward(q_.get(), k_.get(), v_.get(), o_.get(), lse_.get(), dout_.get(), dq_.get(), dk_.get(), dv_.get(),
                    ws.get(), nullptr);
    } else {
      gpu::attention_forward(d, q_.get(), k_.get(), v_.get(), cu_.get(), max_len, o_.get(), lse_.get(), nullptr);
      gpu::attention_backward(d, q_.get(), k_.get(), v_.get(), o_.get(), lse_.get(), dout_.get(), cu_.get(), max_len,
                              dq_.get(), dk_.get(), dv_.get(), scratch.get(), nullptr);
    }
    device_sync();
    return Out{download_bits(o_), download_bits(dq_), download_bits(dk_), download_bits(dv_), download(lse_)};
  };
  const Out a = run(), b = run();
  const auto o_gpu = bits_to_f32(a.o);
  std::vector<float> dq_ref(nq), dk_ref(nkv), dv_ref(nkv);
  m.cpu([&] {
    ds::ops::attention_backward<float>(d, q.data(), k.data(), v.data(), o_gpu.data(), lse_ref.data(), dout.data(),
                                       cu.data(), dq_ref.data(), dk_ref.data(), dv_ref.data());
  });
  m.check("o", rel_l2(o_gpu, o_ref), kFwdTol);
  m.check("lse", rel_l2(a.lse, lse_ref), kFwdTol);
  m.check("dq", rel_l2(bits_to_f32(a.dq), dq_ref), kGradTol);
  m.check("dk", rel_l2(bits_to_f32(a.dk), dk_ref), kGradTol);
  m.check("dv", rel_l2(bits_to_f32(a.dv), dv_ref), kGradTol);
  m.deterministic(same_bits(a.o, b.o) && same_bits(a.lse, b.lse) && same_bits(a.dq, b.dq) && same_bits(a.dk, b.dk) &&
                  same_bits(a.dv, b.dv));
}

TEST(CudaRealShapes, Attention2B_B2xT4096) {
  DS_REQUIRE_REAL_SHAPES();
  check_attention("2b", {4096, 4096});
}
TEST(CudaRealShapes, Attention2B_T8192) {
  DS_REQUIRE_REAL_SHAPES();
  check_attention("2b", {8192});
}
// cuDNN's fused SDPA (the engine's default backend where cuDNN loads) at the same shapes, and at the 9B heads
// (Hq 16, Hkv 4) over a packed T = 8192 with documents in four length buckets.
TEST(CudaRealShapes, AttentionCudnn2B_B2xT4096) {
  DS_REQUIRE_REAL_SHAPES();
  if (std::string why = ds::ops::cudnn::attention_unavailable(); !why.empty()) GTEST_SKIP() << why;
  check_attention("2b", {4096, 4096}, true);
}
TEST(CudaRealShapes, AttentionCudnn9B_T8192_Packed) {
  DS_REQUIRE_REAL_SHAPES();
  if (std::string why = ds::ops::cudnn::attention_unavailable(); !why.empty()) GTEST_SKIP() << why;
  check_attention("9b", {5000, 100, 2900, 1, 191}, true);
}

// ------------------------------------------------------------------------------------------------ linear + CE

// The 2B head: N = 4096 tokens, H = 2048, V = 248320 (10% ignored labels, the last vocabulary row used), z-loss
// 1e-4, mean reduction, the model's 2048-token chunks.
TEST(CudaRealShapes, LinearCrossEntropy2B) {
  DS_REQUIRE_REAL_SHAPES();
  const ModelConfig c = ModelConfig::preset("2b");
  const int64_t N = 4096, H = c.hidden_size, V = c.vocab_size, chunk = 2048;
  Seeds s;
  const std::string what = "linear_cross_entropy N=" + std::to_string(N) + " H=" + std::to_string(H) +
                           " V=" + std::to_string(V) + " chunk=" + std::to_string(chunk);
  SCOPED_TRACE(what + ", " + s.str());
  Measured m(what);
  const auto h = rand_bf16(N * H, s.next());
  const auto W = rand_bf16(V * H, s.next(), 2.0 / std::sqrt(double(H)));  // logits with std ~2
  std::vector<int32_t> labels(N);
  ds::Rng rng(s.next());
  for (auto& y : labels) y = rng.uniform() < 0.1 ? -100 : static_cast<int32_t>(rng.below(V));
  labels[N - 1] = static_cast<int32_t>(V - 1);
  int64_t valid = 0;
  for (auto y : labels) valid += y != -100;
  ds::ops::LinearCeOptions opt;
  opt.z_loss = 1e-4;
  opt.grad_scale = 1.0 / double(valid);
  std::vector<float> dh_ref(N * H), dW_ref(V * H, 0.0f);
  ds::ops::LinearCeResult ref;
  m.cpu([&] {
    ref = ds::ops::linear_cross_entropy<float>(h.data(), W.data(), labels.data(), N, H, V, opt, dh_ref.data(),
                                               dW_ref.data());
  });
  ASSERT_EQ(ref.num_valid, valid);

  opt.chunk_tokens = chunk;
  DevBuf<bf16> h_(N * H), W_(V * H), dh_(N * H);
  DevBuf<float> dW_(V * H);
  DevBuf<int32_t> labels_(N);
  DevBuf<double> loss_(2);
  DevBuf<unsigned char> scratch(gpu::linear_cross_entropy_scratch_bytes(N, H, V, chunk));
  upload_bf16(h_, h);
  upload_bf16(W_, W);
  upload(labels_, labels);
  auto run = [&] {
    dh_.poison(), loss_.poison(), scratch.poison(), dW_.zero();
    gpu::linear_cross_entropy(h_.get(), W_.get(), labels_.get(), N, H, V, opt, loss_.get(), dh_.get(), dW_.get(),
                              scratch.get(), nullptr);
    device_sync();
  };
  run();
  const auto loss = download(loss_);
  const auto dh = download_bits(dh_);
  const auto dW = download(dW_);
  // Loss sums (fp64 over ~3700 tokens) are held to 1e-4 as in the small-shape test.
  m.check("loss", std::abs(loss[0] - ref.loss_sum) / std::abs(ref.loss_sum), 1e-4);
  m.check("z_loss", std::abs(loss[1] - ref.z_loss_sum) / std::abs(ref.z_loss_sum), 1e-4);
  m.check("dh", rel_l2(bits_to_f32(dh), dh_ref), kGradTol);
  m.check("dW", rel_l2(dW, dW_ref), kGradTol);
  run();  // second run compared in place (dW is 2 GB of fp32)
  m.deterministic(same_bits(loss, download(loss_)) && same_bits(dh, download_bits(dh_)) &&
                  same_bits(dW, download(dW_)));
}

}  // namespace

#endif  // DELTASTACK_CUDA
