// check_gated_delta_rule (ops/gated_delta_rule/cuda_check.h). CUDA builds only.
#include "ops/gated_delta_rule/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>
#include <cmath>
#include <memory>

#include "ops/check/device.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/gated_delta_rule.h"
#include "ops/gated_delta_rule/plan.h"

namespace ds::ops {

using namespace check;

namespace {
// rows x dim normal values, each row l2-normalised (eps 1e-6, in double), then rounded to bf16: GDN q and k.
Vec unit_rows(Ctx& ctx, int64_t rows, int64_t dim) {
  Vec x = ctx.randn(static_cast<size_t>(rows * dim));
#pragma omp parallel for schedule(static) if (rows * dim > (int64_t(1) << 20))
  for (int64_t i = 0; i < rows; ++i) {
    float* row = x.data() + i * dim;
    double s = 0;
    for (int64_t j = 0; j < dim; ++j) s += static_cast<double>(row[j]) * row[j];
    const double inv = 1.0 / std::sqrt(s + 1e-6);
    for (int64_t j = 0; j < dim; ++j) row[j] = round_bf16(static_cast<float>(row[j] * inv));
  }
  return x;
}
}  // namespace

Result check_gated_delta_rule(const GatedDeltaRuleCase& c) {
  GdnDims d;
  d.Hk = c.Hk, d.Hv = c.Hk * c.ratio, d.dk = c.dk, d.dv = c.dv;
  d.scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  d.chunk_size = c.chunk;
  const I32 cu = cu_from_lengths(c.lens), coff = chunk_offsets(cu, c.chunk);
  d.N = cu.back();
  d.num_seqs = static_cast<int64_t>(c.lens.size());
  const int64_t N = d.N, Hk = d.Hk, Hv = d.Hv, VD = Hv * d.dv, total_chunks = coff.back();
  const int64_t v_stride = c.v_col + VD + c.v_pad, dv_stride = c.dv_col + VD + c.dv_pad;
  Result r;
  r.what = (c.backend.empty() ? std::string() : c.backend + " ") + "gated_delta_rule dk " + std::to_string(c.dk) + " dv " + std::to_string(c.dv) + " Hk " + std::to_string(Hk) +
           " Hv " + std::to_string(Hv) + " chunk " + std::to_string(c.chunk) + " g [" + std::to_string(c.g_lo) + ", " +
           std::to_string(c.g_hi) + ") documents " + lengths_str(c.lens);
  Ctx ctx(c.seed);
  const Vec q = unit_rows(ctx, N * Hk, d.dk), k = unit_rows(ctx, N * Hk, d.dk);
  const Vec v = ctx.randn_bf16(N * VD), dO = ctx.randn_bf16(N * VD);
  const Vec g = ctx.uniform(N * Hv, c.g_lo, c.g_hi), beta = ctx.uniform(N * Hv, 0.01, 0.99);
  Vec o(N * VD), dq(q.size()), dk(k.size()), dv(v.size()), dg(g.size()), dbeta(g.size());
  timed(&r.cpu_seconds, [&] {
    auto fwd =
        c.chunked_forward_ref ? chunk_gated_delta_rule_forward<float> : recurrent_gated_delta_rule_forward<float>;
    auto bwd =
        c.chunked_backward_ref ? chunk_gated_delta_rule_backward<float> : recurrent_gated_delta_rule_backward<float>;
    fwd(d, q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(), nullptr, o.data(), nullptr);
    bwd(d, q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(), nullptr, dO.data(), nullptr, dq.data(),
        dk.data(), dv.data(), dg.data(), dbeta.data(), nullptr);
  });

  auto q_d = ctx.up_bf16(q), k_d = ctx.up_bf16(k), v_d = ctx.up_bf16(widen(v, VD, v_stride, c.v_col, 1e30f));
  auto dO_d = ctx.up_bf16(dO);
  auto g_d = ctx.up(g), beta_d = ctx.up(beta);
  auto cu_d = ctx.up(cu), coff_d = ctx.up(coff);
  Buf<bf16> o_d(N * VD), dq_d(q.size()), dk_d(k.size()), dv_d(N * dv_stride);
  Buf<float> states_d(total_chunks * Hv * d.dk * d.dv), dg_d(g.size()), dbeta_d(g.size());
  Buf<unsigned char> scratch(cuda::gated_delta_rule_scratch_bytes(d, total_chunks));
  struct Out {
    Bits o, dq, dk, dvrows;
    Vec states, dg, dbeta;
    auto tie() const { return std::tie(o, dq, dk, dvrows, states, dg, dbeta); }
  };
  std::unique_ptr<cuda::GatedDeltaRulePlan> plan;
  std::unique_ptr<Buf<unsigned char>> batch_d, saved_d, ws_d;
  if (!c.backend.empty()) {
    plan = cuda::make_gated_delta_rule_plan(
        c.backend, cuda::GdnLimits{std::max<int64_t>(N, 1) + c.plan_extra_tokens,
                                   std::max<int64_t>(d.num_seqs, 1) + c.plan_extra_seqs, Hk, Hv, d.dk, d.dv, d.scale});
    batch_d = std::make_unique<Buf<unsigned char>>(plan->batch_bytes());
    saved_d = std::make_unique<Buf<unsigned char>>(plan->saved_bytes());
    ws_d = std::make_unique<Buf<unsigned char>>(plan->workspace_bytes());
  }
  auto run = [&] {
    ctx.poison(o_d), ctx.poison(dq_d), ctx.poison(dk_d), ctx.poison(dv_d), ctx.poison(states_d);
    ctx.poison(dg_d), ctx.poison(dbeta_d), ctx.poison(scratch);
    if (plan) {
      ctx.poison(*batch_d), ctx.poison(*saved_d), ctx.poison(*ws_d);
      cuda::GdnForwardIO io;
      io.q = q_d.get(), io.k = k_d.get(), io.v = v_d.get() + c.v_col, io.v_stride = v_stride;
      io.g = g_d.get(), io.beta = beta_d.get(), io.o = o_d.get();
      cuda::GdnBackwardIO gr;
      gr.dout = dO_d.get(), gr.dq = dq_d.get(), gr.dk = dk_d.get(), gr.dv = dv_d.get() + c.dv_col;
      gr.dv_stride = dv_stride, gr.dg = dg_d.get(), gr.dbeta = dbeta_d.get();
      plan->prepare(cu_d.get(), N, d.num_seqs, batch_d->get(), ctx.s);
      plan->forward(io, saved_d->get(), ws_d->get(), ctx.s);
      plan->backward(io, gr, saved_d->get(), ws_d->get(), ctx.s);
    } else {
      cuda::gated_delta_rule_forward(d, q_d.get(), k_d.get(), v_d.get() + c.v_col, v_stride, g_d.get(), beta_d.get(),
                                     cu_d.get(), coff_d.get(), total_chunks, o_d.get(), states_d.get(), ctx.s);
      cuda::gated_delta_rule_backward(d, q_d.get(), k_d.get(), v_d.get() + c.v_col, v_stride, g_d.get(),
                                      beta_d.get(), cu_d.get(), coff_d.get(), total_chunks, states_d.get(),
                                      dO_d.get(), dq_d.get(), dk_d.get(), dv_d.get() + c.dv_col, dv_stride,
                                      dg_d.get(), dbeta_d.get(), scratch.get(), ctx.s);
    }
    return Out{ctx.bits(o_d),      ctx.bits(dq_d), ctx.bits(dk_d),   ctx.bits(dv_d),
               ctx.down(states_d), ctx.down(dg_d), ctx.down(dbeta_d)};
  };
  const Out a = run();
  r.add("o", rel_l2(bf16_view(a.o), o), kForward);
  r.add("dq", rel_l2(bf16_view(a.dq), dq), kGradient);
  r.add("dk", rel_l2(bf16_view(a.dk), dk), kGradient);
  r.add("dv (strided)", rel_l2(to_f32(columns(a.dvrows, dv_stride, c.dv_col, VD)), dv), kGradient);
  r.add("dg", rel_l2(a.dg, dg), kGateGradient);
  r.add("dbeta", rel_l2(a.dbeta, dbeta), kGateGradient);
  r.exact("dv written only inside its columns", poisoned_outside(a.dvrows, dv_stride, c.dv_col, VD));
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  if (plan) return r;  // the chunk states below are the simple kernel's private layout
  r.exact("every chunk state written",
          std::all_of(a.states.begin(), a.states.end(), [](float e) { return std::isfinite(e); }));
  const size_t per_chunk = static_cast<size_t>(Hv * d.dk * d.dv);
  bool zero = true;
  for (size_t s = 0; s + 1 < coff.size(); ++s)
    if (coff[s + 1] > coff[s])
      for (size_t i = 0; i < per_chunk; ++i) zero = zero && a.states[static_cast<size_t>(coff[s]) * per_chunk + i] == 0;
  r.exact("first-chunk states are the zero initial state", zero);
  return r;
}

// Each size is its own kernel instantiation.
std::vector<GatedDeltaRuleCase> gated_delta_rule_probe_cases() {
  auto case_of = [](int64_t Hk, int64_t dim) {  // v and dv inside [N, q | k | v] rows: column 2 Hk dk
    GatedDeltaRuleCase c;  // the defaults (ops/gated_delta_rule/cuda_check.h), then:
    c.lens = {1, 70, 0, 130}, c.Hk = Hk, c.ratio = 2, c.dk = c.dv = dim, c.twice = false;
    c.v_col = c.dv_col = 2 * Hk * dim, c.v_pad = c.dv_pad = 0;
    return c;
  };
  return {case_of(2, 32), case_of(1, 128)};
}

double probe_cuda_gated_delta_rule() {
  return probe("gated_delta_rule", gated_delta_rule_probe_cases(), check_gated_delta_rule);
}

std::vector<GatedDeltaRuleCase> gated_delta_rule_chunked_probe_cases() {
  auto case_of = [](std::vector<int> lens, int64_t ratio, double g_lo) {
    GatedDeltaRuleCase c;  // the defaults (ops/gated_delta_rule/cuda_check.h), then:
    c.lens = std::move(lens), c.Hk = 1, c.ratio = ratio, c.dk = c.dv = 128, c.g_lo = g_lo;
    c.v_col = c.dv_col = 2 * 128, c.v_pad = c.dv_pad = 0;  // v, dv inside [N, q | k | v] rows, as in the model
    c.twice = false;
    c.backend = "cuda-chunked";
    return c;
  };
  return {case_of({1, 70, 0, 130}, 2, -2.0), case_of({64, 39, 1, 127}, 1, -60.0)};
}

double probe_cuda_gated_delta_rule_chunked() {
  return probe("gated_delta_rule", gated_delta_rule_chunked_probe_cases(), check_gated_delta_rule);
}

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
