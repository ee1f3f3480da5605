// check_linear_fp8 (ops/linear/fp8_check.h). CUDA builds only.
#include "ops/linear/fp8_check.h"

#ifdef DELTASTACK_CUDA
#include <cmath>

#include "ops/check/device.h"
#include "ops/linear/fp8.h"

namespace ds::ops {

using namespace check;

namespace {

// The emulated cast of a tensor (core/fp8.h): its codes (row-major, or transposed with rows padded to ldt with
// zero codes) and its dequantized values (row-major), with the dequantization scale.
struct Cast {
  std::vector<uint8_t> codes, codes_t;
  Vec values;
  float scale = 1;
};
Cast emulate(const Vec& x, int64_t rows, int64_t cols, Fp8Format f, int64_t ldt) {
  Cast c;
  const float inv = fp8_inv_scale(fp8_amax(x.data(), static_cast<int64_t>(x.size())), f);
  c.scale = fp8_dequant_scale(inv);
  c.codes.resize(x.size());
  c.values.resize(x.size());
  c.codes_t.assign(static_cast<size_t>(cols * ldt), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) {
      const size_t i = static_cast<size_t>(r * cols + k);
      c.codes[i] = fp8_encode(x[i] * inv, f);
      c.values[i] = fp8_decode(c.codes[i], f) * c.scale;
      c.codes_t[static_cast<size_t>(k * ldt + r)] = c.codes[i];
    }
  return c;
}

// C[M, N] = A[M, K] B[N, K]^T in double.
Vec matmul_nt(const Vec& A, const Vec& B, int64_t M, int64_t N, int64_t K) {
  Vec C(static_cast<size_t>(M * N));
#pragma omp parallel for
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(A[i * K + k]) * double(B[j * K + k]);
      C[i * N + j] = static_cast<float>(s);
    }
  return C;
}
Vec transpose(const Vec& A, int64_t rows, int64_t cols) {
  Vec T(A.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) T[c * rows + r] = A[r * cols + c];
  return T;
}

}  // namespace

Result check_linear_fp8(const LinearFp8Case& c) {
  Result r;
  r.what = "linear_fp8 M " + std::to_string(c.M) + " K " + std::to_string(c.K) + " N " + std::to_string(c.N) +
           " grad " + fp8_format_name(c.grad);
  Ctx ctx(c.seed);
  const int64_t M = c.M, K = c.K, N = c.N, Mp = cuda::fp8_padded(M);
  const Vec x = ctx.randn_bf16(M * K, c.x_scale), W = ctx.randn_bf16(N * K, 1.0 / std::sqrt(static_cast<double>(K)));
  const Vec dy = ctx.randn_bf16(M * N, 1e-3);
  const Vec dx0 = c.accumulate ? ctx.randn_bf16(M * K) : Vec{};
  Cast cx, cw, cdy;
  Vec y, dx, dW;
  timed(&r.cpu_seconds, [&] {
    cx = emulate(x, M, K, Fp8Format::E4M3, Mp);
    cw = emulate(W, N, K, Fp8Format::E4M3, N);
    cdy = emulate(dy, M, N, c.grad, Mp);
    y = matmul_nt(cx.values, cw.values, M, N, K);
    dx = matmul_nt(cdy.values, transpose(cw.values, N, K), M, K, N);
    dW = matmul_nt(transpose(cdy.values, M, N), transpose(cx.values, M, K), N, K, M);
    if (c.accumulate)
      for (size_t i = 0; i < dx.size(); ++i) dx[i] += dx0[i];
  });
  const Vec dW0 = ctx.accum_init(dW);

  auto x_d = ctx.up_bf16(x), W_d = ctx.up_bf16(W), dy_d = ctx.up_bf16(dy);
  Buf<uint8_t> qx(M * K), qxt(K * Mp), qwt(K * N), qw(N * K), qdy(M * N), qdyt(N * Mp);
  Buf<float> f(8 * cuda::kFp8Slot);
  Buf<bf16> y_d(M * N), dx_d(M * K);
  Buf<float> dW_d(N * K);
  struct Out {
    std::vector<uint8_t> qx, qxt, qw, qdy, qdyt;
    std::vector<float> f;
    Bits y, dx;
    Vec dW;
    auto tie() const { return std::tie(qx, qxt, qw, qdy, qdyt, f, y, dx, dW); }
  };
  auto run = [&] {
    Out o;
    ctx.poison(y_d), ctx.poison(qx), ctx.poison(qxt), ctx.poison(qw), ctx.poison(qwt), ctx.poison(qdy),
        ctx.poison(qdyt), ctx.poison(f);
    if (c.accumulate) ctx.upload_bf16(dx_d, dx0);
    else ctx.poison(dx_d);
    ctx.upload(dW_d, dW0);
    float* F = f.get();
    using cuda::kFp8Slot;
    const Fp8Format E4 = Fp8Format::E4M3;
    // forward: q(x) . q(W)^T
    cuda::fp8_amax(x_d.get(), M, K, K, F, ctx.s);
    cuda::fp8_quantize(x_d.get(), M, K, K, F, E4, qx.get(), K, F + 3 * kFp8Slot, ctx.s);
    cuda::fp8_amax(W_d.get(), N, K, K, F + 1 * kFp8Slot, ctx.s);
    cuda::fp8_quantize(W_d.get(), N, K, K, F + 1 * kFp8Slot, E4, qw.get(), K, F + 4 * kFp8Slot, ctx.s);
    cuda::gemm_fp8({qx.get(), M, K, K, E4, F + 3 * kFp8Slot}, {qw.get(), N, K, K, E4, F + 4 * kFp8Slot}, y_d.get(), false, N, 0.0f,
                   c.fast_accum, ctx.s);
    // dgrad: q(dy) . q(W^T)^T
    cuda::fp8_amax(dy_d.get(), M, N, N, F + 2 * kFp8Slot, ctx.s);
    // dy in both layouts in one pass (the engine's backward), its transpose for the wgrad below
    cuda::fp8_quantize_both(dy_d.get(), M, N, N, F + 2 * kFp8Slot, c.grad, qdy.get(), N, qdyt.get(), Mp,
                            F + 6 * kFp8Slot, F + 5 * kFp8Slot, ctx.s);
    cuda::fp8_quantize_transpose(W_d.get(), N, K, K, F + 1 * kFp8Slot, E4, qwt.get(), N, F + 7 * kFp8Slot, ctx.s);
    cuda::gemm_fp8({qdy.get(), M, N, N, c.grad, F + 5 * kFp8Slot}, {qwt.get(), K, N, N, E4, F + 7 * kFp8Slot}, dx_d.get(), false, K,
                   c.accumulate ? 1.0f : 0.0f, c.fast_accum, ctx.s);
    // wgrad: q(dy^T) . q(x^T)^T, padded reduction
    cuda::fp8_quantize_transpose(x_d.get(), M, K, K, F, E4, qxt.get(), Mp, F + 3 * kFp8Slot, ctx.s);
    cuda::gemm_fp8({qdyt.get(), N, Mp, Mp, c.grad, F + 6 * kFp8Slot}, {qxt.get(), K, Mp, Mp, E4, F + 3 * kFp8Slot}, dW_d.get(), true, K,
                   1.0f, c.fast_accum, ctx.s);
    o.qx = ctx.down(qx), o.qxt = ctx.down(qxt), o.qw = ctx.down(qwt), o.qdy = ctx.down(qdy), o.qdyt = ctx.down(qdyt);
    const std::vector<float> all = ctx.down(f);
    for (int k = 0; k < 8; ++k) o.f.push_back(all[static_cast<size_t>(k * cuda::kFp8Slot)]);
    o.y = ctx.bits(y_d), o.dx = ctx.bits(dx_d), o.dW = ctx.down(dW_d);
    return o;
  };
  const Out a = run();
  r.exact("x cast (e4m3) bitwise", a.qx == cx.codes);
  r.exact("x^T cast with zero padding bitwise", a.qxt == cx.codes_t);
  std::vector<uint8_t> wt(static_cast<size_t>(K * N));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) wt[k * N + n] = cw.codes[n * K + k];
  r.exact("W^T cast bitwise", a.qw == wt);
  r.exact(std::string("dy cast (") + fp8_format_name(c.grad) + ") bitwise", a.qdy == cdy.codes);
  r.exact("dy^T cast with zero padding bitwise", a.qdyt == cdy.codes_t);
  r.exact("scales bitwise", a.f[4] == cw.scale && a.f[5] == cdy.scale && a.f[6] == cdy.scale && a.f[7] == cw.scale &&
                                a.f[3] == cx.scale);
  r.add("y", rel_l2(bf16_view(a.y), y), kForward);
  r.add(c.accumulate ? "dx (accumulate)" : "dx", rel_l2(bf16_view(a.dx), dx), kGradient);
  r.add("dW (accumulated)", rel_l2(minus(a.dW, dW0), dW), kGradient);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

std::vector<LinearFp8Case> linear_fp8_probe_cases() {
  return {{.M = 70, .K = 256, .N = 192, .grad = Fp8Format::E5M2, .accumulate = true, .twice = false},
          {.M = 64, .K = 128, .N = 96, .grad = Fp8Format::E4M3, .accumulate = false, .fast_accum = true,
           .twice = false}};
}

double probe_cuda_linear_fp8() { return probe("linear_fp8", linear_fp8_probe_cases(), check_linear_fp8); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
