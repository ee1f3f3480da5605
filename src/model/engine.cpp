// The two engines behind model/engine.h: the CPU reference (Qwen35Model + host AdamW state) and the CUDA engine
// (GpuModel: everything on the device, checkpoints streamed from it in slabs).
#include "model/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <utility>

#include "core/cuda/device.h"
#include "core/error.h"
#include "core/log.h"
#include "dist/communicator.h"
#include "model/gpu_fp8.h"
#include "model/gpu_model.h"
#include "ops/adamw/bf16_state.h"
#include "ops/adamw/q8_state.h"

namespace ds {

namespace {

// AdamW state names in optimizer.safetensors (fp32, one pair per parameter).
std::string exp_avg_name(const ParamSpec& p) { return "exp_avg." + p.name; }
std::string exp_avg_sq_name(const ParamSpec& p) { return "exp_avg_sq." + p.name; }

// A LoRA run's optimizer state in optimizer.safetensors (either engine; docs/lora.md): "exp_avg.<PEFT key>",
// "exp_avg_sq.<PEFT key>" of every adapter tensor, fp32.
constexpr const char* kLoraExpAvg = "exp_avg.";
constexpr const char* kLoraExpAvgSq = "exp_avg_sq.";

// Every adapter tensor of `a`: its PEFT key, shape, and offset and size in the adapter's flat buffers.
struct LoraTensorRef {
  std::string key;
  std::vector<int64_t> shape;
  int64_t offset, numel;
};
std::vector<LoraTensorRef> lora_tensor_refs(const LoraAdapter& a) {
  const int64_t r = a.config().r;
  std::vector<LoraTensorRef> out;
  for (const LoraTensorSpec& s : a.specs()) {
    out.push_back({a.key(s, false), {r, s.in}, s.a_offset, r * s.in});
    out.push_back({a.key(s, true), {s.out, r}, s.b_offset, s.out * r});
  }
  return out;
}

// The per-parameter update of an engine-wide AdamW step: decay only where the ParamSpec says so.
ops::AdamWParams for_param(const ops::AdamWParams& p, const ParamSpec& s) {
  ops::AdamWParams q = p;
  q.weight_decay = s.weight_decay ? p.weight_decay : 0.0;
  return q;
}

// The CPU reference engine. ShardMode::Full (ZeRO-3) splits every unit of the model (model.h: param_units: the
// embedding, each layer, the head) evenly over the ranks (dist::even_counts of the unit's size) instead of the whole
// flat vector as ShardMode::Optimizer does: with the flat split a layer would lie on one or two ranks, and its
// gather would be a broadcast from them (one rank's link carrying the whole layer) and its reduce-scatter a reduce
// to them; split per unit, every rank sends and receives 1/N of every unit (a balanced ring), and a rank's share
// is its piece of each unit, in unit order (shares differ by at most one element per unit).
class CpuEngine final : public Engine, private UnitSource {
 public:
  explicit CpuEngine(Qwen35Model model) : model_(std::move(model)) {
    model_.materialize();
    hi_ = model_.num_parameters();
  }

  std::string device() const override { return "cpu"; }
  const ModelConfig& config() const override { return model_.config(); }
  const std::vector<ParamSpec>& params() const override { return model_.params(); }
  LossResult forward_backward(const PackedBatch& b, double grad_scale, double z_loss, ForwardCapture* cap) override {
    // An armed pass also when grad_scale is 0 (a step whose batch has no targets): its update still runs.
    if (gradients_ == Gradients::InBackward && (armed_ || grad_scale != 0.0))
      return forward_backward_in_backward(b, grad_scale, z_loss, cap);
    if (gradients_ == Gradients::Bf16 && grad_scale != 0.0) return forward_backward_bf16(b, grad_scale, z_loss, cap);
    if (!full()) return model_.forward_backward(b, grad_scale, z_loss, cap);
    begin_units(grad_scale != 0.0 ? order_fb_ : order_f_);
    const LossResult r = model_.forward_backward(b, grad_scale, z_loss, cap);
    end_units();
    return r;
  }
  // ShardMode::Full: the gathers of a forward, in its order, each unit released at once (nothing computed).
  void forward_without_batch() override {
    if (!full()) return;
    begin_units(order_f_);
    for (int64_t u : order_f_) {
      acquire(u);
      release(u);
    }
    end_units();
  }
  void zero_grads() override {
    if (LoraAdapter* a = model_.adapter()) return a->zero_grads();  // the base is frozen: no base gradients
    grad_micro_ = 0;
    std::fill(grad_bf16_.begin(), grad_bf16_.end(), uint16_t{0});
    if (full()) std::fill(g_.begin(), g_.end(), 0.0f);
    else model_.zero_grads();
  }
  std::vector<float> last_logits(const PackedBatch& b) override { return model_.last_logits(b); }
  double grad_sum_squares() override {
    if (gradients_ == Gradients::InBackward) return in_backward_sum_squares_;
    if (LoraAdapter* a = model_.adapter()) {  // the adapters' gradients, the same (reduced) on every rank
      if (a->grads().empty()) a->zero_grads();
      return ops::sum_squares(a->grads().data(), static_cast<int64_t>(a->grads().size()));
    }
    if (!sharded() && !full())
      return ops::sum_squares(model_.grads().data(), static_cast<int64_t>(model_.grads().size()));
    // This rank's share, then every rank's.
    double s = full() ? ops::sum_squares(g_.data(), static_cast<int64_t>(g_.size()))
                      : ops::sum_squares(model_.grads().data() + lo_, hi_ - lo_);
    comm_->all_reduce_sum(&s, 1);
    return s;
  }
  void arm_in_backward(const ops::AdamWParams* update) override {
    DS_CHECK(gradients_ == Gradients::InBackward, "internal: arm_in_backward() needs --gradients in-backward");
    armed_ = true;
    if (update) update_ = *update;
    update_armed_ = update != nullptr;
  }
  Gradients gradients() const override { return gradients_; }
  void begin_step(int64_t step) override { grad_step_ = step; }
  void distribute(dist::Communicator& comm, ShardMode mode) override {
    DS_CHECK(m_.empty(), "distribute() after the optimizer state exists");
    DS_CHECK(gradients_ == Gradients::Fp32 || comm.world() == 1, "--gradients {} runs on one rank (this launch has "
             "{}): use --gradients fp32", gradients_name(gradients_), comm.world());
    DS_CHECK(!comm.on_device(), "{}: the CPU engine's ranks talk over MPI (mpirun), not {}",
             dist::describe(comm.launch()), comm.backend());
    DS_CHECK(!model_.adapter() || comm.world() == 1 || mode == ShardMode::None, "--shard {}: LoRA trains with "
             "--shard none (every rank holds the adapters' small AdamW state; the frozen base has none)",
             mode == ShardMode::Full ? "full" : "optimizer");
    comm_ = &comm;
    mode_ = mode;
    if (model_.adapter()) return;  // every rank keeps the whole adapter and its state
    if (full()) return shard_fully();
    if (!sharded()) return;
    counts_ = dist::even_counts(model_.num_parameters(), comm.world());
    lo_ = 0;
    for (int r = 0; r < comm.rank(); ++r) lo_ += counts_[static_cast<size_t>(r)];
    hi_ = lo_ + counts_[static_cast<size_t>(comm.rank())];
  }
  void reduce_grads() override {
    if (!comm_ || comm_->world() == 1 || full()) return;  // full: reduce-scattered unit by unit in the backward
    if (LoraAdapter* a = model_.adapter()) {  // only the adapters have gradients
      if (a->grads().empty()) a->zero_grads();  // a rank without a micro-batch
      return comm_->all_reduce_sum(a->grads().data(), static_cast<int64_t>(a->grads().size()));
    }
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
    DS_CHECK(gradients_ != Gradients::InBackward, "internal: optimizer_step() with --gradients in-backward (the "
             "update runs in the backward: arm_in_backward)");
    adamw_step(p);
  }
  void set_gradients(Gradients g) {
    DS_CHECK(g == Gradients::Fp32 || !model_.adapter(), "--gradients {} with a LoRA adapter is not supported: use "
             "--gradients fp32", gradients_name(g));
    gradients_ = g;
  }

 private:
  // Gradients::InBackward on the CPU engine: the same semantics over the host buffers (the memory it saves is the
  // GPU engine's point): the armed pass's gradients are made from zero, their sum of squares kept, and the armed
  // update applied after the backward. Bitwise the fp32 mode's step, also for grad_scale 0 (no backward: the
  // gradients stay zero, their sum is 0 and the update runs over them, as the fp32 mode's step over its zeroed
  // buffer does).
  LossResult forward_backward_in_backward(const PackedBatch& b, double grad_scale, double z_loss, ForwardCapture* cap) {
    DS_CHECK(armed_, "internal: a --gradients in-backward backward without arm_in_backward()");
    armed_ = false;
    model_.zero_grads();
    const LossResult r = model_.forward_backward(b, grad_scale, z_loss, cap);
    in_backward_sum_squares_ = ops::sum_squares(model_.grads().data(), static_cast<int64_t>(model_.grads().size()));
    if (update_armed_) adamw_step(update_);
    return r;
  }
  // Gradients::Bf16 on the CPU engine, bitwise the GPU engine's accumulation (model/engine.h): the micro-batch's
  // gradients are made from zero in the model's fp32 buffer (the GPU's slots), added into grad_bf16_ (bf16 bits
  // [P], the GPU's bf16 buffer) with stochastic rounding keyed by (grad_step_, grad_micro_, flat index)
  // (ops::accumulate_grad_bf16), and the model's buffer then holds those values widened exactly, which the grad norm
  // and the AdamW update read (as the GPU's kernels widen theirs).
  LossResult forward_backward_bf16(const PackedBatch& b, double grad_scale, double z_loss, ForwardCapture* cap) {
    DS_CHECK(!full() && !sharded(), "internal: --gradients bf16 runs on one rank");
    model_.zero_grads();
    const LossResult r = model_.forward_backward(b, grad_scale, z_loss, cap);
    std::vector<float>& g = model_.grads();
    grad_bf16_.resize(g.size(), uint16_t{0});  // zeros when the step's first backward comes
    ops::accumulate_grad_bf16(grad_bf16_.data(), g.data(), static_cast<int64_t>(g.size()),
                              ops::bf16_state::grad_key(grad_step_, grad_micro_++), 0);
    for (size_t i = 0; i < g.size(); ++i) g[i] = ops::bf16_state::widen(grad_bf16_[i]);
    return r;
  }
  std::vector<uint16_t> grad_bf16_;
  int64_t grad_step_ = 0, grad_micro_ = 0;
  Gradients gradients_ = Gradients::Fp32;
  bool armed_ = false, update_armed_ = false;
  ops::AdamWParams update_;
  double in_backward_sum_squares_ = 0;

 public:
  void adamw_step(const ops::AdamWParams& p) {
    moments();
    if (LoraAdapter* a = model_.adapter()) {  // the adapters only; decay on every lora_A / lora_B (HF Trainer's rule)
      DS_CHECK(a->grads().size() == a->values().size(), "optimizer step before any gradient");
      return ops::adamw_update(a->values().data(), a->grads().data(), m_.data(), v_.data(),
                               static_cast<int64_t>(a->values().size()), p);
    }
    if (full()) {  // this rank's share only; the next forward gathers the updated weights unit by unit
      for (const Segment& s : segments_)
        ops::adamw_update(w_.data() + s.at, g_.data() + s.at, m_.data() + s.at, v_.data() + s.at, s.n,
                          for_param(p, model_.params()[s.param]));
      return;
    }
    DS_CHECK(model_.grads().size() == model_.weights().size(), "optimizer step before any gradient");
    float *w = model_.weights().data(), *g = model_.grads().data();
    for (const ParamSpec& s : model_.params()) {
      const int64_t a = std::max(s.offset, lo_), b = std::min(s.offset + s.numel, hi_);
      if (a < b) ops::adamw_update(w + a, g + a, m_.data() + (a - lo_), v_.data() + (a - lo_), b - a, for_param(p, s));
    }
    if (sharded()) comm_->all_gather(w, counts_);
  }
  std::vector<SaveTensor> weight_tensors(DType dtype) override {
    if (!full()) return model_.to_tensors(model_.weights(), dtype);
    DS_CHECK(!w_full_.empty(), "weight_tensors() of fully sharded weights without gather_for_save()");
    return model_.to_tensors(w_full_, dtype);
  }
  std::vector<SaveTensor> optimizer_tensors() override {
    moments();
    if (const LoraAdapter* a = model_.adapter()) return lora_moments(*a);
    const bool split = sharded() || full();
    DS_CHECK(!split || !m_full_.empty(), "optimizer_tensors() of a sharded state without gather_for_save()");
    const float* m = split ? m_full_.data() : m_.data();
    const float* v = split ? v_full_.data() : v_.data();
    std::vector<SaveTensor> out;
    for (const ParamSpec& p : model_.params()) {
      out.push_back(make_tensor_f32_view(exp_avg_name(p), p.shape, m + p.offset));
      out.push_back(make_tensor_f32_view(exp_avg_sq_name(p), p.shape, v + p.offset));
    }
    return out;
  }
  void gather_for_save() override {
    if (full()) return gather_fully();
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
    std::vector<float>().swap(w_full_);
  }
  // Whole moments from the checkpoint (any world size wrote them); this rank keeps its share.
  void load_optimizer(const TensorSource& read, const CodeSource& /*codes: fp32 host moments*/ = nullptr) override {
    moments();
    if (const LoraAdapter* a = model_.adapter()) {  // lora_moments' names
      for (const LoraTensorRef& t : lora_tensor_refs(*a))
        for (auto [prefix, dst] : {std::pair{kLoraExpAvg, &m_}, std::pair{kLoraExpAvgSq, &v_}}) {
          const std::vector<float> x = read(prefix + t.key, t.numel, -1);
          DS_CHECK(static_cast<int64_t>(x.size()) == t.numel, "optimizer state for {} has the wrong size", t.key);
          std::copy(x.begin(), x.end(), dst->begin() + t.offset);
        }
      return;
    }
    size_t seg = 0;  // full: segments_ in flat order, at most one per parameter
    for (size_t k = 0; k < model_.params().size(); ++k) {
      const ParamSpec& p = model_.params()[k];
      const std::vector<float> em = read(exp_avg_name(p), p.numel, p.offset),
                               ev = read(exp_avg_sq_name(p), p.numel, p.offset);
      DS_CHECK(static_cast<int64_t>(em.size()) == p.numel && static_cast<int64_t>(ev.size()) == p.numel,
               "optimizer state for {} has the wrong size", p.name);
      if (full()) {
        for (; seg < segments_.size() && segments_[seg].param == k; ++seg) {
          const Segment& s = segments_[seg];
          std::copy_n(em.begin() + (s.flat - p.offset), s.n, m_.begin() + s.at);
          std::copy_n(ev.begin() + (s.flat - p.offset), s.n, v_.begin() + s.at);
        }
        continue;
      }
      const int64_t a = std::max(p.offset, lo_), b = std::min(p.offset + p.numel, hi_);
      if (a >= b) continue;
      std::copy(em.begin() + (a - p.offset), em.begin() + (b - p.offset), m_.begin() + (a - lo_));
      std::copy(ev.begin() + (a - p.offset), ev.begin() + (b - p.offset), v_.begin() + (a - lo_));
    }
  }
  std::vector<SaveTensor> grad_tensors() override {
    DS_CHECK(!full(), "grad_tensors(): the gradients of --shard full are spread over the ranks (each holds its "
             "share only)");
    if (LoraAdapter* a = model_.adapter()) {  // the base is frozen: d loss / d every adapter tensor, PEFT's keys
      if (a->grads().empty()) a->zero_grads();
      return a->tensors(a->grads());
    }
    if (model_.grads().size() != model_.weights().size()) model_.zero_grads();
    return model_.to_tensors(model_.grads());
  }

  LoraAdapter* adapter() override { return model_.adapter(); }

 private:
  // The adapters' AdamW moments, as checkpoint tensors: "exp_avg.<PEFT key>", "exp_avg_sq.<PEFT key>" (F32 views of
  // m_ / v_, which mirror the adapter's flat buffer).
  std::vector<SaveTensor> lora_moments(const LoraAdapter& a) {
    std::vector<SaveTensor> out;
    for (auto [prefix, buf] : {std::pair{kLoraExpAvg, &m_}, std::pair{kLoraExpAvgSq, &v_}})
      for (SaveTensor t : a.tensors(*buf)) {
        t.name = prefix + t.name;
        out.push_back(std::move(t));
      }
    return out;
  }
  bool sharded() const { return comm_ && comm_->world() > 1 && mode_ == ShardMode::Optimizer; }
  bool full() const { return comm_ && comm_->world() > 1 && mode_ == ShardMode::Full; }
  // The AdamW moments of [lo_, hi_) (full: of this rank's share, w_'s layout) exist from the first use of the
  // optimizer on (evaluation never allocates them).
  void moments() {
    const size_t n = model_.adapter() ? model_.adapter()->values().size()
                     : full()         ? w_.size()
                                      : static_cast<size_t>(hi_ - lo_);
    if (m_.empty()) m_.assign(n, 0.0f);
    if (v_.empty()) v_.assign(n, 0.0f);
  }

  // ---- ShardMode::Full
  // Each unit's split, this rank's piece of it and the piece's segments (piece ∩ parameter, for AdamW's decay
  // flag); this rank's share of the weights (w_) and of the reduced gradients (g_), then the model's whole weights
  // released: from here on it reads them from acquire(). The gather and gradient buffers are allocated here, once.
  void shard_fully() {
    const std::vector<ParamUnit>& units = model_.units();
    const int rank = comm_->rank();
    int64_t share = 0, largest = 0, largest_piece = 0;
    for (const ParamUnit& u : units) {
      UnitShard us;
      us.parts = comm_->parts(dist::even_counts(u.size(), comm_->world()));
      us.lo = u.lo + us.parts.displs[static_cast<size_t>(rank)];
      us.n = us.parts.counts[static_cast<size_t>(rank)];
      us.at = share;
      share += us.n;
      largest = std::max(largest, u.size());
      largest_piece = std::max(largest_piece, us.n);
      for (size_t k = 0; k < model_.params().size(); ++k) {
        const ParamSpec& p = model_.params()[k];
        const int64_t a = std::max(p.offset, us.lo), b = std::min(p.offset + p.numel, us.lo + us.n);
        if (a < b) segments_.push_back({a, us.at + (a - us.lo), b - a, k});
      }
      shards_.push_back(std::move(us));
    }
    w_.resize(static_cast<size_t>(share));
    for (const UnitShard& us : shards_)
      std::copy_n(model_.weights().begin() + us.lo, us.n, w_.begin() + us.at);
    g_.assign(static_cast<size_t>(share), 0.0f);
    for (Slot& s : slots_) s.buf.assign(static_cast<size_t>(largest), 0.0f);
    gbuf_.assign(static_cast<size_t>(largest), 0.0f);
    piece_.assign(static_cast<size_t>(largest_piece), 0.0f);
    order_fb_ = model_.unit_order(true);
    order_f_ = model_.unit_order(false);
    model_.release_buffers();
    model_.set_unit_source(this);
    const double mb = 1e-6 * sizeof(float);
    log_info("--shard full: rank {} keeps {} of {} parameters: weights, gradients and AdamW moments {:.1f} MB "
             "(4 x {:.1f}), gather buffers 2 x {:.1f} MB, a gradient buffer {:.1f} MB", rank, share,
             model_.num_parameters(), 4 * mb * static_cast<double>(share), mb * static_cast<double>(share),
             mb * static_cast<double>(largest), mb * static_cast<double>(largest));
  }
  // The whole weights and moments on every rank (each unit all-gathered in place) until release_after_save.
  void gather_fully() {
    moments();
    const size_t n = static_cast<size_t>(model_.num_parameters());
    w_full_.assign(n, 0.0f);
    m_full_.assign(n, 0.0f);
    v_full_.assign(n, 0.0f);
    for (size_t u = 0; u < shards_.size(); ++u) {
      const UnitShard& us = shards_[u];
      const int64_t lo = model_.units()[u].lo;
      for (auto [mine, whole] : {std::pair{&w_, &w_full_}, std::pair{&m_, &m_full_}, std::pair{&v_, &v_full_}}) {
        std::copy_n(mine->begin() + us.at, us.n, whole->begin() + us.lo);
        comm_->all_gather(whole->data() + lo, us.parts.counts);
      }
    }
  }
  // A forward_backward's (or forward_without_batch's) units, in `order`: the two buffers start gathering the
  // first two at once.
  void begin_units(const std::vector<int64_t>& order) {
    for (const Slot& s : slots_) DS_CHECK(s.item < 0, "internal: a unit buffer still in use at the start of a step");
    order_ = &order;
    next_ = cur_ = 0;
    pump();
  }
  void end_units() {
    DS_CHECK(cur_ == order_->size(), "internal: the model acquired {} of its {} planned units", cur_, order_->size());
    order_ = nullptr;
  }
  // Every free buffer starts gathering the next planned unit (MPI_Iallgatherv: the prefetch of the next layer
  // while the current one computes). Every rank starts them in the same order (the plan's).
  void pump() {
    for (Slot& s : slots_) {
      if (next_ >= order_->size()) return;
      if (s.item >= 0) continue;
      const UnitShard& us = shards_[static_cast<size_t>((*order_)[next_])];
      std::copy_n(w_.begin() + us.at, us.n, s.buf.begin() + us.parts.displs[static_cast<size_t>(comm_->rank())]);
      s.item = static_cast<int64_t>(next_++);
      s.ticket = comm_->start_all_gather(s.buf.data(), us.parts);
    }
  }
  float* acquire(int64_t u) override {
    DS_CHECK(order_ && cur_ < order_->size() && (*order_)[cur_] == u, "internal: unit {} acquired out of the "
             "planned order", u);
    for (Slot& s : slots_)
      if (s.item == static_cast<int64_t>(cur_)) {
        if (s.ticket >= 0) comm_->wait(s.ticket);
        s.ticket = -1;
        s.held = true;
        ++cur_;
        return s.buf.data();
      }
    fail("internal: unit {} (planned unit {}) is in no gather buffer", u, cur_);
  }
  void release(int64_t u) override {
    for (Slot& s : slots_)
      if (s.held && (*order_)[static_cast<size_t>(s.item)] == u) {
        s.held = false;
        s.item = -1;
        pump();
        return;
      }
    fail("internal: unit {} released but not held", u);
  }
  float* grads(int64_t u) override {
    std::fill_n(gbuf_.begin(), model_.units()[static_cast<size_t>(u)].size(), 0.0f);
    return gbuf_.data();
  }
  // The unit's gradient summed over the ranks, this rank's piece of it (MPI_Reduce_scatter) added to its share.
  void grads_done(int64_t u) override {
    const UnitShard& us = shards_[static_cast<size_t>(u)];
    comm_->reduce_scatter_sum(gbuf_.data(), piece_.data(), us.parts);
    float* g = g_.data() + us.at;
    for (int64_t i = 0; i < us.n; ++i) g[i] += piece_[static_cast<size_t>(i)];
  }
  struct UnitShard {
    dist::Communicator::Parts parts;  // the unit split over the ranks
    int64_t lo = 0, n = 0;            // this rank's piece: flat [lo, lo + n)
    int64_t at = 0;                   // where the piece starts in this rank's share (w_, g_, m_, v_)
  };
  struct Segment {
    int64_t flat, at, n;  // flat [flat, flat + n) at share offset `at`
    size_t param;         // the parameter it lies in
  };
  // One of the two gather buffers (the largest unit's size): which planned unit it holds (-1: free), the started
  // gather (-1: done) and whether the model holds it (between acquire and release).
  struct Slot {
    std::vector<float> buf;
    int64_t item = -1;
    int ticket = -1;
    bool held = false;
  };
  std::vector<UnitShard> shards_;   // per unit (model_.units())
  std::vector<Segment> segments_;   // in flat order
  std::vector<float> w_, g_;        // this rank's share of the weights and of the reduced gradients
  std::vector<float> w_full_;       // the whole weights, only between gather_for_save and release_after_save
  Slot slots_[2];
  std::vector<float> gbuf_, piece_;  // a unit's gradient as the model adds it; its reduce-scattered piece
  std::vector<int64_t> order_fb_, order_f_;  // the model's unit_order with and without a backward
  const std::vector<int64_t>* order_ = nullptr;
  size_t next_ = 0, cur_ = 0;  // the next planned unit to gather, and to be acquired
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
      : cfg_(host.config()), params_(host.params()), gpu_(std::make_unique<GpuModel>(host, plan)),
        lora_(gpu_->adapter() ? lora_tensor_refs(*gpu_->adapter()) : std::vector<LoraTensorRef>{}) {
    host.release_buffers();  // the device holds the only copy from here on
    // The optimizer step overlapped with the next step's start (GpuModel::adamw_step); DELTASTACK_ASYNC_OPTIMIZER=0
    // runs it in line.
    gpu_->set_async_optimizer(engine_knob("DELTASTACK_ASYNC_OPTIMIZER"));
  }

  std::string device() const override { return "cuda"; }
  const ModelConfig& config() const override { return cfg_; }
  const std::vector<ParamSpec>& params() const override { return params_; }
  LossResult forward_backward(const PackedBatch& b, double grad_scale, double z_loss, ForwardCapture* cap) override {
    return gpu_->forward_backward(b, grad_scale, z_loss, cap);
  }
  std::vector<float> last_logits(const PackedBatch& b) override { return gpu_->last_logits(b); }
  void zero_grads() override { gpu_->zero_grads(); }
  void begin_step(int64_t step) override { gpu_->begin_step(step); }
  // Data parallel over NCCL (at world size 1 under a launcher too: the same path, sums over one rank, so the
  // losses are the plain run's bits). --shard none: every rank keeps the whole state and all-reduces the fp32
  // gradients on the step's stream. --shard optimizer (ZeRO-1; the plan was built with this rank's share,
  // GpuPlan::shard_world): the gradients are reduce-scattered in place, each rank updates only its share of the flat
  // parameters with only its share of the moments, and the updated weights are all-gathered in place (the bf16
  // copy, and the fp32 master: flat in the fp32 layout, by each rank's range of the small parameters' compacted
  // master in the bf16 layout).
  void distribute(dist::Communicator& comm, ShardMode mode) override {
    DS_CHECK(mode != ShardMode::Full, "--shard full is built for the CPU engine only: the GPU engine has no "
             "per-layer parameter gathers yet (train with --device cpu, or use --shard none)");
    DS_CHECK(comm.world() == 1 || comm.on_device(), "{}: the GPU engine's ranks need the NCCL communicator, not {} "
             "(start them with torchrun or mpirun and --device cuda)", dist::describe(comm.launch()), comm.backend());
    DS_CHECK(gradients() == Gradients::Fp32 || comm.world() == 1, "--gradients {} runs on one rank (this launch has "
             "{}): use --gradients fp32", gradients_name(gradients()), comm.world());
    // No gradient buffer to sum (in-backward), or a bf16 one the reduce does not take (bf16): one rank, nothing to
    // sum, so no communicator (reduce_grads does nothing).
    if (gradients() == Gradients::Bf16) return;
    DS_CHECK(!gpu_->adapter() || comm.world() == 1 || mode == ShardMode::None, "--shard optimizer: LoRA trains "
             "with --shard none (every rank holds the adapters' small AdamW state; the frozen base has none)");
    if (comm.on_device()) comm_ = &comm;
    // The overlapped reduce goes unit by unit over the base's gradients; a LoRA run all-reduces its adapters' after
    // the backward (reduce_grads: device_grads are theirs).
    overlap_ = engine_knob("DELTASTACK_DP_OVERLAP") && !gpu_->adapter();
    const GpuModel::ShardBuffers b = gpu_->shard_buffers();
    sharded_ = mode == ShardMode::Optimizer && comm_;
    if (sharded_) gpu_->set_async_optimizer(false);  // the all-gathers follow the update on the step's stream
    DS_CHECK(!sharded_ || b.world == comm.world(), "{}: --shard optimizer needs an "
             "engine planned for {} ranks' shares (GpuPlan::shard_world)", dist::describe(comm.launch()), comm.world());
  }
  void reduce_grads_during_next_backward() override {
    if (!comm_ || sharded_ || !overlap_) return;
    gpu_->reduce_grads_during_next_backward([this](float* x, int64_t n, void* stream) {
      comm_->device_all_reduce_sum(x, n, stream);
    });
  }
  void reduce_grads() override {
    if (!comm_) return;
    if (!sharded_) {
      if (gpu_->join_reduce()) return;  // already summed, layer by layer, during the last backward
      const GpuModel::DeviceGrads g = gpu_->device_grads();
      comm_->device_all_reduce_sum(g.data, g.count, g.stream);
      return;
    }
    const GpuModel::ShardBuffers b = gpu_->shard_buffers();
    comm_->device_reduce_scatter_sum(b.grads, b.grads + comm_->rank() * b.share, b.share, b.stream);
  }
  void arm_in_backward(const ops::AdamWParams* update) override { gpu_->arm_in_backward(update); }
  Gradients gradients() const override { return gpu_->gradients(); }
  double grad_sum_squares() override {
    if (!sharded_) return gpu_->grad_sum_squares();
    double s = gpu_->share_grad_sum_squares();  // this rank's share, then every rank's
    comm_->all_reduce_sum(&s, 1);
    return s;
  }
  void optimizer_step(const ops::AdamWParams& p) override {
    gpu_->adamw_step(p, p.weight_decay);
    adapter_stale_ = true;
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
  std::vector<SaveTensor> grad_tensors() override {
    if (gpu_->adapter()) return lora_tensors("", GpuModel::LoraBuffer::Grads);  // the base is frozen
    return buffer_tensors(GpuModel::Buffer::Grads, DType::F32);
  }
  // The optimizer names its own state tensors (AdamW: exp_avg.<name>, exp_avg_sq.<name>; model/gpu_optimizer.h).
  std::vector<SaveTensor> optimizer_tensors() override {
    std::vector<SaveTensor> out;
    if (gpu_->adapter()) {  // the adapters' moments, the CPU engine's names
      out = lora_tensors(kLoraExpAvg, GpuModel::LoraBuffer::ExpAvg);
      for (SaveTensor& t : lora_tensors(kLoraExpAvgSq, GpuModel::LoraBuffer::ExpAvgSq)) out.push_back(std::move(t));
      return out;
    }
    GpuModel* gpu = gpu_.get();
    if (sharded_) {
      DS_CHECK(!full_state_.empty(), "optimizer_tensors() of a sharded state without gather_for_save() on rank 0");
      for (const ParamSpec& p : params_)
        for (int k = 0; k < gpu->optimizer_state_count(); ++k)
          out.push_back(make_tensor_f32_view(gpu->optimizer_state_name(k, p), p.shape,
                                             full_state_[static_cast<size_t>(k)].data() + p.offset,
                                             moments_dtype(p)));
      return out;
    }
    for (size_t pi = 0; pi < params_.size(); ++pi) {
      const ParamSpec& p = params_[pi];
      for (int k = 0; k < gpu->optimizer_state_count(); ++k) {
        const int64_t base = p.offset;
        const std::string name = gpu->optimizer_state_name(k, p);
        if (!gpu->optimizer_codes_8bit(pi)) {
          out.push_back(make_tensor_f32_reader(name, p.shape, [gpu, k, base](int64_t first, int64_t count, float* dst) {
            gpu->read_optimizer_state(k, base + first, count, dst);
          }, moments_dtype(p)));
          continue;
        }
        // The 8bit state's codes and block scales as they are (moment_scale_name, model/engine.h): bitwise.
        out.push_back(make_tensor_bytes_reader(name, DType::U8, p.shape, [gpu, k, base](int64_t first, int64_t count,
                                                                                    uint8_t* dst) {
          gpu->read_optimizer_codes(k, base + first, count, dst);
        }));
        out.push_back(make_tensor_f32_reader(moment_scale_name(name), {ops::q8_state::num_blocks(p.offset, p.numel)},
                                             [gpu, k, pi](int64_t first, int64_t count, float* dst) {
                                               gpu->read_optimizer_block_scales(k, pi, first, count, dst);
                                             }));
      }
    }
    return out;
  }
  void load_optimizer(const TensorSource& read, const CodeSource& codes = nullptr) override {
    if (gpu_->adapter()) {
      for (const LoraTensorRef& t : lora_)
        for (auto [prefix, which] : {std::pair{kLoraExpAvg, GpuModel::LoraBuffer::ExpAvg},
                                     std::pair{kLoraExpAvgSq, GpuModel::LoraBuffer::ExpAvgSq}}) {
          const std::vector<float> x = read(prefix + t.key, t.numel, -1);
          DS_CHECK(static_cast<int64_t>(x.size()) == t.numel, "optimizer state for {} has the wrong size", t.key);
          gpu_->write_lora(which, t.offset, t.numel, x.data());
        }
      return;
    }
    std::string c;
    std::vector<float> s;
    for (size_t pi = 0; pi < params_.size(); ++pi)
      for (int k = 0; k < gpu_->optimizer_state_count(); ++k) {
        const ParamSpec& p = params_[pi];
        const std::string name = gpu_->optimizer_state_name(k, p);
        if (codes && gpu_->optimizer_codes_8bit(pi) && codes(name, p.numel, p.offset, c, s)) {
          gpu_->write_optimizer_codes(k, p.offset, p.numel, reinterpret_cast<const uint8_t*>(c.data()));
          gpu_->write_optimizer_block_scales(k, pi, 0, static_cast<int64_t>(s.size()), s.data());
          continue;
        }
        const std::vector<float> x = read(name, p.numel, p.offset);
        DS_CHECK(static_cast<int64_t>(x.size()) == p.numel, "optimizer state {} has the wrong size", name);
        gpu_->write_optimizer_state(k, p.offset, p.numel, x.data());
      }
  }
  size_t peak_bytes() const override { return gpu_->peak_bytes(); }
  size_t planned_bytes() const override { return gpu_->planned_bytes(); }
  // A LoRA run: the adapters' state (fp32 masters and moments; the frozen base has none).
  OptimizerState optimizer_state() const override {
    return gpu_->adapter() ? OptimizerState::Fp32 : gpu_->optimizer_state();
  }
  Recompute recompute() const override { return gpu_->recompute(); }
  std::string recompute_label() const override { return gpu_->recompute_label(); }
  // The host adapter with the device's current values (copied back after an update, once).
  LoraAdapter* adapter() override {
    LoraAdapter* a = gpu_->adapter();
    if (a && adapter_stale_) {
      gpu_->read_lora(GpuModel::LoraBuffer::Values, 0, static_cast<int64_t>(a->values().size()), a->values().data());
      adapter_stale_ = false;
    }
    return a;
  }
  void set_lora_dropout_key(std::optional<uint64_t> key) override {
    if (LoraAdapter* a = gpu_->adapter()) a->set_dropout_key(key);  // no copy of the values needed
  }
  Precision precision() const override { return gpu_->precision(); }
  void set_profiler(cuda::StepProfiler* prof) override { gpu_->set_profiler(prof); }

 private:
  // A parameter whose weights the engine keeps in bf16 only (stored BF16 in checkpoints: lossless).
  bool bf16_only(const ParamSpec& p) const {
    return bf16_weights(gpu_->optimizer_state()) && is_matrix(p);
  }
  // The dtype that stores a parameter's moments losslessly: BF16 for the bf16 state's bf16 moments; F32 otherwise
  // (where the 8-bit state is sharded, its moments dequantized: they re-quantize bitwise, ops/adamw/q8_state.h;
  // unsharded they are stored as their codes, optimizer_tensors).
  DType moments_dtype(const ParamSpec& p) const {
    return gpu_->optimizer_state() == OptimizerState::Bf16 && is_matrix(p) ? DType::BF16 : DType::F32;
  }
  // The adapters' device buffer `which` under "<prefix><PEFT key>", streamed like the weights (fp32).
  std::vector<SaveTensor> lora_tensors(const std::string& prefix, GpuModel::LoraBuffer which) {
    std::vector<SaveTensor> out;
    GpuModel* gpu = gpu_.get();
    for (const LoraTensorRef& t : lora_) {
      const int64_t base = t.offset;
      out.push_back(make_tensor_f32_reader(prefix + t.key, t.shape, [gpu, which, base](int64_t first, int64_t count,
                                                                                       float* dst) {
        gpu->read_lora(which, base + first, count, dst);
      }));
    }
    return out;
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
  std::vector<LoraTensorRef> lora_;  // a LoRA run's adapter tensors (empty otherwise)
  bool adapter_stale_ = false;       // the host adapter's values are older than the device's
  dist::Communicator* comm_ = nullptr;  // NCCL (distribute), else null: nothing to reduce
  bool sharded_ = false;                // --shard optimizer over comm_
  bool overlap_ = true;                 // the --shard none all-reduce overlapped with the last backward
  std::vector<std::vector<float>> full_state_;  // rank 0, between gather_for_save and release_after_save
};

}  // namespace

const char* optimizer_state_name(OptimizerState s) {
  switch (s) {
    case OptimizerState::Auto: return "auto";
    case OptimizerState::Fp32: return "fp32";
    case OptimizerState::Bf16: return "bf16";
    case OptimizerState::EightBit: return "8bit";
  }
  return "?";
}
const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::Auto: return "auto";
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Mlp: return "mlp";
    case Recompute::Full: return "full";
  }
  return "?";
}
OptimizerState parse_optimizer_state(const std::string& s) {
  for (OptimizerState v : {OptimizerState::Auto, OptimizerState::Fp32, OptimizerState::Bf16, OptimizerState::EightBit})
    if (s == optimizer_state_name(v)) return v;
  fail("--optimizer-state must be auto, fp32, bf16 or 8bit, got \"{}\"", s);
}
namespace {
constexpr Recompute kRecomputes[] = {Recompute::Auto, Recompute::None, Recompute::Selective, Recompute::Mlp,
                                     Recompute::Full};
}  // namespace
std::string recompute_choices() {
  std::string out;
  const size_t n = std::size(kRecomputes);
  for (size_t k = 0; k < n; ++k)
    out += (k == 0 ? "" : k + 1 == n ? " or " : ", ") + std::string(recompute_name(kRecomputes[k]));
  return out;
}
Recompute parse_recompute(const std::string& s) {
  for (Recompute v : kRecomputes)
    if (s == recompute_name(v)) return v;
  fail("--recompute must be {}, got \"{}\"", recompute_choices(), s);
}

const char* gradients_name(Gradients g) {
  switch (g) {
    case Gradients::Auto: return "auto";
    case Gradients::Fp32: return "fp32";
    case Gradients::InBackward: return "in-backward";
    case Gradients::Bf16: return "bf16";
  }
  return "?";
}
Gradients parse_gradients(const std::string& s) {
  for (Gradients v : {Gradients::Auto, Gradients::Fp32, Gradients::InBackward, Gradients::Bf16})
    if (s == gradients_name(v)) return v;
  fail("--gradients must be auto, fp32, in-backward or bf16, got \"{}\"", s);
}

InBackwardStep in_backward_step(Engine& e, const PackedBatch& b, double grad_scale, double z_loss,
                                ops::AdamWParams p, double clip, bool norm_first) {
  InBackwardStep out;
  p.grad_scale = 1.0;
  if (clip > 0 || norm_first) {
    e.arm_in_backward(nullptr);
    const LossResult first = e.forward_backward(b, grad_scale, z_loss);
    const double sumsq = e.grad_sum_squares(), norm = std::sqrt(sumsq);
    out.result = first;
    out.grad_sum_squares = sumsq;
    if (!std::isfinite(first.loss_sum) || !std::isfinite(norm)) return out;
    p.grad_scale = clip_factor(norm, clip);
    e.arm_in_backward(&p);
    out.result = e.forward_backward(b, grad_scale, z_loss);
    out.updated = true;
    // The same batch and weights: the same bits (the engines are deterministic); a difference would make the
    // clip factor belong to another gradient.
    DS_CHECK(out.result.loss_sum == first.loss_sum && e.grad_sum_squares() == sumsq, "--gradients in-backward: the "
             "updating pass's loss {} / gradient sum of squares {} differ from the norm pass's {} / {} (a "
             "nondeterministic kernel?); use --gradients fp32", out.result.loss_sum, e.grad_sum_squares(),
             first.loss_sum, sumsq);
    return out;
  }
  e.arm_in_backward(&p);
  out.result = e.forward_backward(b, grad_scale, z_loss);
  out.grad_sum_squares = e.grad_sum_squares();
  out.updated = true;
  return out;
}

const char* precision_name(Precision p) { return p == Precision::Fp8 ? "fp8" : "bf16"; }
Precision parse_precision(const std::string& s) {
  for (Precision v : {Precision::Bf16, Precision::Fp8})
    if (s == precision_name(v)) return v;
  fail("--precision must be bf16 or fp8, got \"{}\"", s);
}

void check_fp8_lm_head(bool fp8_lm_head, Precision precision, double z_loss) {
  DS_CHECK(!fp8_lm_head || precision == Precision::Fp8, "--fp8-lm-head needs --precision fp8 (it puts the lm "
           "head's gradient GEMMs in FP8 beside the decoder's; docs/fp8.md)");
  DS_CHECK(!fp8_lm_head || z_loss == 0, "--fp8-lm-head and --z-loss {} contradict each other: the FP8 dlogits' "
           "scale comes from their bound |dlogit| <= grad_scale, which the z-loss factor 1 + 2 z lse breaks", z_loss);
}

void check_offload_recompute(bool offload_activations, const std::string& recompute) {
  DS_CHECK(!offload_activations || recompute == "auto" || recompute == "full", "--offload-activations and "
           "--recompute {} contradict each other: it moves the layer inputs that --recompute full keeps to host memory "
           "(use --recompute full or auto)", recompute);
}

void apply_memory_flags(GpuPlan& plan, const std::string& memory, const std::string& optimizer_state,
                        const std::string& recompute, const std::string& gradients, bool offload_activations) {
  DS_CHECK(memory == "auto" || memory == "fixed", "--memory must be auto or fixed, got \"{}\"", memory);
  plan.optimizer_state = parse_optimizer_state(optimizer_state);
  plan.recompute = parse_recompute(recompute);
  plan.gradients = parse_gradients(gradients);
  plan.offload_activations = offload_activations;
  check_offload_recompute(offload_activations, recompute);
  if (memory == "fixed") {
    if (plan.gradients == Gradients::Auto) plan.gradients = Gradients::Fp32;
    if (plan.optimizer_state == OptimizerState::Auto) plan.optimizer_state = OptimizerState::Fp32;
    if (plan.recompute == Recompute::Auto) plan.recompute = offload_activations ? Recompute::Full : Recompute::Selective;
  }
}

std::string resolve_device(const std::string& device) {
  DS_CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda (got \"{}\")",
           device);
  if (device == "auto") return cuda_device_count() > 0 ? "cuda" : "cpu";
  return device;
}

bool engine_knob(const char* name, bool unset) {
  const char* v = std::getenv(name);
  DS_CHECK(!v || std::string(v) == "0" || std::string(v) == "1", "{} must be 0 or 1, got \"{}\"", name, v ? v : "");
  return v ? std::string(v) == "1" : unset;
}

int layer_slots() {
  const char* v = std::getenv("DELTASTACK_LAYER_SLOTS");
  if (!v) return 0;
  const std::string s(v);
  DS_CHECK(s == "2" || s == "3" || s == "4", "DELTASTACK_LAYER_SLOTS must be 2, 3 or 4, got \"{}\"", s);
  return s[0] - '0';
}

int gpu_layer_slots(const GpuPlan& plan) {
  if (plan.layer_slots > 0) return plan.layer_slots;
  const int knob = layer_slots();
  return knob > 0 ? knob : 2;
}

void check_engine_knobs() {
  engine_knob("DELTASTACK_ASYNC_OPTIMIZER");
  engine_knob("DELTASTACK_DP_OVERLAP");
  engine_knob("DELTASTACK_STREAM_PRIORITY");
  engine_knob(kAttentionSplitKnob, false);
  engine_knob(kFp8FrozenBaseKnob);
  engine_knob("DELTASTACK_WGRAD_OVERWRITE");
  engine_knob("DELTASTACK_EMBED_SPLIT");  // read by model/gpu_model.cpp split_embed
  engine_knob("DELTASTACK_Q8_BINARY_SEARCH", false);  // read by ops/adamw/cuda.h q8_binary_search
  engine_knob("DELTASTACK_CUDNN_ZERO_WORKSPACE", false);  // read by ops/attention/cudnn.cpp
  engine_knob("DELTASTACK_DIVISION_SIGMOID", false);      // read by core/cuda/cuda_utils.h division_sigmoid
  layer_slots();  // DELTASTACK_LAYER_SLOTS
  Fp8Recipe::from_env();  // DELTASTACK_FP8_GRAD, DELTASTACK_FP8_FAST_ACCUM
}

std::unique_ptr<Engine> make_engine(const std::string& device, Qwen35Model host, const GpuPlan& plan) {
  check_fp8_lm_head(plan.fp8_lm_head, plan.precision);
  const std::string d = resolve_device(device);
  if (d == "cuda") return std::make_unique<CudaEngine>(std::move(host), plan);
  DS_CHECK(!plan.offload_activations, "--offload-activations is a mode of the GPU engine; the CPU engine keeps its "
           "activations in host memory already");
  DS_CHECK(!bf16_weights(plan.optimizer_state), "--optimizer-state {} is a mode of the GPU engine; the CPU engine "
           "keeps fp32 weights and moments (use --device cuda, or --optimizer-state auto / fp32)",
           optimizer_state_name(plan.optimizer_state));
  host.set_precision(plan.precision);
  host.set_fp8_lm_head(plan.fp8_lm_head);
  auto cpu = std::make_unique<CpuEngine>(std::move(host));
  cpu->set_gradients(plan.gradients == Gradients::Auto ? Gradients::Fp32 : plan.gradients);  // host memory: no need
  return cpu;
}

}  // namespace ds
