// check_linear (ops/linear/cuda_check.h). CUDA builds only.
#include "ops/linear/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include <cmath>

#include "ops/check/device.h"
#include "ops/linear/cuda.h"
#include "ops/linear/linear.h"

namespace ds::ops {

using namespace check;

Result check_linear(const LinearCase& c) {
  Result r;
  r.what = "linear M " + std::to_string(c.M) + " K " + std::to_string(c.K) + " N " + std::to_string(c.N);
  Ctx ctx(c.seed);
  const int64_t M = c.M, K = c.K, N = c.N;
  const Vec x = ctx.randn_bf16(M * K), W = ctx.randn_bf16(N * K, 1.0 / std::sqrt(static_cast<double>(K)));
  const Vec dy = ctx.randn_bf16(M * N);
  const Vec y0 = c.accumulate ? ctx.randn_bf16(M * N) : Vec{}, dx0 = c.accumulate ? ctx.randn_bf16(M * K) : Vec{};
  Vec y(M * N), dx(M * K), dW(N * K, 0.f), y_acc = y0, dx_acc = dx0;
  timed(&r.cpu_seconds, [&] {
    linear_forward<float>(x.data(), W.data(), y.data(), M, K, N, false);
    linear_backward<float>(x.data(), W.data(), dy.data(), dx.data(), dW.data(), M, K, N, false);
    if (c.accumulate) {
      linear_forward<float>(x.data(), W.data(), y_acc.data(), M, K, N, true);
      linear_backward<float>(x.data(), W.data(), dy.data(), dx_acc.data(), nullptr, M, K, N, true);
    }
  });
  const Vec dW0 = ctx.accum_init(dW);

  auto x_d = ctx.up_bf16(x), W_d = ctx.up_bf16(W), dy_d = ctx.up_bf16(dy);
  Buf<bf16> y_d(M * N), dx_d(M * K), yacc_d(c.accumulate ? M * N : 0), dxacc_d(c.accumulate ? M * K : 0);
  Buf<float> dW_d(N * K);
  struct Out {
    Bits y, dx, yacc, dxacc;
    Vec dW;
    auto tie() const { return std::tie(y, dx, yacc, dxacc, dW); }
  };
  auto run = [&] {
    Out o;
    ctx.poison(y_d), ctx.poison(dx_d);
    ctx.upload(dW_d, dW0);
    cuda::linear_forward(x_d.get(), W_d.get(), y_d.get(), M, K, N, false, ctx.s);
    cuda::linear_backward_data(dy_d.get(), W_d.get(), dx_d.get(), M, K, N, false, ctx.s);
    cuda::linear_backward_weight(dy_d.get(), x_d.get(), dW_d.get(), M, K, N, ctx.s);
    if (c.accumulate) {
      ctx.upload_bf16(yacc_d, y0), ctx.upload_bf16(dxacc_d, dx0);
      cuda::linear_forward(x_d.get(), W_d.get(), yacc_d.get(), M, K, N, true, ctx.s);
      cuda::linear_backward_data(dy_d.get(), W_d.get(), dxacc_d.get(), M, K, N, true, ctx.s);
      o.yacc = ctx.bits(yacc_d), o.dxacc = ctx.bits(dxacc_d);
    }
    o.y = ctx.bits(y_d), o.dx = ctx.bits(dx_d), o.dW = ctx.down(dW_d);
    return o;
  };
  const Out a = run();
  r.add("y", rel_l2(bf16_view(a.y), y), kForward);
  r.add("dx", rel_l2(bf16_view(a.dx), dx), kGradient);
  r.add("dW (accumulated)", rel_l2(minus(a.dW, dW0), dW), kGradient);
  if (c.accumulate) {
    r.add("y (accumulate)", rel_l2(bf16_view(a.yacc), y_acc), kForward);
    r.add("dx (accumulate)", rel_l2(bf16_view(a.dxacc), dx_acc), kGradient);
  }
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

std::vector<LinearCase> linear_probe_cases() {
  return {{.M = 70, .K = 256, .N = 192, .accumulate = true, .twice = false}};
}

double probe_cuda_linear() { return probe("linear", linear_probe_cases(), check_linear); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
