// The GPU engine's optimizer: its state layout and dtype, its update over the parameter store, and its own
// checkpoint tensors. AdamW (decoupled weight decay, bias-corrected; ops/adamw/adamw.h) in the store's layout
// (model/gpu_params.h): parameters with an fp32 master get fp32 moments (exp_avg, exp_avg_sq) at their master
// offsets; bf16-only parameters (the bf16 layout's GEMM weights) get bf16 moments at their flat offsets and the
// stochastic-rounding update of ops/adamw/bf16_state.h, or in the 8bit state 8-bit codes of m and sqrt(v) at their
// flat offsets with one fp32 scale per block (ops/adamw/q8_state.h). Checkpoints hold fp32 values in every state
// (bf16 widened exactly, 8-bit codes dequantized; checkpoints store the 8-bit codes themselves through read_codes /
// read_block_scales, and the loader dequantizes them; an fp32 value loaded into a bf16 moment is rounded to nearest,
// into an 8-bit one quantized, which gives back a saved 8-bit state bitwise), so a run may resume in another state.
#pragma once
#ifdef DELTASTACK_CUDA
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "model/gpu_memory.h"
#include "model/gpu_params.h"
#include "ops/adamw/adamw.h"

namespace ds {

// A part of one parameter's update (GpuOptimizer::step_params): the chunks of the 8-bit update's partition
// (ops/adamw/cuda.h adamw_update_8bit's chunk_mask: 32 quantization blocks each, the partials' partition) whose byte
// in `mask` (device, one per chunk) equals `want`; zero_grads: the gradients taken as zero, not read.
struct ChunkSelect {
  const uint8_t* mask = nullptr;
  uint8_t want = 0;
  bool zero_grads = false;
};

class GpuOptimizer {
 public:
  virtual ~GpuOptimizer() = default;
  virtual void reserve(Arena& a) = 0;
  virtual void zero_state(cudaStream_t stream) = 0;
  // One update of every parameter in the store's share (all of them unsharded; model/gpu_params.h ParamShard):
  // p.weight_decay where the ParamSpec decays, p.grad_scale (the clip factor) multiplies the gradients first;
  // keeps the store's bf16 compute copy of those elements current.
  virtual void step(GpuParamStore& store, const ops::AdamWParams& p, cudaStream_t stream) = 0;
  // The same update of parameters [first, last) (ParamSpec indices) only, enqueued on `stream` without waiting
  // for it: step() is step_params over all of them, then a synchronisation. fuse_sums: where fuses_sum(k), the
  // update also writes parameter k's gradient sum-of-squares partials (GpuParamStore::param_partials, bitwise
  // what unit_sum_squares computes), read from the same pass over the gradients. select (not null): only those
  // chunks of each parameter (where selects(k); ds::Error otherwise), the rest left for another call: the two calls
  // of a split (want 0, then 1) give the one call's results bitwise.
  virtual void step_params(GpuParamStore& store, const ops::AdamWParams& p, size_t first, size_t last,
                           cudaStream_t stream, bool fuse_sums = false, const ChunkSelect* select = nullptr) = 0;
  virtual bool fuses_sum(size_t /*k*/) const { return false; }
  // Whether parameter k's update can run by ChunkSelect parts: where it fuses its sum (the 8-bit state's kernel).
  virtual bool selects(size_t k) const { return fuses_sum(k); }
  // The state as checkpoint tensors: names (one per state tensor and parameter) and fp32 slab access; a slab
  // [first, first + count) of flat offsets lies inside one parameter.
  virtual int num_state_tensors() const = 0;                     // per parameter
  virtual std::string state_name(int which, const ParamSpec& p) const = 0;
  virtual void read_state(int which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const = 0;
  virtual void write_state(int which, int64_t first, int64_t count, const float* src, cudaStream_t stream) = 0;
  // The 8bit state as stored (model/engine.h moment_scale_name), unsharded: whether parameter k's moments are 8-bit
  // codes; the codes of flat elements [first, first + count) (inside one such parameter); and `count` of the block
  // scales of parameter k from its block `first_block` (q8_state::num_blocks(offset, numel) blocks in all).
  virtual bool codes_8bit(size_t /*k*/) const { return false; }
  virtual void read_codes(int /*which*/, int64_t /*first*/, int64_t /*count*/, uint8_t* /*dst*/,
                          cudaStream_t /*stream*/) const {}
  virtual void read_block_scales(int /*which*/, size_t /*k*/, int64_t /*first_block*/, int64_t /*count*/,
                                 float* /*dst*/, cudaStream_t /*stream*/) const {}
  // The same written back (a resume from a checkpoint that stores the codes: bitwise, no re-quantization). ds::Error
  // where parameter k has no 8-bit codes or the range is outside it.
  virtual void write_codes(int /*which*/, int64_t /*first*/, int64_t /*count*/, const uint8_t* /*src*/,
                           cudaStream_t /*stream*/) {}
  virtual void write_block_scales(int /*which*/, size_t /*k*/, int64_t /*first_block*/, int64_t /*count*/,
                                  const float* /*src*/, cudaStream_t /*stream*/) {}
};

class GpuAdamW final : public GpuOptimizer {
 public:
  explicit GpuAdamW(const GpuParamStore& store) : store_(store) {}
  void reserve(Arena& a) override;
  void zero_state(cudaStream_t stream) override;
  void step(GpuParamStore& store, const ops::AdamWParams& p, cudaStream_t stream) override;
  void step_params(GpuParamStore& store, const ops::AdamWParams& p, size_t first, size_t last,
                   cudaStream_t stream, bool fuse_sums = false, const ChunkSelect* select = nullptr) override;
  // The 8-bit update of a whole, unsharded GEMM weight with fp32 gradients (adamw_update_8bit's partials).
  bool fuses_sum(size_t k) const override {
    return mq_ && !store_.sharded() && store_.fp32_offset(k) < 0 && store_.grads_bf16() == nullptr;
  }
  int num_state_tensors() const override { return 2; }
  std::string state_name(int which, const ParamSpec& p) const override {
    return (which == 0 ? "exp_avg." : "exp_avg_sq.") + p.name;
  }
  void read_state(int which, int64_t first, int64_t count, float* dst, cudaStream_t stream) const override;
  void write_state(int which, int64_t first, int64_t count, const float* src, cudaStream_t stream) override;
  bool codes_8bit(size_t k) const override { return mq_ && !store_.sharded() && store_.fp32_offset(k) < 0; }
  void read_codes(int which, int64_t first, int64_t count, uint8_t* dst, cudaStream_t stream) const override;
  void read_block_scales(int which, size_t k, int64_t first_block, int64_t count, float* dst,
                         cudaStream_t stream) const override;
  void write_codes(int which, int64_t first, int64_t count, const uint8_t* src, cudaStream_t stream) override;
  void write_block_scales(int which, size_t k, int64_t first_block, int64_t count, const float* src,
                          cudaStream_t stream) override;

 private:
  using bf16 = ds::cuda::bf16;
  const GpuParamStore& store_;
  float *m_ = nullptr, *v_ = nullptr;   // fp32 moments [n32_] of the master offsets [f0_, f0_ + n32_)
  bf16 *mb_ = nullptr, *vb_ = nullptr;  // bf16 moments [nb_] of the share's flat elements (bf16 state only)
  // The 8bit state: codes of m and sqrt(v) [nb_] of the share's flat elements, and the scales [nq_] of the share's
  // blocks of GEMM weights, parameter by parameter; q0_[k]: the scale index of the block holding parameter k's first
  // element in the share (-1: none there, or not 8-bit).
  uint8_t *mq_ = nullptr, *vq_ = nullptr;
  float *ma_ = nullptr, *va_ = nullptr;
  std::vector<int64_t> q0_;
  int64_t f0_ = 0, n32_ = 0, nb_ = 0, nq_ = 0;
  // Parameter k's elements in the share, [a, b) (a >= b: none).
  std::pair<int64_t, int64_t> piece(size_t k) const;
  // The device address of the codes of flat elements [first, first + count) of moment `which` (inside one
  // parameter); ds::Error where that parameter has no 8-bit codes or the range spans two.
  uint8_t* codes(int which, int64_t first, int64_t count) const;
  // The device address of block scales [first_block, first_block + count) of moment `which` of parameter k;
  // ds::Error where k has no 8-bit codes or the range is outside its blocks.
  float* block_scales(int which, size_t k, int64_t first_block, int64_t count) const;
  // The 8-bit state's slab [first, first + count) of parameter k (inside the share) to / from fp32 on the host.
  void read_q8(int which, size_t k, int64_t first, int64_t count, float* dst, cudaStream_t stream) const;
  void write_q8(int which, size_t k, int64_t first, int64_t count, const float* src, cudaStream_t stream);
};

}  // namespace ds
#endif
