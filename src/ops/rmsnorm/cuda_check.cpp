// check_rmsnorm (ops/rmsnorm/cuda_check.h). CUDA builds only.
#include "ops/rmsnorm/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>
#include <cstring>

#include "ops/check/device.h"
#include "ops/rmsnorm/cuda.h"
#include "ops/rmsnorm/rmsnorm.h"

namespace ds::ops {

using namespace check;

Result check_rmsnorm(const RmsnormCase& c) {
  Result r;
  r.what = "rmsnorm [" + shape({c.rows, c.dim}) + "]" + (c.zero_centered ? " zero-centered" : " plain") +
           (c.offset ? " offset " + std::to_string(c.offset) : "");
  Ctx ctx(c.seed);
  const int64_t R = c.rows, D = c.dim, n = R * D;
  const Vec x = ctx.randn_bf16(n), dy = ctx.randn_bf16(n), dres = ctx.randn_bf16(n);
  const Vec w = ctx.randn(D, 0.2, c.zero_centered ? 0.0 : 1.0);
  Vec y(n), rstd(R), dx(n), dw(D, 0.f);
  timed(&r.cpu_seconds, [&] {
    rmsnorm_forward<float>(x.data(), w.data(), y.data(), rstd.data(), R, D, c.eps, c.zero_centered);
    rmsnorm_backward<float>(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), R, D, c.zero_centered);
  });
  const Vec dw0 = ctx.accum_init(dw);

  auto x_d = ctx.up_bf16(x, c.offset), dy_d = ctx.up_bf16(dy, c.offset);
  auto w_d = ctx.up(w), rstd_in = ctx.up(rstd);
  Buf<bf16> y_d(n, c.offset), dx_d(n, c.offset), alias_d(n, c.offset), res_d(n, c.offset);
  Buf<float> rstd_d(R), dw_d(D), amax_d(1);
  Buf<unsigned char> scratch(cuda::rmsnorm_scratch_bytes(R, D));
  struct Out {
    Bits y, dx, alias, res;
    Vec rstd, dw, amax;
    auto tie() const { return std::tie(y, dx, alias, res, rstd, dw, amax); }
  };
  auto run = [&] {
    ctx.poison(y_d), ctx.poison(rstd_d), ctx.poison(dx_d);
    ctx.upload(dw_d, dw0);
    cuda::rmsnorm_forward(x_d.get(), w_d.get(), y_d.get(), rstd_d.get(), R, D, c.eps, c.zero_centered, ctx.s);
    cuda::rmsnorm_backward(x_d.get(), w_d.get(), rstd_in.get(), dy_d.get(), dx_d.get(), dw_d.get(), R, D,
                           c.zero_centered, scratch.get(), ctx.s);
    Out o{ctx.bits(y_d), ctx.bits(dx_d), {}, {}, ctx.down(rstd_d), ctx.down(dw_d), {}};
    ctx.upload_bf16(alias_d, dy);  // dx written over dy
    ctx.upload(dw_d, dw0);
    cuda::rmsnorm_backward(x_d.get(), w_d.get(), rstd_in.get(), alias_d.get(), alias_d.get(), dw_d.get(), R, D,
                           c.zero_centered, scratch.get(), ctx.s);
    o.alias = ctx.bits(alias_d);
    // the residual stream's gradient added in the same pass, in place (dx over dres), with the fused FP8 amax of dx
    ctx.upload_bf16(res_d, dres);
    ctx.upload(dw_d, dw0);
    DS_CUDA_CHECK(cudaMemsetAsync(amax_d.get(), 0, sizeof(float), ctx.s));
    cuda::rmsnorm_backward(x_d.get(), w_d.get(), rstd_in.get(), dy_d.get(), res_d.get(), dw_d.get(), R, D,
                           c.zero_centered, scratch.get(), ctx.s, res_d.get(), amax_d.get());
    o.res = ctx.bits(res_d);
    o.amax = ctx.down(amax_d);
    return o;
  };
  const Out a = run();
  r.add("y", rel_l2(bf16_view(a.y), y), kForward);
  r.add("rstd", rel_l2(a.rstd, rstd), kForward);
  r.add("dx", rel_l2(bf16_view(a.dx), dx), kGradient);
  r.add("dw (accumulated)", rel_l2(minus(a.dw, dw0), dw), kGradient);
  r.exact("dx aliasing dy equals dx", same_bits(a.dx, a.alias));
  Vec dx_res(dx.size());
  for (size_t i = 0; i < dx.size(); ++i) dx_res[i] = dx[i] + dres[i];
  r.add("dx + dres (in place)", rel_l2(bf16_view(a.res), dx_res), kGradient);
  uint32_t amax_bits = 0;  // max |dx + dres| as ordered bits (NaN above +inf): ops/linear/fp8.h fp8_amax's value
  for (uint16_t b : a.res) amax_bits = std::max<uint32_t>(amax_bits, static_cast<uint32_t>(b & 0x7fffu) << 16);
  uint32_t fused_bits;
  std::memcpy(&fused_bits, a.amax.data(), 4);
  r.exact("fused amax of dx + dres", fused_bits == amax_bits);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

std::vector<RmsnormCase> rmsnorm_probe_cases() {
  return {{.rows = 64, .dim = 256, .zero_centered = true, .twice = false},
          {.rows = 37, .dim = 128, .zero_centered = false, .twice = false}};
}

double probe_cuda_rmsnorm() { return probe("rmsnorm", rmsnorm_probe_cases(), check_rmsnorm); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
