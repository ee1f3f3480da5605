#include "ops/gated_delta_rule/dispatch.h"

#include <cmath>
#include <vector>

#include "core/numerics.h"
#include "core/rng.h"
#include "ops/registry.h"

namespace ds::ops {

namespace {
bool use_chunked() { return !select_backend("gated_delta_rule", "cpu").reference; }

}  // namespace

void gated_delta_rule_forward(const GdnDims& d, const float* q, const float* k, const float* v, const float* g,
                              const float* beta, const int32_t* cu, const float* s0, float* o, float* sT) {
  if (use_chunked()) chunk_gated_delta_rule_forward(d, q, k, v, g, beta, cu, s0, o, sT);
  else recurrent_gated_delta_rule_forward(d, q, k, v, g, beta, cu, s0, o, sT);
}

void gated_delta_rule_backward(const GdnDims& d, const float* q, const float* k, const float* v, const float* g,
                               const float* beta, const int32_t* cu, const float* s0, const float* dout,
                               const float* dsT, float* dq, float* dk, float* dv, float* dg, float* dbeta,
                               float* ds0) {
  if (use_chunked()) chunk_gated_delta_rule_backward(d, q, k, v, g, beta, cu, s0, dout, dsT, dq, dk, dv, dg, dbeta, ds0);
  else recurrent_gated_delta_rule_backward(d, q, k, v, g, beta, cu, s0, dout, dsT, dq, dk, dv, dg, dbeta, ds0);
}

double probe_chunked_gated_delta_rule() {
  // A fixed seed: the same inputs on every start, so the CPU backend choice cannot vary from run to run.
  Rng rng(0x6d6e);
  const std::vector<int32_t> lens = {1, 64, 70, 0, 129};
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  GdnDims d;
  d.N = cu.back();
  d.num_seqs = static_cast<int64_t>(lens.size());
  d.Hk = 2;
  d.Hv = 4;
  d.dk = 16;
  d.dv = 8;
  d.scale = 1.0 / std::sqrt(16.0);
  auto fill = [&](size_t n, double lo, double hi) {
    std::vector<float> x(n);
    for (auto& e : x) e = static_cast<float>(lo + (hi - lo) * rng.uniform());
    return x;
  };
  auto unit_rows = [&](size_t rows, int64_t dim) {
    std::vector<float> x = fill(rows * dim, -1, 1);
    for (size_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t j = 0; j < dim; ++j) s += x[r * dim + j] * x[r * dim + j];
      for (int64_t j = 0; j < dim; ++j) x[r * dim + j] = static_cast<float>(x[r * dim + j] / std::sqrt(s + 1e-6));
    }
    return x;
  };
  const size_t N = static_cast<size_t>(d.N);
  auto q = unit_rows(N * d.Hk, d.dk), k = unit_rows(N * d.Hk, d.dk);
  auto v = fill(N * d.Hv * d.dv, -1, 1), g = fill(N * d.Hv, -2.0, -0.01), beta = fill(N * d.Hv, 0.05, 0.95);
  const size_t S = static_cast<size_t>(d.num_seqs * d.Hv * d.dk * d.dv);
  auto s0 = fill(S, -0.5, 0.5), dsT = fill(S, -0.5, 0.5), dout = fill(N * d.Hv * d.dv, -1, 1);
  struct Out {
    std::vector<float> o, sT, dq, dk, dv, dg, db, ds0;
  };
  auto run = [&](bool chunked) {
    Out r;
    r.o.resize(N * d.Hv * d.dv);
    r.sT.resize(S);
    r.dq.resize(q.size());
    r.dk.resize(k.size());
    r.dv.resize(v.size());
    r.dg.resize(g.size());
    r.db.resize(g.size());
    r.ds0.resize(S);
    if (chunked) {
      chunk_gated_delta_rule_forward(d, q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(), s0.data(),
                                     r.o.data(), r.sT.data());
      chunk_gated_delta_rule_backward(d, q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(), s0.data(),
                                      dout.data(), dsT.data(), r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(),
                                      r.db.data(), r.ds0.data());
    } else {
      recurrent_gated_delta_rule_forward(d, q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(), s0.data(),
                                         r.o.data(), r.sT.data());
      recurrent_gated_delta_rule_backward(d, q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(),
                                          s0.data(), dout.data(), dsT.data(), r.dq.data(), r.dk.data(), r.dv.data(),
                                          r.dg.data(), r.db.data(), r.ds0.data());
    }
    return r;
  };
  Out a = run(true), b = run(false);
  double e = 0;
  for (auto [x, y] : {std::pair{&a.o, &b.o}, {&a.sT, &b.sT}, {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv},
                      {&a.dg, &b.dg}, {&a.db, &b.db}, {&a.ds0, &b.ds0}})
    e = std::max(e, rel_l2(*x, *y));
  return e;
}

}  // namespace ds::ops
