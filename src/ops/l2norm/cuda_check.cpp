// check_l2norm (ops/l2norm/cuda_check.h). CUDA builds only.
#include "ops/l2norm/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include "ops/check/device.h"
#include "ops/l2norm/cuda.h"
#include "ops/l2norm/l2norm.h"

namespace ds::ops {

using namespace check;

Result check_l2norm(const L2normCase& c) {
  Result r;
  r.what = "l2norm [" + shape({c.tokens, c.heads, c.dim}) + "] stride " + std::to_string(c.stride) + " col0 " +
           std::to_string(c.col0);
  Ctx ctx(c.seed);
  const int64_t rows = c.tokens * c.heads, width = c.heads * c.dim, n = rows * c.dim;
  const Vec xbuf = ctx.randn_bf16(c.tokens * c.stride), dy = ctx.randn_bf16(n);
  const Vec x = columns(xbuf, c.stride, c.col0, width);
  Vec y(n), rnorm(rows), y_saved, dx(n);
  timed(&r.cpu_seconds, [&] {
    l2norm_forward<float>(x.data(), y.data(), rnorm.data(), rows, c.dim, c.eps);
    y_saved = rounded(y);  // the backward reads the bf16 y the forward stored
    l2norm_backward<float>(y_saved.data(), rnorm.data(), dy.data(), dx.data(), rows, c.dim);
  });

  auto x_d = ctx.up_bf16(xbuf), yin_d = ctx.up_bf16(y_saved), dy_d = ctx.up_bf16(dy);
  auto rnin_d = ctx.up(rnorm);
  Buf<bf16> y_d(n), dx_d(xbuf.size());
  Buf<float> rn_d(rows);
  struct Out {
    Bits y, dxbuf;
    Vec rn;
    auto tie() const { return std::tie(y, dxbuf, rn); }
  };
  auto run = [&] {
    ctx.poison(y_d), ctx.poison(rn_d), ctx.poison(dx_d);
    cuda::l2norm_forward(x_d.get() + c.col0, c.stride, y_d.get(), rn_d.get(), c.tokens, c.heads, c.dim, c.eps, ctx.s);
    cuda::l2norm_backward(yin_d.get(), rnin_d.get(), dy_d.get(), dx_d.get() + c.col0, c.stride, c.tokens, c.heads,
                          c.dim, ctx.s);
    return Out{ctx.bits(y_d), ctx.bits(dx_d), ctx.down(rn_d)};
  };
  const Out a = run();
  r.add("y", rel_l2(bf16_view(a.y), y), kForward);
  r.add("rnorm", rel_l2(a.rn, rnorm), kForward);
  r.add("dx (strided)", rel_l2(to_f32(columns(a.dxbuf, c.stride, c.col0, width)), dx), kGradient);
  r.exact("dx written only inside its columns", poisoned_outside(a.dxbuf, c.stride, c.col0, width));
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

// k rows out of a conv output [T, q | k | v]: stride 2 * 2 * 128 + 4 * 128, k at column 256.
std::vector<L2normCase> l2norm_probe_cases() {
  return {{.tokens = 48, .heads = 2, .dim = 128, .stride = 1024, .col0 = 256, .twice = false}};
}

double probe_cuda_l2norm() { return probe("l2norm", l2norm_probe_cases(), check_l2norm); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
