// check_linear_cross_entropy (ops/linear_cross_entropy/cuda_check.h). CUDA builds only.
#include "ops/linear_cross_entropy/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include <cmath>

#include "ops/check/device.h"
#include "ops/linear_cross_entropy/cuda.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace ds::ops {

using namespace check;

Result check_linear_cross_entropy(const LinearCeCase& c) {
  Result r;
  r.what = "linear_cross_entropy N " + std::to_string(c.N) + " H " + std::to_string(c.H) + " V " + std::to_string(c.V) +
           " chunk " + std::to_string(c.chunk_tokens) + (c.fp8 ? " fp8 lm head" : "");
  Ctx ctx(c.seed);
  const int64_t N = c.N, H = c.H, V = c.V;
  const Vec h = ctx.randn_bf16(N * H), W = ctx.randn_bf16(V * H, 2.0 / std::sqrt(static_cast<double>(H)));
  I32 labels(static_cast<size_t>(N));
  Rng rng = ctx.rng();
  for (auto& y : labels) y = rng.uniform() < 0.1 ? -100 : static_cast<int32_t>(rng.below(static_cast<uint64_t>(V)));
  labels[0] = -100;
  if (N > 1) labels[N - 1] = static_cast<int32_t>(V - 1);
  int64_t valid = 0;
  for (int32_t y : labels) valid += y != -100;
  LinearCeOptions opt;
  opt.z_loss = c.fp8 ? 0.0 : 1e-4;
  opt.grad_scale = 1.0 / static_cast<double>(std::max<int64_t>(valid, 1));
  opt.fp8_grads = c.fp8;
  Vec dh(N * H), dW(V * H, 0.f);
  LinearCeResult ref;
  timed(&r.cpu_seconds, [&] {
    ref = linear_cross_entropy<float>(h.data(), W.data(), labels.data(), N, H, V, opt, dh.data(), dW.data());
  });
  const Vec dW0 = ctx.accum_init(dW);
  opt.chunk_tokens = c.chunk_tokens;
  Vec dh_exact;
  if (c.fp8) {  // the exact dh, which the FP8 path's must differ from
    LinearCeOptions exact = opt;
    exact.fp8_grads = false;
    dh_exact.resize(static_cast<size_t>(N * H));
    linear_cross_entropy<float>(h.data(), W.data(), labels.data(), N, H, V, exact, dh_exact.data(), nullptr);
  }

  auto h_d = ctx.up_bf16(h), W_d = ctx.up_bf16(W);
  auto t_d = ctx.up(labels);
  Buf<bf16> dh_d(N * H);
  Buf<float> dW_d(V * H);
  Buf<double> loss_d(2), loss_fwd_d(2);
  Buf<unsigned char> scratch(cuda::linear_cross_entropy_scratch_bytes(N, H, V, c.chunk_tokens, c.fp8, c.dW));
  struct Out {
    std::vector<double> loss, loss_fwd;
    Bits dh;
    Vec dW_inc;  // dW - dW0
    auto tie() const { return std::tie(loss, loss_fwd, dh, dW_inc); }
  };
  auto run = [&] {
    ctx.poison(dh_d), ctx.poison(loss_d), ctx.poison(loss_fwd_d), ctx.poison(scratch);
    ctx.upload(dW_d, dW0);
    cuda::linear_cross_entropy(h_d.get(), W_d.get(), t_d.get(), N, H, V, opt, loss_d.get(), dh_d.get(),
                               c.dW ? dW_d.get() : nullptr, scratch.get(), ctx.s);
    cuda::linear_cross_entropy(h_d.get(), W_d.get(), t_d.get(), N, H, V, opt, loss_fwd_d.get(), nullptr, nullptr,
                               scratch.get(), ctx.s);
    return Out{ctx.down(loss_d), ctx.down(loss_fwd_d), ctx.bits(dh_d), minus(ctx.down(dW_d), dW0)};
  };
  const Out a = run();
  r.add("loss sum", rel_scalar(a.loss[0], ref.loss_sum), 1e-4);
  r.add("z-loss sum", rel_scalar(a.loss[1], ref.z_loss_sum), 1e-4);
  r.exact("forward-only loss equals the loss", same_bits(a.loss_fwd, a.loss));
  r.add("dh", rel_l2(bf16_view(a.dh), dh), kGradient);
  if (c.dW) r.add("dW (accumulated)", rel_l2(a.dW_inc, dW), kGradient);
  if (c.fp8) {
    const double off = rel_l2(bf16_view(a.dh), dh_exact);
    r.exact("dh is the FP8 path's: rel. L2 " + std::to_string(off) + " >= 2e-3 from the exact dh", off >= 2e-3);
  }
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  if (c.dW) {  // LinearCeOptions::dW_overwrite: into a NaN-poisoned dW, bitwise the gradient added into zeros
    auto dW_of = [&](bool overwrite) {
      LinearCeOptions o = opt;
      o.dW_overwrite = overwrite;
      if (overwrite) ctx.poison(dW_d);
      else ctx.upload(dW_d, Vec(static_cast<size_t>(V * H), 0.f));
      cuda::linear_cross_entropy(h_d.get(), W_d.get(), t_d.get(), N, H, V, o, loss_d.get(), dh_d.get(), dW_d.get(),
                                 scratch.get(), ctx.s);
      return ctx.down(dW_d);
    };
    r.exact("dW overwritten (dW_overwrite) bitwise dW added into zeros", same_bits(dW_of(true), dW_of(false)));
  }
  return r;
}

std::vector<LinearCeCase> linear_cross_entropy_probe_cases() {
  return {{.N = 64, .H = 128, .V = 1000, .chunk_tokens = 24, .twice = false}};
}

double probe_cuda_linear_cross_entropy() {
  return probe("linear_cross_entropy", linear_cross_entropy_probe_cases(), check_linear_cross_entropy);
}

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
