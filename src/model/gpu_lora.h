// The GPU engine's LoRA adapters (docs/lora.md; model/lora.h has the math and PEFT's files): beside the frozen base
// (model/gpu_params.h in its frozen mode: bf16 GEMM weights, no gradient, no optimizer state), the adapters' fp32
// masters, their bf16 compute copy, fp32 gradients and fp32 AdamW moments, each one flat buffer in the host
// LoraAdapter's layout (lora_tensor_specs: the same offsets, so a slab of the host buffers is a slab here), plus the
// low-rank products' scratch, all reserved in the engine's one allocation (model/gpu_plan.h lay_out_gpu_memory).
//
// The LoRA term of adapted linear k with input x [N, in] (bf16) and output y [N, out] (row stride ldy: a row block of
// a fused output, gate|up, is a column range of it):
//   forward   u = keep * (m ⊙ x) A^T [N, r] (bf16),   y += scaling * u B^T
//   backward  dB += scaling * dy^T u,   du = scaling * dy B [N, r] (bf16),   dA += keep * du^T (m ⊙ x),
//             dx += keep * m ⊙ (du A)
// with m the 0/1 dropout mask of the CPU engine (LoraAdapter::dropout_stream, ops/elementwise/dropout.h) and
// keep = 1 / (1 - lora_dropout) in training with dropout, else m = 1 and keep = 1. Every product is a cuBLASLt GEMM
// (ops/linear/cuda.h gemm: bf16 operands, fp32 accumulation; gradients accumulated in fp32), also under --precision
// fp8 (only the base's GEMMs go through FP8).
#pragma once
#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "core/cuda/cuda_utils.h"
#include "model/config.h"
#include "model/gpu_memory.h"
#include "model/lora.h"
#include "ops/adamw/adamw.h"

namespace ds {

class GpuLora {
 public:
  using bf16 = ds::cuda::bf16;
  // The adapters of `config` on model c, for micro-batches of at most max_tokens tokens. ds::Error as
  // lora_tensor_specs.
  GpuLora(const ModelConfig& c, const LoraConfig& config, int64_t max_tokens);

  // masters, compute copy (Parameters), gradients (Gradients), moments (Optimizer), the sum-of-squares scratch and the
  // products' scratch: u, du [N, r] and, with lora_dropout > 0, the masked input and dx term [N, largest in]
  // (Workspace).
  void reserve(Arena& a);

  const LoraConfig& config() const { return config_; }
  const std::vector<LoraTensorSpec>& specs() const { return specs_; }
  int64_t size() const { return n_; }  // floats of each flat buffer
  float* grads() const { return g_; }  // fp32 [size()]: what data parallelism reduces

  // The host adapter's values (fp32 [size()], LoraAdapter::values()) into the masters and the bf16 copy; zeroes
  // the gradients and moments.
  void upload(const std::vector<float>& values, cudaStream_t stream);
  void zero_grads(cudaStream_t stream);
  // Sum of squares of the gradients in double (fixed order: ops/adamw/cuda.h sum_squares); synchronises.
  double grad_sum_squares(cudaStream_t stream);
  // One AdamW update of every adapter element (p.weight_decay on all of them: HF Trainer decays every lora_A /
  // lora_B; p.grad_scale the clip factor), refreshing the bf16 copy.
  void step(const ops::AdamWParams& p, cudaStream_t stream);
  // fp32 slabs [first, first + count) of a flat buffer to / from the host (Values: the masters; a write refreshes
  // their bf16 copy). ds::Error outside [0, size()). Synchronise.
  enum class Buffer { Values, Grads, ExpAvg, ExpAvgSq };
  void read(Buffer which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const;
  void write(Buffer which, int64_t first, int64_t count, const float* src, cudaStream_t stream);

  // The LoRA term of spec k (above) over N tokens. drop: the mask's stream (LoraAdapter::dropout_stream(k)) in a
  // training pass with dropout; nullopt: none. x [N, in] contiguous; y / dy [N, ldy] (out columns used); dx [N, in].
  void forward(size_t k, const bf16* x, int64_t N, bf16* y, int64_t ldy, std::optional<uint64_t> drop,
               cudaStream_t stream);
  void backward(size_t k, const bf16* x, int64_t N, const bf16* dy, int64_t ldy, bf16* dx,
                std::optional<uint64_t> drop, cudaStream_t stream);

 private:
  // lora_A's input: x, or m ⊙ x in the masked-input scratch; and keep.
  const bf16* input(size_t k, const bf16* x, int64_t N, std::optional<uint64_t> drop, float& keep, cudaStream_t stream);
  LoraConfig config_;
  std::vector<LoraTensorSpec> specs_;
  int64_t n_ = 0, max_tokens_ = 0, max_in_ = 0;
  float *w_ = nullptr, *g_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  bf16* wb_ = nullptr;
  bf16 *u_ = nullptr, *du_ = nullptr, *xd_ = nullptr, *dxd_ = nullptr;
  double* sumsq_ = nullptr;
  void* sumsq_scratch_ = nullptr;
};

}  // namespace ds
#endif
