// Semantics of packing and of the whole model's gradients ("make the CPU engine exact"):
//   * thousands of tiny documents in one packed batch (docs/model.md §7.4 #8, #24: tiny-document cases) through
//     the gated delta rule op (float64) and through the whole model (fp32 logits and every parameter gradient);
//   * chunk-boundary document lengths {1, 2, 3, 63, 64, 65, 127} plus empty documents (repeated cu_seqlens entries)
//     through the whole model;
//   * GVA ratios 1, 2, 3 in the whole model, chunked vs token-recurrent GDN backend (`deltastack forward` run twice
//     with DELTASTACK_GATED_DELTA_RULE, since the registry caches its choice per process);
//   * model-level finite differences of the fp32 loss for single scalar parameters of every kind.
// Each test prints its measured errors as "[ measured ]" lines.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "ops/gated_delta_rule/gated_delta_rule.h"
#include "test_util.h"

extern "C" void openblas_set_num_threads(int);  // OpenBLAS's own API (cblas.h)

namespace fs = std::filesystem;
using json = nlohmann::json;
using ds::test::rel_l2;

namespace {

void report(const std::string& what, double v) { std::printf("[ measured ] %-66s %.3e\n", what.c_str(), v); }

// A small Qwen3.5 text model: GDN, gated attention, GDN (so GDN runs both before and after attention), untied
// lm_head, GVA ratio linear_num_value_heads / linear_num_key_heads = ratio.
// Conditioning: with HF's rms_norm_eps = 1e-6 the gated RMSNorm of a GDN head whose output is near zero (the first
// token of a document with q.k ~ 0, heads with tiny beta) is a near-step function of the weights: the fp32 loss has
// kinks ~1e-3 wide in weight space (a conv1d tap measured 54.0 analytic vs 11.0 by central difference at h = 4e-3,
// converging to 53.98 at h = 3e-5), and gradient sums through it lose digits (packing the same documents in
// reverse order moved a layer-0 gradient by 1.1e-5 relative). eps = 1e-2 and initializer_range 0.3 keep the
// model smooth at the scale of the checks; packing, GVA and backends are exercised identically.
ds::ModelConfig small_config(int ratio, bool tie = false, double init_range = 0.3, double eps = 1e-2) {
  json j = {{"model_type", "qwen3_5_text"},
            {"vocab_size", 64},
            {"hidden_size", 16},
            {"intermediate_size", 32},
            {"num_hidden_layers", 3},
            {"layer_types", {"linear_attention", "full_attention", "linear_attention"}},
            {"num_attention_heads", 2},
            {"num_key_value_heads", 1},
            {"head_dim", 8},
            {"linear_num_key_heads", 2},
            {"linear_num_value_heads", 2 * ratio},
            {"linear_key_head_dim", 8},
            {"linear_value_head_dim", 8},
            {"max_position_embeddings", 512},
            {"rope_parameters", {{"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}},
            {"initializer_range", init_range},
            {"tie_word_embeddings", tie},
            {"rms_norm_eps", eps}};
  return ds::ModelConfig::from_json(j, "test_semantics/config.json");
}

// HF init, then every vector parameter moved off its init constant (zero-centered norms start at 0, dt_bias and
// the gated norm at 1): their gradients then exercise every term, and no test passes because a weight is 0 or 1.
void init_model(ds::Qwen35Model& m, uint64_t seed) {
  m.init_weights(seed);
  ds::Rng r(seed, 777);
  for (const ds::ParamSpec& p : m.params()) {
    bool vec = p.shape.size() == 1 && p.name.find("A_log") == std::string::npos;
    if (!vec) continue;
    float* w = m.weights().data() + p.offset;
    for (int64_t i = 0; i < p.numel; ++i) w[i] += static_cast<float>(0.3 * r.normal());
  }
  // A_log: the HF init log(U(0.01, 16)) can decay a head by e^-20 per token; keep a spread but stay moderate so the
  // gate gradients are not all vanishing.
  for (const ds::ParamSpec& p : m.params())
    if (p.name.find("A_log") != std::string::npos)
      for (int64_t i = 0; i < p.numel; ++i) m.weights()[p.offset + i] = static_cast<float>(-1.0 + 1.5 * r.uniform());
}

using Docs = std::vector<std::vector<int32_t>>;

Docs random_docs(const std::vector<int>& lens, int64_t vocab, uint64_t seed) {
  ds::Rng r(seed, 99);
  Docs d;
  for (int L : lens) {
    std::vector<int32_t> ids(static_cast<size_t>(L));
    for (auto& x : ids) x = static_cast<int32_t>(r.below(static_cast<uint64_t>(vocab)));
    d.push_back(ids);
  }
  return d;
}

// Documents [b, e) packed into one batch; each token's target is the next token of its own document.
ds::PackedBatch pack(const Docs& docs, size_t b, size_t e) {
  ds::PackedBatch pb;
  pb.cu_seqlens.push_back(0);
  for (size_t i = b; i < e; ++i) {
    const auto& d = docs[i];
    for (size_t t = 0; t < d.size(); ++t) {
      pb.input_ids.push_back(d[t]);
      pb.targets.push_back(t + 1 < d.size() ? d[t + 1] : -100);
    }
    pb.cu_seqlens.push_back(static_cast<int32_t>(pb.input_ids.size()));
  }
  pb.finalize("test batch");
  return pb;
}
ds::PackedBatch pack(const Docs& docs) { return pack(docs, 0, docs.size()); }

// The per-token gate gradients of A_log and dt_bias are summed over all tokens with heavy cancellation, so any change
// of fp32 summation order moves them more than other tensors: packing the same documents in reverse order changes
// them by up to 1.5e-5 relative (measured), every other tensor by <= 3e-6. They get a 3e-5 band, the rest `tol`.
bool gate_vector(const std::string& name) {
  return name.find("A_log") != std::string::npos || name.find("dt_bias") != std::string::npos;
}

// Per-tensor relative L2 errors (grads as flat buffers): each within `tol` (3e-5 for the gate vectors) and the
// whole gradient within `tol`. Returns a printable summary: worst non-gate tensor, worst gate vector, whole.
std::string param_errors(const ds::Qwen35Model& m, const std::vector<float>& got, const std::vector<float>& want,
                         double tol) {
  const double whole = rel_l2(got, want);
  EXPECT_LE(whole, tol) << "whole gradient";
  double worst[2] = {0, 0};
  std::string name[2];
  for (const ds::ParamSpec& p : m.params()) {
    std::vector<float> a(got.begin() + p.offset, got.begin() + p.offset + p.numel),
        b(want.begin() + p.offset, want.begin() + p.offset + p.numel);
    const double e = rel_l2(a, b);
    const int gate = gate_vector(p.name) ? 1 : 0;
    EXPECT_LE(e, gate ? std::max(tol, 3e-5) : tol) << p.name;
    double nb = 0;
    for (float x : b) nb += static_cast<double>(x) * x;
    EXPECT_GT(nb, 0.0) << p.name << ": gradient is identically zero, the comparison would be vacuous";
    if (e >= worst[gate]) worst[gate] = e, name[gate] = p.name;
  }
  return fmt::format("whole {:.2e}; worst {:.2e} ({}); gate {:.2e} ({})", whole, worst[0], name[0], worst[1], name[1]);
}

// The model tests run single-threaded (OpenMP and OpenBLAS): their batches are tiny, OpenMP barriers spinning on a
// loaded 2-core machine turned 1 s into 30 s, and OpenBLAS sgemm results depend on its thread count
// (docs/determinism.md), which would make the in-process vs `deltastack --threads 1` comparison inexact.
struct OneThread {
  int keep = ds::num_threads();
  OneThread() { ds::set_num_threads(1); }
  ~OneThread() { ds::set_num_threads(keep); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- gated delta rule op, float64 ----

struct GdnCase {
  ds::ops::GdnDims d;
  std::vector<int32_t> cu;
  std::vector<double> q, k, v, g, beta, h0, dO, dht;
};

void l2_rows(std::vector<double>& x, int64_t dim) {
  for (size_t r = 0; r < x.size() / static_cast<size_t>(dim); ++r) {
    double s = 0;
    for (int64_t i = 0; i < dim; ++i) s += x[r * dim + i] * x[r * dim + i];
    for (int64_t i = 0; i < dim; ++i) x[r * dim + i] /= std::sqrt(s + 1e-6);
  }
}

struct GdnOut {
  std::vector<double> o, ht, dq, dk, dv, dg, dbeta, dh0;
};

GdnOut gdn_run(const GdnCase& c, bool chunked) {
  GdnOut r;
  r.o.assign(c.v.size(), -7);
  r.ht.assign(c.h0.size(), -7);
  r.dq.assign(c.q.size(), -7);
  r.dk.assign(c.k.size(), -7);
  r.dv.assign(c.v.size(), -7);
  r.dg.assign(c.g.size(), -7);
  r.dbeta.assign(c.beta.size(), -7);
  r.dh0.assign(c.h0.size(), -7);
  auto fwd = chunked ? ds::ops::chunk_gated_delta_rule_forward<double> : ds::ops::recurrent_gated_delta_rule_forward<double>;
  auto bwd = chunked ? ds::ops::chunk_gated_delta_rule_backward<double> : ds::ops::recurrent_gated_delta_rule_backward<double>;
  fwd(c.d, c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.cu.data(), c.h0.data(), r.o.data(),
      r.ht.data());
  bwd(c.d, c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.cu.data(), c.h0.data(), c.dO.data(),
      c.dht.data(), r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), r.dh0.data());
  return r;
}

}  // namespace

// 1a (op). 4100 documents of lengths 1, 2, 3, 0, 1, 2, 3, 0, ... (1025 empty ones) in one packed call, with an
// initial state and a final-state gradient per document: output, final state and all six gradients equal the
// per-document runs, both chunked and token-recurrent, in float64.
TEST(Semantics, GdnOpThousandsOfTinyDocumentsEqualSeparateRuns) {
  const int64_t num_docs = 4100, Hk = 2, ratio = 2, dk = 8, dv = 6;
  GdnCase c;
  c.cu.push_back(0);
  const int cycle[4] = {1, 2, 3, 0};
  for (int64_t s = 0; s < num_docs; ++s) c.cu.push_back(c.cu.back() + cycle[s % 4]);
  c.d.N = c.cu.back();
  c.d.num_seqs = num_docs;
  c.d.Hk = Hk;
  c.d.Hv = Hk * ratio;
  c.d.dk = dk;
  c.d.dv = dv;
  c.d.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  c.d.chunk_size = 64;
  const size_t N = static_cast<size_t>(c.d.N), Hv = static_cast<size_t>(c.d.Hv);
  const size_t SS = Hv * dk * dv;  // state size per document
  c.q = ds::test::randn<double>(N * Hk * dk, 11);
  c.k = ds::test::randn<double>(N * Hk * dk, 12);
  l2_rows(c.q, dk);
  l2_rows(c.k, dk);
  c.v = ds::test::randn<double>(N * Hv * dv, 13);
  c.g = ds::test::randu<double>(N * Hv, 14, -0.5, 0.0);
  c.beta = ds::test::randu<double>(N * Hv, 15, 0.05, 0.95);
  c.h0 = ds::test::randn<double>(num_docs * SS, 16, 0.5);
  c.dO = ds::test::randn<double>(N * Hv * dv, 17);
  c.dht = ds::test::randn<double>(num_docs * SS, 18);
  ASSERT_EQ(c.d.N, 6150);

  auto t0 = std::chrono::steady_clock::now();
  const GdnOut packed = gdn_run(c, true);
  const GdnOut packed_rec = gdn_run(c, false);
  // Per-document runs, reassembled into packed layout.
  GdnOut sep_c = packed, sep_r = packed;
  for (auto* o : {&sep_c, &sep_r})
    for (auto* x : {&o->o, &o->ht, &o->dq, &o->dk, &o->dv, &o->dg, &o->dbeta, &o->dh0}) std::fill(x->begin(), x->end(), NAN);
  const size_t qk = Hk * dk, vv = Hv * dv;
  for (int64_t s = 0; s < num_docs; ++s) {
    const size_t t0s = static_cast<size_t>(c.cu[s]), L = static_cast<size_t>(c.cu[s + 1] - c.cu[s]);
    GdnCase one;
    one.d = c.d;
    one.d.N = static_cast<int64_t>(L);
    one.d.num_seqs = 1;
    one.cu = {0, static_cast<int32_t>(L)};
    auto sl = [](const std::vector<double>& x, size_t from, size_t n) {
      return std::vector<double>(x.begin() + from, x.begin() + from + n);
    };
    one.q = sl(c.q, t0s * qk, L * qk);
    one.k = sl(c.k, t0s * qk, L * qk);
    one.v = sl(c.v, t0s * vv, L * vv);
    one.dO = sl(c.dO, t0s * vv, L * vv);
    one.g = sl(c.g, t0s * Hv, L * Hv);
    one.beta = sl(c.beta, t0s * Hv, L * Hv);
    one.h0 = sl(c.h0, s * SS, SS);
    one.dht = sl(c.dht, s * SS, SS);
    for (bool chunked : {true, false}) {
      const GdnOut r = gdn_run(one, chunked);
      GdnOut& dst = chunked ? sep_c : sep_r;
      std::copy(r.o.begin(), r.o.end(), dst.o.begin() + t0s * vv);
      std::copy(r.dv.begin(), r.dv.end(), dst.dv.begin() + t0s * vv);
      std::copy(r.dq.begin(), r.dq.end(), dst.dq.begin() + t0s * qk);
      std::copy(r.dk.begin(), r.dk.end(), dst.dk.begin() + t0s * qk);
      std::copy(r.dg.begin(), r.dg.end(), dst.dg.begin() + t0s * Hv);
      std::copy(r.dbeta.begin(), r.dbeta.end(), dst.dbeta.begin() + t0s * Hv);
      std::copy(r.ht.begin(), r.ht.end(), dst.ht.begin() + s * SS);
      std::copy(r.dh0.begin(), r.dh0.end(), dst.dh0.begin() + s * SS);
    }
  }
  auto max_abs = [](const std::vector<double>& a, const std::vector<double>& b) -> double {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      double e = std::fabs(a[i] - b[i]);
      if (!(e <= 1e300)) return INFINITY;  // NaN: an entry never written
      m = std::max(m, e);
    }
    return m;
  };
  const char* names[8] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  double worst_c = 0, worst_r = 0, worst_pr = 0;
  for (int i = 0; i < 8; ++i) {
    auto get = [i](const GdnOut& o) -> const std::vector<double>& {
      const std::vector<double>* f[8] = {&o.o, &o.ht, &o.dq, &o.dk, &o.dv, &o.dg, &o.dbeta, &o.dh0};
      return *f[i];
    };
    double ec = max_abs(get(packed), get(sep_c)), er = max_abs(get(packed), get(sep_r)),
           epr = max_abs(get(packed_rec), get(sep_r));
    EXPECT_LE(ec, 1e-12) << names[i] << " packed chunked vs separate chunked";
    EXPECT_LE(er, 1e-12) << names[i] << " packed chunked vs separate recurrent";
    EXPECT_LE(epr, 1e-12) << names[i] << " packed recurrent vs separate recurrent";
    worst_c = std::max(worst_c, ec);
    worst_r = std::max(worst_r, er);
    worst_pr = std::max(worst_pr, epr);
  }
  // Empty documents pass the state (and its gradient) through unchanged.
  for (int64_t s = 3; s < num_docs; s += 4)
    for (size_t x = 0; x < SS; ++x) {
      ASSERT_EQ(packed.ht[s * SS + x], c.h0[s * SS + x]) << "doc " << s;
      ASSERT_EQ(packed.dh0[s * SS + x], c.dht[s * SS + x]) << "doc " << s;
    }
  report("GDN op 4100 docs: packed chunked vs separate chunked, max abs", worst_c);
  report("GDN op 4100 docs: packed chunked vs separate recurrent, max abs", worst_r);
  report("GDN op 4100 docs: packed recurrent vs separate recurrent, max abs", worst_pr);
  report("GDN op 4100 docs: seconds", seconds_since(t0));
}

// 1a (model). ~4100 documents of lengths 1, 2, 3 (8200 tokens) in one packed batch through the whole model:
// per-document logits equal each document run alone, and the packed gradient equals the sum of the per-document
// gradients, for every parameter tensor.
TEST(Semantics, ModelThousandsOfTinyDocumentsEqualSeparateRuns) {
  OneThread one_thread;
  ds::Qwen35Model m(small_config(2));
  init_model(m, 21);
  std::vector<int> lens;
  for (int i = 0; i < 4101; ++i) lens.push_back(1 + i % 3);
  Docs docs = random_docs(lens, 64, 22);
  auto t0 = std::chrono::steady_clock::now();
  ds::PackedBatch all = pack(docs);
  ASSERT_EQ(all.size(), 8202);
  ds::ForwardCapture cp;
  cp.logits = true;
  m.zero_grads();
  ds::LossResult rp = m.forward_backward(all, 1.0, 0.0, &cp);
  std::vector<float> gp = m.grads();

  // Each document alone; gradients accumulate (forward_backward adds into grads()).
  m.zero_grads();
  std::vector<float> logits_sep;
  logits_sep.reserve(cp.logits_values.size());
  double loss_sep = 0;
  int64_t valid_sep = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    ds::ForwardCapture c1;
    c1.logits = true;
    ds::LossResult r = m.forward_backward(pack(docs, i, i + 1), 1.0, 0.0, &c1);
    loss_sep += r.loss_sum;
    valid_sep += r.num_valid;
    logits_sep.insert(logits_sep.end(), c1.logits_values.begin(), c1.logits_values.end());
  }
  const double el = rel_l2(cp.logits_values, logits_sep);
  double max_abs = 0, max_logit = 0;
  for (size_t i = 0; i < logits_sep.size(); ++i) {
    max_abs = std::max(max_abs, static_cast<double>(std::fabs(cp.logits_values[i] - logits_sep[i])));
    max_logit = std::max(max_logit, static_cast<double>(std::fabs(logits_sep[i])));
  }
  EXPECT_LE(el, 1e-6);
  EXPECT_LE(max_abs, 1e-5 * max_logit);  // every single logit, relative to the logits' scale
  EXPECT_EQ(rp.num_valid, valid_sep);
  EXPECT_EQ(rp.num_valid, 4101);  // lengths 2 and 3 give 1 and 2 targets
  EXPECT_NEAR(rp.loss_sum, loss_sep, 1e-6 * loss_sep);
  const std::string gerr = param_errors(m, gp, m.grads(), 1e-5);
  report("model 4101 docs: logits rel L2 packed vs separate", el);
  report("model 4101 docs: logits max abs packed vs separate / max |logit|", max_abs / max_logit);
  report("model 4101 docs: loss_sum rel diff", std::fabs(rp.loss_sum - loss_sep) / loss_sep);
  std::printf("[ measured ] model 4101 docs: grad rel L2 packed vs sum of separate: %s\n", gerr.c_str());
  report("model 4101 docs: seconds", seconds_since(t0));
}

// 1b. Chunk-boundary lengths and empty documents (repeated cu_seqlens entries, first, middle and last) through the
// whole model: logits and all parameter gradients equal each document alone. An empty batch is a no-op.
TEST(Semantics, ModelChunkBoundaryLengthsAndEmptyDocuments) {
  OneThread one_thread;
  for (bool tie : {false, true}) {
    SCOPED_TRACE(tie ? "tied embeddings" : "untied");
    ds::Qwen35Model m(small_config(2, tie));
    init_model(m, 31);
    Docs docs = random_docs({0, 1, 2, 3, 0, 63, 64, 65, 127, 0}, 64, 32);
    ds::PackedBatch all = pack(docs);
    EXPECT_EQ(all.cu_seqlens, (std::vector<int32_t>{0, 0, 1, 3, 6, 6, 69, 133, 198, 325, 325}));
    ds::ForwardCapture cp;
    cp.logits = true;
    m.zero_grads();
    ds::LossResult rp = m.forward_backward(all, 1.0, 0.0, &cp);
    std::vector<float> gp = m.grads();
    m.zero_grads();
    std::vector<float> logits_sep;
    double loss_sep = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
      ds::ForwardCapture c1;
      c1.logits = true;
      std::vector<float> before = m.grads();
      ds::LossResult r = m.forward_backward(pack(docs, i, i + 1), 1.0, 0.0, &c1);
      if (docs[i].empty()) {  // an empty batch: no loss, no logits, no gradient
        EXPECT_EQ(r.num_valid, 0);
        EXPECT_EQ(r.loss_sum, 0.0);
        EXPECT_TRUE(c1.logits_values.empty());
        EXPECT_EQ(m.grads(), before);
      }
      loss_sep += r.loss_sum;
      logits_sep.insert(logits_sep.end(), c1.logits_values.begin(), c1.logits_values.end());
    }
    const double el = rel_l2(cp.logits_values, logits_sep);
    EXPECT_LE(el, 1e-6);
    EXPECT_NEAR(rp.loss_sum, loss_sep, 1e-6 * loss_sep);
    EXPECT_EQ(rp.num_valid, 0 + 1 + 2 + 62 + 63 + 64 + 126);
    const std::string gerr = param_errors(m, gp, m.grads(), 1e-5);
    report(std::string(tie ? "tied" : "untied") + " lengths {0,1,2,3,0,63,64,65,127,0}: logits rel L2", el);
    std::printf("[ measured ] %s: grad rel L2 packed vs sum of separate: %s\n", tie ? "tied" : "untied", gerr.c_str());
  }
}

// 1c. GVA ratios 1, 2, 3 through the whole model: `deltastack forward` with the chunked GDN backend and with the
// token-recurrent one (two processes: the registry caches its choice) give the same logits, loss and every
// parameter gradient; the in-process model (auto backend) matches the binary.
TEST(Semantics, GvaRatiosChunkedVsRecurrentBackendWholeModel) {
  OneThread one_thread;
  fs::path dir = fs::temp_directory_path() / ("deltastack_sem_gva_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (int ratio : {1, 2, 3}) {
    SCOPED_TRACE("ratio " + std::to_string(ratio));
    ds::Qwen35Model m(small_config(ratio));
    init_model(m, 40 + ratio);
    const std::string ck = (dir / ("ck" + std::to_string(ratio))).string();
    m.save(ck);
    Docs docs = random_docs({5, 70, 0, 130, 64}, 64, 50 + ratio);
    ds::PackedBatch b = pack(docs);
    // Inputs in HF form: labels = input_ids (shifted inside each segment by the command), cu_seqlens.
    std::vector<int64_t> ids(b.input_ids.begin(), b.input_ids.end()), cu(b.cu_seqlens.begin(), b.cu_seqlens.end());
    const std::string in = ck + "/inputs.safetensors";
    ds::write_safetensors(in, {ds::make_tensor_i64("input_ids", {1, static_cast<int64_t>(ids.size())}, ids.data()),
                               ds::make_tensor_i64("labels", {1, static_cast<int64_t>(ids.size())}, ids.data()),
                               ds::make_tensor_i64("cu_seqlens", {static_cast<int64_t>(cu.size())}, cu.data())});
    for (const char* mode : {"fast", "reference"}) {
      std::string cmd = std::string("DELTASTACK_GATED_DELTA_RULE=") + mode + " " + DELTASTACK_BIN + " --threads 1 forward --model " +
                        ck + " --inputs " + in + " --output " + ck + "/out_" + mode + ".safetensors --grads " + ck +
                        "/grads_" + mode + ".safetensors >/dev/null 2>&1";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    ds::SafetensorsReader of(ck + "/out_fast.safetensors"), orf(ck + "/out_reference.safetensors");
    ds::SafetensorsReader gf(ck + "/grads_fast.safetensors"), gr(ck + "/grads_reference.safetensors");
    const double e_logits = rel_l2(of.read_f32("logits"), orf.read_f32("logits"));
    EXPECT_LE(e_logits, 1e-5);
    EXPECT_NEAR(of.read_f32("loss")[0], orf.read_f32("loss")[0], 1e-6);
    // In-process (auto backend) with the command's loss scaling: mean over valid targets.
    ds::ForwardCapture cap;
    cap.logits = true;
    m.zero_grads();
    ds::LossResult r = m.forward_backward(b, 1.0 / static_cast<double>(b.num_targets()), 0.0, &cap);
    EXPECT_EQ(cap.logits_values, of.read_f32("logits"));
    EXPECT_NEAR(r.loss_sum / static_cast<double>(r.num_valid), of.read_f32("loss")[0], 1e-5);
    ASSERT_EQ(gf.tensors().size(), m.params().size());
    std::vector<float> all_fast, all_ref;
    for (const ds::ParamSpec& p : m.params()) {
      std::vector<float> a = gf.read_f32(p.name), bref = gr.read_f32(p.name);
      std::vector<float> mine(m.grads().begin() + p.offset, m.grads().begin() + p.offset + p.numel);
      all_fast.insert(all_fast.end(), a.begin(), a.end());
      all_ref.insert(all_ref.end(), bref.begin(), bref.end());
      EXPECT_EQ(mine, a) << p.name << " in-process vs forward command (same code, one thread: bitwise)";
    }
    // Chunked and recurrent sum in different orders: 1e-5 per tensor, the gate vectors 3e-5 (see gate_vector()).
    // The flat buffers are laid out in the model's parameter order, so param_errors() can slice them.
    const std::string gerr = param_errors(m, all_fast, all_ref, 1e-5);
    report("GVA " + std::to_string(ratio) + ": logits rel L2 chunked vs recurrent", e_logits);
    std::printf("[ measured ] GVA %d: grad rel L2 chunked vs recurrent: %s\n", ratio, gerr.c_str());
  }
  fs::remove_all(dir);
}

// 1d. Model-level finite differences (fp32 loss): d loss_sum / d w for one scalar of each parameter kind, at the
// entry with the largest analytic gradient, against a central difference of forward-only losses.
TEST(Semantics, ModelGradientsMatchFiniteDifferences) {
  OneThread one_thread;
  for (int ratio : {2, 3}) {
    SCOPED_TRACE("ratio " + std::to_string(ratio));
    ds::Qwen35Model m(small_config(ratio));
    init_model(m, 60 + ratio);
    ds::PackedBatch b = pack(random_docs({20, 0, 45}, 64, 61));
    m.zero_grads();
    m.forward_backward(b, 1.0, 0.0);
    const std::vector<float> g = m.grads();
    const std::vector<std::string> names = {
        "model.layers.0.linear_attn.A_log",          "model.layers.0.linear_attn.dt_bias",
        "model.layers.2.linear_attn.A_log",          "model.layers.2.linear_attn.dt_bias",
        "model.layers.0.linear_attn.conv1d.weight",  "model.layers.2.linear_attn.in_proj_a.weight",
        "model.layers.2.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.norm.weight",
        "model.layers.1.self_attn.q_norm.weight",    "model.layers.1.self_attn.k_norm.weight",
        "model.embed_tokens.weight",                 "model.norm.weight",
        "lm_head.weight"};
    double worst = 0;
    for (const std::string& n : names) {
      const ds::ParamSpec& p = m.spec(n);
      int64_t best = 0;
      for (int64_t i = 0; i < p.numel; ++i)
        if (std::fabs(g[p.offset + i]) > std::fabs(g[p.offset + best])) best = i;
      const double an = g[p.offset + best];
      float& w = m.weights()[p.offset + best];
      const float keep = w;
      auto loss_at = [&](double h) {
        w = static_cast<float>(keep + h);
        double actual = static_cast<double>(w) - keep;  // the step fp32 can represent
        double l = m.forward_backward(b, 0.0, 0.0).loss_sum;
        return std::pair<double, double>{l, actual};
      };
      const double h = 4e-3 * std::max(1.0, std::fabs(static_cast<double>(keep)));
      auto [lp, hp] = loss_at(h);
      auto [lm, hm] = loss_at(-h);
      w = keep;
      const double fd = (lp - lm) / (hp - hm);
      const double rel = std::fabs(fd - an) / std::fabs(an);
      EXPECT_GT(std::fabs(an), 1e-2) << n << ": gradient too small for a fp32 finite difference";
      EXPECT_LE(rel, 2e-2) << n << "[" << best << "] analytic " << an << " finite difference " << fd;
      worst = std::max(worst, rel);
      std::printf("[ measured ]   ratio %d %-46s [%3lld] analytic % .6e  fd % .6e  rel %.2e\n", ratio, n.c_str(),
                  static_cast<long long>(best), an, fd, rel);
    }
    report("finite differences ratio " + std::to_string(ratio) + ": worst relative error", worst);
  }
}

// 3 (where thread-count dependence lives). A 1024-token packed batch through the whole model: changing only the
// OpenMP thread count (OpenBLAS pinned to 1 thread) leaves logits and every gradient bitwise unchanged, so every
// OpenMP op partitions its work independently of the thread count. Changing OpenBLAS's thread count may change the
// last bits (OpenBLAS 0.3.21 gives different sgemm results with 1 and 2 threads once M*N*K >= 262144, e.g. the
// [1024 x 16] @ [16 x 64] in_proj_qkv here; docs/determinism.md), so that comparison is held to fp32 tolerance.
TEST(Semantics, ThreadCountInvariantLogitsAndGradients) {
  // ops::linear and linear_cross_entropy split their GEMMs over fixed partitions with single-threaded
  // OpenBLAS, and every OpenMP op uses a fixed partition: 1 and 2 threads must give the same bits.
  const int keep = ds::num_threads();
  ds::Qwen35Model m(small_config(2));
  init_model(m, 90);
  ds::PackedBatch b = pack(random_docs({200, 1, 300, 0, 64, 459}, 64, 91));
  ASSERT_EQ(b.size(), 1024);
  auto run = [&](int threads) {
    ds::set_num_threads(threads);
    ds::ForwardCapture cap;
    cap.logits = true;
    m.zero_grads();
    m.forward_backward(b, 1.0, 0.0, &cap);
    std::vector<float> out = m.grads();
    out.insert(out.end(), cap.logits_values.begin(), cap.logits_values.end());
    return out;
  };
  const auto a1 = run(1), a2 = run(2);
  ds::set_num_threads(keep);
  EXPECT_TRUE(a1 == a2) << "thread count changed the logits or gradients (rel L2 " << rel_l2(a2, a1) << ")";
}
