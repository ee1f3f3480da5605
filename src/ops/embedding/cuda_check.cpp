// check_embedding (ops/embedding/cuda_check.h). CUDA builds only.
#include "ops/embedding/cuda_check.h"

#ifdef DELTASTACK_CUDA
#include "ops/check/device.h"
#include "ops/embedding/cuda.h"
#include "ops/embedding/embedding.h"

namespace ds::ops {

using namespace check;

Result check_embedding(const EmbeddingCase& c) {
  Result r;
  const int64_t N = c.N, V = c.V, H = c.H, distinct = c.distinct > 0 ? std::min(c.distinct, V) : V;
  r.what = "embedding N " + std::to_string(N) + " V " + std::to_string(V) + " H " + std::to_string(H) + " distinct " +
           std::to_string(distinct) + (c.offset ? " offset " + std::to_string(c.offset) : "");
  Ctx ctx(c.seed);
  Rng rng = ctx.rng();
  I32 ids(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    ids[i] =
        i % 5 == 0 ? static_cast<int32_t>(7 % V) : static_cast<int32_t>(rng.below(static_cast<uint64_t>(distinct)));
  if (N > 1) ids[N - 1] = static_cast<int32_t>(V - 1);
  const Vec table = ctx.randn_bf16(V * H), dout = ctx.randn_bf16(N * H);
  Vec out(N * H), dtable(V * H, 0.f);
  timed(&r.cpu_seconds, [&] {
    embedding_forward<float>(ids.data(), N, table.data(), V, H, out.data());
    embedding_backward<float>(ids.data(), N, dout.data(), V, H, dtable.data());
  });
  const Vec dtable0 = ctx.accum_init(dtable);
  const IdGroups grp = group_ids(ids);
  const int64_t U = static_cast<int64_t>(grp.uniq.size());

  auto ids_d = ctx.up(ids), uniq_d = ctx.up(grp.uniq), starts_d = ctx.up(grp.starts), pos_d = ctx.up(grp.positions);
  auto table_d = ctx.up_bf16(table, c.offset), dout_d = ctx.up_bf16(dout, c.offset);
  Buf<bf16> out_d(N * H, c.offset);
  Buf<float> dtable_d(V * H, c.offset);
  struct Out {
    Bits out;
    Vec dtable;
    auto tie() const { return std::tie(out, dtable); }
  };
  auto run = [&] {
    ctx.poison(out_d);
    ctx.upload(dtable_d, dtable0);
    cuda::embedding_forward(ids_d.get(), table_d.get(), out_d.get(), N, H, ctx.s);
    cuda::embedding_backward(uniq_d.get(), starts_d.get(), pos_d.get(), U, dout_d.get(), dtable_d.get(), H, ctx.s);
    return Out{ctx.bits(out_d), ctx.down(dtable_d)};
  };
  const Out a = run();
  r.add("out", rel_l2(bf16_view(a.out), out), kForward);
  r.add("dtable (accumulated)", rel_l2(minus(a.dtable, dtable0), dtable), kGradient);
  if (c.twice) r.exact("two runs bitwise equal", same_runs(a, run()));
  return r;
}

// Ids from 16 (many repeats), then from the whole vocabulary.
std::vector<EmbeddingCase> embedding_probe_cases() {
  return {{.N = 96, .V = 512, .H = 256, .distinct = 16, .twice = false},
          {.N = 96, .V = 512, .H = 256, .distinct = 0, .seed = 2, .twice = false}};
}

double probe_cuda_embedding() { return probe("embedding", embedding_probe_cases(), check_embedding); }

}  // namespace ds::ops

#endif  // DELTASTACK_CUDA
