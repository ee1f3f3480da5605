// `deltastack bench ops` and `deltastack bench step`: GPU timings with CUDA events (median of repeats after
// warm-up), bytes or FLOPs per op, and the fraction of the measured ceilings of the H200 this project uses
// (device copy 4.23 TB/s read+write, bf16 GEMM 8192^3 699 TFLOP/s; docs/gpu.md "Anchors").
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <memory>
#include <vector>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/files.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "model/config.h"
#include "model/model.h"

#ifdef DELTASTACK_CUDA
#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"
#include "core/cuda/profile.h"
#include "core/profile.h"
#include "model/engine.h"
#include "model/gpu_plan.h"
#include "ops/adamw/cuda.h"
#include "ops/adamw/q8_state.h"
#include "ops/attention/cuda.h"
#include "ops/attention/cudnn.h"
#include "ops/conv1d/cuda.h"
#include "ops/elementwise/random.h"
#include "ops/gated_delta_rule/plan.h"
#include "ops/linear/cuda.h"
#include "ops/linear/fp8.h"
#include "ops/linear_cross_entropy/cuda.h"
#include "ops/rmsnorm/cuda.h"
#include "ops/swiglu/cuda.h"
#endif

namespace ds::cli {

int cmd_bench_tokenizer(const std::string& tokenizer_path, const std::string& text_path, int repeats) {
  DS_CHECK(repeats >= 1, "--repeats must be >= 1");
  Tokenizer tok = Tokenizer::from_file(tokenizer_path);
  std::string text = read_file(text_path);
  DS_CHECK(!text.empty(), "{}: empty file", text_path);
  // One thread: the number is MB/s per core. The first pass fills the per-thread word cache; both are reported.
  set_num_threads(1);
  std::vector<double> secs;
  size_t ids = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    ids = tok.encode(text).size();
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<double> warm(secs.begin() + 1, secs.end());
  std::sort(warm.begin(), warm.end());
  const double mb = text.size() / 1e6;
  fmt::print("tokenizer {} on {} ({:.2f} MB -> {} ids), one core: first pass {:.1f} MB/s, warm median {:.1f} MB/s\n",
             tokenizer_path, text_path, mb, ids, mb / secs[0], mb / warm[warm.size() / 2]);
  return 0;
}

#ifdef DELTASTACK_CUDA
namespace {

using ds::cuda::bf16;
namespace K = ds::ops::cuda;
constexpr double kCopyBw = 4.23e12;     // bytes/s, read + write
constexpr double kGemmRate = 699e12;    // FLOP/s, bf16 dense

// One device allocation for all benchmark buffers, freed at exit.
struct DevBuf {
  std::vector<void*> ptrs;
  template <typename T>
  T* get(size_t n) {
    void* p = nullptr;
    DS_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    ptrs.push_back(p);
    return static_cast<T*>(p);
  }
  ~DevBuf() {
    for (void* p : ptrs) cudaFree(p);
  }
};

// Median milliseconds of fn over `reps` runs after `warmup` runs.
double time_ms(const std::function<void()>& fn, int warmup = 3, int reps = 10) {
  for (int i = 0; i < warmup; ++i) fn();
  DS_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  DS_CUDA_CHECK(cudaEventCreate(&a));
  DS_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    DS_CUDA_CHECK(cudaEventRecord(a));
    fn();
    DS_CUDA_CHECK(cudaEventRecord(b));
    DS_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    DS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Row {
  std::string op, shape;
  double fwd_ms, fb_ms;
  std::string rate;
  double frac;
};

void print_rows(const std::vector<Row>& rows) {
  fmt::print("{:<22} {:<34} {:>9} {:>11} {:>22} {:>9}\n", "op", "shape", "fwd ms", "fwd+bwd ms", "rate (fwd+bwd)",
             "roofline");
  for (const Row& r : rows)
    fmt::print("{:<22} {:<34} {:>9.3f} {:>11.3f} {:>22} {:>8.1f}%\n", r.op, r.shape, r.fwd_ms, r.fb_ms, r.rate,
               100 * r.frac);
}

// The fused linear + cross-entropy over 16384 tokens x H x the 248320-token vocabulary, one row per chunk size
// (fp8: the FP8 head, `--fp8-lm-head`): fwd = the logits GEMMs + the rows' loss pass, fwd+bwd with dh and dW. `name`
// gives a row's name from its chunk size.
void bench_loss(std::vector<Row>& rows, cudaStream_t s, int64_t H, bool fp8, std::initializer_list<int64_t> chunks,
                const std::function<std::string(int64_t)>& name, const std::string& shape) {
  DevBuf d;
  const int64_t N = 16384, V = 248320;
  bf16 *h = d.get<bf16>(N * H), *W = d.get<bf16>(V * H), *dh = d.get<bf16>(N * H);
  float* dW = d.get<float>(V * H);
  int32_t* tg = d.get<int32_t>(N);
  double* loss = d.get<double>(2);
  ops::LinearCeOptions opt;
  opt.grad_scale = 1.0 / N;
  opt.fp8_grads = fp8;
  void* scratch = d.get<char>(K::linear_cross_entropy_scratch_bytes(N, H, V, std::max(chunks), fp8));
  K::fill_uniform(h, N * H, 16, -1, 1, s);
  K::fill_uniform(W, V * H, 17, -0.02f, 0.02f, s);
  K::fill_uniform_int(tg, N, 18, static_cast<int32_t>(V), s);
  const double fl = 6.0 * N * H * V;
  for (int64_t chunk : chunks) {
    opt.chunk_tokens = chunk;
    const double f =
        time_ms([&] { K::linear_cross_entropy(h, W, tg, N, H, V, opt, loss, nullptr, nullptr, scratch, s); }, 1, 3);
    const double fb = time_ms([&] { K::linear_cross_entropy(h, W, tg, N, H, V, opt, loss, dh, dW, scratch, s); }, 1, 3);
    rows.push_back({name(chunk), fmt::format("{}{}x{}x{}", shape, N, H, V), f, fb,
                    fmt::format("{:.0f} TFLOP/s; scratch {:.2f} GiB", fl / (fb * 1e-3) / 1e12,
                                K::linear_cross_entropy_scratch_bytes(N, H, V, chunk, fp8) / 1073741824.0),
                    fl / (fb * 1e-3) / kGemmRate});
  }
}
// The loss at the 2B step's shape with the FP8 head, in chunks of 2048 (the step's) and of 4096: the larger chunk
// halves the FP8 wgrad GEMMs' read-modify-write of the fp32 dW (2 GB per chunk) and doubles the fp32 logits scratch.
void bench_loss_2b(std::vector<Row>& rows, cudaStream_t s) {
  bench_loss(rows, s, 2048, true, {2048, 4096}, [](int64_t c) { return fmt::format("lce fp8 head c{}", c); }, "2b ");
}

// AdamW, one 9B decoder layer's worth (218M parameters), fp32 gradients, each --optimizer-state's kernel. Bytes
// read + written per parameter: fp32 30 (p, m, v in and out, g in, the bf16 copy out), bf16 16, 8bit 12 (the
// block scales: 8 B per 256 parameters).
void bench_adamw(std::vector<Row>& rows, cudaStream_t s) {
  DevBuf d;
  const int64_t n = 218103808;
  float* g = d.get<float>(n);
  K::fill_uniform(g, n, 19, -1e-3f, 1e-3f, s);
  ops::AdamWParams hp;
  hp.lr = 1e-4;
  hp.step = 10;
  std::vector<std::pair<std::string, double>> t;
  {
    float *p = d.get<float>(n), *m = d.get<float>(n), *v = d.get<float>(n);
    bf16* pb = d.get<bf16>(n);
    DS_CUDA_CHECK(cudaMemset(p, 0, n * 4));
    DS_CUDA_CHECK(cudaMemset(m, 0, n * 4));
    DS_CUDA_CHECK(cudaMemset(v, 0, n * 4));
    t.emplace_back("fp32", time_ms([&] { K::adamw_update(p, g, m, v, pb, n, hp, s); }));
  }
  {
    bf16 *p = d.get<bf16>(n), *m = d.get<bf16>(n), *v = d.get<bf16>(n);
    DS_CUDA_CHECK(cudaMemset(p, 0, n * 2));
    DS_CUDA_CHECK(cudaMemset(m, 0, n * 2));
    DS_CUDA_CHECK(cudaMemset(v, 0, n * 2));
    t.emplace_back("bf16", time_ms([&] { K::adamw_update_bf16(p, g, m, v, n, hp, 0, s); }));
  }
  {
    const int64_t nb = ops::q8_state::num_blocks(0, n);
    bf16* p = d.get<bf16>(n);
    uint8_t *mc = d.get<uint8_t>(n), *vc = d.get<uint8_t>(n);
    float *ma = d.get<float>(nb), *va = d.get<float>(nb);
    DS_CUDA_CHECK(cudaMemset(p, 0, n * 2));
    DS_CUDA_CHECK(cudaMemset(mc, 0, n));
    DS_CUDA_CHECK(cudaMemset(vc, 0, n));
    DS_CUDA_CHECK(cudaMemset(ma, 0, nb * 4));
    DS_CUDA_CHECK(cudaMemset(va, 0, nb * 4));
    t.emplace_back("8bit", time_ms([&] { K::adamw_update_8bit(p, g, mc, vc, ma, va, n, hp, 0, s); }));
    // The codes by the binary search (ops/adamw/cuda.h q8_binary_search) instead of the bucketed count.
    const bool saved = K::q8_binary_search();
    K::q8_binary_search() = true;
    t.emplace_back("8bit (binary search)", time_ms([&] { K::adamw_update_8bit(p, g, mc, vc, ma, va, n, hp, 0, s); }));
    K::q8_binary_search() = saved;
  }
  for (const auto& [name, ms] : t) {
    const double bytes = (name == "fp32" ? 30.0 : name == "bf16" ? 16.0 : 12.0 + 8.0 / 256) * n;  // 8bit: both
    rows.push_back({"adamw " + name + " state", fmt::format("{:.0f}M params", n / 1e6), ms, ms,
                    fmt::format("{:.2f} TB/s", bytes / (ms * 1e-3) / 1e12), bytes / (ms * 1e-3) / kCopyBw});
  }
}

}  // namespace

int cmd_bench_ops(const std::string& only) {
  check_engine_knobs();  // the kernels' knobs (DELTASTACK_Q8_BINARY_SEARCH, ...): 0 or 1, else an error
  DS_CHECK(cuda_device_count() > 0, "bench ops: no CUDA device");
  fmt::print("device: {}; ceilings: copy {:.2f} TB/s, bf16 GEMM {:.0f} TFLOP/s\n", cuda_device_name(), kCopyBw / 1e12,
             kGemmRate / 1e12);
  std::vector<Row> rows;
  cudaStream_t s = nullptr;
  if (!only.empty()) {
    if (only == "loss") bench_loss_2b(rows, s);
    if (only == "adamw") bench_adamw(rows, s);
    print_rows(rows);
    return 0;
  }
  // RMSNorm (zero-centered): fwd reads x, writes y; bwd reads x, dy, writes dx (2 B each).
  for (int64_t H : {2560, 4096, 5120}) {
    DevBuf d;
    const int64_t N = 32768;
    bf16 *x = d.get<bf16>(N * H), *y = d.get<bf16>(N * H), *dx = d.get<bf16>(N * H);
    float *w = d.get<float>(H), *rstd = d.get<float>(N), *dw = d.get<float>(H);
    void* scratch = d.get<char>(K::rmsnorm_scratch_bytes(N, H));
    K::fill_uniform(x, N * H, 1, -2, 2, s);
    K::fill_uniform(w, H, 2, -0.5, 0.5, s);
    double f = time_ms([&] { K::rmsnorm_forward(x, w, y, rstd, N, H, 1e-6f, true, s); });
    double b = time_ms([&] { K::rmsnorm_backward(x, w, rstd, y, dx, dw, N, H, true, scratch, s); });
    double bytes = 4.0 * N * H + 6.0 * N * H;
    rows.push_back({"rmsnorm", fmt::format("{}x{}", N, H), f, f + b,
                    fmt::format("{:.2f} / {:.2f} TB/s", 4.0 * N * H / f / 1e9, 6.0 * N * H / b / 1e9),
                    bytes / ((f + b) * 1e-3) / kCopyBw});
  }
  // SwiGLU: fwd reads gate|up, writes h (6 B per I element); bwd reads gu, dh, writes dgu (10 B).
  for (int64_t I : {9216, 12288, 17408}) {
    DevBuf d;
    const int64_t N = 16384;
    bf16 *gu = d.get<bf16>(N * 2 * I), *h = d.get<bf16>(N * I), *dgu = d.get<bf16>(N * 2 * I);
    K::fill_uniform(gu, N * 2 * I, 3, -3, 3, s);
    double f = time_ms([&] { K::swiglu_forward(gu, h, N, I, s); });
    double b = time_ms([&] { K::swiglu_backward(gu, h, dgu, N, I, s); });
    rows.push_back({"swiglu", fmt::format("{}x{}", N, I), f, f + b,
                    fmt::format("{:.2f} / {:.2f} TB/s", 6.0 * N * I / f / 1e9, 10.0 * N * I / b / 1e9),
                    16.0 * N * I / ((f + b) * 1e-3) / kCopyBw});
  }
  // conv1d + SiLU at T 32768, C 8192 and at the 2B layer's 16384 x 6144, K 4; "(division sigmoid)": the kernels with
  // one IEEE division per sigmoid (core/cuda/cuda_utils.h division_sigmoid; bitwise the same outputs).
  for (const auto& [N, C] : std::vector<std::pair<int64_t, int64_t>>{{32768, 8192}, {16384, 6144}}) {
    DevBuf d;
    const int64_t Kw = 4;
    bf16 *x = d.get<bf16>(N * C), *y = d.get<bf16>(N * C), *dx = d.get<bf16>(N * C);
    float *w = d.get<float>(C * Kw), *dw = d.get<float>(C * Kw);
    int32_t* ss = d.get<int32_t>(N);
    DS_CUDA_CHECK(cudaMemset(ss, 0, N * sizeof(int32_t)));
    void* scratch = d.get<char>(K::conv1d_scratch_bytes(N, C, Kw));
    K::fill_uniform(x, N * C, 4, -2, 2, s);
    K::fill_uniform(w, C * Kw, 5, -0.5, 0.5, s);
    const bool division0 = cuda::division_sigmoid();
    for (const bool division : {false, true}) {
      cuda::division_sigmoid() = division;
      double f = time_ms([&] { K::conv1d_silu_forward(x, w, ss, y, N, C, Kw, s); });
      double b = time_ms([&] { K::conv1d_silu_backward(x, w, y, ss, dx, dw, N, C, Kw, scratch, s); });
      rows.push_back({division ? "conv1d+silu (division)" : "conv1d+silu", fmt::format("T{} C{} K{}", N, C, Kw), f,
                      f + b, fmt::format("{:.2f} / {:.2f} TB/s", 4.0 * N * C / f / 1e9, 6.0 * N * C / b / 1e9),
                      10.0 * N * C / ((f + b) * 1e-3) / kCopyBw});
    }
    cuda::division_sigmoid() = division0;
  }
  // gated delta rule through the plan the registry selects (DELTASTACK_GATED_DELTA_RULE picks another): one
  // 32768-token sequence at Hk16 / Hv32, the 2B / 0.8B layer (2 x 8192 tokens, Hk16 / Hv16), and 8 documents of
  // fixed uneven lengths (a 39-token one included) packed into 32768 tokens at Hk16 / Hv32.
  struct GdnShape {
    std::vector<int32_t> lengths;
    int64_t Hk, Hv;
    const char* goal;
  };
  const std::vector<GdnShape> gdn_shapes{{{32768}, 16, 32, "3.0"},
                                         {{8192, 8192}, 16, 16, "0.8"},
                                         {{7463, 1021, 5810, 39, 9000, 2601, 4316, 2518}, 16, 32, "-"}};
  for (const GdnShape& sh : gdn_shapes) {
    DevBuf d;
    const int64_t B = static_cast<int64_t>(sh.lengths.size()), Hk = sh.Hk, Hv = sh.Hv, D = 128;
    std::vector<int32_t> hcu{0};
    for (int32_t len : sh.lengths) hcu.push_back(hcu.back() + len);
    const int64_t N = hcu.back();
    const K::GdnLimits lim{N, B, Hk, Hv, D, D, 1.0 / std::sqrt(128.0)};
    std::unique_ptr<K::GatedDeltaRulePlan> plan = K::make_gated_delta_rule_plan(lim);
    bf16 *q = d.get<bf16>(N * Hk * D), *k = d.get<bf16>(N * Hk * D), *v = d.get<bf16>(N * Hv * D),
         *o = d.get<bf16>(N * Hv * D), *dq = d.get<bf16>(N * Hk * D), *dk = d.get<bf16>(N * Hk * D),
         *dv = d.get<bf16>(N * Hv * D);
    float *gg = d.get<float>(N * Hv), *beta = d.get<float>(N * Hv), *dg = d.get<float>(N * Hv),
          *db = d.get<float>(N * Hv);
    int32_t* cu = d.get<int32_t>(B + 1);
    DS_CUDA_CHECK(cudaMemcpy(cu, hcu.data(), hcu.size() * 4, cudaMemcpyHostToDevice));
    void *batch = d.get<char>(plan->batch_bytes()), *saved = d.get<char>(plan->saved_bytes()),
         *ws = d.get<char>(plan->workspace_bytes());
    K::fill_uniform(q, N * Hk * D, 6, -0.1f, 0.1f, s);
    K::fill_uniform(k, N * Hk * D, 7, -0.1f, 0.1f, s);
    K::fill_uniform(v, N * Hv * D, 8, -1, 1, s);
    K::fill_uniform(gg, N * Hv, 9, -1.0f, -0.01f, s);
    K::fill_uniform(beta, N * Hv, 10, 0.1f, 0.9f, s);
    plan->prepare(cu, N, B, batch, s);
    K::GdnForwardIO io;
    io.q = q, io.k = k, io.v = v, io.v_stride = Hv * D, io.g = gg, io.beta = beta, io.o = o;
    K::GdnBackwardIO gr;
    gr.dout = o, gr.dq = dq, gr.dk = dk, gr.dv = dv, gr.dv_stride = Hv * D, gr.dg = dg, gr.dbeta = db;
    double f = time_ms([&] { plan->forward(io, saved, ws, s); }, 1, 3);
    double bw = time_ms([&] { plan->backward(io, gr, saved, ws, s); }, 1, 3);
    // Chunked-algorithm FLOPs (fwd ~ 4 N Hv dk dv + intra-chunk 2 N Hv 64 (dk+dv)), bwd ~ 2x fwd.
    double fl = N * Hv * (4.0 * D * D + 2.0 * 64 * (D + D)) * 3;
    const std::string shape = B == 1   ? fmt::format("T{} Hk{} Hv{} d128", N, Hk, Hv)
                              : B == 2 ? fmt::format("B2xT{} Hk{} Hv{} d128", N / 2, Hk, Hv)
                                       : fmt::format("{}docs T{} Hk{} Hv{} d128", B, N, Hk, Hv);
    rows.push_back({"gated_delta_rule", shape, f, f + bw,
                    fmt::format("{:.1f} TFLOP/s; {}; goal {} ms", fl / ((f + bw) * 1e-3) / 1e12, plan->name(),
                                sh.goal),
                    fl / ((f + bw) * 1e-3) / kGemmRate});
  }
  {  // attention, causal GQA d 256, 16 q / 4 kv heads, B 2 x T 8192
    DevBuf d;
    ops::AttnDims a;
    const int64_t T = 8192, B = 2;
    a.N = T * B;
    a.num_seqs = B;
    a.Hq = 16;
    a.Hkv = 4;
    a.head_dim = 256;
    a.scale = 1.0 / 16.0;
    bf16 *q = d.get<bf16>(a.N * a.Hq * 256), *k = d.get<bf16>(a.N * a.Hkv * 256), *v = d.get<bf16>(a.N * a.Hkv * 256),
         *o = d.get<bf16>(a.N * a.Hq * 256), *dq = d.get<bf16>(a.N * a.Hq * 256), *dk = d.get<bf16>(a.N * a.Hkv * 256),
         *dv = d.get<bf16>(a.N * a.Hkv * 256);
    float* lse = d.get<float>(a.N * a.Hq);
    int32_t* cu = d.get<int32_t>(B + 1);
    int32_t hcu[3] = {0, static_cast<int32_t>(T), static_cast<int32_t>(2 * T)};
    DS_CUDA_CHECK(cudaMemcpy(cu, hcu, sizeof(hcu), cudaMemcpyHostToDevice));
    void* scratch = d.get<char>(K::attention_scratch_bytes(a));
    K::fill_uniform(q, a.N * a.Hq * 256, 11, -1, 1, s);
    K::fill_uniform(k, a.N * a.Hkv * 256, 12, -1, 1, s);
    K::fill_uniform(v, a.N * a.Hkv * 256, 13, -1, 1, s);
    double f = time_ms([&] { K::attention_forward(a, q, k, v, cu, T, o, lse, s); }, 1, 3);
    double b = time_ms([&] { K::attention_backward(a, q, k, v, o, lse, o, cu, T, dq, dk, dv, scratch, s); }, 1, 3);
    double fl_f = 4.0 * B * a.Hq * 256 * (T * (T + 1) / 2.0);
    rows.push_back({"attention (simple kernel)", "B2 T8192 16q/4kv d256 causal", f, f + b,
                    fmt::format("{:.0f} / {:.0f} TFLOP/s", fl_f / (f * 1e-3) / 1e12, 2.5 * fl_f / (b * 1e-3) / 1e12),
                    3.5 * fl_f / ((f + b) * 1e-3) / kGemmRate});
    // The same through cuDNN's fused SDPA (deterministic backward), as the GPU engine runs it: one document per
    // row, ragged offsets, length buckets up to T.
    const std::string why = ops::cudnn::attention_unavailable();
    if (why.empty()) {
      ops::cudnn::Attention att({a.N, B, T, a.Hq, a.Hkv, a.head_dim, a.scale});
      void* ws = d.get<char>(att.workspace_bytes());
      void* meta = d.get<char>(att.meta_bytes());
      DS_CHECK(att.set_batch(hcu, B, meta, s), "bench: cuDNN attention refused the batch");
      double cf = time_ms([&] { att.forward(q, k, v, o, lse, ws, s); }, 1, 3);
      double cb = time_ms([&] { att.backward(q, k, v, o, lse, o, dq, dk, dv, ws, s); }, 1, 3);
      rows.push_back({"attention (cuDNN " + ops::cudnn::loaded_version() + ")", "B2 T8192 16q/4kv d256 causal", cf,
                      cf + cb,
                      fmt::format("{:.0f} / {:.0f} TFLOP/s; ws {:.2f} GiB", fl_f / (cf * 1e-3) / 1e12,
                                  2.5 * fl_f / (cb * 1e-3) / 1e12, att.workspace_bytes() / 1073741824.0),
                      3.5 * fl_f / ((cf + cb) * 1e-3) / kGemmRate});
    } else {
      fmt::print("attention (cuDNN): unavailable: {}\n", why);
    }
  }
  {  // linear (cuBLASLt): 16384 x 4096 -> 12288
    DevBuf d;
    const int64_t M = 16384, Kd = 4096, N = 12288;
    bf16 *x = d.get<bf16>(M * Kd), *W = d.get<bf16>(N * Kd), *y = d.get<bf16>(M * N), *dx = d.get<bf16>(M * Kd);
    float* dW = d.get<float>(N * Kd);
    K::fill_uniform(x, M * Kd, 14, -1, 1, s);
    K::fill_uniform(W, N * Kd, 15, -0.05f, 0.05f, s);
    double f = time_ms([&] { K::linear_forward(x, W, y, M, Kd, N, false, s); });
    double b = time_ms([&] {
      K::linear_backward_data(y, W, dx, M, Kd, N, false, s);
      K::linear_backward_weight(y, x, dW, M, Kd, N, s);
    });
    double fl = 2.0 * M * Kd * N;
    rows.push_back({"linear", fmt::format("{}x{}x{}", M, Kd, N), f, f + b,
                    fmt::format("{:.0f} / {:.0f} TFLOP/s", fl / (f * 1e-3) / 1e12, 2 * fl / (b * 1e-3) / 1e12),
                    3 * fl / ((f + b) * 1e-3) / kGemmRate});
  }
  {  // FP8 GEMMs (--precision fp8; docs/fp8.md) beside bf16 at the decoder's shapes: tokens x in -> out
    // (2B: seq 8192 x 2, gate|up and down; 9B: seq 8192 x 1, gate|up, down, in_proj_qkv). Per-tensor scaling with
    // and without fast accumulation, and cuBLASLt's block scaling (1x128 activations, 128x128 weights; uniform
    // scales: the rate does not depend on their values); then the casts themselves (amax + cast, transposed).
    struct Shape {
      const char* name;
      int64_t M, K, N;
    };
    const Shape shapes[] = {{"2b gate|up", 16384, 2048, 12288}, {"2b down", 16384, 6144, 2048},
                            {"9b gate|up", 8192, 4096, 24576}, {"9b down", 8192, 12288, 4096},
                            {"9b in_proj_qkv", 8192, 4096, 8192}};
    for (const Shape& sh : shapes) {
      DevBuf d;
      const int64_t M = sh.M, Kd = sh.K, N = sh.N;
      bf16 *x = d.get<bf16>(M * Kd), *W = d.get<bf16>(N * Kd), *y = d.get<bf16>(M * N);
      uint8_t *qx = d.get<uint8_t>(M * Kd), *qw = d.get<uint8_t>(N * Kd), *qt = d.get<uint8_t>(Kd * K::fp8_padded(M));
      const int64_t sa = M * ((Kd + 127) / 128), sb = ((N + 127) / 128) * ((Kd + 127) / 128);
      float *f = d.get<float>(8 * K::kFp8Slot), *bsa = d.get<float>(sa), *bsb = d.get<float>(sb);
      K::fill_uniform(x, M * Kd, 21, -1, 1, s);
      K::fill_uniform(W, N * Kd, 22, -0.05f, 0.05f, s);
      K::fill_uniform(bsa, sa, 23, 1, 1, s);
      K::fill_uniform(bsb, sb, 24, 1, 1, s);
      K::fp8_amax(x, M, Kd, Kd, f, s);
      K::fp8_quantize(x, M, Kd, Kd, f, Fp8Format::E4M3, qx, Kd, f + 2 * K::kFp8Slot, s);
      K::fp8_amax(W, N, Kd, Kd, f + 1 * K::kFp8Slot, s);
      K::fp8_quantize(W, N, Kd, Kd, f + 1 * K::kFp8Slot, Fp8Format::E4M3, qw, Kd, f + 3 * K::kFp8Slot, s);
      const double fl = 2.0 * M * Kd * N;
      const std::string shape = fmt::format("{} {}x{}x{}", sh.name, M, Kd, N);
      auto row = [&](const char* op, double ms) {
        rows.push_back({op, shape, ms, ms, fmt::format("{:.0f} TFLOP/s", fl / (ms * 1e-3) / 1e12), fl / (ms * 1e-3) / kGemmRate});
      };
      row("gemm bf16", time_ms([&] { K::linear_forward(x, W, y, M, Kd, N, false, s); }));
      const K::Fp8Matrix A{qx, M, Kd, Kd, Fp8Format::E4M3, f + 2 * K::kFp8Slot}, B{qw, N, Kd, Kd, Fp8Format::E4M3, f + 3 * K::kFp8Slot};
      row("gemm fp8 tensor fast", time_ms([&] { K::gemm_fp8(A, B, y, false, N, 0.0f, true, s); }));
      row("gemm fp8 tensor", time_ms([&] { K::gemm_fp8(A, B, y, false, N, 0.0f, false, s); }));
      try {
        const K::Fp8Matrix Ab{qx, M, Kd, Kd, Fp8Format::E4M3, bsa}, Bb{qw, N, Kd, Kd, Fp8Format::E4M3, bsb};
        row("gemm fp8 block", time_ms([&] { K::gemm_fp8(Ab, Bb, y, false, N, 0.0f, false, s, K::Fp8ScaleMode::Block); }));
      } catch (const std::exception& e) {
        fmt::print("gemm fp8 block {}: unavailable: {}\n", shape, e.what());
      }
      // The casts: read bf16 (2 B), write fp8 (1 B); amax reads it once more.
      const double cast_bytes = 5.0 * M * Kd;
      const double c1 = time_ms([&] {
        K::fp8_amax(x, M, Kd, Kd, f, s);
        K::fp8_quantize(x, M, Kd, Kd, f, Fp8Format::E4M3, qx, Kd, f + 2 * K::kFp8Slot, s);
      });
      const double c2 = time_ms([&] {
        K::fp8_amax(x, M, Kd, Kd, f, s);
        K::fp8_quantize_transpose(x, M, Kd, Kd, f, Fp8Format::E4M3, qt, K::fp8_padded(M), f + 2 * K::kFp8Slot, s);
      });
      rows.push_back({"fp8 cast (amax+cast)", fmt::format("{} x {}x{}", sh.name, M, Kd), c1, c2,
                      fmt::format("{:.2f} / {:.2f} TB/s (row / transposed)", cast_bytes / (c1 * 1e-3) / 1e12,
                                  cast_bytes / (c2 * 1e-3) / 1e12),
                      cast_bytes / (c2 * 1e-3) / kCopyBw});
    }
  }
  // fused linear + cross-entropy, 16384 tokens x 4096 x 248320 vocab, chunks of 2048
  bench_loss(rows, s, 4096, false, {2048}, [](int64_t) { return std::string("linear_cross_entropy"); }, "");
  bench_loss_2b(rows, s);
  bench_adamw(rows, s);
  print_rows(rows);
  return 0;
}

int cmd_bench_step(const std::string& preset, int64_t seq_len, int64_t micro_batch, int64_t steps,
                   const MemoryFlags& memory, bool profile) {
  // The flags first: a typo is an error at once, not after the model's weights are made (a minute at 9B).
  check_engine_knobs();
  GpuPlan plan = GpuPlan::windows(micro_batch, seq_len, 1);
  apply_memory_flags(plan, memory.memory, memory.optimizer_state, memory.recompute, memory.gradients,
                     memory.offload_activations);
  plan.precision = parse_precision(memory.precision);
  plan.fp8_lm_head = memory.fp8_lm_head;
  check_fp8_lm_head(plan.fp8_lm_head, plan.precision);
  plan.norm_pass = memory.clip > 0;
  plan.lora = memory_flags_lora(memory);
  DS_CHECK(memory.clip >= 0 && std::isfinite(memory.clip), "bench step: --clip must be >= 0, got {}", memory.clip);
  DS_CHECK(memory.max_memory_gib >= 0 && memory.max_memory_gib < 1e6, "bench step: --max-memory must be GiB >= 0 "
           "(0 = all that is free), got {}", memory.max_memory_gib);
  plan.memory_limit = static_cast<size_t>(memory.max_memory_gib * 1073741824.0);
  DS_CHECK(seq_len >= 2 && micro_batch >= 1 && steps >= 1, "bench step: bad --seq-len/--micro-batch/--steps");
  DS_CHECK(cuda_device_count() > 0, "bench step: no CUDA device");
  ModelConfig cfg = ModelConfig::resolve(preset);
  Qwen35Model model(cfg, Qwen35Model::Deferred{});  // initialised per parameter while the engine uploads
  model.defer_init(1234);
  if (plan.lora.r > 0) {  // train --lora-rank's adapter (PEFT's init: lora_B zero), through the same engine path
    auto adapter = std::make_shared<LoraAdapter>(cfg, plan.lora);
    adapter->init_peft(1234);
    model.set_adapter(adapter);
  }
  std::unique_ptr<Engine> gpu = make_engine("cuda", std::move(model), plan);
  // Random tokens, one document per row (the HF benchmark's layout).
  PackedBatch b;
  Rng rng(7);
  for (int64_t r = 0; r < micro_batch; ++r) {
    b.cu_seqlens.push_back(static_cast<int32_t>(r * seq_len));
    for (int64_t t = 0; t < seq_len; ++t) b.input_ids.push_back(static_cast<int32_t>(rng.below(cfg.vocab_size)));
  }
  b.cu_seqlens.push_back(static_cast<int32_t>(micro_batch * seq_len));
  b.targets.assign(b.input_ids.size(), -100);
  for (int64_t r = 0; r < micro_batch; ++r)
    for (int64_t t = 0; t + 1 < seq_len; ++t) b.targets[r * seq_len + t] = b.input_ids[r * seq_len + t + 1];
  b.finalize("bench batch");
  const double scale = 1.0 / static_cast<double>(b.num_targets());
  ops::AdamWParams ap;
  ap.lr = 1e-5;
  ap.weight_decay = 0.1;
  // The trainer's step (train/trainer.cpp): with --gradients in-backward, in_backward_step (the norm pass first
  // when --clip is on).
  auto step = [&](int64_t i) {
    ap.step = i + 1;
    if (gpu->gradients() == Gradients::InBackward) {
      const InBackwardStep r = in_backward_step(*gpu, b, scale, 0.0, ap, memory.clip, false);
      return std::pair<double, double>{r.result.loss_sum * scale, std::sqrt(r.grad_sum_squares)};
    }
    gpu->begin_step(ap.step);
    gpu->zero_grads();
    LossResult r = gpu->forward_backward(b, scale);
    double gn = std::sqrt(gpu->grad_sum_squares());
    ops::AdamWParams q = ap;
    q.grad_scale = clip_factor(gn, memory.clip);
    gpu->optimizer_step(q);
    return std::pair<double, double>{r.loss_sum * scale, gn};
  };
  // --profile: every step runs with timed scopes (the warm-up too, so that it creates the event pool); after each
  // timed step, outside its wall time, the scopes' event pairs are read into the table (the warm-up's dropped).
  std::unique_ptr<cuda::StepProfiler> prof;
  ProfileTable table, gaps;
  if (profile) {
    prof = std::make_unique<cuda::StepProfiler>();
    gpu->set_profiler(prof.get());
  }
  step(0);  // warm-up (cuBLASLt heuristics, first-touch)
  if (prof) {
    ProfileTable warm;
    prof->collect(warm);
  }
  std::vector<double> times;
  double loss = 0, gn = 0;
  for (int64_t i = 1; i <= steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    std::tie(loss, gn) = step(i);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (prof) {
      prof->collect(table, &gaps);
      table.end_step(1e3 * times.back());
      gaps.end_step(1e3 * times.back());
    }
  }
  if (prof) gpu->set_profiler(nullptr);
  std::sort(times.begin(), times.end());
  double t = times[times.size() / 2];
  const double tokens = static_cast<double>(seq_len * micro_batch);
  // Model FLOPs per token: 6 x matmul parameters (the lm_head counts, the embedding lookup does not) + causal
  // attention scores 6 x 2 x Hq x hd x T/2 per full-attention layer. The GDN state math is not counted. LoRA: 4 x
  // (forward and dgrad; no weight gradient of the frozen base); the adapters' own GEMMs are not counted.
  double matmul_params = static_cast<double>(cfg.num_parameters()) -
                         (cfg.tie_word_embeddings ? 0.0 : static_cast<double>(cfg.vocab_size) * cfg.hidden_size);
  int64_t n_full = std::count(cfg.layer_types.begin(), cfg.layer_types.end(), "full_attention");
  double attn = 6.0 * 2.0 * cfg.num_attention_heads * cfg.head_dim * (seq_len / 2.0) * n_full;
  double flops = ((plan.lora.r > 0 ? 4.0 : 6.0) * matmul_params + attn) * tokens;
  fmt::print("bench step: preset {} ({:.2f}B params), seq {} x micro-batch {}, {} timed steps on {}; optimizer state "
             "{}, recompute {}, precision {}{}, gradients {}{}{}\n", preset, cfg.num_parameters() / 1e9, seq_len,
             micro_batch, steps, cuda_device_name(), optimizer_state_name(gpu->optimizer_state()),
             gpu->recompute_label(), precision_name(gpu->precision()),
             plan.fp8_lm_head && gpu->precision() == Precision::Fp8 ? " (lm head's gradient GEMMs too)" : "",
             gradients_name(gpu->gradients()),
             memory.clip > 0 ? fmt::format(", clip {}", memory.clip) : std::string(),
             plan.lora.r > 0 ? fmt::format(", LoRA rank {} (all-linear; optimizer state = the adapters')", plan.lora.r)
                             : std::string());
  fmt::print("  step {:.1f} ms (median) | {:.0f} tokens/s | MFU {:.1f}% of 989 TFLOP/s ({:.1f}% of the measured 699) | "
             "peak {:.1f} GiB (plan {:.1f} GiB: the arena {:.1f} + the CUDA context) | loss {:.4f} grad_norm {:.3f}\n",
             1e3 * t, tokens / t, 100 * flops / t / 989e12, 100 * flops / t / 699e12, gpu->peak_bytes() / 1073741824.0,
             (gpu->planned_bytes() + kCudaContextBytes) / 1073741824.0, gpu->planned_bytes() / 1073741824.0, loss, gn);
  if (profile) {
    fmt::print("profile: ms per step by op family and role (mean of {} timed steps; CUDA events on the compute "
               "stream); roofline: GEMM-like work against {:.0f} TFLOP/s, memory-bound work (bytes read + written) "
               "against {:.2f} TB/s\n", steps, kGemmRate / 1e12, kCopyBw / 1e12);
    fmt::print("{}", table.format(kGemmRate, kCopyBw, 1e3 * t));
    // Where the gaps fall: the time between consecutive scopes, by the scope that follows (the 16 largest).
    std::vector<ProfileTable::Row> g = gaps.rows();
    double between = 0;
    for (const auto& r : g) between += r.ms;
    std::sort(g.begin(), g.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
    fmt::print("gaps between scopes: {:.3f} ms per step of the {:.3f} ms gaps (the rest: before the first scope and "
               "after the last); by the scope that follows, largest first:\n", between, table.gaps_ms());
    for (size_t i = 0; i < g.size() && i < 16; ++i)
      fmt::print("  {:<58} {:>8.3f} ms {:>6.0f} per step {:>8.2f} us each\n", g[i].role, g[i].ms, g[i].calls,
                 g[i].calls > 0 ? 1e3 * g[i].ms / g[i].calls : 0.0);
  }
  return 0;
}

#else

int cmd_bench_ops(const std::string&) { fail("bench ops: this build has no CUDA support"); }
int cmd_bench_step(const std::string&, int64_t, int64_t, int64_t, const MemoryFlags&, bool) {
  fail("bench step: this build has no CUDA support");
}

#endif

}  // namespace ds::cli
