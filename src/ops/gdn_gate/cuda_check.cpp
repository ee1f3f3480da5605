// check_gdn_gate (ops/gdn_gate/cuda_check.h). CUDA builds only.
#include "ops/gdn_gate/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include "ops/check/device.h"
#include "ops/gdn_gate/cuda.h"
#include "ops/gdn_gate/gdn_gate.h"

namespace ds::ops {

using namespace check;

Result check_gdn_gate(const GdnGateCase& c) {
  Result r;
  r.what = "gdn_gate [" + shape({c.N, c.Hv}) + "]";
  Ctx ctx(c.seed);
  const int64_t N = c.N, Hv = c.Hv, n = N * Hv;
  Vec a = ctx.randn_bf16(n, 8.0);
  const Vec b = ctx.randn_bf16(n, 3.0), past = ctx.uniform_bf16(Hv, 20.0, 25.0);
  for (int64_t h = 0; h < Hv && h < n; ++h) a[h] = past[h];  // softplus threshold
  const Vec A_log = ctx.uniform(Hv, 0.0, 2.7), dt_bias = ctx.randn(Hv);
  const Vec dg = ctx.randn(n), dbeta = ctx.randn(n);
  Vec g(n), beta(n), da(n), db(n), dA(Hv, 0.f), ddt(Hv, 0.f);
  timed(&r.cpu_seconds, [&] {
    gdn_gate_forward<float>(a.data(), b.data(), A_log.data(), dt_bias.data(), g.data(), beta.data(), N, Hv);
    gdn_gate_backward<float>(a.data(), b.data(), A_log.data(), dt_bias.data(), dg.data(), dbeta.data(), da.data(),
                             db.data(), dA.data(), ddt.data(), N, Hv);
  });
  const Vec dA0 = ctx.accum_init(dA), ddt0 = ctx.accum_init(ddt);
  Vec ab = widen(b, Hv, 2 * Hv, 0, 0.f);  // per token: b then a
  for (int64_t t = 0; t < N; ++t) std::copy_n(a.begin() + t * Hv, Hv, ab.begin() + t * 2 * Hv + Hv);

  auto ab_d = ctx.up_bf16(ab);
  auto A_d = ctx.up(A_log), dt_d = ctx.up(dt_bias), dg_d = ctx.up(dg), dbeta_d = ctx.up(dbeta);
  Buf<float> g_d(n), beta_d(n), dA_d(Hv), ddt_d(Hv);
  Buf<bf16> dab_d(2 * n);
  Buf<unsigned char> scratch(cuda::gdn_gate_scratch_bytes(N, Hv));
  struct Out {
    Vec g, beta, dA, ddt;
    Bits dab;
    auto tie() const { return std::tie(g, beta, dA, ddt, dab); }
  };
  auto run = [&] {
    ctx.poison(g_d), ctx.poison(beta_d), ctx.poison(dab_d);
    ctx.upload(dA_d, dA0), ctx.upload(ddt_d, ddt0);
    cuda::gdn_gate_forward(ab_d.get(), A_d.get(), dt_d.get(), g_d.get(), beta_d.get(), N, Hv, ctx.s);
    cuda::gdn_gate_backward(ab_d.get(), A_d.get(), dt_d.get(), dg_d.get(), dbeta_d.get(), dab_d.get(), dA_d.get(),
                            ddt_d.get(), N, Hv, scratch.get(), ctx.s);
    return Out{ctx.down(g_d), ctx.down(beta_d), ctx.down(dA_d), ctx.down(ddt_d), ctx.bits(dab_d)};
  };
  const Out x = run();
  const Vec dab = to_f32(x.dab);
  r.add("g", rel_l2(x.g, g), kForward);
  r.add("beta", rel_l2(x.beta, beta), kForward);
  r.add("da", rel_l2(columns(dab, 2 * Hv, Hv, Hv), da), kGradient);
  r.add("db", rel_l2(columns(dab, 2 * Hv, 0, Hv), db), kGradient);
  r.add("dA_log (accumulated)", rel_l2(minus(x.dA, dA0), dA), kGradient);
  r.add("ddt_bias (accumulated)", rel_l2(minus(x.ddt, ddt0), ddt), kGradient);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(x, run()));
  return r;
}

std::vector<GdnGateCase> gdn_gate_probe_cases() { return {{.N = 64, .Hv = 32, .twice = false}}; }

double probe_cuda_gdn_gate() { return probe("gdn_gate", gdn_gate_probe_cases(), check_gdn_gate); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
