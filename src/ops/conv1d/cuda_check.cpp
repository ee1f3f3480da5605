// check_conv1d (ops/conv1d/cuda_check.h). CUDA builds only.
#include "ops/conv1d/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include "ops/check/device.h"
#include "ops/conv1d/conv1d.h"
#include "ops/conv1d/cuda.h"

namespace ds::ops {

using namespace check;

Result check_conv1d(const Conv1dCase& c) {
  Ctx ctx(c.seed);
  Rng rng = ctx.rng();
  const std::vector<int> lens = c.lens.empty() ? random_lengths(c.N, c.max_doc, rng) : c.lens;
  const I32 cu = cu_from_lengths(lens);
  const int64_t N = cu.back(), S = static_cast<int64_t>(lens.size()), C = c.C, K = c.K;
  Result r;
  r.what = "conv1d [" + shape({N, C, K}) + "] documents " + lengths_str(lens) +
           (c.offset ? " offset " + std::to_string(c.offset) : "");
  const Vec x = ctx.randn_bf16(N * C, c.x_std), dy = ctx.randn_bf16(N * C), w = ctx.randn(C * K, 0.5);
  Vec y(N * C), dx(N * C), dw(C * K, 0.f);
  timed(&r.cpu_seconds, [&] {
    conv1d_silu_forward<float>(x.data(), w.data(), cu.data(), S, N, C, K, y.data());
    conv1d_silu_backward<float>(x.data(), w.data(), dy.data(), cu.data(), S, N, C, K, dx.data(), dw.data());
  });
  const Vec dw0 = ctx.accum_init(dw);

  auto x_d = ctx.up_bf16(x, c.offset), dy_d = ctx.up_bf16(dy, c.offset);
  auto w_d = ctx.up(w);
  auto ss_d = ctx.up(seq_starts(cu));
  Buf<bf16> y_d(N * C, c.offset), dx_d(N * C, c.offset);
  Buf<float> dw_d(C * K);
  Buf<unsigned char> scratch(cuda::conv1d_scratch_bytes(N, C, K));
  struct Out {
    Bits y, dx;
    Vec dw;
    auto tie() const { return std::tie(y, dx, dw); }
  };
  auto run = [&] {
    ctx.poison(y_d), ctx.poison(dx_d);
    ctx.upload(dw_d, dw0);
    cuda::conv1d_silu_forward(x_d.get(), w_d.get(), ss_d.get(), y_d.get(), N, C, K, ctx.s);
    cuda::conv1d_silu_backward(x_d.get(), w_d.get(), dy_d.get(), ss_d.get(), dx_d.get(), dw_d.get(), N, C, K,
                               scratch.get(), ctx.s);
    return Out{ctx.bits(y_d), ctx.bits(dx_d), ctx.down(dw_d)};
  };
  const Out a = run();
  r.add("y", rel_l2(bf16_view(a.y), y), kForward);
  r.add("dx", rel_l2(bf16_view(a.dx), dx), kGradient);
  r.add("dw (accumulated)", rel_l2(minus(a.dw, dw0), dw), kGradient);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  if (c.division) {
    DivisionSigmoid on;
    r.exact("the division sigmoid's run bitwise equal", same_runs(a, run()));
  }
  return r;
}

std::vector<Conv1dCase> conv1d_probe_cases() { return {{.lens = {1, 70, 0, 130}, .C = 96, .K = 4, .twice = false}}; }

double probe_cuda_conv1d() { return probe("conv1d", conv1d_probe_cases(), check_conv1d); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
