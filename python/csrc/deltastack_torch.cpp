// deltastack's kernels as PyTorch functions: forward and backward of each op, taking and returning tensors.
// python/deltastack/torch/ops.py registers them as torch custom ops (torch.library.custom_op, with fake kernels
// and autograd). CPU tensors run the fp32 CPU reference of src/ops/<op>/cpu.cpp (the registry's CPU backend for
// the gated delta rule); CUDA tensors run the CUDA kernels of src/ops/<op>/cuda.h (bf16 activations, fp32 small
// weights, gates and statistics, as in the GPU engine). Every argument is checked here with an error naming it.
//
// Layouts are the transformers / fla ones ([B, T, H, D] for the gated delta rule, token-major [B, T, C] for the
// conv); the glue flattens them into the packed token-major layouts of the op headers.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/cu_seqlens.h"
#include "ops/conv1d/conv1d.h"
#include "ops/gated_delta_rule/dispatch.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"
#include "ops/l2norm/l2norm.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/swiglu/swiglu.h"

#ifdef DELTASTACK_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops/conv1d/cuda.h"
#include "ops/gated_delta_rule/chunked_cuda.h"
#include "ops/gated_delta_rule/plan.h"
#include "ops/gated_rmsnorm/cuda.h"
#include "ops/l2norm/cuda.h"
#include "ops/linear_cross_entropy/cuda.h"
#include "ops/rmsnorm/cuda.h"
#include "ops/swiglu/cuda.h"
#endif

namespace {

using torch::Tensor;
using OptTensor = std::optional<Tensor>;

// ---------------------------------------------------------------------------------------------- argument checks

void check_float(const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16 ||
                  t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kDouble,
              op, ": ", name, " must be a floating tensor (float32, bfloat16, float16 or float64), got ",
              t.scalar_type());
}

void check_dim(const Tensor& t, int64_t dim, const char* op, const char* name, const char* shape) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", shape, " (", dim, " dims), got shape ", t.sizes());
}

void check_same_device(const Tensor& ref, const Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but the first input is on ",
              ref.device());
  TORCH_CHECK(ref.is_cpu() || ref.is_cuda(), op, ": only CPU and CUDA tensors are supported, got ", ref.device());
}

void check_shape(const Tensor& t, at::IntArrayRef expect, const char* op, const char* name) {
  TORCH_CHECK(t.sizes() == expect, op, ": ", name, " must have shape ", expect, ", got ", t.sizes());
}

#ifndef DELTASTACK_TORCH_CUDA
[[noreturn]] void no_cuda(const char* op) {
  TORCH_CHECK(false, op, ": this build of deltastack's torch extension has no CUDA support (built with "
                         "DELTASTACK_TORCH_CPU_ONLY=1 or without nvcc); use CPU tensors or rebuild");
}
#endif

Tensor f32(const Tensor& t) { return t.to(torch::kFloat).contiguous(); }
float* fp(Tensor& t) { return t.data_ptr<float>(); }
const float* cfp(const Tensor& t) { return t.data_ptr<float>(); }

#ifdef DELTASTACK_TORCH_CUDA
using ds::cuda::bf16;
Tensor b16(const Tensor& t) { return t.to(torch::kBFloat16).contiguous(); }
bf16* bp(Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>()); }
const bf16* cbp(const Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr<at::BFloat16>()); }
cudaStream_t stream() { return at::cuda::getCurrentCUDAStream().stream(); }
Tensor bytes(int64_t n, const Tensor& like) {
  return torch::empty({std::max<int64_t>(n, 1)}, like.options().dtype(torch::kUInt8));
}
// The forward's saved buffers are outputs of the op: zeroed, so that the bytes the kernels leave unwritten (padding
// of partial chunks) are defined and two runs give equal outputs (torch.library.opcheck compares them).
Tensor zero_bytes(int64_t n, const Tensor& like) {
  return torch::zeros({std::max<int64_t>(n, 1)}, like.options().dtype(torch::kUInt8));
}
#endif

// cu_seqlens for the packed layout: the given one (int32, on `device`), or [0, T, 2T, ..., B*T].
// Checked on the host (it is small) by ds::check_cu_seqlens, the check every entry point shares.
Tensor make_cu_seqlens(const OptTensor& cu, int64_t B, int64_t T, const torch::Device& device, const char* op) {
  Tensor c;
  if (cu.has_value() && cu->defined()) {
    TORCH_CHECK(B == 1, op, ": cu_seqlens needs batch size 1 (the sequences packed along T), got batch ", B);
    TORCH_CHECK(cu->dim() == 1 && cu->numel() >= 2, op, ": cu_seqlens must be 1-D [num_seqs + 1], got shape ",
                cu->sizes());
    TORCH_CHECK(cu->scalar_type() == torch::kInt || cu->scalar_type() == torch::kLong, op,
                ": cu_seqlens must be int32 or int64, got ", cu->scalar_type());
    Tensor h = cu->to(torch::kCPU, torch::kLong).contiguous();
    try {
      ds::check_cu_seqlens(h.data_ptr<int64_t>(), static_cast<size_t>(h.numel()), T, op);
    } catch (const ds::Error& e) {
      TORCH_CHECK(false, e.what());
    }
    c = h.to(torch::kInt);
  } else {
    c = torch::arange(0, B + 1, torch::kLong).mul(T).to(torch::kInt);
  }
  return c.to(device).contiguous();
}

// ------------------------------------------------------------------------------------------- gated delta rule
// fla chunk_gated_delta_rule / transformers torch_chunk_gated_delta_rule (q, k already l2-normalised here:
// ops.py applies use_qk_l2norm_in_kernel with the l2norm op). q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv];
// g, beta: [B, T, Hv]; initial_state: [S, Hv, dk, dv]; cu_seqlens: [S + 1] (B = 1) or none (S = B).

struct GdnArgs {
  int64_t B, T, Hk, Hv, dk, dv, S;
  Tensor cu;  // int32 on the inputs' device
};

GdnArgs gdn_check(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                  const OptTensor& initial_state, const OptTensor& cu_seqlens) {
  const char* op = "chunk_gated_delta_rule";
  for (auto [t, n] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}}) {
    check_float(*t, op, n);
    check_same_device(q, *t, op, n);
  }
  check_dim(q, 4, op, "q", "[B, T, Hk, dk]");
  check_dim(v, 4, op, "v", "[B, T, Hv, dv]");
  GdnArgs a{q.size(0), q.size(1), q.size(2), v.size(2), q.size(3), v.size(3), 0, {}};
  check_shape(k, q.sizes(), op, "k");
  TORCH_CHECK(v.size(0) == a.B && v.size(1) == a.T, op, ": v must be [B, T, Hv, dv] with q's B, T = ", a.B, ", ",
              a.T, ", got ", v.sizes());
  TORCH_CHECK(a.Hk > 0 && a.Hv % a.Hk == 0, op, ": the value heads (", a.Hv, ") must be a multiple of the key heads (",
              a.Hk, ")");
  check_shape(g, {a.B, a.T, a.Hv}, op, "g");
  check_shape(beta, {a.B, a.T, a.Hv}, op, "beta");
  a.cu = make_cu_seqlens(cu_seqlens, a.B, a.T, q.device(), op);
  a.S = a.cu.numel() - 1;
  if (initial_state.has_value() && initial_state->defined()) {
    check_float(*initial_state, op, "initial_state");
    check_same_device(q, *initial_state, op, "initial_state");
    check_shape(*initial_state, {a.S, a.Hv, a.dk, a.dv}, op, "initial_state");
  }
  return a;
}

ds::ops::GdnDims gdn_dims(const GdnArgs& a, double scale) {
  ds::ops::GdnDims d;
  d.N = a.B * a.T;
  d.num_seqs = a.S;
  d.Hk = a.Hk;
  d.Hv = a.Hv;
  d.dk = a.dk;
  d.dv = a.dv;
  d.scale = scale;
  return d;
}

bool has(const OptTensor& t) { return t.has_value() && t->defined(); }

#ifdef DELTASTACK_TORCH_CUDA
// Which CUDA path runs ("direct"): with an initial state or a final state the chunked kernel's own API (it takes
// both; the plan interface of the engine does not); otherwise the plan of the backend the op registry selected
// (DELTASTACK_GATED_DELTA_RULE; cuda-chunked or cuda-simple), exactly as the GPU engine runs it.

ds::ops::cuda::GdnLimits gdn_limits(const GdnArgs& a, double scale) {
  ds::ops::cuda::GdnLimits l;
  l.max_tokens = std::max<int64_t>(a.B * a.T, 1);
  l.max_seqs = std::max<int64_t>(a.S, 1);
  l.Hk = a.Hk;
  l.Hv = a.Hv;
  l.dk = a.dk;
  l.dv = a.dv;
  l.scale = scale;
  return l;
}

ds::ops::cuda::GdnChunkedPlan gdn_chunked(const GdnArgs& a) {
  TORCH_CHECK(a.dk == 128 && a.dv == 128,
              "chunk_gated_delta_rule: on CUDA, initial_state / output_final_state need head dims 128 (the chunked "
              "kernel), got dk=", a.dk, ", dv=", a.dv);
  return ds::ops::cuda::gdn_chunked_plan(std::max<int64_t>(a.B * a.T, 1), std::max<int64_t>(a.S, 1), a.Hk, a.Hv,
                                         a.dk, a.dv);
}
#endif

}  // namespace

// Sizes in bytes of the two buffers the CUDA forward keeps for the backward (batch indices, saved state), so the
// fake kernel can allocate them; zeros on the CPU.
std::vector<int64_t> gdn_buffer_bytes(bool cuda, int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                      int64_t num_seqs, double scale, bool with_states) {
  if (!cuda) return {0, 0};
#ifdef DELTASTACK_TORCH_CUDA
  GdnArgs a{B, T, Hk, Hv, dk, dv, num_seqs, {}};
  if (with_states) {  // direct
    auto p = gdn_chunked(a);
    return {int64_t(p.index_bytes()), int64_t(p.saved_bytes())};
  }
  auto plan = ds::ops::cuda::make_gated_delta_rule_plan(gdn_limits(a, scale));
  return {int64_t(plan->batch_bytes()), int64_t(plan->saved_bytes())};
#else
  no_cuda("chunk_gated_delta_rule");
#endif
}

// Returns {o (q's dtype) [B, T, Hv, dv], final_state fp32 [S, Hv, dk, dv] (empty [0] when not wanted),
// batch, saved (CUDA: byte buffers for the backward; CPU: empty)}.
std::vector<Tensor> gdn_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, double scale, const OptTensor& initial_state,
                                const OptTensor& cu_seqlens, bool output_final_state) {
  GdnArgs a = gdn_check(q, k, v, g, beta, initial_state, cu_seqlens);
  auto d = gdn_dims(a, scale);
  auto f32opt = q.options().dtype(torch::kFloat);
  Tensor fstate = output_final_state ? torch::empty({a.S, a.Hv, a.dk, a.dv}, f32opt) : torch::empty({0}, f32opt);
  if (q.is_cpu()) {
    Tensor qf = f32(q), kf = f32(k), vf = f32(v), gf = f32(g), bf = f32(beta);
    Tensor h0 = has(initial_state) ? f32(*initial_state) : Tensor();
    Tensor o = torch::empty({a.B, a.T, a.Hv, a.dv}, f32opt);
    ds::ops::gated_delta_rule_forward(d, cfp(qf), cfp(kf), cfp(vf), cfp(gf), cfp(bf), a.cu.data_ptr<int32_t>(),
                                      h0.defined() ? cfp(h0) : nullptr, fp(o),
                                      output_final_state ? fp(fstate) : nullptr);
    return {o.to(q.scalar_type()), fstate, torch::empty({0}, q.options().dtype(torch::kUInt8)),
            torch::empty({0}, q.options().dtype(torch::kUInt8))};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor qb = b16(q), kb = b16(k), vb = b16(v), gf = f32(g), bf = f32(beta);
  Tensor o = torch::empty({a.B, a.T, a.Hv, a.dv}, q.options().dtype(torch::kBFloat16));
  const bool direct = has(initial_state) || output_final_state;
  Tensor batch, saved;
  if (direct) {
    auto p = gdn_chunked(a);
    batch = zero_bytes(p.index_bytes(), q);
    saved = zero_bytes(p.saved_bytes(), q);
    Tensor ws = bytes(p.workspace_bytes(), q);
    Tensor h0 = has(initial_state) ? f32(*initial_state) : Tensor();
    ds::ops::cuda::gdn_chunked_prepare(p, a.cu.data_ptr<int32_t>(), a.S, d.N, batch.data_ptr(), stream());
    ds::ops::cuda::gdn_chunked_forward(p, d, batch.data_ptr(), cbp(qb), cbp(kb), cbp(vb), a.Hv * a.dv, cfp(gf),
                                       cfp(bf), h0.defined() ? cfp(h0) : nullptr, bp(o),
                                       output_final_state ? fp(fstate) : nullptr, saved.data_ptr(), ws.data_ptr(),
                                       stream());
  } else {
    auto plan = ds::ops::cuda::make_gated_delta_rule_plan(gdn_limits(a, scale));
    batch = zero_bytes(plan->batch_bytes(), q);
    saved = zero_bytes(plan->saved_bytes(), q);
    Tensor ws = bytes(plan->workspace_bytes(), q);
    plan->prepare(a.cu.data_ptr<int32_t>(), d.N, a.S, batch.data_ptr(), stream());
    ds::ops::cuda::GdnForwardIO io{cbp(qb), cbp(kb), cbp(vb), a.Hv * a.dv, cfp(gf), cfp(bf), bp(o)};
    plan->forward(io, saved.data_ptr(), ws.data_ptr(), stream());
  }
  return {o.to(q.scalar_type()), fstate, batch, saved};
#else
  no_cuda("chunk_gated_delta_rule");
#endif
}

// Returns {dq, dk, dv, dg, dbeta (each in its input's dtype), dinitial_state (fp32; empty [0] without an initial
// state)}. do_: [B, T, Hv, dv]; dfinal_state: [S, Hv, dk, dv] or none (zero).
std::vector<Tensor> gdn_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                 const Tensor& beta, double scale, const OptTensor& initial_state,
                                 const OptTensor& cu_seqlens, const Tensor& batch, const Tensor& saved,
                                 const Tensor& do_, const OptTensor& dfinal_state, bool output_final_state) {
  GdnArgs a = gdn_check(q, k, v, g, beta, initial_state, cu_seqlens);
  auto d = gdn_dims(a, scale);
  const char* op = "chunk_gated_delta_rule backward";
  check_float(do_, op, "grad o");
  check_shape(do_, {a.B, a.T, a.Hv, a.dv}, op, "grad o");
  if (has(dfinal_state)) check_shape(*dfinal_state, {a.S, a.Hv, a.dk, a.dv}, op, "grad final_state");
  const bool with_h0 = has(initial_state);
  auto f32opt = q.options().dtype(torch::kFloat);
  Tensor dh0 = with_h0 ? torch::empty({a.S, a.Hv, a.dk, a.dv}, f32opt) : torch::empty({0}, f32opt);
  if (q.is_cpu()) {
    Tensor qf = f32(q), kf = f32(k), vf = f32(v), gf = f32(g), bf = f32(beta), dof = f32(do_);
    Tensor h0 = with_h0 ? f32(*initial_state) : Tensor();
    Tensor dhT = has(dfinal_state) ? f32(*dfinal_state) : Tensor();
    Tensor dq = torch::empty_like(qf), dk = torch::empty_like(kf), dv = torch::empty_like(vf);
    Tensor dg = torch::empty_like(gf), db = torch::empty_like(bf);
    ds::ops::gated_delta_rule_backward(d, cfp(qf), cfp(kf), cfp(vf), cfp(gf), cfp(bf), a.cu.data_ptr<int32_t>(),
                                       with_h0 ? cfp(h0) : nullptr, cfp(dof), dhT.defined() ? cfp(dhT) : nullptr,
                                       fp(dq), fp(dk), fp(dv), fp(dg), fp(db), with_h0 ? fp(dh0) : nullptr);
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), dg.to(g.scalar_type()),
            db.to(beta.scalar_type()), dh0};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor qb = b16(q), kb = b16(k), vb = b16(v), gf = f32(g), bf = f32(beta), dob = b16(do_);
  auto bopt = q.options().dtype(torch::kBFloat16);
  Tensor dq = torch::empty({a.B, a.T, a.Hk, a.dk}, bopt), dk = torch::empty({a.B, a.T, a.Hk, a.dk}, bopt);
  Tensor dv = torch::empty({a.B, a.T, a.Hv, a.dv}, bopt);
  Tensor dg = torch::empty({a.B, a.T, a.Hv}, f32opt), db = torch::empty({a.B, a.T, a.Hv}, f32opt);
  const bool direct = with_h0 || output_final_state;
  if (direct) {
    auto p = gdn_chunked(a);
    TORCH_CHECK(batch.numel() >= int64_t(p.index_bytes()) && saved.numel() >= int64_t(p.saved_bytes()), op,
                ": saved buffers do not match the forward");
    Tensor ws = bytes(p.workspace_bytes(), q);
    Tensor dhT = has(dfinal_state) ? f32(*dfinal_state) : Tensor();
    ds::ops::cuda::gdn_chunked_backward(p, d, batch.data_ptr(), cbp(qb), cbp(kb), cbp(vb), a.Hv * a.dv, cfp(gf),
                                        cfp(bf), saved.data_ptr(), cbp(dob), dhT.defined() ? cfp(dhT) : nullptr,
                                        bp(dq), bp(dk), bp(dv), a.Hv * a.dv, fp(dg), fp(db),
                                        with_h0 ? fp(dh0) : nullptr, ws.data_ptr(), stream());
  } else {
    auto plan = ds::ops::cuda::make_gated_delta_rule_plan(gdn_limits(a, scale));
    TORCH_CHECK(saved.numel() >= int64_t(plan->saved_bytes()), op, ": saved buffers do not match the forward");
    Tensor ws = bytes(plan->workspace_bytes(), q);
    // A plan keeps the batch indices (and cu_seqlens) its prepare() was given: this one is new, so it prepares its
    // own copy of the forward's indices (the same values; the forward's buffer is an input and stays untouched).
    Tensor batch2 = bytes(plan->batch_bytes(), q);
    plan->prepare(a.cu.data_ptr<int32_t>(), d.N, a.S, batch2.data_ptr(), stream());
    ds::ops::cuda::GdnForwardIO in{cbp(qb), cbp(kb), cbp(vb), a.Hv * a.dv, cfp(gf), cfp(bf), nullptr};
    ds::ops::cuda::GdnBackwardIO gr{cbp(dob), bp(dq), bp(dk), bp(dv), a.Hv * a.dv, fp(dg), fp(db)};
    plan->backward(in, gr, saved.data_ptr(), ws.data_ptr(), stream());
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), dg.to(g.scalar_type()),
          db.to(beta.scalar_type()), dh0};
#else
  no_cuda("chunk_gated_delta_rule");
#endif
}

// --------------------------------------------------------------------------------------------------- l2norm
// transformers l2norm / fla l2norm_fwd: y = x * rsqrt(sum(x^2) + eps) over the last dim. Returns {y (x's dtype),
// rnorm fp32 [rows]}.
std::vector<Tensor> l2norm_forward(const Tensor& x, double eps) {
  const char* op = "l2norm";
  check_float(x, op, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must have a non-empty last dim, got ", x.sizes());
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  auto f32opt = x.options().dtype(torch::kFloat);
  Tensor rn = torch::empty({rows}, f32opt);
  if (x.is_cpu()) {
    Tensor xf = f32(x), y = torch::empty_like(xf);
    ds::ops::l2norm_forward(cfp(xf), fp(y), fp(rn), rows, dim, eps);
    return {y.to(x.scalar_type()), rn};
  }
#ifdef DELTASTACK_TORCH_CUDA
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CPU or CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor xb = b16(x), y = torch::empty_like(xb);
  if (rows > 0) ds::ops::cuda::l2norm_forward(cbp(xb), dim, bp(y), fp(rn), rows, 1, dim, float(eps), stream());
  return {y.to(x.scalar_type()), rn};
#else
  no_cuda(op);
#endif
}

Tensor l2norm_backward(const Tensor& y, const Tensor& rnorm, const Tensor& dy) {
  const char* op = "l2norm backward";
  check_float(y, op, "y");
  check_shape(dy, y.sizes(), op, "grad y");
  const int64_t dim = y.size(-1), rows = y.numel() / dim;
  check_shape(rnorm, {rows}, op, "rnorm");
  if (y.is_cpu()) {
    Tensor yf = f32(y), dyf = f32(dy), rf = f32(rnorm), dx = torch::empty_like(yf);
    ds::ops::l2norm_backward(cfp(yf), cfp(rf), cfp(dyf), fp(dx), rows, dim);
    return dx.to(dy.scalar_type());
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(y.device());
  Tensor yb = b16(y), dyb = b16(dy), rf = f32(rnorm), dx = torch::empty_like(yb);
  if (rows > 0) ds::ops::cuda::l2norm_backward(cbp(yb), cfp(rf), cbp(dyb), bp(dx), dim, rows, 1, dim, stream());
  return dx.to(dy.scalar_type());
#else
  no_cuda(op);
#endif
}

// ----------------------------------------------------------------------------------------- causal conv1d + SiLU
// transformers causal_conv1d_fn(x, weight, activation="silu") / Dao causal_conv1d_fn with seq_idx, no bias,
// here token-major (fla causal_conv1d layout): x [B, T, C], weight [C, K], cu_seqlens [S + 1] (B = 1) or none.
// Returns y (x's dtype) [B, T, C].

namespace {
#ifdef DELTASTACK_TORCH_CUDA
// seq_start[t]: the first token of t's sequence (the CUDA kernel's form of cu_seqlens).
Tensor seq_starts(const Tensor& cu, int64_t N) {
  Tensor cl = cu.to(torch::kLong);
  Tensor lengths = cl.slice(0, 1) - cl.slice(0, 0, cl.numel() - 1);
  return torch::repeat_interleave(cl.slice(0, 0, cl.numel() - 1), lengths, 0, N).to(torch::kInt).contiguous();
}
#endif

void conv_check(const Tensor& x, const Tensor& w, const char* op) {
  check_float(x, op, "x");
  check_float(w, op, "weight");
  check_same_device(x, w, op, "weight");
  check_dim(x, 3, op, "x", "[B, T, C]");
  check_dim(w, 2, op, "weight", "[C, K]");
  TORCH_CHECK(w.size(0) == x.size(2), op, ": weight must be [C, K] with x's C = ", x.size(2), ", got ", w.sizes());
  TORCH_CHECK(w.size(1) >= 1, op, ": weight must have at least one tap");
}
}  // namespace

Tensor conv1d_forward(const Tensor& x, const Tensor& w, const OptTensor& cu_seqlens) {
  const char* op = "causal_conv1d";
  conv_check(x, w, op);
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), K = w.size(1), N = B * T;
  Tensor cu = make_cu_seqlens(cu_seqlens, B, T, x.device(), op);
  if (x.is_cpu()) {
    Tensor xf = f32(x), wf = f32(w), y = torch::empty_like(xf);
    ds::ops::conv1d_silu_forward(cfp(xf), cfp(wf), cu.data_ptr<int32_t>(), cu.numel() - 1, N, C, K, fp(y));
    return y.to(x.scalar_type());
  }
#ifdef DELTASTACK_TORCH_CUDA
  TORCH_CHECK(K <= 4, op, ": the CUDA kernel takes up to 4 taps, got ", K);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor xb = b16(x), wf = f32(w), y = torch::empty_like(xb), ss = seq_starts(cu, N);
  if (N > 0) ds::ops::cuda::conv1d_silu_forward(cbp(xb), cfp(wf), ss.data_ptr<int32_t>(), bp(y), N, C, K, stream());
  return y.to(x.scalar_type());
#else
  no_cuda(op);
#endif
}

// Returns {dx (x's dtype), dweight (weight's dtype)}.
std::vector<Tensor> conv1d_backward(const Tensor& x, const Tensor& w, const OptTensor& cu_seqlens, const Tensor& dy) {
  const char* op = "causal_conv1d backward";
  conv_check(x, w, op);
  check_shape(dy, x.sizes(), op, "grad y");
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), K = w.size(1), N = B * T;
  Tensor cu = make_cu_seqlens(cu_seqlens, B, T, x.device(), op);
  if (x.is_cpu()) {
    Tensor xf = f32(x), wf = f32(w), dyf = f32(dy), dx = torch::empty_like(xf), dw = torch::zeros_like(wf);
    ds::ops::conv1d_silu_backward(cfp(xf), cfp(wf), cfp(dyf), cu.data_ptr<int32_t>(), cu.numel() - 1, N, C, K,
                                  fp(dx), fp(dw));
    return {dx.to(x.scalar_type()), dw.to(w.scalar_type())};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor xb = b16(x), wf = f32(w), dyb = b16(dy), ss = seq_starts(cu, N);
  Tensor dx = torch::empty_like(xb), dw = torch::zeros_like(wf);
  Tensor scratch = bytes(ds::ops::cuda::conv1d_scratch_bytes(N, C, K), x);
  if (N > 0)
    ds::ops::cuda::conv1d_silu_backward(cbp(xb), cfp(wf), cbp(dyb), ss.data_ptr<int32_t>(), bp(dx), fp(dw), N, C, K,
                                        scratch.data_ptr(), stream());
  return {dx.to(x.scalar_type()), dw.to(w.scalar_type())};
#else
  no_cuda(op);
#endif
}

// ---------------------------------------------------------------------------------------------------- RMSNorm
// transformers Qwen3_5RMSNorm (zero_centered: y = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32 inside, cast to x's
// dtype) or the plain form (* w). x: [..., D]; w: [D]. Returns {y (x's dtype), rstd fp32 [rows]}.
std::vector<Tensor> rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, bool zero_centered) {
  const char* op = "rms_norm";
  check_float(x, op, "x");
  check_float(w, op, "weight");
  check_same_device(x, w, op, "weight");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must have a non-empty last dim, got ", x.sizes());
  const int64_t D = x.size(-1), rows = x.numel() / D;
  check_shape(w, {D}, op, "weight");
  Tensor rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
  if (x.is_cpu()) {
    Tensor xf = f32(x), wf = f32(w), y = torch::empty_like(xf);
    ds::ops::rmsnorm_forward(cfp(xf), cfp(wf), fp(y), fp(rstd), rows, D, eps, zero_centered);
    return {y.to(x.scalar_type()), rstd};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor xb = b16(x), wf = f32(w), y = torch::empty_like(xb);
  if (rows > 0) ds::ops::cuda::rmsnorm_forward(cbp(xb), cfp(wf), bp(y), fp(rstd), rows, D, float(eps), zero_centered, stream());
  return {y.to(x.scalar_type()), rstd};
#else
  no_cuda(op);
#endif
}

// Returns {dx (x's dtype), dweight (weight's dtype)}.
std::vector<Tensor> rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                     bool zero_centered) {
  const char* op = "rms_norm backward";
  check_shape(dy, x.sizes(), op, "grad y");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  check_shape(rstd, {rows}, op, "rstd");
  if (x.is_cpu()) {
    Tensor xf = f32(x), wf = f32(w), rf = f32(rstd), dyf = f32(dy), dx = torch::empty_like(xf),
           dw = torch::zeros_like(wf);
    ds::ops::rmsnorm_backward(cfp(xf), cfp(wf), cfp(rf), cfp(dyf), fp(dx), fp(dw), rows, D, zero_centered);
    return {dx.to(x.scalar_type()), dw.to(w.scalar_type())};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor xb = b16(x), wf = f32(w), rf = f32(rstd), dyb = b16(dy), dx = torch::empty_like(xb),
         dw = torch::zeros_like(wf);
  Tensor scratch = bytes(ds::ops::cuda::rmsnorm_scratch_bytes(rows, D), x);
  if (rows > 0)
    ds::ops::cuda::rmsnorm_backward(cbp(xb), cfp(wf), cfp(rf), cbp(dyb), bp(dx), fp(dw), rows, D, zero_centered,
                                    scratch.data_ptr(), stream());
  return {dx.to(x.scalar_type()), dw.to(w.scalar_type())};
#else
  no_cuda(op);
#endif
}

// -------------------------------------------------------------------------------------------- gated RMSNorm
// transformers Qwen3_5RMSNormGated / fla FusedRMSNormGated: y = x * rsqrt(mean(x^2) + eps) * w * silu(z), fp32
// inside. x, z: [..., D]; w: [D]. Returns {y (x's dtype), rstd fp32 [rows]}.
std::vector<Tensor> gated_rmsnorm_forward(const Tensor& x, const Tensor& z, const Tensor& w, double eps) {
  const char* op = "gated_rms_norm";
  check_float(x, op, "x");
  check_float(z, op, "gate");
  check_float(w, op, "weight");
  check_same_device(x, z, op, "gate");
  check_same_device(x, w, op, "weight");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must have a non-empty last dim, got ", x.sizes());
  check_shape(z, x.sizes(), op, "gate");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  check_shape(w, {D}, op, "weight");
  Tensor rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
  if (x.is_cpu()) {
    Tensor xf = f32(x), zf = f32(z), wf = f32(w), y = torch::empty_like(xf);
    ds::ops::gated_rmsnorm_forward(cfp(xf), cfp(zf), cfp(wf), fp(y), fp(rstd), rows, D, eps);
    return {y.to(x.scalar_type()), rstd};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor xb = b16(x), zb = b16(z), wf = f32(w), y = torch::empty_like(xb);
  if (rows > 0) ds::ops::cuda::gated_rmsnorm_forward(cbp(xb), cbp(zb), cfp(wf), bp(y), fp(rstd), rows, D, float(eps), stream());
  return {y.to(x.scalar_type()), rstd};
#else
  no_cuda(op);
#endif
}

// Returns {dx, dgate, dweight} in their inputs' dtypes.
std::vector<Tensor> gated_rmsnorm_backward(const Tensor& x, const Tensor& z, const Tensor& w, const Tensor& rstd,
                                           const Tensor& dy) {
  const char* op = "gated_rms_norm backward";
  check_shape(dy, x.sizes(), op, "grad y");
  check_shape(z, x.sizes(), op, "gate");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  check_shape(rstd, {rows}, op, "rstd");
  if (x.is_cpu()) {
    Tensor xf = f32(x), zf = f32(z), wf = f32(w), rf = f32(rstd), dyf = f32(dy);
    Tensor dx = torch::empty_like(xf), dz = torch::empty_like(zf), dw = torch::zeros_like(wf);
    ds::ops::gated_rmsnorm_backward(cfp(xf), cfp(zf), cfp(wf), cfp(rf), cfp(dyf), fp(dx), fp(dz), fp(dw), rows, D);
    return {dx.to(x.scalar_type()), dz.to(z.scalar_type()), dw.to(w.scalar_type())};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor xb = b16(x), zb = b16(z), wf = f32(w), rf = f32(rstd), dyb = b16(dy);
  Tensor dx = torch::empty_like(xb), dz = torch::empty_like(zb), dw = torch::zeros_like(wf);
  Tensor scratch = bytes(ds::ops::cuda::gated_rmsnorm_scratch_bytes(rows, D), x);
  if (rows > 0)
    ds::ops::cuda::gated_rmsnorm_backward(cbp(xb), cbp(zb), cfp(wf), cfp(rf), cbp(dyb), bp(dx), bp(dz), fp(dw), rows,
                                          D, scratch.data_ptr(), stream());
  return {dx.to(x.scalar_type()), dz.to(z.scalar_type()), dw.to(w.scalar_type())};
#else
  no_cuda(op);
#endif
}

// ------------------------------------------------------------------------------------------------------ SwiGLU
// transformers Qwen3_5MLP's act_fn(gate_proj(x)) * up_proj(x) with act silu: h = silu(gate) * up, same shapes.
Tensor swiglu_forward(const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu";
  check_float(gate, op, "gate");
  check_float(up, op, "up");
  check_same_device(gate, up, op, "up");
  check_shape(up, gate.sizes(), op, "up");
  if (gate.is_cpu()) {
    Tensor gf = f32(gate), uf = f32(up), h = torch::empty_like(gf);
    ds::ops::swiglu_forward(cfp(gf), cfp(uf), fp(h), gf.numel());
    return h.to(gate.scalar_type());
  }
#ifdef DELTASTACK_TORCH_CUDA
  TORCH_CHECK(gate.dim() >= 1 && gate.size(-1) > 0, op, ": gate must have a non-empty last dim");
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t I = gate.size(-1), N = gate.numel() / I;
  Tensor gb = b16(gate), ub = b16(up);
  Tensor h = torch::empty(gate.sizes(), gate.options().dtype(torch::kBFloat16));
  if (N > 0) ds::ops::cuda::swiglu_forward_rows(cbp(gb), cbp(ub), I, bp(h), N, I, stream());
  return h.to(gate.scalar_type());
#else
  no_cuda(op);
#endif
}

// Returns {dgate, dup}.
std::vector<Tensor> swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh) {
  const char* op = "swiglu backward";
  for (auto [t, n] : {std::pair{&gate, "gate"}, {&up, "up"}, {&dh, "grad h"}}) {
    check_float(*t, op, n);
    check_same_device(gate, *t, op, n);
  }
  TORCH_CHECK(gate.dim() >= 1 && gate.size(-1) > 0, op, ": gate must have a non-empty last dim, got ", gate.sizes());
  check_shape(up, gate.sizes(), op, "up");
  check_shape(dh, gate.sizes(), op, "grad h");
  if (gate.is_cpu()) {
    Tensor gf = f32(gate), uf = f32(up), dhf = f32(dh), dg = torch::empty_like(gf), du = torch::empty_like(uf);
    ds::ops::swiglu_backward(cfp(gf), cfp(uf), cfp(dhf), fp(dg), fp(du), gf.numel());
    return {dg.to(gate.scalar_type()), du.to(up.scalar_type())};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(gate.device());
  const int64_t I = gate.size(-1), N = gate.numel() / I;
  // Two separate gradient tensors (a custom op's outputs may not alias each other).
  Tensor gb = b16(gate), ub = b16(up), dhb = b16(dh), dg = torch::empty_like(gb), du = torch::empty_like(ub);
  if (N > 0) ds::ops::cuda::swiglu_backward_rows(cbp(gb), cbp(ub), I, cbp(dhb), bp(dg), bp(du), I, N, I, stream());
  return {dg.to(gate.scalar_type()), du.to(up.scalar_type())};
#else
  no_cuda(op);
#endif
}

// ------------------------------------------------------------------------------ fused linear + cross-entropy
// transformers ForCausalLMLoss on logits = hidden @ weight^T (the labels already shifted), plus z_loss * lse^2,
// never materialising [N, V]. hidden: [N, H]; weight: [V, H]; labels: [N] integer (ignore_index or [0, V)).
// mean: the loss and its gradients are divided by the number of valid labels (reduction "mean"; 0 valid labels give a
// NaN loss and zero gradients, as torch's cross_entropy), else summed. The gradients (of the reduced loss) are made
// in the same pass as the loss. Returns {loss fp32 [] (reduced), z_loss part fp32 [] (reduced the same way),
// num_valid int64 [], dhidden (hidden's dtype, or empty [0] without grads), dweight (weight's dtype, or empty)}.
std::vector<Tensor> linear_cross_entropy_forward(const Tensor& hidden, const Tensor& weight, const Tensor& labels,
                                                 int64_t ignore_index, double z_loss, bool mean,
                                                 bool want_grads, int64_t chunk_tokens) {
  const char* op = "linear_cross_entropy";
  check_float(hidden, op, "hidden");
  check_float(weight, op, "weight");
  check_same_device(hidden, weight, op, "weight");
  check_same_device(hidden, labels, op, "labels");
  check_dim(hidden, 2, op, "hidden", "[N, H]");
  check_dim(weight, 2, op, "weight", "[V, H]");
  TORCH_CHECK(weight.size(1) == hidden.size(1), op, ": weight must be [V, H] with hidden's H = ", hidden.size(1),
              ", got ", weight.sizes());
  TORCH_CHECK(!at::isFloatingType(labels.scalar_type()) && labels.scalar_type() != torch::kBool, op,
              ": labels must be an integer tensor, got ", labels.scalar_type());
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  check_shape(labels, {N}, op, "labels");
  TORCH_CHECK(chunk_tokens > 0, op, ": chunk_tokens must be positive");
  TORCH_CHECK(ignore_index < 0 || ignore_index >= V, op, ": ignore_index ", ignore_index,
              " must lie outside [0, V) (V = ", V, ")");
  Tensor lab = labels.to(torch::kLong);
  Tensor valid = lab.ne(ignore_index);
  Tensor bad = valid.logical_and(lab.lt(0).logical_or(lab.ge(V)));
  Tensor counts = torch::stack({valid.sum(), bad.sum()}).to(torch::kCPU);  // one device-to-host copy
  const int64_t num_valid = counts[0].item<int64_t>();
  TORCH_CHECK(counts[1].item<int64_t>() == 0, op, ": labels must be ignore_index (", ignore_index, ") or in [0, ",
              V, ")");
  ds::ops::LinearCeOptions opt;
  opt.ignore_index = ignore_index;
  opt.z_loss = z_loss;
  opt.grad_scale = mean ? (num_valid > 0 ? 1.0 / double(num_valid) : 0.0) : 1.0;
  const double div = mean ? double(num_valid) : 1.0;  // 0 for a mean over nothing: NaN, as torch
  opt.chunk_tokens = chunk_tokens;
  Tensor lab32 = lab.to(torch::kInt).contiguous();
  auto f32opt = hidden.options().dtype(torch::kFloat);
  Tensor count = torch::full({}, num_valid, torch::dtype(torch::kLong)).to(hidden.device());
  if (hidden.is_cpu()) {
    Tensor hf = f32(hidden), wf = f32(weight);
    Tensor dh = want_grads ? torch::empty_like(hf) : Tensor(), dw = want_grads ? torch::zeros_like(wf) : Tensor();
    auto r = ds::ops::linear_cross_entropy(cfp(hf), cfp(wf), lab32.data_ptr<int32_t>(), N, H, V, opt,
                                           want_grads ? fp(dh) : nullptr, want_grads ? fp(dw) : nullptr);
    return {torch::full({}, r.loss_sum / div, f32opt), torch::full({}, r.z_loss_sum / div, f32opt), count,
            want_grads ? dh.to(hidden.scalar_type()) : torch::empty({0}, hidden.options()),
            want_grads ? dw.to(weight.scalar_type()) : torch::empty({0}, weight.options())};
  }
#ifdef DELTASTACK_TORCH_CUDA
  const c10::cuda::CUDAGuard guard(hidden.device());
  Tensor hb = b16(hidden), wb = b16(weight);
  Tensor loss = torch::zeros({2}, hidden.options().dtype(torch::kDouble));
  Tensor dh = want_grads ? torch::empty_like(hb) : Tensor();
  Tensor dw = want_grads ? torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat)) : Tensor();
  Tensor scratch = bytes(ds::ops::cuda::linear_cross_entropy_scratch_bytes(N, H, V, chunk_tokens), hidden);
  ds::ops::cuda::linear_cross_entropy(cbp(hb), cbp(wb), lab32.data_ptr<int32_t>(), N, H, V, opt,
                                      loss.data_ptr<double>(), want_grads ? bp(dh) : nullptr,
                                      want_grads ? fp(dw) : nullptr, scratch.data_ptr(), stream());
  Tensor lf = loss.div(div).to(torch::kFloat);
  return {lf.select(0, 0).clone(), lf.select(0, 1).clone(), count,
          want_grads ? dh.to(hidden.scalar_type()) : torch::empty({0}, hidden.options()),
          want_grads ? dw.to(weight.scalar_type()) : torch::empty({0}, weight.options())};
#else
  no_cuda(op);
#endif
}

bool has_cuda() {
#ifdef DELTASTACK_TORCH_CUDA
  return true;
#else
  return false;
#endif
}

// Raises a c10::Error (RuntimeError in Python) with `what`: setup.py calls it in a fresh process after each build,
// because an extension whose C++ exceptions cannot reach Python crashes at the first bad argument instead (seen with
// the H200 image's CXX=/opt/gcc/bin/g++ wrapper: docs/torch.md).
void raise_check(const std::string& what) { TORCH_CHECK(false, what); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deltastack kernels (src/ops) for PyTorch: forward/backward functions; see deltastack.torch.ops";
  m.def("has_cuda", &has_cuda, "whether this build has the CUDA kernels");
  m.def("_raise_check", &raise_check, "raises RuntimeError(what): the build's exception check");
  m.def("gdn_buffer_bytes", &gdn_buffer_bytes);
  m.def("gdn_forward", &gdn_forward);
  m.def("gdn_backward", &gdn_backward);
  m.def("l2norm_forward", &l2norm_forward);
  m.def("l2norm_backward", &l2norm_backward);
  m.def("conv1d_forward", &conv1d_forward);
  m.def("conv1d_backward", &conv1d_backward);
  m.def("rmsnorm_forward", &rmsnorm_forward);
  m.def("rmsnorm_backward", &rmsnorm_backward);
  m.def("gated_rmsnorm_forward", &gated_rmsnorm_forward);
  m.def("gated_rmsnorm_backward", &gated_rmsnorm_backward);
  m.def("swiglu_forward", &swiglu_forward);
  m.def("swiglu_backward", &swiglu_backward);
  m.def("linear_cross_entropy_forward", &linear_cross_entropy_forward);
}
