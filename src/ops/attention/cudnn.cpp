// cuDNN fused SDPA backend of causal GQA attention (contract and layout: cudnn.h). Built with cudnn-frontend
// only when CMake found its headers (DELTASTACK_CUDNN); libcudnn itself is opened at run time.
#include "ops/attention/cudnn.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"

#ifdef DELTASTACK_CUDNN
#include <dlfcn.h>

#include <cudnn_frontend.h>

// The frontend's dynamic-loading shim resolves every cuDNN call through this handle (dlsym).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}
namespace fe = cudnn_frontend;
#endif

namespace ds::ops::cudnn {

namespace {

struct LoadState {
  std::once_flag once;
  std::string why_not;  // empty: usable
  std::string version;
};

LoadState& load_state() {
  static LoadState s;
  return s;
}

void load_library(LoadState& s) {
#ifndef DELTASTACK_CUDNN
  s.why_not = "this build has no cuDNN attention backend (cudnn-frontend headers were not found when configuring; "
              "run scripts/fetch_cudnn_frontend.sh and rebuild)";
#else
  // The frontend also opens the CUDA runtime; name the one this binary links so it never guesses between two.
  const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), 0);
  const char* env = std::getenv("DELTASTACK_CUDNN_LIBRARY");
  const std::string path = env && *env ? env : "libcudnn.so.9";
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    s.why_not = "cannot load " + path + " (" + (e ? e : "unknown error") +
                "); set DELTASTACK_CUDNN_LIBRARY or LD_LIBRARY_PATH to a cuDNN 9 library";
    return;
  }
  fe::cudnn_dlhandle = h;
  int64_t v = 0;
  try {
    v = static_cast<int64_t>(fe::detail::get_backend_version());
  } catch (const std::exception& e) {
    s.why_not = path + ": " + e.what();
    return;
  }
  s.version = fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  if (v < 90600) {
    s.why_not = "cuDNN " + s.version + " is older than 9.6 (GQA attention over ragged offsets on sm90)";
    return;
  }
  if (v >= 91000 && v < 91002) {
    s.why_not = "cuDNN " + s.version + " has known fused-SDPA bugs (9.10.0 / 9.10.1); use another version";
    return;
  }
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    s.why_not = "no CUDA device";
    return;
  }
  if (major < 9) s.why_not = "cuDNN THD attention with GQA needs compute capability >= 9.0 (this device: " +
                             std::to_string(major) + ".x)";
#endif
}

}  // namespace

std::string attention_unavailable() {
  LoadState& s = load_state();
  std::call_once(s.once, [&] { load_library(s); });
  return s.why_not;
}

std::string loaded_version() {
  return attention_unavailable().empty() ? load_state().version : std::string();
}

std::vector<BucketShape> attention_buckets(const AttnBounds& b) {
  std::vector<BucketShape> out;
  int64_t lo = 1;
  for (int64_t s = 64;; s *= 2) {
    BucketShape bk;
    bk.lo = lo;
    bk.S = std::min(s, b.max_seqlen);
    bk.bmax = std::min(b.max_seqs, b.max_tokens / lo);
    if (b.rows > 0) bk.bmax = std::min(bk.bmax, b.rows * (b.max_seqlen / lo));
    if (lo == 1) bk.bmax = std::min(bk.bmax, std::max<int64_t>(b.max_tokens / 32, 1));
    bk.bmax = std::max<int64_t>(bk.bmax, 1);
    out.push_back(bk);
    if (bk.S >= b.max_seqlen) break;
    lo = bk.S + 1;
  }
  return out;
}

#ifdef DELTASTACK_CUDNN

namespace {

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV, kSeqQ, kSeqKV, kOffQ, kOffKV, kOffSt };

// One length bucket (BucketShape) with its metadata offsets and graphs.
struct Bucket {
  int64_t lo = 1, S = 0, bmax = 0;
  // int32 element offsets in the metadata of seq[bmax], off_q[bmax + 1], off_kv[bmax + 1], off_st[bmax + 1]; each
  // array starts on 16 bytes (the frontend's default alignment for tensors).
  size_t o_seq = 0, o_q = 0, o_kv = 0, o_st = 0;
  int64_t count = 0;    // documents of the current batch
  bool full = false;    // every one of the bmax entries holds a document of exactly S tokens (set_batch)
  std::shared_ptr<fe::graph::Graph> fwd, bwd;
  int64_t ws_fwd = 0, ws_bwd = 0;  // each graph's workspace (bytes)
};

}  // namespace

struct Attention::Impl {
  AttnBounds b;
  cudnnHandle_t handle = nullptr;
  std::vector<Bucket> buckets;
  size_t meta_ints = 0;
  int64_t workspace = 0;
  int32_t* meta = nullptr;        // device, from set_batch
  size_t zeroed = 0;              // bytes the last run() zeroed
  // AttnBounds::zero_workspace or DELTASTACK_CUDNN_ZERO_WORKSPACE=1: zero the workspace before every call, full
  // buckets too (run; the A/B and a way back should a cuDNN read a full bucket's workspace before writing it).
  bool zero_always = false;
  std::vector<int32_t> staging;   // host copy of meta, alive until the next set_batch

  ~Impl() {
    buckets.clear();  // graphs first: they hold the handle's plans
    if (handle) fe::detail::destroy_handle(handle);
  }

  void check(fe::error_t e, const Bucket& bk, const char* which, const char* step) const {
    DS_CHECK(e.is_good(), "cuDNN attention ({} graph for documents of {}..{} tokens, {} entries, Hq {}, Hkv {}, "
             "head_dim {}, {} head groups): {} failed: {}", which, bk.lo, bk.S, bk.bmax, b.Hq, b.Hkv, b.head_dim,
             b.head_groups, step, e.get_message());
  }

  // The forward over all heads; the backward over one head group (AttnBounds::head_groups): Hq / G query and
  // Hkv / G key/value heads, whose rows keep the full rows' strides (the caller offsets the pointers per group).
  std::shared_ptr<fe::graph::Graph> build(Bucket& bk, bool backward) {
    const int64_t B = bk.bmax, S = bk.S, D = b.head_dim, G = backward ? b.head_groups : 1;
    const int64_t Hq = b.Hq / G, Hkv = b.Hkv / G, rq = b.Hq * D, rkv = b.Hkv * D;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto index = [&](const char* name, int64_t uid, int64_t n) {
      return g->tensor(fe::graph::Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim({n, 1, 1, 1})
                           .set_stride({1, 1, 1, 1})
                           .set_data_type(fe::DataType_t::INT32));
    };
    auto seq_q = index("seq_q", kSeqQ, B), seq_kv = index("seq_kv", kSeqKV, B);
    auto off_q = index("off_q", kOffQ, B + 1), off_kv = index("off_kv", kOffKV, B + 1),
         off_st = index("off_st", kOffSt, B + 1);
    // Token-major packed rows of R elements (the full row: all heads): element (entry b, head h, row s, d) at
    // off[b] + s * R + h * D + d, for the H heads of this graph.
    auto rows = [&](std::shared_ptr<fe::graph::Tensor_attributes> t, int64_t uid, bool query,
                    std::shared_ptr<fe::graph::Tensor_attributes> off) {
      const int64_t H = query ? Hq : Hkv, R = query ? rq : rkv;
      t->set_uid(uid).set_dim({B, H, S, D}).set_stride({S * R, D, R, 1}).set_ragged_offset(off);
      return t;
    };
    auto input = [&](const char* name, int64_t uid, bool query, std::shared_ptr<fe::graph::Tensor_attributes> off) {
      return rows(g->tensor(fe::graph::Tensor_attributes().set_name(name)), uid, query, off);
    };
    // Stats (lse) [N, b.Hq] fp32: element (b, h, s) at off_st[b] + s * b.Hq + h. A head group's pointer is offset
    // by g * Hq floats, so it is aligned to the largest power of two (at most the frontend's default 16) dividing
    // Hq * 4 bytes.
    int64_t stats_alignment = 16;
    while ((Hq * 4) % stats_alignment != 0) stats_alignment /= 2;
    auto stats = [&](std::shared_ptr<fe::graph::Tensor_attributes> t) {
      t->set_uid(kStats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim({B, Hq, S, 1})
          .set_stride({b.Hq * S, 1, b.Hq, 1})
          .set_ragged_offset(off_st);
      if (G > 1) t->set_alignment(stats_alignment);
      return t;
    };
    auto Q = input("Q", kQ, true, off_q), K = input("K", kK, false, off_kv), V = input("V", kV, false, off_kv);
    const float scale = static_cast<float>(b.scale);
    if (!backward) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("sdpa")
                      .set_generate_stats(true)
                      .set_causal_mask(true)
                      .set_attn_scale(scale)
                      .set_padding_mask(true)
                      .set_seq_len_q(seq_q)
                      .set_seq_len_kv(seq_kv);
      auto [O, Stats] = g->sdpa(Q, K, V, opts);
      rows(O, kO, true, off_q)->set_output(true);
      stats(Stats)->set_output(true);
    } else {
      auto O = input("O", kO, true, off_q), dO = input("dO", kdO, true, off_q);
      auto Stats = stats(g->tensor(fe::graph::Tensor_attributes().set_name("Stats")));
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("sdpa_backward")
                      .set_causal_mask(true)
                      .set_attn_scale(scale)
                      .set_padding_mask(true)
                      .set_seq_len_q(seq_q)
                      .set_seq_len_kv(seq_kv)
                      .set_deterministic_algorithm(true)
                      .set_max_total_seq_len_q(b.max_tokens)
                      .set_max_total_seq_len_kv(b.max_tokens);
      auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
      rows(dQ, kdQ, true, off_q)->set_output(true);
      rows(dK, kdK, false, off_kv)->set_output(true);
      rows(dV, kdV, false, off_kv)->set_output(true);
    }
    const char* which = backward ? "backward" : "forward";
    check(g->validate(), bk, which, "validate");
    check(g->build_operation_graph(handle), bk, which, "build_operation_graph");
    check(g->create_execution_plans({fe::HeurMode_t::A}), bk, which, "create_execution_plans");
    check(g->check_support(handle), bk, which, "check_support");
    check(g->build_plans(), bk, which, "build_plans");
    int64_t ws = 0;
    check(g->get_workspace_size(ws), bk, which, "get_workspace_size");
    workspace = std::max(workspace, ws);
    (backward ? bk.ws_bwd : bk.ws_fwd) = ws;
    return g;
  }

  // Runs the forward or backward graph of every bucket the current batch uses, on `s`; `pack` holds the data
  // tensors (uid -> device pointer), the bucket metadata is added here.
  void run(bool backward, std::unordered_map<int64_t, void*>& pack, void* ws, cudaStream_t s) {
    const char* which = backward ? "backward" : "forward";
    DS_CHECK(meta, "cuDNN attention: {} before set_batch", which);
    auto st = fe::detail::set_stream(handle, s);
    DS_CHECK(st == CUDNN_STATUS_SUCCESS, "cuDNN attention: cudnnSetStream failed (status {})", static_cast<int>(st));
    zeroed = 0;
    for (const Bucket& bk : buckets) {
      if (bk.count == 0) continue;
      pack[kSeqQ] = meta + bk.o_seq;
      pack[kSeqKV] = meta + bk.o_seq;
      pack[kOffQ] = meta + bk.o_q;
      pack[kOffKV] = meta + bk.o_kv;
      pack[kOffSt] = meta + bk.o_st;
      // The workspace is zeroed before a call: with it holding NaN bit patterns (the GPU engine shares it with
      // other ops' scratch), the deterministic backward returned NaN gradients on the H200 (cuDNN 9.19) for a
      // packed batch of documents 1..600 tokens long: parts of it are read before they are written (the padding of
      // entries shorter than S, or empty ones). A full bucket (every entry S tokens: the trainer's windows of one
      // document each) has no such part: its graphs write every tile they read, so its calls skip the memset
      // (0.55 ms per backward at the 2B shape; tests poison the workspace with NaN: CudnnAttention.FullBuckets*).
      const int64_t bytes = (bk.full && !zero_always) ? 0 : backward ? bk.ws_bwd : bk.ws_fwd;
      if (!backward || b.head_groups == 1) {
        if (bytes > 0) DS_CUDA_CHECK(cudaMemsetAsync(ws, 0, static_cast<size_t>(bytes), s));
        zeroed += static_cast<size_t>(bytes);
        check((backward ? bk.bwd : bk.fwd)->execute(handle, pack, ws), bk, which, "execute");
        continue;
      }
      // One call per head group, its tensors offset to the group's first head (rows keep their full strides).
      std::unordered_map<int64_t, void*> part = pack;
      const int64_t D = b.head_dim, hq = b.Hq / b.head_groups, hkv = b.Hkv / b.head_groups;
      for (int64_t g = 0; g < b.head_groups; ++g) {
        for (int64_t uid : {kQ, kO, kdO, kdQ}) part[uid] = static_cast<ds::cuda::bf16*>(pack[uid]) + g * hq * D;
        for (int64_t uid : {kK, kV, kdK, kdV}) part[uid] = static_cast<ds::cuda::bf16*>(pack[uid]) + g * hkv * D;
        part[kStats] = static_cast<float*>(pack[kStats]) + g * hq;
        if (bytes > 0) DS_CUDA_CHECK(cudaMemsetAsync(ws, 0, static_cast<size_t>(bytes), s));
        zeroed += static_cast<size_t>(bytes);
        check(bk.bwd->execute(handle, part, ws), bk, which, "execute");
      }
    }
  }
};

Attention::Attention(const AttnBounds& bounds) : impl_(std::make_unique<Impl>()) {
  const std::string why = attention_unavailable();
  DS_CHECK(why.empty(), "cuDNN attention: {}", why);
  Impl& m = *impl_;
  m.b = bounds;
  const char* zero_env = std::getenv("DELTASTACK_CUDNN_ZERO_WORKSPACE");
  m.zero_always = bounds.zero_workspace || (zero_env && std::string(zero_env) == "1");
  const AttnBounds& b = m.b;
  DS_CHECK(b.max_tokens > 0 && b.max_seqs > 0 && b.max_seqlen > 0 && b.max_seqlen <= b.max_tokens,
           "cuDNN attention: bad bounds (max_tokens {}, max_seqs {}, max_seqlen {})", b.max_tokens, b.max_seqs,
           b.max_seqlen);
  DS_CHECK(b.Hkv > 0 && b.Hq % b.Hkv == 0 && b.head_dim % 8 == 0 && b.head_dim <= 256 && b.scale > 0,
           "cuDNN attention: unsupported heads (Hq {}, Hkv {}, head_dim {})", b.Hq, b.Hkv, b.head_dim);
  DS_CHECK(b.head_groups >= 1 && b.Hkv % b.head_groups == 0,
           "cuDNN attention: {} head groups do not divide the {} key/value heads", b.head_groups, b.Hkv);
  DS_CHECK(b.max_tokens * b.Hq * b.head_dim < (int64_t{1} << 31),
           "cuDNN attention: {} tokens x {} heads x {} exceeds the int32 ragged offsets", b.max_tokens, b.Hq,
           b.head_dim);
  for (const BucketShape& shape : attention_buckets(b)) {
    Bucket bk;
    bk.lo = shape.lo;
    bk.S = shape.S;
    bk.bmax = shape.bmax;
    auto take = [&](int64_t n) {
      const size_t at = m.meta_ints;
      m.meta_ints += (static_cast<size_t>(n) + 3) / 4 * 4;
      return at;
    };
    bk.o_seq = take(bk.bmax);
    bk.o_q = take(bk.bmax + 1);
    bk.o_kv = take(bk.bmax + 1);
    bk.o_st = take(bk.bmax + 1);
    m.buckets.push_back(bk);
  }
  const auto t0 = std::chrono::steady_clock::now();
  {
    auto st = fe::detail::create_handle(&m.handle);
    DS_CHECK(st == CUDNN_STATUS_SUCCESS, "cuDNN attention: cudnnCreate failed (status {})", static_cast<int>(st));
  }
  for (Bucket& bk : m.buckets) {
    bk.fwd = m.build(bk, false);
    bk.bwd = m.build(bk, true);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log_info("attention: cuDNN {} fused SDPA, {} length buckets (64..{} tokens), deterministic backward{}, workspace "
           "{:.1f} MiB, graphs built in {:.1f} s", load_state().version, m.buckets.size(), b.max_seqlen,
           b.head_groups > 1 ? fmt::format(" in {} head groups", b.head_groups) : std::string(),
           m.workspace / 1048576.0, secs);
}

Attention::~Attention() = default;

size_t Attention::workspace_bytes() const { return static_cast<size_t>(impl_->workspace); }
size_t Attention::meta_bytes() const { return impl_->meta_ints * sizeof(int32_t); }
size_t Attention::zeroed_bytes() const { return impl_->zeroed; }

bool Attention::set_batch(const int32_t* cu, int64_t num_seqs, void* meta, cudaStream_t stream) {
  Impl& m = *impl_;
  const AttnBounds& b = m.b;
  DS_CHECK(num_seqs >= 0 && num_seqs <= b.max_seqs,
           "cuDNN attention: batch of {} documents exceeds the plan ({})", num_seqs, b.max_seqs);
  DS_CHECK(cu[0] == 0, "cuDNN attention: cu_seqlens[0] is {}, not 0", cu[0]);
  std::vector<std::vector<int64_t>> docs(m.buckets.size());
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t len = cu[i + 1] - cu[i];
    DS_CHECK(len >= 0 && len <= b.max_seqlen && cu[i + 1] <= b.max_tokens,
             "cuDNN attention: document {} ({} tokens ending at {}) exceeds the plan (max_seqlen {}, max_tokens {})",
             i, len, cu[i + 1], b.max_seqlen, b.max_tokens);
    if (len == 0) continue;
    size_t k = 0;
    while (m.buckets[k].S < len) ++k;
    docs[k].push_back(i);
  }
  for (size_t k = 0; k < docs.size(); ++k)
    if (static_cast<int64_t>(docs[k].size()) > m.buckets[k].bmax) return false;
  m.staging.assign(m.meta_ints, 0);
  const int64_t rq = b.Hq * b.head_dim, rkv = b.Hkv * b.head_dim;
  for (size_t k = 0; k < docs.size(); ++k) {
    Bucket& bk = m.buckets[k];
    bk.count = static_cast<int64_t>(docs[k].size());
    bk.full = bk.count == bk.bmax;
    for (int64_t d : docs[k]) bk.full = bk.full && cu[d + 1] - cu[d] == bk.S;
    int32_t *seq = m.staging.data() + bk.o_seq, *oq = m.staging.data() + bk.o_q, *okv = m.staging.data() + bk.o_kv,
            *ost = m.staging.data() + bk.o_st;
    // Entries past the count have length 0 and start where the bucket's last document ends.
    int64_t start = 0;
    for (int64_t j = 0; j <= bk.bmax; ++j) {
      int64_t len = 0;
      if (j < bk.count) {
        const int64_t d = docs[k][static_cast<size_t>(j)];
        start = cu[d];
        len = cu[d + 1] - cu[d];
      }
      if (j < bk.bmax) seq[j] = static_cast<int32_t>(len);
      oq[j] = static_cast<int32_t>(start * rq);
      okv[j] = static_cast<int32_t>(start * rkv);
      ost[j] = static_cast<int32_t>(start * b.Hq);
      start += len;
    }
  }
  m.meta = static_cast<int32_t*>(meta);
  DS_CUDA_CHECK(cudaMemcpyAsync(meta, m.staging.data(), m.meta_ints * sizeof(int32_t), cudaMemcpyHostToDevice,
                                stream));
  return true;
}

void Attention::forward(const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v,
                        ds::cuda::bf16* o, float* lse, void* workspace, cudaStream_t stream) {
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<ds::cuda::bf16*>(q)},
                                          {kK, const_cast<ds::cuda::bf16*>(k)},
                                          {kV, const_cast<ds::cuda::bf16*>(v)},
                                          {kO, o},
                                          {kStats, lse}};
  impl_->run(false, pack, workspace, stream);
}

void Attention::backward(const ds::cuda::bf16* q, const ds::cuda::bf16* k, const ds::cuda::bf16* v,
                         const ds::cuda::bf16* o, const float* lse, const ds::cuda::bf16* dout, ds::cuda::bf16* dq,
                         ds::cuda::bf16* dk, ds::cuda::bf16* dv, void* workspace, cudaStream_t stream) {
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<ds::cuda::bf16*>(q)},
                                          {kK, const_cast<ds::cuda::bf16*>(k)},
                                          {kV, const_cast<ds::cuda::bf16*>(v)},
                                          {kO, const_cast<ds::cuda::bf16*>(o)},
                                          {kStats, const_cast<float*>(lse)},
                                          {kdO, const_cast<ds::cuda::bf16*>(dout)},
                                          {kdQ, dq},
                                          {kdK, dk},
                                          {kdV, dv}};
  impl_->run(true, pack, workspace, stream);
}

#else  // no cudnn-frontend in this build: the class exists, construction reports why.

struct Attention::Impl {};
Attention::Attention(const AttnBounds&) { fail("cuDNN attention: {}", attention_unavailable()); }
Attention::~Attention() = default;
size_t Attention::workspace_bytes() const { return 0; }
size_t Attention::meta_bytes() const { return 0; }
size_t Attention::zeroed_bytes() const { return 0; }
bool Attention::set_batch(const int32_t*, int64_t, void*, cudaStream_t) { return false; }
void Attention::forward(const ds::cuda::bf16*, const ds::cuda::bf16*, const ds::cuda::bf16*, ds::cuda::bf16*, float*,
                        void*, cudaStream_t) {}
void Attention::backward(const ds::cuda::bf16*, const ds::cuda::bf16*, const ds::cuda::bf16*, const ds::cuda::bf16*,
                         const float*, const ds::cuda::bf16*, ds::cuda::bf16*, ds::cuda::bf16*, ds::cuda::bf16*,
                         void*, cudaStream_t) {}

#endif  // DELTASTACK_CUDNN

}  // namespace ds::ops::cudnn

#endif  // DELTASTACK_CUDA
