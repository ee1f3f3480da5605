// check_attention (ops/attention/cuda_check.h). CUDA builds only.
#include "ops/attention/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/attention/cuda.h"
#include "ops/attention/cudnn.h"
#include "ops/check/device.h"

namespace ds::ops {

using namespace check;

Result check_attention(const AttentionCase& c) {
  const I32 cu = cu_from_lengths(c.lens);
  AttnDims d;
  d.N = cu.back();
  d.num_seqs = static_cast<int64_t>(c.lens.size());
  d.Hq = c.Hq, d.Hkv = c.Hkv, d.head_dim = c.head_dim;
  d.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const int64_t N = d.N, max_len = *std::max_element(c.lens.begin(), c.lens.end());
  const int64_t nq = N * d.Hq * d.head_dim, nk = N * d.Hkv * d.head_dim;
  Result r;
  r.what = std::string(c.cudnn ? "attention (cuDNN)" : "attention") +
           (c.head_groups > 1 ? " in " + std::to_string(c.head_groups) + " head groups" : std::string()) + " hd " + std::to_string(c.head_dim) + " Hq " +
           std::to_string(c.Hq) + " Hkv " + std::to_string(c.Hkv) + " documents " + lengths_str(c.lens);
  Ctx ctx(c.seed);
  const Vec q = ctx.randn_bf16(nq), k = ctx.randn_bf16(nk), v = ctx.randn_bf16(nk), dout = ctx.randn_bf16(nq);
  Vec o(nq), lse(N * d.Hq);
  timed(&r.cpu_seconds,
        [&] { attention_forward<float>(d, q.data(), k.data(), v.data(), cu.data(), o.data(), lse.data()); });

  std::unique_ptr<cudnn::Attention> att;
  const cudnn::AttnBounds bounds{c.max_tokens ? c.max_tokens : N, c.max_seqs ? c.max_seqs : d.num_seqs,
                                 c.max_seqlen ? c.max_seqlen : max_len, d.Hq, d.Hkv, d.head_dim, d.scale, 0,
                                 c.head_groups};
  if (c.cudnn) att = std::make_unique<cudnn::Attention>(bounds);
  auto q_d = ctx.up_bf16(q), k_d = ctx.up_bf16(k), v_d = ctx.up_bf16(v), dout_d = ctx.up_bf16(dout);
  auto cu_d = ctx.up(cu);
  Buf<bf16> o_d(nq), dq_d(nq), dk_d(nk), dv_d(nk);
  Buf<float> lse_d(N * d.Hq);
  Buf<unsigned char> ws(att ? att->workspace_bytes() : cuda::attention_scratch_bytes(d)),
      meta(att ? att->meta_bytes() : 0);
  if (att && !att->set_batch(cu.data(), d.num_seqs, meta.get(), ctx.s))
    throw Error("cuDNN attention refused the batch");
  struct Out {
    Bits o, dq, dk, dv;
    Vec lse;
    auto tie() const { return std::tie(o, dq, dk, dv, lse); }
  };
  // ws_byte: what the workspace holds before each call (0xFF: NaN; 0x3C: finite values, which a read of unwritten
  // workspace would turn into a different result instead of NaN).
  auto run = [&](int ws_byte = 0xFF) {
    ctx.poison(o_d), ctx.poison(lse_d), ctx.poison(dq_d), ctx.poison(dk_d), ctx.poison(dv_d), ctx.poison(ws, ws_byte);
    if (att) {
      att->forward(q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), ws.get(), ctx.s);
      ctx.poison(ws, ws_byte);  // as in the engine, whose other ops use the same scratch between the two calls
      att->backward(q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), dout_d.get(), dq_d.get(), dk_d.get(),
                    dv_d.get(), ws.get(), ctx.s);
    } else {
      cuda::attention_forward(d, q_d.get(), k_d.get(), v_d.get(), cu_d.get(), max_len, o_d.get(), lse_d.get(), ctx.s);
      cuda::attention_backward(d, q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), dout_d.get(), cu_d.get(),
                               max_len, dq_d.get(), dk_d.get(), dv_d.get(), ws.get(), ctx.s);
    }
    return Out{ctx.bits(o_d), ctx.bits(dq_d), ctx.bits(dk_d), ctx.bits(dv_d), ctx.down(lse_d)};
  };
  const Out a = run();
  if (att && c.full_buckets >= 0)
    r.exact(c.full_buckets ? "full buckets: no workspace zeroed" : "a bucket not full: workspace zeroed",
            (att->zeroed_bytes() == 0) == (c.full_buckets == 1));
  if (att && c.full_buckets == 1) {
    // The skip against the zeroing: with finite garbage in the workspace, bitwise what an Attention that zeroes it
    // before every call (AttnBounds::zero_workspace) gives.
    const Out skipped = run(0x3C);
    cudnn::AttnBounds zb = bounds;
    zb.zero_workspace = true;
    std::unique_ptr<cudnn::Attention> zeroing = std::make_unique<cudnn::Attention>(zb);
    std::swap(att, zeroing);
    if (!att->set_batch(cu.data(), d.num_seqs, meta.get(), ctx.s)) throw Error("cuDNN attention refused the batch");
    const Out zeroed = run(0x3C);
    r.exact("zeroing always: workspace zeroed", att->zeroed_bytes() > 0);
    r.exact("full buckets: bitwise the zeroing attention's, finite garbage in the workspace", same_runs(skipped, zeroed));
    r.exact("full buckets: bitwise the NaN-poisoned run's", same_runs(a, zeroed));
    std::swap(att, zeroing);
    if (!att->set_batch(cu.data(), d.num_seqs, meta.get(), ctx.s)) throw Error("cuDNN attention refused the batch");
  }
  const Vec o_gpu = to_f32(a.o);
  Vec dq(nq), dk(nk), dv(nk);
  timed(&r.cpu_seconds, [&] {
    attention_backward<float>(d, q.data(), k.data(), v.data(), o_gpu.data(), lse.data(), dout.data(), cu.data(),
                              dq.data(), dk.data(), dv.data());
  });
  r.add("o", rel_l2(o_gpu, o), kForward);
  r.add("lse", rel_l2(a.lse, lse), kForward);
  r.add("dq", rel_l2(bf16_view(a.dq), dq), kGradient);
  r.add("dk", rel_l2(bf16_view(a.dk), dk), kGradient);
  r.add("dv", rel_l2(bf16_view(a.dv), dv), kGradient);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

// Each head_dim is its own kernel instantiation.
std::vector<AttentionCase> attention_probe_cases() {
  return {{.lens = {1, 70, 0, 130}, .Hq = 4, .Hkv = 2, .head_dim = 64, .twice = false},
          {.lens = {1, 70, 0, 130}, .Hq = 2, .Hkv = 1, .head_dim = 256, .twice = false}};
}

std::vector<AttentionCase> cudnn_attention_probe_cases() {
  std::vector<AttentionCase> cases = {
      {.lens = {1, 70, 0, 130, 5}, .Hq = 4, .Hkv = 2, .head_dim = 128, .cudnn = true, .twice = true},
      {.lens = {1, 70, 0, 130, 5}, .Hq = 4, .Hkv = 1, .head_dim = 256, .cudnn = true, .twice = true}};
  // The backward by head groups only where the engine will run it (DELTASTACK_ATTENTION_SPLIT=1, model/engine.h):
  // a cuDNN that refused its strided rows must not cost the runs that never use them the cuDNN backend.
  if (const char* v = std::getenv("DELTASTACK_ATTENTION_SPLIT"); v && std::string(v) == "1")
    cases.push_back({.lens = {1, 70, 0, 130, 5}, .Hq = 6, .Hkv = 2, .head_dim = 256, .cudnn = true, .head_groups = 2,
                     .twice = true});
  return cases;
}

double probe_cuda_attention() { return probe("attention", attention_probe_cases(), check_attention); }
double probe_cudnn_attention() { return probe("attention", cudnn_attention_probe_cases(), check_attention); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
