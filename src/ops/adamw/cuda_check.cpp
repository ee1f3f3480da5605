// check_adamw (ops/adamw/cuda_check.h). CUDA builds only.
#include "ops/adamw/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include <cmath>

#include "core/bf16.h"
#include "ops/adamw/cuda.h"
#include "ops/adamw/q8_state.h"
#include "ops/check/device.h"

namespace ds::ops {

using namespace check;

Result check_adamw(const AdamwCase& c) {
  Result r;
  r.what = "adamw n " + std::to_string(c.n) + (c.with_bf16 ? "" : " no bf16 copy") +
           (c.offset ? " offset " + std::to_string(c.offset) : "");
  Ctx ctx(c.seed);
  const int64_t n = c.n;
  const Vec p0 = ctx.randn(n, 0.02), grad = ctx.randn(n, 1e-3), m0 = ctx.randn(n, 1e-3), v0 = ctx.uniform(n, 0, 1e-6);
  Vec p = p0, m = m0, v = v0;
  double ss = 0;
  timed(&r.cpu_seconds, [&] {
    adamw_update(p.data(), grad.data(), m.data(), v.data(), n, c.hp);
    ss = sum_squares(grad.data(), n);
  });

  Buf<float> p_d(n, c.offset), m_d(n, c.offset), v_d(n, c.offset);
  auto g_d = ctx.up(grad, c.offset);
  Buf<bf16> pb_d(n, c.offset), gb_d(n, c.offset);
  Buf<double> ss_d(1);
  Buf<unsigned char> scratch(cuda::sum_squares_scratch_bytes(n));
  struct Out {
    Vec p, m, v;
    Bits pb, gb;
    std::vector<double> ss;
    auto tie() const { return std::tie(p, m, v, pb, gb, ss); }
  };
  auto run = [&] {
    ctx.upload(p_d, p0), ctx.upload(m_d, m0), ctx.upload(v_d, v0);
    ctx.poison(pb_d), ctx.poison(gb_d), ctx.poison(ss_d);
    cuda::sum_squares(g_d.get(), n, ss_d.get(), scratch.get(), ctx.s);
    cuda::adamw_update(p_d.get(), g_d.get(), m_d.get(), v_d.get(), c.with_bf16 ? pb_d.get() : nullptr, n, c.hp, ctx.s);
    cuda::to_bf16(g_d.get(), gb_d.get(), n, ctx.s);
    return Out{ctx.down(p_d), ctx.down(m_d), ctx.down(v_d), ctx.bits(pb_d), ctx.bits(gb_d), ctx.down(ss_d)};
  };
  const Out a = run();
  r.add("param", rel_l2(a.p, p), kForward);
  r.add("m", rel_l2(a.m, m), kForward);
  r.add("v", rel_l2(a.v, v), kForward);
  r.add("param update", rel_l2(minus(a.p, p0), minus(p, p0)), kForward);
  r.add("m update", rel_l2(minus(a.m, m0), minus(m, m0)), kForward);
  r.add("v update", rel_l2(minus(a.v, v0), minus(v, v0)), kForward);
  if (c.with_bf16) {
    r.add("param bf16 copy", rel_l2(bf16_view(a.pb), p), kForward);
    r.exact("param bf16 copy is the RNE rounding of the fp32 param", same_bits(to_f32(a.pb), rounded(a.p)));
  }
  r.exact("to_bf16 is round-to-nearest-even", same_bits(to_f32(a.gb), rounded(grad)));
  r.add("sum_squares", rel_scalar(a.ss[0], ss), 1e-10);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

Result check_adamw_bf16(const AdamwCase& c) {
  Result r;
  r.what = "adamw bf16 state n " + std::to_string(c.n) + (c.offset ? " offset " + std::to_string(c.offset) : "");
  Ctx ctx(c.seed);
  const int64_t n = c.n, index0 = 1000 + static_cast<int64_t>(c.seed);
  auto to_bits = [](const Vec& x) {
    Bits b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16_bits(x[i]);
    return b;
  };
  const Bits p0 = to_bits(ctx.randn(n, 0.02)), m0 = to_bits(ctx.randn(n, 1e-3)), v0 = to_bits(ctx.uniform(n, 0, 1e-6));
  const Vec grad = ctx.randn(n, 1e-3);
  Bits p = p0, m = m0, v = v0;
  timed(&r.cpu_seconds, [&] { adamw_update_bf16(p.data(), grad.data(), m.data(), v.data(), n, c.hp, index0); });
  Buf<bf16> p_d(n, c.offset), m_d(n, c.offset), v_d(n, c.offset);
  auto g_d = ctx.up(grad, c.offset);
  auto up_bits = [&](Buf<bf16>& d, const Bits& h) {
    DS_CUDA_CHECK(cudaMemcpyAsync(d.get(), h.data(), d.bytes(), cudaMemcpyHostToDevice, ctx.s));
  };
  struct Out {
    Bits p, m, v;
    auto tie() const { return std::tie(p, m, v); }
  };
  auto run = [&] {
    up_bits(p_d, p0), up_bits(m_d, m0), up_bits(v_d, v0);
    cuda::adamw_update_bf16(p_d.get(), g_d.get(), m_d.get(), v_d.get(), n, c.hp, index0, ctx.s);
    return Out{ctx.bits(p_d), ctx.bits(m_d), ctx.bits(v_d)};
  };
  const Out a = run();
  r.exact("param bitwise the CPU reference's", same_bits(a.p, p));
  r.exact("exp_avg bitwise the CPU reference's", same_bits(a.m, m));
  r.exact("exp_avg_sq bitwise the CPU reference's", same_bits(a.v, v));
  r.add("param update", rel_l2(minus(to_f32(a.p), to_f32(p0)), minus(to_f32(p), to_f32(p0))), kForward);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

Result check_adamw_8bit(const AdamwCase& c) {
  Result r;
  const int64_t n = c.n, index0 = 1000 + static_cast<int64_t>(c.seed);  // a partial first block
  r.what = "adamw 8-bit state n " + std::to_string(n) + " from flat index " + std::to_string(index0) +
           (c.offset ? " offset " + std::to_string(c.offset) : "") + (c.wide ? " wide" : "");
  Ctx ctx(c.seed);
  const int64_t nb = q8_state::num_blocks(index0, n);
  Bits p0(static_cast<size_t>(n));
  const Vec w = ctx.randn(n, 0.02);
  for (int64_t i = 0; i < n; ++i) p0[static_cast<size_t>(i)] = f32_to_bf16_bits(w[static_cast<size_t>(i)]);
  // The starting state: random moments quantized (the scales span decades), then `steps` updates with new gradients.
  Vec m_init = ctx.randn(n, 1e-3), v_init = ctx.uniform(n, 0, 1e-6);
  std::vector<Vec> grads;
  constexpr int kSteps = 3;
  for (int s = 0; s < kSteps; ++s) grads.push_back(ctx.randn(n, s == 1 ? 1e-5 : 1e-3));
  if (c.wide) {
    Rng rng = ctx.rng();
    std::vector<double> block_scale(static_cast<size_t>(nb));
    for (double& x : block_scale) x = std::pow(10.0, -30.0 + 40.0 * rng.uniform());
    for (int64_t i = 0; i < n; ++i) {
      const size_t e = static_cast<size_t>(i);
      const int64_t blk = (index0 + i) / q8_state::kBlock - index0 / q8_state::kBlock;
      const double sc = block_scale[static_cast<size_t>(blk)];
      m_init[e] = blk % 7 == 3 ? 0.0f : static_cast<float>(m_init[e] * sc);
      v_init[e] = blk % 7 == 3 ? 0.0f : static_cast<float>(v_init[e] * sc * sc);
      for (Vec& g : grads)
        g[e] = blk % 5 == 1 || rng.below(50) == 0 ? 0.0f
                                                   : static_cast<float>(g[e] * std::pow(10.0, -25.0 + 35.0 * rng.uniform()));
    }
  }
  using U8 = std::vector<uint8_t>;
  U8 mq0(static_cast<size_t>(n)), vq0(mq0.size());
  Vec ma0(static_cast<size_t>(nb)), va0(ma0.size());
  quantize_moment_8bit(0, m_init.data(), n, index0, mq0.data(), ma0.data());
  quantize_moment_8bit(1, v_init.data(), n, index0, vq0.data(), va0.data());
  Bits p = p0;
  U8 mq = mq0, vq = vq0;
  Vec ma = ma0, va = va0;
  AdamWParams hp = c.hp;
  timed(&r.cpu_seconds, [&] {
    for (int s = 0; s < kSteps; ++s) {
      hp.step = c.hp.step + s;
      adamw_update_8bit(p.data(), grads[static_cast<size_t>(s)].data(), mq.data(), vq.data(), ma.data(), va.data(), n,
                        hp, index0);
    }
  });
  Buf<bf16> p_d(n, c.offset);
  Buf<uint8_t> mq_d(n, c.offset), vq_d(n, c.offset);
  Buf<float> ma_d(nb), va_d(nb);
  std::vector<Buf<float>> g_d;
  for (const Vec& g : grads) g_d.push_back(ctx.up(g, c.offset));
  struct Out {
    Bits p;
    U8 mq, vq;
    Vec ma, va;
    auto tie() const { return std::tie(p, mq, vq, ma, va); }
  };
  auto reset = [&] {  // the weights and the state as they start
    DS_CUDA_CHECK(cudaMemcpyAsync(p_d.get(), p0.data(), p_d.bytes(), cudaMemcpyHostToDevice, ctx.s));
    ctx.upload(mq_d, mq0), ctx.upload(vq_d, vq0), ctx.upload(ma_d, ma0), ctx.upload(va_d, va0);
  };
  auto run = [&] {
    reset();
    for (int s = 0; s < kSteps; ++s) {
      hp.step = c.hp.step + s;
      cuda::adamw_update_8bit(p_d.get(), g_d[static_cast<size_t>(s)].get(), mq_d.get(), vq_d.get(), ma_d.get(),
                              va_d.get(), n, hp, index0, ctx.s);
    }
    return Out{ctx.bits(p_d), ctx.down(mq_d), ctx.down(vq_d), ctx.down(ma_d), ctx.down(va_d)};
  };
  const Out a = run();
  r.exact("param bitwise the CPU reference's", same_bits(a.p, p));
  r.exact("exp_avg codes bitwise the CPU reference's", same_bits(a.mq, mq));
  r.exact("exp_avg_sq codes bitwise the CPU reference's", same_bits(a.vq, vq));
  r.exact("exp_avg block scales bitwise the CPU reference's", same_bits(a.ma, ma));
  r.exact("exp_avg_sq block scales bitwise the CPU reference's", same_bits(a.va, va));
  r.add("param update", rel_l2(minus(to_f32(a.p), to_f32(p0)), minus(to_f32(p), to_f32(p0))), kForward);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  // The gradients' sum-of-squares partials (--gradients in-backward): the update's own (fused) are bitwise the
  // standalone kernel's, for fp32 and widened-bf16 gradients of the same values; the update with them is bitwise
  // the update without; their sum tracks the float64 sum of squares.
  const int64_t np = cuda::sum_squares_partials_count(index0, n);
  Buf<double> fused(np), alone(np), total(1);
  DS_CUDA_CHECK(cudaMemsetAsync(fused.get(), 0xFF, fused.bytes(), ctx.s));  // NaN: a partial the update skips shows
  bool same_partials = true;
  double worst = 0;
  reset();
  for (int s = 0; s < kSteps; ++s) {
    hp.step = c.hp.step + s;
    cuda::adamw_update_8bit(p_d.get(), g_d[static_cast<size_t>(s)].get(), mq_d.get(), vq_d.get(), ma_d.get(),
                            va_d.get(), n, hp, index0, ctx.s, fused.get());
    cuda::sum_squares_partials(g_d[static_cast<size_t>(s)].get(), n, index0, alone.get(), ctx.s);
    same_partials = same_partials && same_bits(ctx.down(fused), ctx.down(alone));
    cuda::sum_partials(alone.get(), np, total.get(), ctx.s);
    double want = 0;
    for (float g : grads[static_cast<size_t>(s)]) want += static_cast<double>(g) * g;
    worst = std::max(worst, std::fabs(ctx.down(total)[0] - want) / want);
  }
  r.exact("sum-of-squares partials of the update bitwise the standalone kernel's", same_partials);
  r.exact("the update with partials bitwise the update without",
          same_runs(a, Out{ctx.bits(p_d), ctx.down(mq_d), ctx.down(vq_d), ctx.down(ma_d), ctx.down(va_d)}));
  r.add("sum of squares from the partials vs float64", worst, 1e-12);
  {  // bf16 gradients: the same values widened give the same partials
    Vec gb = grads[0];
    for (float& x : gb) x = bf16_bits_to_f32(f32_to_bf16_bits(x));
    Buf<float> gf = ctx.up(gb, c.offset);
    Buf<bf16> gh(n, c.offset);
    ctx.upload_bf16(gh, gb);
    cuda::sum_squares_partials(gf.get(), n, index0, fused.get(), ctx.s);
    cuda::sum_squares_partials(gh.get(), n, index0, alone.get(), ctx.s);
    r.exact("partials of bf16 gradients bitwise those of their fp32 values", same_bits(ctx.down(fused), ctx.down(alone)));
  }
  {  // The update in two calls by a chunk mask (every third chunk, the last one too, in the first call), with the
     // fused partials: bitwise the one call's results and partials. And null gradients: bitwise a zero buffer.
    std::vector<uint8_t> mask(static_cast<size_t>(np));
    for (int64_t j = 0; j < np; ++j) mask[static_cast<size_t>(j)] = (j % 3 == 1 || j == np - 1) ? 0 : 1;
    Buf<uint8_t> mask_d = ctx.up(mask);
    Buf<float> zeros = ctx.up(Vec(static_cast<size_t>(n), 0.f), c.offset);
    auto steps = [&](bool split, bool null_grads) {
      reset();
      DS_CUDA_CHECK(cudaMemsetAsync(fused.get(), 0xFF, fused.bytes(), ctx.s));
      for (int s = 0; s < kSteps; ++s) {
        hp.step = c.hp.step + s;
        // the last step's gradients zero (null or a zero buffer), so the partials compared below are that step's
        const float* g = s == kSteps - 1 ? (null_grads ? nullptr : zeros.get()) : g_d[static_cast<size_t>(s)].get();
        for (uint8_t want : {uint8_t{0}, uint8_t{1}}) {
          if (!split && want == 1) break;
          cuda::adamw_update_8bit(p_d.get(), g, mq_d.get(), vq_d.get(), ma_d.get(), va_d.get(), n, hp, index0, ctx.s,
                                  fused.get(), split ? mask_d.get() : nullptr, want);
        }
      }
      return std::pair{Out{ctx.bits(p_d), ctx.down(mq_d), ctx.down(vq_d), ctx.down(ma_d), ctx.down(va_d)},
                       ctx.down(fused)};
    };
    const auto one = steps(false, false), two = steps(true, false), null = steps(false, true);
    r.exact("the update in two calls by a chunk mask bitwise the one call (and its partials)",
            same_runs(one.first, two.first) && same_bits(one.second, two.second));
    r.exact("null gradients bitwise a zero buffer (and the partials)",
            same_runs(one.first, null.first) && same_bits(one.second, null.second));
  }
  return r;
}

std::vector<AdamwCase> adamw_probe_cases() { return {{.n = 5003, .twice = false}}; }

double probe_cuda_adamw() { return probe("adamw", adamw_probe_cases(), check_adamw); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
