// check_swiglu (ops/swiglu/cuda_check.h). CUDA builds only.
#include "ops/swiglu/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include "ops/check/device.h"
#include "ops/swiglu/cuda.h"
#include "ops/swiglu/swiglu.h"

namespace ds::ops {

using namespace check;

Result check_swiglu(const SwigluCase& c) {
  Result r;
  r.what = "swiglu [" + shape({c.N, c.I}) + "]" + (c.offset ? " offset " + std::to_string(c.offset) : "") +
           (c.split ? " split" : "");
  Ctx ctx(c.seed);
  const int64_t N = c.N, I = c.I, n = N * I;
  const Vec gate = ctx.randn_bf16(n, c.gate_std), up = ctx.randn_bf16(n), dh = ctx.randn_bf16(n);
  Vec gu = widen(gate, I, 2 * I, 0, 0.f);  // [gate | up] per row
  for (int64_t t = 0; t < N; ++t) std::copy_n(up.begin() + t * I, I, gu.begin() + t * 2 * I + I);
  Vec h(n), dgate(n), dup(n);
  timed(&r.cpu_seconds, [&] {
    swiglu_forward<float>(gate.data(), up.data(), h.data(), n);
    swiglu_backward<float>(gate.data(), up.data(), dh.data(), dgate.data(), dup.data(), n);
  });

  auto gu_d = ctx.up_bf16(gu, c.offset), dh_d = ctx.up_bf16(dh, c.offset);
  Buf<bf16> h_d(n, c.offset), dgu_d(2 * n, c.offset);
  // split: the two halves in their own dense buffers (row stride I), as the torch extension passes them.
  auto gate_d = ctx.up_bf16(gate, c.offset), up_d = ctx.up_bf16(up, c.offset);
  Buf<bf16> dgate_d(n, c.offset), dup_d(n, c.offset);
  struct Out {
    Bits h, dgu, dgate, dup;
    auto tie() const { return std::tie(h, dgu, dgate, dup); }
  };
  auto run = [&] {
    ctx.poison(h_d), ctx.poison(dgu_d), ctx.poison(dgate_d), ctx.poison(dup_d);
    if (c.split) {
      cuda::swiglu_forward_rows(gate_d.get(), up_d.get(), I, h_d.get(), N, I, ctx.s);
      cuda::swiglu_backward_rows(gate_d.get(), up_d.get(), I, dh_d.get(), dgate_d.get(), dup_d.get(), I, N, I, ctx.s);
      return Out{ctx.bits(h_d), {}, ctx.bits(dgate_d), ctx.bits(dup_d)};
    }
    cuda::swiglu_forward(gu_d.get(), h_d.get(), N, I, ctx.s);
    cuda::swiglu_backward(gu_d.get(), dh_d.get(), dgu_d.get(), N, I, ctx.s);
    return Out{ctx.bits(h_d), ctx.bits(dgu_d), {}, {}};
  };
  const Out a = run();
  r.add("h", rel_l2(bf16_view(a.h), h), kForward);
  if (c.split) {
    r.add("dgate", rel_l2(bf16_view(a.dgate), dgate), kGradient);
    r.add("dup", rel_l2(bf16_view(a.dup), dup), kGradient);
  } else {
    const Vec dgu = to_f32(a.dgu);
    r.add("dgate", rel_l2(columns(dgu, 2 * I, 0, I), dgate), kGradient);
    r.add("dup", rel_l2(columns(dgu, 2 * I, I, I), dup), kGradient);
  }
  if (!c.split) {  // in place (dgu over gu), as the engine runs it: bitwise the out-of-place gradients
    auto io_d = ctx.up_bf16(gu, c.offset);
    cuda::swiglu_backward(io_d.get(), dh_d.get(), io_d.get(), N, I, ctx.s);
    r.exact("in place bitwise the out-of-place", ctx.bits(io_d) == a.dgu);
  }
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  if (c.division) {
    DivisionSigmoid on;
    r.exact("the division sigmoid's run bitwise equal", same_runs(a, run()));
  }
  return r;
}

std::vector<SwigluCase> swiglu_probe_cases() { return {{.N = 64, .I = 256, .twice = false}}; }

double probe_cuda_swiglu() { return probe("swiglu", swiglu_probe_cases(), check_swiglu); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
