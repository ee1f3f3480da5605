// Diagnostic for the FP8 GEMM (ops/linear/fp8.h): which cuBLASLt FP8 configurations run on this device, each
// tried alone (status of the heuristic and of the matmul). Build and run on the device machine:
//   nvcc -std=c++17 -O2 -o /tmp/fp8diag bench/fp8_gemm_diag.cu -lcublasLt && /tmp/fp8diag
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

static const char* name(cublasStatus_t s) { return cublasLtGetStatusName(s); }

int main() {
  cublasLtHandle_t h;
  cublasLtCreate(&h);
  const int64_t M = 256, N = 512, K = 1024;  // ours: C[M, N] = A[M, K] B[N, K]^T
  void *A, *B, *C, *ws, *scales;
  cudaMalloc(&A, M * K);
  cudaMalloc(&B, N * K);
  cudaMalloc(&C, M * N * 4);
  cudaMalloc(&ws, 32 << 20);
  cudaMalloc(&scales, 4096);
  cudaMemset(A, 0x38, M * K);  // 1.0 in e4m3
  cudaMemset(B, 0x38, N * K);
  float one = 1.0f;
  for (int i = 0; i < 1024; ++i) cudaMemcpy(static_cast<float*>(scales) + i, &one, 4, cudaMemcpyHostToDevice);
  struct Var {
    const char* what;
    bool f32_out, fast, align_pref, reduction_pref;
    int scale_off;  // floats from a 256-byte boundary
  };
  const Var vars[] = {{"bf16 out, plain", false, false, false, false, 0},
                      {"bf16 out, fast accum", false, true, false, false, 0},
                      {"bf16 out, scale at +8 B", false, false, false, false, 2},
                      {"bf16 out, scale at +12 B", false, false, false, false, 3},
                      {"bf16 out, reduction pref", false, false, false, true, 0},
                      {"bf16 out, alignment pref", false, false, true, false, 0},
                      {"f32 out, plain", true, false, false, false, 0},
                      {"f32 out, reduction pref", true, false, false, true, 0}};
  for (const Var& v : vars) {
    cublasLtMatmulDesc_t op;
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n));
    int8_t fa = v.fast;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof(fa));
    const void* sa = static_cast<float*>(scales) + v.scale_off;
    const void* sb = static_cast<float*>(scales) + 64 + v.scale_off;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb));
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K);
    cublasLtMatrixLayoutCreate(&lc, v.f32_out ? CUDA_R_32F : CUDA_R_16BF, N, M, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    uint64_t wsb = 32 << 20;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
    if (v.reduction_pref) {
      uint32_t r = CUBLASLT_REDUCTION_SCHEME_INPLACE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                   CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &r, sizeof(r));
    }
    if (v.align_pref) {
      uint32_t al = 256;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof(al));
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof(al));
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof(al));
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof(al));
    }
    cublasLtMatmulHeuristicResult_t res[8];
    int found = 0;
    cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 8, res, &found);
    std::printf("%-28s heuristic %s (%d):", v.what, name(hs), found);
    float alpha = 1, beta = 0;
    for (int i = 0; i < found; ++i) {
      cublasStatus_t ms = cublasLtMatmul(h, op, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &res[i].algo, ws,
                                         res[i].workspaceSize, 0);
      std::printf(" %s", ms == CUBLAS_STATUS_SUCCESS ? "ok" : name(ms));
    }
    cudaError_t e = cudaDeviceSynchronize();
    std::printf(" | sync %s\n", cudaGetErrorString(e));
  }
  return 0;
}
