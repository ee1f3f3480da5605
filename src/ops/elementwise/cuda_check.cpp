// check_elementwise, check_copy_rows (ops/elementwise/cuda_check.h). CUDA builds only.
#include "ops/elementwise/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include "ops/attention/attention.h"
#include "ops/check/device.h"
#include "ops/elementwise/cuda.h"

namespace ds::ops {

using namespace check;

Result check_elementwise(const ElementwiseCase& c) {
  Result r;
  r.what = "elementwise n " + std::to_string(c.n) + (c.offset ? " offset " + std::to_string(c.offset) : "");
  Ctx ctx(c.seed);
  const int64_t n = c.n;
  const Vec a = ctx.randn_bf16(n), b = ctx.randn_bf16(n, 2.0), dy = ctx.randn_bf16(n);
  Vec sum(n), y(n), dout(n), dgate(n);
  timed(&r.cpu_seconds, [&] {
    for (int64_t i = 0; i < n; ++i) sum[i] = a[i] + b[i];
    output_gate_forward<float>(a.data(), b.data(), y.data(), n);
    output_gate_backward<float>(a.data(), b.data(), dy.data(), dout.data(), dgate.data(), n);
  });

  auto a_d = ctx.up_bf16(a, c.offset), b_d = ctx.up_bf16(b, c.offset), dy_d = ctx.up_bf16(dy, c.offset);
  Buf<bf16> y_d(n, c.offset), dout_d(n, c.offset), dgate_d(n, c.offset), add_d(n, c.offset), alias_d(n, c.offset);
  Buf<float> f_d(n, c.offset);
  struct Out {
    Bits y, dout, dgate, add, alias;
    Vec f32;
    auto tie() const { return std::tie(y, dout, dgate, add, alias, f32); }
  };
  auto run = [&] {
    ctx.poison(y_d), ctx.poison(dout_d), ctx.poison(dgate_d), ctx.poison(add_d), ctx.poison(f_d);
    cuda::output_gate_forward(a_d.get(), b_d.get(), y_d.get(), n, ctx.s);
    cuda::output_gate_backward(a_d.get(), b_d.get(), dy_d.get(), dout_d.get(), dgate_d.get(), n, ctx.s);
    cuda::add(a_d.get(), b_d.get(), add_d.get(), n, ctx.s);
    cuda::bf16_to_f32(a_d.get(), f_d.get(), n, ctx.s);
    ctx.upload_bf16(alias_d, a);
    cuda::add(alias_d.get(), b_d.get(), alias_d.get(), n, ctx.s);  // the residual add in place
    return Out{ctx.bits(y_d), ctx.bits(dout_d), ctx.bits(dgate_d), ctx.bits(add_d), ctx.bits(alias_d), ctx.down(f_d)};
  };
  const Out x = run();
  r.add("output gate y", rel_l2(bf16_view(x.y), y), kForward);
  r.add("output gate dout", rel_l2(bf16_view(x.dout), dout), kGradient);
  r.add("output gate dgate", rel_l2(bf16_view(x.dgate), dgate), kGradient);
  r.add("add", rel_l2(bf16_view(x.add), sum), kForward);
  r.exact("add is one rounding of the fp32 sum", same_bits(to_f32(x.add), rounded(sum)));
  r.exact("add in place equals add", same_bits(x.alias, x.add));
  r.exact("bf16_to_f32 exact", same_bits(x.f32, a));
  if (c.twice) r.exact("two runs bitwise equal", same_runs(x, run()));
  return r;
}

Result check_copy_rows(const CopyRowsCase& c) {
  Result r;
  r.what = "copy_rows [" + shape({c.rows, c.cols}) + "] from column " + std::to_string(c.src_col) + " of " +
           std::to_string(c.src_stride) + " to column " + std::to_string(c.dst_col) + " of " +
           std::to_string(c.dst_stride) + (c.offset ? " offset " + std::to_string(c.offset) : "");
  Ctx ctx(c.seed);
  const Vec src = ctx.randn_bf16(c.rows * c.src_stride), dst0 = ctx.randn_bf16(c.rows * c.dst_stride);
  Vec ref = dst0;
  for (int64_t i = 0; i < c.rows; ++i)
    std::copy_n(src.begin() + i * c.src_stride + c.src_col, c.cols, ref.begin() + i * c.dst_stride + c.dst_col);
  auto src_d = ctx.up_bf16(src, c.offset);
  Buf<bf16> dst_d(dst0.size(), c.offset);
  auto run = [&] {
    ctx.upload_bf16(dst_d, dst0);
    cuda::copy_rows(src_d.get() + c.src_col, c.src_stride, dst_d.get() + c.dst_col, c.dst_stride, c.rows, c.cols,
                    ctx.s);
    return ctx.bits(dst_d);
  };
  const Bits a = run();
  const Vec got = to_f32(a);
  r.add("copy", rel_l2(columns(got, c.dst_stride, c.dst_col, c.cols), columns(ref, c.dst_stride, c.dst_col, c.cols)),
        kForward);
  r.exact("destination exact (nothing written outside the rows)", same_bits(got, ref));
  if (c.twice) r.exact("two runs bitwise equal", same_bits(a, run()));
  return r;
}

std::vector<ElementwiseCase> elementwise_probe_cases() { return {{.n = 64 * 256, .twice = false}}; }

std::vector<CopyRowsCase> copy_rows_probe_cases() {
  return {
      {.rows = 64, .cols = 128, .src_stride = 256, .src_col = 128, .dst_stride = 384, .dst_col = 64, .twice = false}};
}

double probe_cuda_output_gate() {
  return std::max(probe("output_gate", elementwise_probe_cases(), check_elementwise),
                  probe("output_gate", copy_rows_probe_cases(), check_copy_rows));
}

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
