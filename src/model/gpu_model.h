// The Qwen3.5 model on one CUDA GPU: fp32 master weights, AdamW moments and gradients, a bf16 compute copy of
// the weights, bf16 activations (DESIGN.md §5). Every device buffer comes from one allocation planned up front
// from GpuPlan (parameters, gradients, optimizer state, activations, scratch): nothing is allocated in the
// step loop. Parameter layout and names are the host Qwen35Model's, so checkpoints move both ways.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/model.h"
#include "ops/adamw/adamw.h"

namespace ds {

struct GpuPlan {
  int64_t max_tokens = 0;         // tokens per micro-batch (packed)
  int64_t max_seqs = 0;           // documents per micro-batch
  int64_t max_seqlen = 0;         // longest document (0: max_tokens); sizes cuDNN attention's length buckets
  int64_t rows = 0;               // the tokens are `rows` windows of max_seqlen (micro-batch); 0: any packing
  int64_t ce_chunk_tokens = 2048; // fused-loss chunk

  // Batches of `micro_batch` packed windows of seq_len tokens, each holding at most docs_per_window documents
  // (a document never spans windows): the trainer's, eval's and bench's batches.
  static GpuPlan windows(int64_t micro_batch, int64_t seq_len, int64_t docs_per_window) {
    GpuPlan p;
    p.max_tokens = micro_batch * seq_len;
    p.max_seqs = micro_batch * docs_per_window;
    p.max_seqlen = seq_len;
    p.rows = micro_batch;
    return p;
  }
};

class GpuModel {
 public:
  // Uploads host.weights() (fp32) and allocates the whole plan. Throws ds::Error if CUDA is unavailable or
  // the plan does not fit in device memory (the message gives the bytes needed).
  GpuModel(const Qwen35Model& host, const GpuPlan& plan);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  // As Qwen35Model::forward_backward: gradients of grad_scale * loss_sum are ADDED to the device gradients.
  LossResult forward_backward(const PackedBatch& batch, double grad_scale, double z_loss = 0.0,
                              ForwardCapture* capture = nullptr);
  void zero_grads();
  double grad_sum_squares();  // deterministic
  // One AdamW update of every parameter (decay per ParamSpec::weight_decay), refreshing the bf16 copy.
  void adamw_step(const ops::AdamWParams& p, double weight_decay);

  void download_weights(std::vector<float>& out) const;
  void download_grads(std::vector<float>& out) const;
  void download_optimizer(std::vector<float>& m, std::vector<float>& v) const;
  void upload_optimizer(const std::vector<float>& m, const std::vector<float>& v);

  size_t planned_bytes() const;  // the single device allocation
  size_t peak_bytes() const;     // device memory in use by this process at its high point (cudaMemGetInfo)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds
