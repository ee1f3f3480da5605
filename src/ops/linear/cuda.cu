// Linear layers through cuBLASLt (see cuda.h).
//
// Row-major to column-major: a row-major matrix X [r, c] with leading dimension ld is, in memory, the
// column-major matrix X^T [c, r] with the same ld. So the row-major product C = op(A) op(B) is computed as the
// column-major product C^T = op(B)^T op(A)^T: cuBLASLt's "A" is our B and its "B" is our A, with m = N, n = M.
//
// One cublasLtHandle_t and one 32 MiB workspace per device, created on first use (under a mutex) and kept for
// the life of the process. Matmul descriptors, layouts and the heuristic's algorithm are cached per problem
// (shape, transpositions, leading dimensions, output type, beta == 0, pointer alignments), so the heuristic runs
// once per problem and the same algorithm is used every time: results are bitwise reproducible run to run.
// Split-K: the reduction-scheme preference is set explicitly to cuBLASLt's three schemes (in place, ordered by
// counters; or partials in the workspace reduced by a second kernel), all of which reduce in a fixed order:
// no atomics reach the result.
// The workspace is shared by every GEMM of the device: GEMMs issued on different streams must not run
// concurrently (the training stack issues them on one compute stream).
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "ops/linear/cuda.h"
#include "ops/linear/fp8.h"

namespace ds::ops::cuda {
namespace {

using ds::cuda::bf16;

void check_cublas(cublasStatus_t s, const char* expr, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    ds::cuda::throw_error(std::string("cuBLASLt error ") + cublasLtGetStatusName(s) + " (" +
                          cublasLtGetStatusString(s) + ") in " + expr + " at " + file + ":" + std::to_string(line));
}
#define DS_CUBLAS_CHECK(expr) check_cublas((expr), #expr, __FILE__, __LINE__)

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

struct DeviceCtx {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
};

// (device, ta, tb, M, N, K, lda, ldb, ldc, c_is_f32, beta_zero, alignA, alignB, alignC)
using PlanKey = std::tuple<int, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, uint32_t,
                           uint32_t, uint32_t>;

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};

std::mutex g_mu;
std::map<int, DeviceCtx> g_ctx;  // never destroyed: they live as long as the process (no teardown-order issues)
std::map<PlanKey, Plan> g_plans;

// Largest power of two (<= 256) dividing the address.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

// Caller holds g_mu.
DeviceCtx& device_ctx(int dev) {
  auto it = g_ctx.find(dev);
  if (it != g_ctx.end()) return it->second;
  DeviceCtx ctx;
  DS_CUBLAS_CHECK(cublasLtCreate(&ctx.handle));
  DS_CUDA_CHECK(cudaMalloc(&ctx.workspace, kWorkspaceBytes));
  return g_ctx.emplace(dev, ctx).first->second;
}

// The heuristic's preferences for every GEMM here: the shared workspace, only reduction schemes with a fixed order
// (no atomics reach a result), and the operands' actual alignments (alA, alB of our A and B; alC of C and D).
// cuBLASLt's A is our B and its B is our A. The caller destroys it.
cublasLtMatmulPreference_t make_preference(uint32_t alA, uint32_t alB, uint32_t alC) {
  cublasLtMatmulPreference_t pref = nullptr;
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  const uint32_t reductions =
      CUBLASLT_REDUCTION_SCHEME_INPLACE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                                       sizeof(reductions)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &alB, sizeof(alB)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &alA, sizeof(alA)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &alC, sizeof(alC)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &alC, sizeof(alC)));
  return pref;
}

// Caller holds g_mu. Builds the descriptors of the column-major problem D[m', n'] = op(A') op(B') with
// m' = N, n' = M: A' is our B, B' is our A.
const Plan& get_plan(const PlanKey& key, cublasLtHandle_t handle) {
  auto it = g_plans.find(key);
  if (it != g_plans.end()) return it->second;
  const auto [dev, ta, tb, M, N, K, lda, ldb, ldc, c_f32, beta_zero, alA, alB, alC] = key;
  (void)dev;
  (void)beta_zero;
  Plan p;
  DS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // A' must be op(B)^T [N, K]. tb = false: B is stored row-major [K, N], i.e. column-major [N, K] = B^T: op N.
  // tb = true: B is stored row-major [N, K], i.e. column-major [K, N] = B^T, and op(B)^T = B: op T.
  // B' must be op(A)^T [K, M]. ta = false: A stored row-major [M, K] is column-major [K, M] = A^T: op N.
  // ta = true: A stored row-major [K, M] is column-major [M, K] = A^T, and op(A)^T = A: op T.
  const cublasOperation_t opA = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opB = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof(opA)));
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof(opB)));
  // Stored (column-major) shapes: A' is N x K (op N) or K x N (op T); B' is K x M (op N) or M x K (op T).
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, tb ? K : N, tb ? N : K, ldb));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, ta ? M : K, ta ? K : M, lda));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_f32 ? CUDA_R_32F : CUDA_R_16BF, N, M, ldc));

  cublasLtMatmulPreference_t pref = make_preference(alA, alB, alC);
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0 || res.state != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulDescDestroy(p.op);
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    ds::cuda::throw_error("gemm: cuBLASLt found no algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                          " K=" + std::to_string(K) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                          " lda=" + std::to_string(lda) + " ldb=" + std::to_string(ldb) + " ldc=" +
                          std::to_string(ldc) + " (" + cublasLtGetStatusName(st) + ")");
  }
  p.algo = res.algo;
  p.workspace = res.workspaceSize;
  return g_plans.emplace(key, p).first->second;
}

// C = beta * C for K == 0 (beta == 0 writes zeros, never reading C).
template <typename T>
__global__ void scale_rows_kernel(T* C, int64_t M, int64_t N, int64_t ldc, float beta) {
  const int64_t total = M * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    T* p = C + (i / N) * ldc + (i % N);
    const float v = beta == 0.0f ? 0.0f : beta * static_cast<float>(*p);
    *p = static_cast<T>(v);
  }
}

}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda, const bf16* B,
          int64_t ldb, float beta, void* C, bool c_is_f32, int64_t ldc, cudaStream_t stream, const void* C_in) {
  DS_CUDA_REQUIRE(M >= 0 && N >= 0 && K >= 0, "gemm: M, N, K must be >= 0 (M=" + std::to_string(M) +
                                                 " N=" + std::to_string(N) + " K=" + std::to_string(K) + ")");
  if (M == 0 || N == 0) return;
  DS_CUDA_REQUIRE(C != nullptr, "gemm: C is null");
  DS_CUDA_REQUIRE(ldc >= N, "gemm: ldc (" + std::to_string(ldc) + ") < N (" + std::to_string(N) + ")");
  DS_CUDA_REQUIRE(!C_in || K > 0, "gemm: a separate C input needs K > 0");
  if (K == 0) {
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>(ds::cuda::ceil_div(M * N, threads), 65536);
    if (c_is_f32)
      scale_rows_kernel<float><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<float*>(C), M, N,
                                                                                       ldc, beta);
    else
      scale_rows_kernel<bf16><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<bf16*>(C), M, N,
                                                                                      ldc, beta);
    DS_CUDA_LAUNCH_CHECK();
    return;
  }
  DS_CUDA_REQUIRE(A != nullptr && B != nullptr, "gemm: A or B is null");
  DS_CUDA_REQUIRE(lda >= (ta ? M : K), "gemm: lda (" + std::to_string(lda) + ") too small");
  DS_CUDA_REQUIRE(ldb >= (tb ? K : N), "gemm: ldb (" + std::to_string(ldb) + ") too small");

  int dev = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  const PlanKey key{dev,   ta,       tb,          M,
                    N,     K,        lda,         ldb,
                    ldc,   c_is_f32, beta == 0.f, alignment_of(A),
                    alignment_of(B), C_in ? std::min(alignment_of(C), alignment_of(C_in)) : alignment_of(C)};
  cublasLtHandle_t handle;
  void* workspace;
  const Plan* plan;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    DeviceCtx& ctx = device_ctx(dev);
    handle = ctx.handle;
    workspace = ctx.workspace;
    plan = &get_plan(key, handle);  // std::map nodes are stable: the pointer stays valid after unlocking
  }
  DS_CUBLAS_CHECK(cublasLtMatmul(handle, plan->op, &alpha, B, plan->a, A, plan->b, &beta, C_in ? C_in : C, plan->c,
                                 C, plan->c, &plan->algo, workspace, plan->workspace, stream));
}

void linear_forward(const bf16* x, const bf16* W, bf16* y, int64_t M, int64_t K, int64_t N, bool accumulate,
                    cudaStream_t stream, const bf16* residual) {
  DS_CUDA_REQUIRE(!(accumulate && residual), "linear_forward: accumulate and a residual together");
  gemm(false, true, M, N, K, 1.0f, x, K, W, K, accumulate || residual ? 1.0f : 0.0f, y, false, N, stream, residual);
}

void linear_backward_data(const bf16* dy, const bf16* W, bf16* dx, int64_t M, int64_t K, int64_t N, bool accumulate,
                          cudaStream_t stream) {
  gemm(false, false, M, K, N, 1.0f, dy, N, W, K, accumulate ? 1.0f : 0.0f, dx, false, K, stream);
}

void linear_backward_weight(const bf16* dy, const bf16* x, float* dW, int64_t M, int64_t K, int64_t N,
                            cudaStream_t stream, float beta) {
  gemm(true, false, N, K, M, 1.0f, dy, N, x, K, beta, dW, true, K, stream);
}


// ---------------------------------------------------------------------------------------------------------------
// FP8 GEMMs (fp8.h). The same row-major to column-major mapping as gemm(): cuBLASLt's A is our B [N, K] (stored
// column-major as [K, N]: op T), its B is our A [M, K] (column-major [K, M]: op N): the TN form Hopper's FP8 kernels
// require. cuBLASLt's A scale is therefore B.scale and its B scale A.scale.
namespace {

// (device, M, N, K, lda, ldb, ldc, A format, B format, c_is_f32, beta_zero, fast_accum, scale mode, alignments
// of A, B, C)
using Fp8Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, bool, bool, bool, int,
                          uint32_t, uint32_t, uint32_t>;
// The heuristic's candidates in its order; `chosen` is the first that cuBLASLt ran for this problem (-1 until the
// first call), used from then on: one algorithm per problem, so the results are reproducible.
struct Fp8Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulHeuristicResult_t algos[8] = {};
  int n_algos = 0, chosen = -1;
};
std::map<Fp8Key, Fp8Plan> g_fp8_plans;

cudaDataType_t fp8_type(Fp8Format f) { return f == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// Caller holds g_mu.
Fp8Plan& get_fp8_plan(const Fp8Key& key, cublasLtHandle_t handle, const void* placeholder_scale) {
  auto it = g_fp8_plans.find(key);
  if (it != g_fp8_plans.end()) return it->second;
  const auto [dev, M, N, K, lda, ldb, ldc, fa, fb, c_f32, beta_zero, fast, mode, alA, alB, alC] = key;
  (void)dev;
  (void)beta_zero;
  Fp8Plan p;
  DS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)));
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
  const int8_t fast_accum = fast ? 1 : 0;
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
  if (mode == static_cast<int>(Fp8ScaleMode::Block)) {
    const int32_t weight_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, act_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &weight_mode, sizeof(weight_mode)));
    DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &act_mode, sizeof(act_mode)));
  }
  // The scale pointers are set per call (they differ per operand); a placeholder (any 256-byte aligned device
  // address) here lets the heuristic see an FP8 problem with scaled operands.
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &placeholder_scale,
                                                 sizeof(placeholder_scale)));
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &placeholder_scale,
                                                 sizeof(placeholder_scale)));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, fp8_type(static_cast<Fp8Format>(fb)), K, N, ldb));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, fp8_type(static_cast<Fp8Format>(fa)), K, M, lda));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_f32 ? CUDA_R_32F : CUDA_R_16BF, N, M, ldc));
  cublasLtMatmulPreference_t pref = make_preference(alA, alB, alC);
  cublasLtMatmulHeuristicResult_t res[8] = {};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.a, p.b, p.c, p.c, pref, 8, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < found; ++i)
    if (res[i].state == CUBLAS_STATUS_SUCCESS) p.algos[p.n_algos++] = res[i];
  if (p.n_algos == 0) {
    cublasLtMatmulDescDestroy(p.op);
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    ds::cuda::throw_error("gemm_fp8: cuBLASLt found no algorithm for M=" + std::to_string(M) + " N=" +
                          std::to_string(N) + " K=" + std::to_string(K) + " lda=" + std::to_string(lda) + " ldb=" +
                          std::to_string(ldb) + " ldc=" + std::to_string(ldc) + " (" + cublasLtGetStatusName(st) + ")");
  }
  return g_fp8_plans.emplace(key, p).first->second;
}

}  // namespace

bool gemm_fp8_supported(const Fp8Matrix& A, const Fp8Matrix& B) {
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return A.cols == B.cols && A.cols % 16 == 0 && A.ld % 16 == 0 && B.ld % 16 == 0 && A.ld >= A.cols &&
         B.ld >= B.cols && al16(A.data) && al16(B.data) &&
         !(A.format == Fp8Format::E5M2 && B.format == Fp8Format::E5M2);
}

void gemm_fp8(const Fp8Matrix& A, const Fp8Matrix& B, void* C, bool c_is_f32, int64_t ldc, float beta,
              bool fast_accum, cudaStream_t stream, Fp8ScaleMode mode, const void* C_in) {
  const int64_t M = A.rows, N = B.rows, K = A.cols;
  if (M == 0 || N == 0) return;
  DS_CUDA_REQUIRE(gemm_fp8_supported(A, B),
                  "gemm_fp8: unsupported operands (K=" + std::to_string(K) + " lda=" + std::to_string(A.ld) +
                      " ldb=" + std::to_string(B.ld) + "; K, lda, ldb must be multiples of 16, pointers 16-byte "
                      "aligned, not both E5M2)");
  DS_CUDA_REQUIRE(C != nullptr && ldc >= N, "gemm_fp8: C is null or ldc < N");
  DS_CUDA_REQUIRE(A.scale != nullptr && B.scale != nullptr, "gemm_fp8: an operand has no scale");
  int dev = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  const Fp8Key key{dev, M, N, K, A.ld, B.ld, ldc, static_cast<int>(A.format), static_cast<int>(B.format),
                   c_is_f32, beta == 0.f, fast_accum, static_cast<int>(mode), alignment_of(A.data),
                   alignment_of(B.data), C_in ? std::min(alignment_of(C), alignment_of(C_in)) : alignment_of(C)};
  // The scale pointers live in the descriptor: set and used by the matmul enqueued under the lock.
  std::lock_guard<std::mutex> lock(g_mu);
  DeviceCtx& ctx = device_ctx(dev);
  Fp8Plan& plan = get_fp8_plan(key, ctx.handle, ctx.workspace);
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &B.scale,
                                                 sizeof(B.scale)));
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &A.scale,
                                                 sizeof(A.scale)));
  const float alpha = 1.0f;
  auto run = [&](int i) {
    const cublasLtMatmulHeuristicResult_t& r = plan.algos[i];
    return cublasLtMatmul(ctx.handle, plan.op, &alpha, B.data, plan.a, A.data, plan.b, &beta, C_in ? C_in : C, plan.c,
                          C, plan.c, &r.algo, ctx.workspace, r.workspaceSize, stream);
  };
  if (plan.chosen >= 0) {
    DS_CUBLAS_CHECK(run(plan.chosen));
    return;
  }
  // First call of this problem: the heuristic's candidates in order, the first that runs is kept (a candidate
  // cuBLASLt refuses at run time returns before launching anything).
  cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
  for (int i = 0; i < plan.n_algos; ++i) {
    st = run(i);
    if (st == CUBLAS_STATUS_SUCCESS) {
      plan.chosen = i;
      return;
    }
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) break;
  }
  ds::cuda::throw_error(std::string("gemm_fp8: cuBLASLt ran none of its ") + std::to_string(plan.n_algos) +
                        " algorithms for M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" +
                        std::to_string(K) + ": " + cublasLtGetStatusName(st));
}

}  // namespace ds::ops::cuda
