// check_rope (ops/rope/cuda_check.h). CUDA builds only.
#include "ops/rope/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include "ops/check/device.h"
#include "ops/rope/cuda.h"
#include "ops/rope/rope.h"

namespace ds::ops {

using namespace check;

Result check_rope(const RopeCase& c) {
  Ctx ctx(c.seed);
  Rng rng = ctx.rng();
  const std::vector<int> lens = c.lens.empty() ? random_lengths(c.N, 400, rng) : c.lens;
  const I32 cu = cu_from_lengths(lens), pos = positions_in_docs(cu);
  const int64_t N = cu.back(), H = c.H, hd = c.head_dim, rd = c.rotary_dim, n = N * H * hd;
  Result r;
  r.what = "rope [" + shape({N, H, hd}) + "] rotary " + std::to_string(rd) + " documents " + lengths_str(lens) +
           (c.offset ? " offset " + std::to_string(c.offset) : "");
  Vec ct(N * rd / 2), st(ct.size());
  rope_tables<float>(pos.data(), N, rd, c.theta, ct.data(), st.data());
  const Vec x = ctx.randn_bf16(n);
  auto ct_d = ctx.up(ct), st_d = ctx.up(st);
  Buf<bf16> x_d(n, c.offset);
  for (const bool inverse : {false, true}) {
    Vec ref = x;
    timed(&r.cpu_seconds, [&] { rope_apply<float>(ref.data(), N, H, hd, rd, ct.data(), st.data(), inverse); });
    auto run = [&] {
      ctx.upload_bf16(x_d, x);
      cuda::rope_apply(x_d.get(), N, H, hd, rd, ct_d.get(), st_d.get(), inverse, ctx.s);
      return ctx.bits(x_d);
    };
    const Bits a = run();
    const std::string tag = inverse ? "inverse (backward)" : "forward";
    r.add(tag, rel_l2(bf16_view(a), ref), inverse ? kGradient : kForward);
    if (c.twice) r.exact(tag + ": two runs bitwise equal", same_bits(a, run()));
  }
  return r;
}

std::vector<RopeCase> rope_probe_cases() {
  return {{.lens = {1, 70, 0, 130}, .H = 3, .head_dim = 128, .rotary_dim = 32, .theta = 1e7, .twice = false}};
}

double probe_cuda_rope() { return probe("rope", rope_probe_cases(), check_rope); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
