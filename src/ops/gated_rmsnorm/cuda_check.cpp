// check_gated_rmsnorm (ops/gated_rmsnorm/cuda_check.h). CUDA builds only.
#include "ops/gated_rmsnorm/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include "ops/check/device.h"
#include "ops/gated_rmsnorm/cuda.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"

namespace ds::ops {

using namespace check;

Result check_gated_rmsnorm(const GatedRmsnormCase& c) {
  Result r;
  r.what = "gated_rmsnorm [" + shape({c.rows, c.d}) + "]" + (c.offset ? " offset " + std::to_string(c.offset) : "");
  Ctx ctx(c.seed);
  const int64_t R = c.rows, D = c.d, n = R * D;
  const Vec x = ctx.randn_bf16(n), z = ctx.randn_bf16(n, 2.0), dy = ctx.randn_bf16(n), w = ctx.randn(D, 0.3, 1.0);
  Vec y(n), rstd(R), dx(n), dz(n), dw(D, 0.f);
  timed(&r.cpu_seconds, [&] {
    gated_rmsnorm_forward<float>(x.data(), z.data(), w.data(), y.data(), rstd.data(), R, D, c.eps);
    gated_rmsnorm_backward<float>(x.data(), z.data(), w.data(), rstd.data(), dy.data(), dx.data(), dz.data(), dw.data(),
                                  R, D);
  });
  const Vec dw0 = ctx.accum_init(dw);

  auto x_d = ctx.up_bf16(x, c.offset), z_d = ctx.up_bf16(z, c.offset), dy_d = ctx.up_bf16(dy, c.offset);
  auto w_d = ctx.up(w), rstd_in = ctx.up(rstd);
  Buf<bf16> y_d(n, c.offset), dx_d(n, c.offset), dz_d(n, c.offset);
  Buf<float> rstd_d(R), dw_d(D);
  Buf<unsigned char> scratch(cuda::gated_rmsnorm_scratch_bytes(R, D));
  struct Out {
    Bits y, dx, dz;
    Vec rstd, dw;
    auto tie() const { return std::tie(y, dx, dz, rstd, dw); }
  };
  auto run = [&] {
    ctx.poison(y_d), ctx.poison(rstd_d), ctx.poison(dx_d), ctx.poison(dz_d);
    ctx.upload(dw_d, dw0);
    cuda::gated_rmsnorm_forward(x_d.get(), z_d.get(), w_d.get(), y_d.get(), rstd_d.get(), R, D, c.eps, ctx.s);
    cuda::gated_rmsnorm_backward(x_d.get(), z_d.get(), w_d.get(), rstd_in.get(), dy_d.get(), dx_d.get(), dz_d.get(),
                                 dw_d.get(), R, D, scratch.get(), ctx.s);
    return Out{ctx.bits(y_d), ctx.bits(dx_d), ctx.bits(dz_d), ctx.down(rstd_d), ctx.down(dw_d)};
  };
  const Out a = run();
  r.add("y", rel_l2(bf16_view(a.y), y), kForward);
  r.add("rstd", rel_l2(a.rstd, rstd), kForward);
  r.add("dx", rel_l2(bf16_view(a.dx), dx), kGradient);
  r.add("dz", rel_l2(bf16_view(a.dz), dz), kGradient);
  r.add("dw (accumulated)", rel_l2(minus(a.dw, dw0), dw), kGradient);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

std::vector<GatedRmsnormCase> gated_rmsnorm_probe_cases() { return {{.rows = 64, .d = 128, .twice = false}}; }

double probe_cuda_gated_rmsnorm() { return probe("gated_rmsnorm", gated_rmsnorm_probe_cases(), check_gated_rmsnorm); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
