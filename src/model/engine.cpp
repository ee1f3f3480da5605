// The two engines behind model/engine.h: the CPU reference (Qwen35Model + host AdamW state) and the CUDA engine
// (GpuModel: everything on the device, checkpoints streamed from it in slabs).
#include "model/engine.h"

#include <algorithm>
#include <utility>

#include "core/cuda/device.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "model/gpu_model.h"

namespace ds {

namespace {

// AdamW state names in optimizer.safetensors (fp32, one pair per parameter).
std::string exp_avg_name(const ParamSpec& p) { return "exp_avg." + p.name; }
std::string exp_avg_sq_name(const ParamSpec& p) { return "exp_avg_sq." + p.name; }

// The per-parameter update of an engine-wide AdamW step: decay only where the ParamSpec says so.
ops::AdamWParams for_param(const ops::AdamWParams& p, const ParamSpec& s) {
  ops::AdamWParams q = p;
  q.weight_decay = s.weight_decay ? p.weight_decay : 0.0;
  return q;
}

class CpuEngine final : public Engine {
 public:
  explicit CpuEngine(Qwen35Model model) : model_(std::move(model)) {
    model_.materialize();
    hi_ = model_.num_parameters();
  }

  std::string device() const override { return "cpu"; }
  const ModelConfig& config() const override { return model_.config(); }
  const std::vector<ParamSpec>& params() const override { return model_.params(); }
  LossResult forward_backward(const PackedBatch& b, double grad_scale, double z_loss, ForwardCapture* cap) override {
    return model_.forward_backward(b, grad_scale, z_loss, cap);
  }
  std::vector<float> last_logits(const PackedBatch& b) override { return model_.last_logits(b); }
  void zero_grads() override { model_.zero_grads(); }
  double grad_sum_squares() override {
    if (!sharded()) return ops::sum_squares(model_.grads().data(), static_cast<int64_t>(model_.grads().size()));
    double s = ops::sum_squares(model_.grads().data() + lo_, hi_ - lo_);  // this rank's share, then every rank's
    comm_->all_reduce_sum(&s, 1);
    return s;
  }
  void distribute(dist::Communicator& comm, ShardMode mode) override {
    DS_CHECK(m_.empty(), "distribute() after the optimizer state exists");
    DS_CHECK(!comm.on_device(), "{}: the CPU engine's ranks talk over MPI (mpirun), not {}",
             dist::describe(comm.launch()), comm.backend());
    comm_ = &comm;
    mode_ = mode;
    if (!sharded()) return;
    counts_ = dist::even_counts(model_.num_parameters(), comm.world());
    lo_ = 0;
    for (int r = 0; r < comm.rank(); ++r) lo_ += counts_[static_cast<size_t>(r)];
    hi_ = lo_ + counts_[static_cast<size_t>(comm.rank())];
  }
  void reduce_grads() override {
    if (!comm_ || comm_->world() == 1) return;
    if (model_.grads().size() != model_.weights().size()) model_.zero_grads();  // a rank without a micro-batch
    float* g = model_.grads().data();
    if (!sharded()) {
      comm_->all_reduce_sum(g, static_cast<int64_t>(model_.grads().size()));
      return;
    }
    mine_.resize(static_cast<size_t>(hi_ - lo_));  // kept: no allocation per step
    comm_->reduce_scatter_sum(g, mine_.data(), counts_);
    std::copy(mine_.begin(), mine_.end(), g + lo_);  // the rest of g is not this rank's (never read)
  }
  // AdamW on [lo_, hi_) of the flat parameters (all of them unless sharded), parameter by parameter as each one's
  // decay flag says; sharded, every rank's updated share is then gathered.
  void optimizer_step(const ops::AdamWParams& p) override {
    moments();
    DS_CHECK(model_.grads().size() == model_.weights().size(), "optimizer step before any gradient");
    float *w = model_.weights().data(), *g = model_.grads().data();
    for (const ParamSpec& s : model_.params()) {
      const int64_t a = std::max(s.offset, lo_), b = std::min(s.offset + s.numel, hi_);
      if (a < b) ops::adamw_update(w + a, g + a, m_.data() + (a - lo_), v_.data() + (a - lo_), b - a, for_param(p, s));
    }
    if (sharded()) comm_->all_gather(w, counts_);
  }
  std::vector<SaveTensor> weight_tensors(DType dtype) override { return model_.to_tensors(model_.weights(), dtype); }
  std::vector<SaveTensor> optimizer_tensors() override {
    moments();
    DS_CHECK(!sharded() || !m_full_.empty(), "optimizer_tensors() of a sharded state without gather_for_save()");
    const float* m = sharded() ? m_full_.data() : m_.data();
    const float* v = sharded() ? v_full_.data() : v_.data();
    std::vector<SaveTensor> out;
    for (const ParamSpec& p : model_.params()) {
      out.push_back(make_tensor_f32_view(exp_avg_name(p), p.shape, m + p.offset));
      out.push_back(make_tensor_f32_view(exp_avg_sq_name(p), p.shape, v + p.offset));
    }
    return out;
  }
  void gather_for_save() override {
    if (!sharded()) return;
    moments();
    const size_t n = static_cast<size_t>(model_.num_parameters());
    m_full_.assign(n, 0.0f);
    v_full_.assign(n, 0.0f);
    std::copy(m_.begin(), m_.end(), m_full_.begin() + lo_);
    std::copy(v_.begin(), v_.end(), v_full_.begin() + lo_);
    comm_->all_gather(m_full_.data(), counts_);
    comm_->all_gather(v_full_.data(), counts_);
  }
  void release_after_save() override {
    std::vector<float>().swap(m_full_);
    std::vector<float>().swap(v_full_);
  }
  // Whole moments from the checkpoint (any world size wrote them); this rank keeps its share.
  void load_optimizer(const TensorSource& read) override {
    moments();
    for (const ParamSpec& p : model_.params()) {
      const std::vector<float> em = read(exp_avg_name(p), p.numel), ev = read(exp_avg_sq_name(p), p.numel);
      DS_CHECK(static_cast<int64_t>(em.size()) == p.numel && static_cast<int64_t>(ev.size()) == p.numel,
               "optimizer state for {} has the wrong size", p.name);
      const int64_t a = std::max(p.offset, lo_), b = std::min(p.offset + p.numel, hi_);
      if (a >= b) continue;
      std::copy(em.begin() + (a - p.offset), em.begin() + (b - p.offset), m_.begin() + (a - lo_));
      std::copy(ev.begin() + (a - p.offset), ev.begin() + (b - p.offset), v_.begin() + (a - lo_));
    }
  }
  std::vector<SaveTensor> grad_tensors() override {
    if (model_.grads().size() != model_.weights().size()) model_.zero_grads();
    return model_.to_tensors(model_.grads());
  }

 private:
  bool sharded() const { return comm_ && comm_->world() > 1 && mode_ == ShardMode::Optimizer; }
  // The AdamW moments of [lo_, hi_) exist from the first use of the optimizer on (evaluation never allocates them).
  void moments() {
    if (m_.empty()) m_.assign(static_cast<size_t>(hi_ - lo_), 0.0f);
    if (v_.empty()) v_.assign(static_cast<size_t>(hi_ - lo_), 0.0f);
  }
  Qwen35Model model_;
  std::vector<float> m_, v_;  // AdamW moments of the flat parameters [lo_, hi_)
  dist::Communicator* comm_ = nullptr;
  ShardMode mode_ = ShardMode::None;
  std::vector<int64_t> counts_;  // every rank's share (sharded)
  int64_t lo_ = 0, hi_ = 0;
  std::vector<float> m_full_, v_full_;  // the whole moments, only between gather_for_save and release_after_save
  std::vector<float> mine_;             // this rank's reduce-scattered share of the gradients
};

class CudaEngine final : public Engine {
 public:
  CudaEngine(Qwen35Model host, const GpuPlan& plan)
      : cfg_(host.config()), params_(host.params()), gpu_(std::make_unique<GpuModel>(host, plan)) {
    host.release_buffers();  // the device holds the only copy from here on
  }

  std::string device() const override { return "cuda"; }
  const ModelConfig& config() const override { return cfg_; }
  const std::vector<ParamSpec>& params() const override { return params_; }
  LossResult forward_backward(const PackedBatch& b, double grad_scale, double z_loss, ForwardCapture* cap) override {
    return gpu_->forward_backward(b, grad_scale, z_loss, cap);
  }
  std::vector<float> last_logits(const PackedBatch& b) override { return gpu_->last_logits(b); }
  void zero_grads() override { gpu_->zero_grads(); }
  // Data parallel over NCCL (at world size 1 under a launcher too: the same path, sums over one rank, so the
  // losses are the plain run's bits). --shard none: every rank keeps the whole state and all-reduces the fp32
  // gradients on the step's stream. --shard optimizer (ZeRO-1; the plan was built with this rank's share,
  // GpuPlan::shard_world): the gradients are reduce-scattered in place, each rank updates only its share of the flat
  // parameters with only its share of the moments, and the updated weights are all-gathered in place (the bf16
  // copy, and the fp32 master: flat in the fp32 layout, by each rank's range of the small parameters' compacted
  // master in the bf16 layout).
  void distribute(dist::Communicator& comm, ShardMode mode) override {
    DS_CHECK(comm.world() == 1 || comm.on_device(), "{}: the GPU engine's ranks need the NCCL communicator, not {} "
             "(start them with torchrun or mpirun and --device cuda)", dist::describe(comm.launch()), comm.backend());
    if (comm.on_device()) comm_ = &comm;
    const GpuModel::ShardBuffers b = gpu_->shard_buffers();
    sharded_ = mode == ShardMode::Optimizer && comm_;
    DS_CHECK(!sharded_ || b.world == comm.world(), "{}: --shard optimizer needs an "
             "engine planned for {} ranks' shares (GpuPlan::shard_world)", dist::describe(comm.launch()), comm.world());
  }
  void reduce_grads() override {
    if (!comm_) return;
    if (!sharded_) {
      const GpuModel::DeviceGrads g = gpu_->device_grads();
      comm_->device_all_reduce_sum(g.data, g.count, g.stream);
      return;
    }
    const GpuModel::ShardBuffers b = gpu_->shard_buffers();
    comm_->device_reduce_scatter_sum(b.grads, b.grads + comm_->rank() * b.share, b.share, b.stream);
  }
  double grad_sum_squares() override {
    if (!sharded_) return gpu_->grad_sum_squares();
    double s = gpu_->share_grad_sum_squares();  // this rank's share, then every rank's
    comm_->all_reduce_sum(&s, 1);
    return s;
  }
  void optimizer_step(const ops::AdamWParams& p) override {
    gpu_->adamw_step(p, p.weight_decay);
    if (!sharded_) return;
    const GpuModel::ShardBuffers b = gpu_->shard_buffers();
    const int r = comm_->rank();
    comm_->device_all_gather(static_cast<char*>(b.compute) + r * b.share * 2, b.compute, b.share * 2, b.stream);
    if (b.master_flat) {
      comm_->device_all_gather(b.master + r * b.share, b.master, b.share * 4, b.stream);
      return;
    }
    comm_->device_group_start();
    for (int q = 0; q < comm_->world(); ++q) {
      const auto [x, y] = b.master_ranges[static_cast<size_t>(q)];
      if (y > x) comm_->device_broadcast(b.master + x, (y - x) * 4, q, b.stream);
    }
    comm_->device_group_end();
  }
  // Sharded: the moments are made whole on rank 0's host for the save (8 bytes per parameter there), released after.
  void gather_for_save() override {
    if (!sharded_) return;
    gpu_->gather_optimizer_state([this](void* p, int64_t bytes, int root) {
      comm_->device_broadcast(p, bytes, root, gpu_->shard_buffers().stream);
    }, comm_->rank(), &full_state_);
  }
  void release_after_save() override { std::vector<std::vector<float>>().swap(full_state_); }
  std::vector<SaveTensor> weight_tensors(DType dtype) override { return buffer_tensors(GpuModel::Buffer::Weights, dtype); }
  std::vector<SaveTensor> checkpoint_weight_tensors() override {
    return buffer_tensors(GpuModel::Buffer::Weights, DType::F32, /*lossless=*/true);
  }
  std::vector<SaveTensor> grad_tensors() override { return buffer_tensors(GpuModel::Buffer::Grads, DType::F32); }
  // The optimizer names its own state tensors (AdamW: exp_avg.<name>, exp_avg_sq.<name>; model/gpu_optimizer.h).
  std::vector<SaveTensor> optimizer_tensors() override {
    std::vector<SaveTensor> out;
    GpuModel* gpu = gpu_.get();
    if (sharded_) {
      DS_CHECK(!full_state_.empty(), "optimizer_tensors() of a sharded state without gather_for_save() on rank 0");
      for (const ParamSpec& p : params_)
        for (int k = 0; k < gpu->optimizer_state_count(); ++k)
          out.push_back(make_tensor_f32_view(gpu->optimizer_state_name(k, p), p.shape,
                                             full_state_[static_cast<size_t>(k)].data() + p.offset,
                                             bf16_only(p) ? DType::BF16 : DType::F32));
      return out;
    }
    for (const ParamSpec& p : params_)
      for (int k = 0; k < gpu->optimizer_state_count(); ++k) {
        const int64_t base = p.offset;
        out.push_back(make_tensor_f32_reader(gpu->optimizer_state_name(k, p), p.shape,
                                             [gpu, k, base](int64_t first, int64_t count, float* dst) {
                                               gpu->read_optimizer_state(k, base + first, count, dst);
                                             }, bf16_only(p) ? DType::BF16 : DType::F32));
      }
    return out;
  }
  void load_optimizer(const TensorSource& read) override {
    for (const ParamSpec& p : params_)
      for (int k = 0; k < gpu_->optimizer_state_count(); ++k) {
        const std::string name = gpu_->optimizer_state_name(k, p);
        const std::vector<float> x = read(name, p.numel);
        DS_CHECK(static_cast<int64_t>(x.size()) == p.numel, "optimizer state {} has the wrong size", name);
        gpu_->write_optimizer_state(k, p.offset, p.numel, x.data());
      }
  }
  size_t peak_bytes() const override { return gpu_->peak_bytes(); }
  size_t planned_bytes() const override { return gpu_->planned_bytes(); }
  OptimizerState optimizer_state() const override { return gpu_->optimizer_state(); }
  Recompute recompute() const override { return gpu_->recompute(); }
  void set_profiler(cuda::StepProfiler* prof) override { gpu_->set_profiler(prof); }

 private:
  // A parameter whose weights and moments the engine keeps in bf16 only (stored BF16 in checkpoints: lossless).
  bool bf16_only(const ParamSpec& p) const {
    return gpu_->optimizer_state() == OptimizerState::Bf16 && is_matrix(p);
  }
  // Checkpoint entries whose values are copied from a device buffer slab by slab while the file is written;
  // lossless: BF16 for bf16-only weights, `dtype` (F32) for the others.
  std::vector<SaveTensor> buffer_tensors(GpuModel::Buffer which, DType dtype, bool lossless = false) {
    std::vector<SaveTensor> out;
    GpuModel* gpu = gpu_.get();
    for (const ParamSpec& p : params_) {
      const int64_t base = p.offset;
      out.push_back(make_tensor_f32_reader(p.name, p.shape, [gpu, which, base](int64_t first, int64_t count, float* dst) {
        gpu->read(which, base + first, count, dst);
      }, which != GpuModel::Buffer::Weights ? DType::F32 : lossless && bf16_only(p) ? DType::BF16 : stored_dtype(p, dtype)));
    }
    return out;
  }

  ModelConfig cfg_;
  std::vector<ParamSpec> params_;
  std::unique_ptr<GpuModel> gpu_;
  dist::Communicator* comm_ = nullptr;  // NCCL (distribute), else null: nothing to reduce
  bool sharded_ = false;                // --shard optimizer over comm_
  std::vector<std::vector<float>> full_state_;  // rank 0, between gather_for_save and release_after_save
};

}  // namespace

const char* optimizer_state_name(OptimizerState s) {
  switch (s) {
    case OptimizerState::Auto: return "auto";
    case OptimizerState::Fp32: return "fp32";
    case OptimizerState::Bf16: return "bf16";
  }
  return "?";
}
const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::Auto: return "auto";
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}
OptimizerState parse_optimizer_state(const std::string& s) {
  for (OptimizerState v : {OptimizerState::Auto, OptimizerState::Fp32, OptimizerState::Bf16})
    if (s == optimizer_state_name(v)) return v;
  fail("--optimizer-state must be auto, fp32 or bf16, got \"{}\"", s);
}
Recompute parse_recompute(const std::string& s) {
  for (Recompute v : {Recompute::Auto, Recompute::None, Recompute::Selective, Recompute::Full})
    if (s == recompute_name(v)) return v;
  fail("--recompute must be auto, none, selective or full, got \"{}\"", s);
}

void apply_memory_flags(GpuPlan& plan, const std::string& memory, const std::string& optimizer_state,
                        const std::string& recompute) {
  DS_CHECK(memory == "auto" || memory == "fixed", "--memory must be auto or fixed, got \"{}\"", memory);
  plan.optimizer_state = parse_optimizer_state(optimizer_state);
  plan.recompute = parse_recompute(recompute);
  if (memory == "fixed") {
    if (plan.optimizer_state == OptimizerState::Auto) plan.optimizer_state = OptimizerState::Fp32;
    if (plan.recompute == Recompute::Auto) plan.recompute = Recompute::Selective;
  }
}

std::string resolve_device(const std::string& device) {
  DS_CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda (got \"{}\")",
           device);
  if (device == "auto") return cuda_device_count() > 0 ? "cuda" : "cpu";
  return device;
}

std::unique_ptr<Engine> make_engine(const std::string& device, Qwen35Model host, const GpuPlan& plan) {
  const std::string d = resolve_device(device);
  if (d == "cuda") return std::make_unique<CudaEngine>(std::move(host), plan);
  DS_CHECK(plan.optimizer_state != OptimizerState::Bf16, "--optimizer-state bf16 is a mode of the GPU engine; the CPU "
           "engine keeps fp32 weights and moments (use --device cuda, or --optimizer-state auto / fp32)");
  return std::make_unique<CpuEngine>(std::move(host));
}

}  // namespace ds
