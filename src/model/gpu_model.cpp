// The GPU engine's decoder and its assembly (gpu_model.h). Compiled only with DELTASTACK_CUDA; the stub at the
// bottom reports a clear error otherwise.
#include "model/gpu_model.h"

#include "core/error.h"

#ifdef DELTASTACK_CUDA
#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>

#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"
#include "core/cuda/profile.h"
#include "core/log.h"
#include "model/dims.h"
#include "model/gpu_activations.h"
#include "model/gpu_fp8.h"
#include "model/gpu_lora.h"
#include "model/gpu_memory.h"
#include "model/gpu_optimizer.h"
#include "model/gpu_params.h"
#include "model/gpu_plan.h"
#include "model/params.h"
#include "ops/adamw/bf16_state.h"
#include "ops/adamw/cuda.h"
#include "ops/adamw/q8_state.h"
#include "ops/attention/plan.h"
#include "ops/conv1d/plan.h"
#include "ops/elementwise/cuda.h"
#include "ops/embedding/cuda.h"
#include "ops/gated_delta_rule/plan.h"
#include "ops/gated_rmsnorm/cuda.h"
#include "ops/gdn_gate/cuda.h"
#include "ops/l2norm/cuda.h"
#include "ops/linear/cuda.h"
#include "ops/linear_cross_entropy/plan.h"
#include "ops/registry.h"
#include "ops/rmsnorm/cuda.h"
#include "ops/rope/cuda.h"
#include "ops/rope/rope.h"
#include "ops/swiglu/cuda.h"

namespace ds {

using ds::cuda::bf16;
using ds::cuda::ProfScope;
namespace K = ds::ops::cuda;

std::atomic<int64_t> g_embedding_update_splits{0};  // embedding_update_splits()

namespace {

// The embedding backward's grouping of the N token positions by id (ids in [0, vocab)): pos = the positions sorted
// by id, stably (by id, then position); uniq = the distinct ids in order; starts[j] = the first index in pos of
// uniq[j], then N. An LSD radix sort by the ids' 11-bit digits (at most 3 stable counting passes for vocab < 2^31),
// several times a comparison sort's speed at 16k tokens.
void group_by_id(const int32_t* ids, int64_t N, int64_t vocab, std::vector<int32_t>& pos, std::vector<int32_t>& uniq,
                 std::vector<int32_t>& starts) {
  pos.resize(static_cast<size_t>(N));
  for (int64_t t = 0; t < N; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(t);
  std::vector<int32_t> tmp(static_cast<size_t>(N));
  constexpr int kBits = 11;
  std::vector<int32_t> count(size_t{1} << kBits);
  for (int shift = 0; (vocab - 1) >> shift > 0; shift += kBits) {
    std::fill(count.begin(), count.end(), 0);
    auto digit = [&](int32_t p) { return (static_cast<uint32_t>(ids[p]) >> shift) & ((1u << kBits) - 1); };
    for (const int32_t p : pos) ++count[digit(p)];
    int32_t sum = 0;
    for (int32_t& x : count) sum += std::exchange(x, sum);
    for (const int32_t p : pos) tmp[static_cast<size_t>(count[digit(p)]++)] = p;
    pos.swap(tmp);
  }
  uniq.clear();
  starts.clear();
  for (int64_t i = 0; i < N; ++i) {
    const int32_t id = ids[pos[static_cast<size_t>(i)]];
    if (i == 0 || id != ids[pos[static_cast<size_t>(i - 1)]]) {
      uniq.push_back(id);
      starts.push_back(static_cast<int32_t>(i));
    }
  }
  starts.push_back(static_cast<int32_t>(N));
}

}  // namespace

// The decoder: the layer sequence of HF Qwen3_5ForCausalLM (docs/model.md §2) over the parameter store's views,
// the activation plan and the op plans. All of it runs on one stream.
struct GpuModel::Impl {
  ModelConfig c;
  std::vector<ParamSpec> params;
  std::shared_ptr<const ParamLayout> layout;
  GpuPlan plan;
  int64_t P = 0;  // parameter count
  cudaStream_t stream = nullptr;
  char* arena_base = nullptr;
  size_t arena_bytes = 0;
  size_t peak = 0;

  std::unique_ptr<GpuParamStore> store;
  std::unique_ptr<GpuOptimizer> optimizer;  // null in a LoRA run (the base is frozen)
  // A LoRA run (docs/lora.md): the adapters on the device, and the host adapter (its config, dropout key and the
  // values the engine's checkpoints read back); null otherwise.
  std::unique_ptr<GpuLora> lora;
  std::shared_ptr<LoraAdapter> adapter;
  GpuActivations acts;
  std::unique_ptr<K::GatedDeltaRulePlan> gdn;  // null when the model has no GDN layer
  std::unique_ptr<K::AttentionPlan> attn;      // null when the model has no attention layer
  std::unique_ptr<K::Conv1dPlan> conv;
  std::unique_ptr<K::LinearCrossEntropyPlan> ce;
  // --precision fp8 (model/gpu_fp8.h): the decoder's matrix GEMMs in FP8; empty in bf16, or when the FP8 backend
  // failed its probe (the engine then runs bf16 and says so once).
  std::optional<GpuFp8Linear> f8;
  // the current micro-batch
  int64_t N = 0, S = 0, num_uniq = 0;
  std::vector<int32_t> rope_positions;  // the positions whose RoPE tables acts.batch.cos_t / sin_t hold (prepare_batch)
  double attn_pairs = 0;  // causal (query, key) pairs per head: sum over documents of len (len + 1) / 2
  // `bench step --profile` (core/cuda/profile.h): timed scopes around the ops, by family and role, with their
  // FLOPs (GEMMs, gated delta rule, attention, loss) or bytes moved (reads + writes; the memory-bound ops). Null:
  // profiling off, each scope one pointer test.
  cuda::StepProfiler* prof = nullptr;
  // The data-parallel gradient sum overlapped with one backward (reduce_grads_during_next_backward): the reduce
  // of each unit's gradients (model/model.h param_units), issued on `side` once the unit's last gradient kernel is
  // enqueued on `stream` (`ready` recorded there, waited for on `side`).
  std::function<void(float*, int64_t, void*)> reduce;
  std::vector<ParamUnit> units;
  cudaStream_t side = nullptr;
  bool prioritized = true;  // the step's stream at the greatest priority (DELTASTACK_STREAM_PRIORITY)
  cudaEvent_t ready = nullptr;
  bool side_unjoined = false;  // work issued on `side` (reduces, an update) that `stream` has not joined yet
  bool reduce_issued = false;  // the armed backward handed its units to `reduce` (join_reduce reports it)
  // Gradients::InBackward (model/gpu_params.h: the slots): the armed pass (arm_in_backward) and, for an updating
  // one, its AdamW parameters. begin_unit(u) readies unit u's slot before the unit's first gradient is made (the
  // update that last read the slot done, the parts that kernels add into zeroed: all of it without
  // wgrad_overwrite); unit_final(u) takes the unit's sum of squares and
  // enqueues its update on `side`, recording `updated[u]` (the next forward waits for it there) and
  // `slot_free[slot]` (the slot's next unit waits for it in begin_unit).
  bool in_backward() const { return store->gradients() == Gradients::InBackward; }
  // Gradients::Bf16 (the slots too): unit_final(u) adds the unit's slot into the bf16 buffer with stochastic
  // rounding keyed by grad_key (bf16_state::grad_key of grad_step and the micro-batch's index, grad_micro counting
  // the backwards since zero_grads).
  bool bf16_grads() const { return store->gradients() == Gradients::Bf16; }
  int64_t grad_step = 0, grad_micro = 0;
  uint64_t grad_key = 0;
  bool ib_armed = false, ib_update = false;
  ops::AdamWParams ib_params;
  cudaEvent_t slot_free[kMaxGradSlots] = {};
  bool slot_busy[kMaxGradSlots] = {};
  void begin_unit(size_t u) {
    if (!store->slotted()) return;
    const int s = store->slot_of(u);
    if (slot_busy[s]) {  // the step's stream idles here until `side` has updated the slot's previous unit
      ProfScope ps = scope("optimizer", "slot wait (update on side)");
      DS_CUDA_CHECK(cudaStreamWaitEvent(stream, slot_free[s], 0));
    }
    slot_busy[s] = false;
    float* g = store->unit_grads(u);
    // The embedding's rows are added into (embedding_backward); with wgrad_overwrite the loss writes lm_head's
    // gradient (LinearCeOptions::dW_overwrite), tied (unit 0, begun before the loss) or not (the head unit).
    if (!wgrad_overwrite || (u == 0 && !c.tie_word_embeddings)) {
      ProfScope ps = scope("optimizer", "zero a gradient slot", 0, static_cast<double>(units[u].size()) * sizeof(float));
      DS_CUDA_CHECK(cudaMemsetAsync(g, 0, units[u].size() * sizeof(float), stream));
      return;
    }
    // A layer: its matrices' wgrad GEMMs write their gradients; only the rest (norms, conv taps, A_log, dt_bias:
    // kernels that add into their gradients) is zeroed, in runs of adjacent parameters. The head: the final norm
    // (lm_head, a matrix, written by the loss); a tied embedding's unit: nothing.
    ensure_units();
    std::vector<std::pair<int64_t, int64_t>> runs;  // [first, end) flat offsets of adjacent non-matrix parameters
    for (size_t k = unit_params[u].first; k < unit_params[u].second; ++k) {
      const ParamSpec& p = params[k];
      if (is_matrix(p)) continue;
      if (!runs.empty() && runs.back().second == p.offset) runs.back().second += p.numel;
      else runs.emplace_back(p.offset, p.offset + p.numel);
    }
    if (runs.empty()) return;  // nothing to zero: no empty profiler scope
    ProfScope ps = scope("optimizer", "zero a gradient slot");
    for (const auto& [first, end] : runs)
      DS_CUDA_CHECK(cudaMemsetAsync(g + (first - units[u].lo), 0, static_cast<size_t>(end - first) * sizeof(float), stream));
  }
  // This backward's matrix wgrad GEMMs write their gradients (beta 0) instead of adding to zeroed ones, and so does
  // the loss for lm_head's (tied or not; LinearCeOptions::dW_overwrite): in a slotted mode's every backward (each
  // unit's slot holds one micro-batch; its matrices are then not zeroed) and in the flat buffer's first backward
  // after zero_grads. Bitwise the same values (CudaEngine.InBackwardUpdateIsTheFp32Step).
  // DELTASTACK_WGRAD_OVERWRITE=0 (an A/B knob; docs/gpu.md, ninth and eleventh sessions): zero, then add.
  bool wgrad_overwrite = false;
  int64_t backwards_since_zero = 0;
  float wgrad_beta() const { return wgrad_overwrite ? 0.0f : 1.0f; }
  // The unit's update (an updating pass) and its sum of squares, both on `side`, off the step's stream. The 8-bit
  // update writes its parameters' sum-of-squares partials from its own read of the gradients (GpuOptimizer::
  // fuses_sum: bitwise what unit_sum_squares would take), unit_sum_squares takes the others' and adds them;
  // grad_sum_squares() waits for `sums_done` (the last unit's sum) before it reads the sums.
  void update_in_backward(size_t u) {
    ensure_units();
    DS_CUDA_CHECK(cudaEventRecord(ready, stream));
    DS_CUDA_CHECK(cudaStreamWaitEvent(side, ready, 0));
    if (ib_update) {
      const ChunkSelect rest{acts.batch.emb_chunks, 1, false};
      const bool split = u == 0 && embed_rest_pending;
      if (u == 0) embed_rest_pending = false;
      optimizer->step_params(*store, ib_params, unit_params[u].first, unit_params[u].second, side,
                             /*fuse_sums=*/true, split ? &rest : nullptr);
      DS_CUDA_CHECK(cudaEventRecord(updated[u], side));
      waits_pending = true;
      store->unit_sum_squares(u, side, [this](size_t k) { return optimizer->fuses_sum(k); });
    } else {
      store->unit_sum_squares(u, side);
    }
    if (!sums_done) DS_CUDA_CHECK(cudaEventCreateWithFlags(&sums_done, cudaEventDisableTiming));
    DS_CUDA_CHECK(cudaEventRecord(sums_done, side));
    sums_pending = side_unjoined = true;
    const int s = store->slot_of(u);  // its next unit waits for the sum (and the update) that read it
    if (!slot_free[s]) DS_CUDA_CHECK(cudaEventCreateWithFlags(&slot_free[s], cudaEventDisableTiming));
    DS_CUDA_CHECK(cudaEventRecord(slot_free[s], side));
    slot_busy[s] = true;
  }
  cudaEvent_t sums_done = nullptr;  // recorded on `side` after each in-backward unit's sum of squares
  // The embedding's in-backward update in two parts (docs/memory.md, "The embedding's update, split"). Its update
  // partition's chunks (q8_state.h: kPartialBlocks quantization blocks, 8192 elements) that hold no row of the
  // batch's token ids have their final gradients once the loss's backward is done: lm_head's when tied, none (zero,
  // not read) when untied. They are updated on `side` right after the loss, overlapping the rest of the backward;
  // the chunks that hold a row of an id wait for the embedding's backward and run at the unit's end, where the whole
  // update ran before. Each chunk runs the same kernel code on the same values: bitwise the unsplit update
  // (CudaEngine.EmbeddingUpdateSplitIsBitwise). On where the 8-bit state's kernel fuses the embedding's sum (an
  // unsharded run, fp32 gradients: GpuOptimizer::selects), the embedding a unit of its own, DELTASTACK_EMBED_SPLIT
  // unset or 1.
  int embed_split = -1;                  // -1: not decided yet (split_embed)
  size_t embed_k = 0;                    // the embedding's ParamSpec index
  std::vector<uint8_t> embed_mask_host;  // per chunk: 1 where a row of the batch's ids lies (prepare_batch)
  bool embed_rest_pending = false;       // this backward updated the early chunks: unit 0's update runs the rest
  bool split_embed() {
    if (embed_split < 0) {
      embed_split = 0;
      if (in_backward() && optimizer && !lora && engine_knob("DELTASTACK_EMBED_SPLIT")) {
        ensure_units();
        const auto [first, last] = unit_params[0];
        if (last == first + 1 && params[first].name.find("embed_tokens") != std::string::npos &&
            optimizer->selects(first)) {
          embed_k = first;
          embed_split = 1;
        }
      }
    }
    return embed_split == 1;
  }
  // The chunks without a row of `uniq` (the batch's distinct ids), on `side` after the loss's backward.
  void update_embedding_early() {
    g_embedding_update_splits.fetch_add(1);
    ensure_units();
    DS_CUDA_CHECK(cudaEventRecord(ready, stream));
    DS_CUDA_CHECK(cudaStreamWaitEvent(side, ready, 0));
    const ChunkSelect early{acts.batch.emb_chunks, 0, /*zero_grads=*/!c.tie_word_embeddings};
    optimizer->step_params(*store, ib_params, unit_params[0].first, unit_params[0].second, side, /*fuse_sums=*/true,
                           &early);
    side_unjoined = embed_rest_pending = true;
  }
  bool sums_pending = false;        // grad_sum_squares() has not waited for sums_done yet
  void unit_final(size_t u) {
    if (in_backward()) return update_in_backward(u);
    if (bf16_grads()) {
      ProfScope ps = scope("optimizer", "bf16 gradient accumulation (stochastic rounding)", 0, 8.0 * units[u].size());
      return store->accumulate_unit(u, grad_key, stream);
    }
    if (!reduce) return;
    ensure_side();
    DS_CUDA_CHECK(cudaEventRecord(ready, stream));
    DS_CUDA_CHECK(cudaStreamWaitEvent(side, ready, 0));
    reduce(store->grads() + units[u].lo, units[u].size(), side);
    side_unjoined = reduce_issued = true;
  }
  // The optimizer step overlapped with what follows it (adamw_step with async_optimizer): the update runs on `side`,
  // unit by unit in the forward's order (embedding, layers, head), each unit's gradients zeroed there right after its
  // update and `updated[u]` recorded; the next forward waits for updated[u] before unit u's weights are read (so the
  // next step's first layers start while the later layers are still being updated), and zero_grads() has nothing
  // left to do. Any other reader of weights, gradients or optimizer state joins `side` first (join_side).
  bool async_optimizer = false;
  std::vector<std::pair<size_t, size_t>> unit_params;  // per unit: the ParamSpec index range [first, last)
  std::vector<cudaEvent_t> updated;
  bool waits_pending = false;   // the next forward still has to wait for updated[]
  bool grads_zeroed = false;    // the gradients were zeroed on `side` after the update
  void ensure_side() {
    if (side) return;
    int least = 0, greatest = 0;  // the least priority (the default's): the step's stream goes first when prioritized
    DS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    DS_CUDA_CHECK(cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, least));
    DS_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  }
  void wait_updated(size_t u) {
    if (waits_pending) DS_CUDA_CHECK(cudaStreamWaitEvent(stream, updated[u], 0));
  }
  void join_side() {
    if (!side_unjoined) return;
    DS_CUDA_CHECK(cudaEventRecord(ready, side));
    DS_CUDA_CHECK(cudaStreamWaitEvent(stream, ready, 0));
    side_unjoined = waits_pending = false;
  }
  // unit_params and the `updated` events, once.
  void ensure_units() {
    ensure_side();
    if (unit_params.empty()) {
      for (size_t u = 0; u < units.size(); ++u) unit_params.push_back(store->unit_params(u));
      updated.resize(units.size());
      for (cudaEvent_t& e : updated) DS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
  }
  void async_adamw_step(const ops::AdamWParams& q) {
    ensure_units();
    DS_CUDA_CHECK(cudaEventRecord(ready, stream));  // the gradients (and the grad norm's read of them) are done
    DS_CUDA_CHECK(cudaStreamWaitEvent(side, ready, 0));
    for (size_t u = 0; u < units.size(); ++u) {
      optimizer->step_params(*store, q, unit_params[u].first, unit_params[u].second, side);
      store->zero_unit_grads(u, side);
      DS_CUDA_CHECK(cudaEventRecord(updated[u], side));
    }
    waits_pending = grads_zeroed = side_unjoined = true;
  }
  // Scopes opened while on are the backward's recompute of forward activations (" (rebuild)" after the role).
  void mark_rebuild(bool on) {
    if (prof) prof->set_rebuild(on);
  }
  ProfScope scope(const char* family, const char* role, double flops = 0, double bytes = 0) {
    return ProfScope(prof, stream, family, role, flops, bytes);
  }

  // --offload-activations (GpuPlan::offload_activations; docs/memory.md "Offloaded layer inputs"): the layer inputs
  // hs[0..L-1] share a ring of R device buffers (kOffloadRing, model/engine.h; hs[j] in buffer j % R), and the first
  // L - R of them live in pinned host memory (host_hs, [L - R, max_tokens, H] bf16), copied there on `copy` as the
  // forward writes them and back before their layer's backward. Events per layer input j: hs_written (its writer done, on `stream`),
  // hs_copied (its host copy done, on `copy`), hs_freed (the ring buffer it goes back into free, on `stream`),
  // hs_fetched (back on the device, on `copy`).
  // Only a pass with a backward offloads (offload_pass, set by run()): a forward-only pass (eval, last_logits, an
  // armed pass without targets) writes the ring in order and needs nothing back. Only hs[0..L-R-1] travel: the
  // backward finds hs[L-R..L-1] still in the ring.
  cudaStream_t copy = nullptr;
  bf16* host_hs = nullptr;
  std::vector<cudaEvent_t> hs_written, hs_copied, hs_freed, hs_fetched;
  bool offload_pass = false;
  static_assert(kOffloadRing >= 3, "the backward's fetch, read and rerun buffers must differ");
  bool offloads() const { return host_hs != nullptr; }
  int64_t ring() const { return offload_ring(c.num_hidden_layers); }
  int64_t resident() const { return offloaded_layers(c, plan); }  // inputs from here on stay in the ring
  bf16* host_input(int64_t j) const { return host_hs + j * plan.max_tokens * c.hidden_size; }
  size_t input_bytes() const { return static_cast<size_t>(N * c.hidden_size) * sizeof(bf16); }
  // The forward, before hs[j] is written: its ring buffer held hs[j - R], whose host copy must be done (every
  // copied input, j - R < L - R, is waited for so before the forward ends).
  void offload_before_write(int64_t j) {
    if (!offload_pass || j >= c.num_hidden_layers || j < ring()) return;
    DS_CUDA_CHECK(cudaStreamWaitEvent(stream, hs_copied[static_cast<size_t>(j - ring())], 0));
  }
  // The forward, after hs[j] is written: its copy to the host, on `copy`, if the backward will fetch it back.
  void offload_after_write(int64_t j) {
    if (!offload_pass || j >= resident()) return;
    const size_t k = static_cast<size_t>(j);
    DS_CUDA_CHECK(cudaEventRecord(hs_written[k], stream));
    DS_CUDA_CHECK(cudaStreamWaitEvent(copy, hs_written[k], 0));
    DS_CUDA_CHECK(cudaMemcpyAsync(host_input(j), acts.hs[k], input_bytes(), cudaMemcpyDeviceToHost, copy));
    DS_CUDA_CHECK(cudaEventRecord(hs_copied[k], copy));
  }
  // The backward, before layer i's rerun and backward: hs[i] on the device, and hs[i - 1]'s fetch started. The
  // ring still holds hs[L-R..L-1] from the forward (a rerun of layer k writes hs[k + 1] into buffer (k + 1) % R,
  // whose input is no longer needed and is never read again: the last layer is never rerun); every earlier input
  // is fetched into its buffer while the layer above it runs, once that layer's predecessor in the backward (the
  // last reader and writer of that buffer) is done.
  void offload_before_backward(int64_t i) {
    if (!offload_pass) return;
    const int64_t resident = this->resident();
    if (i >= 1 && i - 1 < resident) {
      const size_t k = static_cast<size_t>(i - 1);
      DS_CUDA_CHECK(cudaEventRecord(hs_freed[k], stream));
      DS_CUDA_CHECK(cudaStreamWaitEvent(copy, hs_freed[k], 0));
      DS_CUDA_CHECK(cudaMemcpyAsync(acts.hs[k], host_input(i - 1), input_bytes(), cudaMemcpyHostToDevice, copy));
      DS_CUDA_CHECK(cudaEventRecord(hs_fetched[k], copy));
    }
    if (i < resident) DS_CUDA_CHECK(cudaStreamWaitEvent(stream, hs_fetched[static_cast<size_t>(i)], 0));
  }

  // Also runs when the constructor throws after the stream or the allocation exist.
  ~Impl() {
    attn.reset();  // cuDNN's handle and plans before the stream and memory they were used with
    if (copy) cudaStreamSynchronize(copy);
    for (auto* v : {&hs_written, &hs_copied, &hs_freed, &hs_fetched})
      for (cudaEvent_t e : *v)
        if (e) cudaEventDestroy(e);
    if (host_hs) cudaFreeHost(host_hs);
    if (copy) cudaStreamDestroy(copy);
    if (side) cudaStreamSynchronize(side);
    if (arena_base) cudaFree(arena_base);
    for (cudaEvent_t e : updated) cudaEventDestroy(e);
    for (cudaEvent_t e : slot_free)
      if (e) cudaEventDestroy(e);
    if (sums_done) cudaEventDestroy(sums_done);
    if (ready) cudaEventDestroy(ready);
    if (side) cudaStreamDestroy(side);
    if (stream) cudaStreamDestroy(stream);
  }

  // The whole memory plan in one pass over `a` (sizing pass when a.base is null): model/gpu_plan.h, the same
  // function `deltastack plan` sizes with.
  void layout_memory(Arena& a) {
    GpuOpSizes ops;
    if (gdn) ops.gdn_saved = gdn->saved_bytes(), ops.gdn_batch = gdn->batch_bytes(), ops.gdn_workspace = gdn->workspace_bytes();
    if (attn) ops.attn_batch = attn->batch_bytes(), ops.attn_workspace = attn->workspace_bytes();
    ops.conv_workspace = conv->workspace_bytes();
    ops.ce_workspace = ce->workspace_bytes();
    lay_out_gpu_memory(a, c, plan, *store, optimizer.get(), lora.get(), acts, ops);
  }

  // Whether the backward of layer cur_layer (enter_layer) rebuilds the shared activations: recompute selective, mlp
  // or full, but not the first kept_layers layers of those, which keep their own as none does.
  bool rebuild() const { return layer_rc(cur_layer) != Recompute::None; }
  // Layer i's policy (model/gpu_activations.h layer_recompute: none for a kept layer, mlp for GpuPlan::mlp_layers,
  // selective for GpuPlan::selective_layers).
  Recompute layer_rc(int64_t i) const {
    return layer_recompute(plan.recompute, plan.kept_layers, plan.mlp_layers, plan.selective_layers, i);
  }

  // ---------------------------------------------------------------------------------------------------------
  // Per micro-batch: the inputs on the device and every op plan's batch data, once for all layers.
  void prepare_batch(const PackedBatch& b) {
    N = b.size();
    S = static_cast<int64_t>(b.cu_seqlens.size()) - 1;
    DS_CHECK(N <= plan.max_tokens && S <= plan.max_seqs,
             "gpu: batch of {} tokens / {} documents exceeds the plan ({} / {})", N, S, plan.max_tokens, plan.max_seqs);
    b.check(batch_limits(c));
    const GpuBatchBufs& d = acts.batch;
    std::vector<int32_t> ss(static_cast<size_t>(N)), pos, uniq, starts;
    std::vector<float> ct, st;
    {
      // The host's part (the step's stream is idle meanwhile: the scope's time is that idle time)
      ProfScope host_ps = scope("copy", "batch prep (host)");
      for (int64_t s = 0; s < S; ++s)
        for (int32_t t = b.cu_seqlens[s]; t < b.cu_seqlens[s + 1]; ++t) ss[static_cast<size_t>(t)] = b.cu_seqlens[s];
      group_by_id(b.input_ids.data(), N, c.vocab_size, pos, uniq, starts);
      num_uniq = static_cast<int64_t>(uniq.size());
      if (split_embed())  // the chunks of the embedding's update that hold a row of an id (split_embed)
        embed_mask_host = ops::q8_state::row_chunk_mask(params[embed_k].offset, params[embed_k].numel, c.hidden_size,
                                                        uniq);
      attn_pairs = 0;
      for (int64_t s = 0; s < S; ++s) {
        const double len = b.cu_seqlens[s + 1] - b.cu_seqlens[s];
        attn_pairs += len * (len + 1) / 2;
      }
      // The RoPE tables depend on the positions only: a batch with the positions of the one before (training windows
      // of one document each: every step) keeps the tables on the device.
      const bool same_rope = rope_positions.size() == static_cast<size_t>(N) &&
                             std::equal(rope_positions.begin(), rope_positions.end(), b.positions.begin());
      if (!same_rope) {
        ct.resize(static_cast<size_t>(N * c.rotary_dim() / 2));
        st.resize(ct.size());
        ops::rope_tables(b.positions.data(), N, c.rotary_dim(), c.rope_theta, ct.data(), st.data());
        rope_positions.clear();  // (set again once the new tables' upload is queued, below)
      }
    }
    auto up = [&](void* dst, const void* src, size_t bytes) {
      if (bytes) DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    };
    {
      ProfScope ps = scope("copy", "batch upload (H2D)");  // and the op plans' batch data (prepare)
      up(d.ids, b.input_ids.data(), N * 4);
      up(d.targets, b.targets.data(), N * 4);
      up(d.cu, b.cu_seqlens.data(), (S + 1) * 4);
      up(d.seq_start, ss.data(), N * 4);
      up(d.emb_uniq, uniq.data(), uniq.size() * 4);
      up(d.emb_starts, starts.data(), starts.size() * 4);
      up(d.emb_pos, pos.data(), N * 4);
      if (split_embed()) {  // the last step's rest of the embedding's update (on `side`) read the mask before
        DS_CUDA_CHECK(cudaStreamWaitEvent(stream, updated[0], 0));
        up(d.emb_chunks, embed_mask_host.data(), embed_mask_host.size());
      }
      up(d.cos_t, ct.data(), ct.size() * 4);
      up(d.sin_t, st.data(), st.size() * 4);
      if (!ct.empty()) rope_positions.assign(b.positions.begin(), b.positions.begin() + N);
      if (gdn) gdn->prepare(d.cu, N, S, d.gdn_batch, stream);
      if (attn) attn->prepare(b.cu_seqlens.data(), d.cu, N, S, d.attn_batch, stream);
    }
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));  // host vectors die at return
  }

  // ---------------------------------------------------------------------------------------------------------
  // The decoder's matrix GEMMs: linears that read the same input x [N, K], in FP8 when the precision is fp8 and
  // every shape takes it (one cast of x for all of them), else bf16 (cuBLASLt).
  struct LinOut {
    const bf16* W;                    // [n, K]
    int64_t n;                        // outputs
    bf16* y;                          // [N, n]
    const bf16* residual = nullptr;  // [N, n]: y = x W^T + residual (the GEMM's epilogue), or null
  };
  struct LinGrad {
    const bf16* dy;  // [N, n]
    const bf16* W;   // [n, K]
    int64_t n;
    float* dW;                        // [n, K], accumulated
    const float* dy_amax = nullptr;  // --precision fp8: dy's amax from its producer (fp8_grad_amax), or null
  };
  template <class L>
  bool use_fp8(int64_t Kd, std::initializer_list<L> ls) const {
    if (!f8) return false;
    for (const L& l : ls)
      if (!GpuFp8Linear::takes(Kd, l.n)) return false;
    return true;
  }
  // --precision fp8's amax table (model/gpu_fp8.h): the layer running, and the weight index of the j-th linear
  // reading input `role` (0..2 the mixer input's, then the mixer's output projection, gate|up, down).
  int64_t cur_layer = 0;
  static int fp8_weight(Fp8Input role, size_t j) {
    return role == Fp8Input::MixerIn ? static_cast<int>(j) : static_cast<int>(role) + 2;
  }
  // The zeroed amax slot a kernel producing layer cur_layer's GEMM input `role` (its `amax` argument) fills, or null
  // (bf16).
  float* fp8_input_amax(Fp8Input role) { return f8 ? f8->fused_input_amax(cur_layer, role) : nullptr; }
  // Layer cur_layer's kept transposed FP8 cast of input `role` (model/gpu_fp8.h fp8_keeps_inputs), or null.
  uint8_t* kept_t8(Fp8Input role) const {
    return f8 ? acts.layers[static_cast<size_t>(cur_layer)].t8[static_cast<int>(role)] : nullptr;
  }
  // The same for an output gradient, handed to linears_backward in its LinGrad. Slots: the residual stream's
  // gradient dh, gate|up's, in_proj_z's and in_proj_qkv's output gradients.
  enum GradAmax { kAmaxDh = 0, kAmaxDgu = 1, kAmaxDz = 2, kAmaxDmixed = 3 };
  float* fp8_grad_amax(GradAmax k) { return f8 ? f8->fused_grad_amax(k) : nullptr; }
  // d.dh's amax from the RMSNorm backward that produced it, for the next linears_backward that reads d.dh;
  // null: none (the final norm's backward produced it, or bf16).
  float* dh_amax = nullptr;

  // y_j = x W_j^T for each output (+ the LoRA terms of the adapted ones). x is layer cur_layer's input `role`.
  void linears_forward(const bf16* x, int64_t Kd, Fp8Input role, std::initializer_list<LinOut> outs) {
    if (use_fp8(Kd, outs)) {
      uint8_t* kept = kept_t8(role);  // this input kept for the backward as its transposed FP8 cast
      const K::Fp8Matrix qx = kept ? f8->input_keeping_t(x, N, Kd, cur_layer, role, kept)
                                   : f8->input(x, N, Kd, cur_layer, role);
      size_t j = 0;
      for (const LinOut& o : outs)
        f8->forward(qx, o.W, o.n, o.y, false, cur_layer, fp8_weight(role, j++), o.residual);
    } else {
      for (const LinOut& o : outs) {
        DS_CHECK(!store->holds_fp8(o.W), "internal: a bf16 GEMM on an FP8-stored weight");
        K::linear_forward(x, o.W, o.y, N, Kd, o.n, false, stream, o.residual);
      }
    }
    for (const LinOut& o : outs)
      for (const LoraAt& l : lora_at)
        if (l.W == o.W) lora->forward(l.spec, x, N, o.y + l.col, o.n, lora_drop(l.spec), stream);
  }
  // dx [N, K] = sum_j dy_j W_j (overwritten), dW_j += dy_j^T x (none for a frozen W: dW null); + the LoRA terms'
  // dx and their adapters' gradients.
  void linears_backward(const bf16* x, int64_t Kd, Fp8Input role, bf16* dx, std::initializer_list<LinGrad> gs) {
    bool acc = false;
    if (use_fp8(Kd, gs)) {
      const uint8_t* kept = kept_t8(role);
      const K::Fp8Matrix qxt = store->frozen() ? K::Fp8Matrix{nullptr, Kd, K::fp8_padded(N), K::fp8_padded(N)}
                               : kept          ? f8->kept_t(kept, N, Kd, cur_layer, role)
                                               : f8->input_t(x, N, Kd, cur_layer, role);
      size_t j = 0;
      for (const LinGrad& g : gs)
        f8->backward(g.dy, N, g.W, qxt, g.n, dx, std::exchange(acc, true), g.dW, cur_layer, fp8_weight(role, j++),
                     g.dy_amax, wgrad_overwrite);
    } else {
      // the wgrads first: x may be dx's buffer (the MLP's act holds dact: layer_backward)
      for (const LinGrad& g : gs)
        if (g.dW) K::linear_backward_weight(g.dy, x, g.dW, N, Kd, g.n, stream, wgrad_beta());
      for (const LinGrad& g : gs) {
        DS_CHECK(!store->holds_fp8(g.W), "internal: a bf16 GEMM on an FP8-stored weight");
        K::linear_backward_data(g.dy, g.W, dx, N, Kd, g.n, std::exchange(acc, true), stream);
      }
    }
    for (const LinGrad& g : gs)
      for (const LoraAt& l : lora_at)
        if (l.W == g.W) lora->backward(l.spec, x, N, g.dy + l.col, g.n, dx, lora_drop(l.spec), stream);
  }

  // --- LoRA (model/gpu_lora.h): the adapted linears of the layer running, found by their base weight (the W the
  // linears_* helpers get), with the column where the adapted projection's rows start in that W's output (gate_proj
  // 0 and up_proj I in the fused gate|up output; 0 elsewhere: q_proj's adapter covers the whole q|gate output, which
  // is q_proj's own).
  struct LoraAt {
    const bf16* W;
    int64_t col;
    size_t spec;  // index in the adapter's specs()
  };
  std::vector<LoraAt> lora_at;
  bool lora_dropout = false;  // this pass applies dropout (a backward pass with a dropout key and lora_dropout > 0)
  // Layer i's forward or backward begins: the layer the FP8 amax table keys by, and its adapted linears.
  void enter_layer(int64_t i, const GpuParamStore::Layer& p) {
    cur_layer = i;
    lora_at.clear();
    if (!lora) return;
    const int64_t I = c.intermediate_size;
    for (size_t k : adapter->layer_specs(i)) {
      const LoraModule m = adapter->specs()[k].module;
      const bf16* W = nullptr;
      int64_t col = 0;
      switch (m) {
        case LoraModule::in_proj_qkv: W = p.compute.gdn.in_proj_qkv; break;
        case LoraModule::in_proj_z: W = p.compute.gdn.in_proj_z; break;
        case LoraModule::out_proj: W = p.compute.gdn.out_proj; break;
        case LoraModule::q_proj: W = p.compute.attn.q_proj; break;
        case LoraModule::k_proj: W = p.compute.attn.k_proj; break;
        case LoraModule::v_proj: W = p.compute.attn.v_proj; break;
        case LoraModule::o_proj: W = p.compute.attn.o_proj; break;
        case LoraModule::gate_proj: W = p.compute.mlp.gate_up; break;
        case LoraModule::up_proj: W = p.compute.mlp.gate_up, col = I; break;
        case LoraModule::down_proj: W = p.compute.mlp.down; break;
      }
      DS_CHECK(W, "internal: layer {} has no weight for the adapter {}", i, adapter->key(adapter->specs()[k], false));
      lora_at.push_back({W, col, k});
    }
  }
  std::optional<uint64_t> lora_drop(size_t k) const {
    return lora_dropout ? std::optional<uint64_t>(adapter->dropout_stream(k)) : std::nullopt;
  }

  // ---------------------------------------------------------------------------------------------------------
  // Gated DeltaNet mixer (HF Qwen3_5GatedDeltaNet.forward, docs/model.md §2.6): xn1 -> h_mid = h_in + mixer (the
  // residual add in out_proj's epilogue).
  void gdn_forward(const GpuParamStore::Layer& p, GpuLayerActs& A, const bf16* h_in) {
    const GdnParams<const bf16*>& w = p.compute.gdn;
    const GdnParams<const float*>& m = p.master.gdn;
    const int64_t H = c.hidden_size, CD = c.conv_dim(), VD = c.value_dim(), Hv = c.linear_num_value_heads,
                  dv = c.linear_value_head_dim;
    const double n = static_cast<double>(N);
    {
      ProfScope ps = scope("gemm", "gdn in_proj", 2 * n * H * (CD + VD + 2 * Hv));
      linears_forward(A.xn1, H, Fp8Input::MixerIn, {{w.in_proj_qkv, CD, A.mixed}, {w.in_proj_z, VD, A.z}});
      K::linear_forward(A.xn1, w.in_proj_ba, A.ab, N, H, 2 * Hv, false, stream);  // [b | a] per token: bf16
    }
    gdn_rebuildable(p, A);
    {
      ProfScope ps = scope("elementwise", "gdn gates", 0, 12 * n * Hv);  // ab bf16 -> g, beta fp32
      K::gdn_gate_forward(A.ab, m.A_log, m.dt_bias, A.g, A.beta, N, Hv, stream);
    }
    {
      ProfScope ps = scope("gdn", "gated delta rule", gdn_flops());
      gdn->forward(gdn_io(A), A.gdn_saved, acts.op_scratch, stream);
    }
    {
      ProfScope ps = scope("norm", "gated rmsnorm", 0, 6 * n * VD);  // core, z -> y
      K::gated_rmsnorm_forward(A.core, A.z, m.norm, A.y, A.rstd_g, N * Hv, dv, static_cast<float>(c.rms_norm_eps),
                               stream, fp8_input_amax(Fp8Input::MixerOut));
    }
    ProfScope ps = scope("gemm", "gdn out_proj", 2 * n * VD * H);
    linears_forward(A.y, VD, Fp8Input::MixerOut, {{w.out_proj, H, A.h_mid, h_in}});
  }

  // conv_out, qn, kn from mixed: the forward's ops, again in the backward when rebuilding.
  void gdn_rebuildable(const GpuParamStore::Layer& p, GpuLayerActs& A) {
    const GdnParams<const float*>& m = p.master.gdn;
    const int64_t CD = c.conv_dim(), KD = c.key_dim(), Hk = c.linear_num_key_heads, dk = c.linear_key_head_dim;
    const double n = static_cast<double>(N);
    {
      ProfScope ps = scope("conv", "conv1d+silu", 0, 4 * n * CD);  // mixed -> conv_out (bf16)
      conv->forward(A.mixed, m.conv1d, acts.batch.seq_start, A.conv_out, N, stream);
    }
    ProfScope ps = scope("norm", "l2norm q/k", 0, 8 * n * KD);  // q, k -> qn, kn (bf16)
    K::l2norm_forward(A.conv_out, CD, A.qn, A.rq, N, Hk, dk, 1e-6f, stream);
    K::l2norm_forward(A.conv_out + KD, CD, A.kn, A.rk, N, Hk, dk, 1e-6f, stream);
  }

  // Chunked gated delta rule forward FLOPs (as `bench ops`): per token and value head 4 dk dv (state update and
  // readout) + intra-chunk 2 x 64 (dk + dv); the backward about twice that.
  double gdn_flops() const {
    return static_cast<double>(N) * c.linear_num_value_heads *
           (4.0 * c.linear_key_head_dim * c.linear_value_head_dim +
            2.0 * 64 * (c.linear_key_head_dim + c.linear_value_head_dim));
  }

  K::GdnForwardIO gdn_io(const GpuLayerActs& A) const {
    K::GdnForwardIO io;
    io.q = A.qn;
    io.k = A.kn;
    io.v = A.conv_out + 2 * c.key_dim();
    io.v_stride = c.conv_dim();
    io.g = A.g;
    io.beta = A.beta;
    io.o = A.core;
    return io;
  }

  // dh (gradient of the mixer output) -> dxn (gradient of xn1, overwritten).
  void gdn_backward(const GpuParamStore::Layer& p, GpuLayerActs& A) {
    const GdnParams<const bf16*>& w = p.compute.gdn;
    const GdnParams<const float*>& m = p.master.gdn;
    const GdnParams<float*>& gw = p.grad.gdn;
    const GpuGradBufs& d = acts.grad;
    const GpuBatchBufs& B = acts.batch;
    const int64_t H = c.hidden_size, CD = c.conv_dim(), KD = c.key_dim(), VD = c.value_dim(),
                  Hv = c.linear_num_value_heads, Hk = c.linear_num_key_heads, dk = c.linear_key_head_dim,
                  dv = c.linear_value_head_dim;
    void* scratch = acts.op_scratch;
    const double n = static_cast<double>(N);
    if (rebuild()) {  // y, conv_out, qn, kn (shared buffers) exactly as gdn_forward made them
      mark_rebuild(true);
      {
        ProfScope ps = scope("norm", "gated rmsnorm", 0, 6 * n * VD);
        K::gated_rmsnorm_forward(A.core, A.z, m.norm, A.y, A.rstd_g, N * Hv, dv, static_cast<float>(c.rms_norm_eps),
                                 stream);
      }
      gdn_rebuildable(p, A);
      mark_rebuild(false);
    }
    {
      ProfScope ps = scope("gemm", "gdn out_proj (bwd)", 4 * n * VD * H);
      linears_backward(A.y, VD, Fp8Input::MixerOut, d.dy, {{d.dh, w.out_proj, H, gw.out_proj, std::exchange(dh_amax, nullptr)}});
    }
    float* dz_amax = fp8_grad_amax(kAmaxDz);
    {
      ProfScope ps = scope("norm", "gated rmsnorm (bwd)", 0, 10 * n * VD);  // core, z, dy -> dcore, dz
      K::gated_rmsnorm_backward(A.core, A.z, m.norm, A.rstd_g, d.dy, d.dcore, d.dz, gw.norm, N * Hv, dv, scratch,
                                stream, dz_amax);
    }
    K::GdnBackwardIO gr;
    gr.dout = d.dcore;
    gr.dq = d.dqn;
    gr.dk = d.dkn;
    gr.dv = d.dconv + 2 * KD;
    gr.dv_stride = CD;
    gr.dg = d.dg;
    gr.dbeta = d.dbeta;
    {
      ProfScope ps = scope("gdn", "gated delta rule (bwd)", 2 * gdn_flops());
      gdn->backward(gdn_io(A), gr, A.gdn_saved, scratch, stream);
    }
    {
      ProfScope ps = scope("norm", "l2norm q/k (bwd)", 0, 12 * n * KD);  // qn, kn, dqn, dkn -> dconv's q, k
      K::l2norm_backward(A.qn, A.rq, d.dqn, d.dconv, CD, N, Hk, dk, stream);
      K::l2norm_backward(A.kn, A.rk, d.dkn, d.dconv + KD, CD, N, Hk, dk, stream);
    }
    {
      ProfScope ps = scope("elementwise", "gdn gates (bwd)", 0, 16 * n * Hv);  // ab, dg, dbeta -> dab
      K::gdn_gate_backward(A.ab, m.A_log, m.dt_bias, d.dg, d.dbeta, d.dab, gw.A_log, gw.dt_bias, N, Hv, scratch,
                           stream);
    }
    float* dmixed_amax = fp8_grad_amax(kAmaxDmixed);
    {
      ProfScope ps = scope("conv", "conv1d+silu (bwd)", 0, 6 * n * CD);  // mixed, dconv -> dmixed
      conv->backward(A.mixed, m.conv1d, d.dconv, B.seq_start, d.dmixed, gw.conv1d, N, scratch, stream, dmixed_amax);
    }
    ProfScope ps = scope("gemm", "gdn in_proj (bwd)", 4 * n * H * (CD + VD + 2 * Hv));
    linears_backward(A.xn1, H, Fp8Input::MixerIn, d.dxn,
                     {{d.dmixed, w.in_proj_qkv, CD, gw.in_proj_qkv, dmixed_amax},
                      {d.dz, w.in_proj_z, VD, gw.in_proj_z, dz_amax}});
    K::linear_backward_data(d.dab, w.in_proj_ba, d.dxn, N, H, 2 * Hv, true, stream);  // b|a: bf16 at any precision
    if (gw.in_proj_ba) K::linear_backward_weight(d.dab, A.xn1, gw.in_proj_ba, N, H, 2 * Hv, stream, wgrad_beta());
  }

  // Gated attention mixer (HF Qwen3_5Attention.forward, docs/model.md §2.5): xn1 -> h_mid = h_in + mixer (the
  // residual add in o_proj's epilogue).
  void attn_forward(const GpuParamStore::Layer& p, GpuLayerActs& A, const bf16* h_in) {
    const AttnParams<const bf16*>& w = p.compute.attn;
    const AttnParams<const float*>& m = p.master.attn;
    const GpuBatchBufs& B = acts.batch;
    const int64_t H = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
    const double n = static_cast<double>(N);
    {
      ProfScope ps = scope("gemm", "attn qkv", 2 * n * H * (Hq * 2 + Hkv * 2) * hd);
      linears_forward(A.xn1, H, Fp8Input::MixerIn,
                      {{w.q_proj, Hq * 2 * hd, acts.qg}, {w.k_proj, Hkv * hd, A.kraw}, {w.v_proj, Hkv * hd, A.vraw}});
    }
    {
      ProfScope ps = scope("elementwise", "copy_rows q/gate", 0, 8 * n * Hq * hd);  // qg -> qraw, graw (bf16)
      // per head: [query (hd) | gate (hd)]
      K::copy_rows(acts.qg, 2 * hd, A.qraw, hd, N * Hq, hd, stream);
      K::copy_rows(acts.qg + hd, 2 * hd, A.graw, hd, N * Hq, hd, stream);
    }
    const float eps = static_cast<float>(c.rms_norm_eps);
    {
      ProfScope ps = scope("norm", "q/k rmsnorm", 0, 4 * n * (Hq + Hkv) * hd);
      K::rmsnorm_forward(A.qraw, m.q_norm, A.qr, A.rstd_q, N * Hq, hd, eps, true, stream);
      K::rmsnorm_forward(A.kraw, m.k_norm, A.kr, A.rstd_k, N * Hkv, hd, eps, true, stream);
    }
    {
      ProfScope ps = scope("elementwise", "rope", 0, 4 * n * (Hq + Hkv) * c.rotary_dim());  // in place
      K::rope_apply(A.qr, N, Hq, hd, c.rotary_dim(), B.cos_t, B.sin_t, false, stream);
      K::rope_apply(A.kr, N, Hkv, hd, c.rotary_dim(), B.cos_t, B.sin_t, false, stream);
    }
    {
      ProfScope ps = scope("attention", "sdpa", attn_flops());
      attn->forward(A.qr, A.kr, A.vraw, A.ao, A.lse, acts.op_scratch, stream);
    }
    {
      ProfScope ps = scope("elementwise", "output gate", 0, 6 * n * Hq * hd);  // ao, graw -> og
      K::output_gate_forward(A.ao, A.graw, A.og, N * Hq * hd, stream, fp8_input_amax(Fp8Input::MixerOut));
    }
    ProfScope ps = scope("gemm", "attn o_proj", 2 * n * Hq * hd * H);
    linears_forward(A.og, Hq * hd, Fp8Input::MixerOut, {{w.o_proj, H, A.h_mid, h_in}});
  }

  // Causal attention forward FLOPs: QK^T and PV, 2 x 2 x hd per (query, key) pair and query head; the backward
  // about 2.5 times that.
  double attn_flops() const { return 4.0 * c.num_attention_heads * c.head_dim * attn_pairs; }

  void attn_backward(const GpuParamStore::Layer& p, GpuLayerActs& A) {
    const AttnParams<const bf16*>& w = p.compute.attn;
    const AttnParams<const float*>& m = p.master.attn;
    const AttnParams<float*>& gw = p.grad.attn;
    const GpuGradBufs& d = acts.grad;
    const GpuBatchBufs& B = acts.batch;
    const int64_t H = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
    void* scratch = acts.op_scratch;
    const double n = static_cast<double>(N);
    if (rebuild()) {  // og (shared buffer)
      mark_rebuild(true);
      ProfScope ps = scope("elementwise", "output gate", 0, 6 * n * Hq * hd);
      K::output_gate_forward(A.ao, A.graw, A.og, N * Hq * hd, stream);
      mark_rebuild(false);
    }
    {
      ProfScope ps = scope("gemm", "attn o_proj (bwd)", 4 * n * Hq * hd * H);
      linears_backward(A.og, Hq * hd, Fp8Input::MixerOut, d.dog, {{d.dh, w.o_proj, H, gw.o_proj, std::exchange(dh_amax, nullptr)}});
    }
    {
      ProfScope ps = scope("elementwise", "output gate (bwd)", 0, 10 * n * Hq * hd);  // ao, graw, dog -> dao, dgate
      K::output_gate_backward(A.ao, A.graw, d.dog, d.dao, d.dgate, N * Hq * hd, stream);
    }
    {
      ProfScope ps = scope("attention", "sdpa (bwd)", 2.5 * attn_flops());
      attn->backward(A.qr, A.kr, A.vraw, A.ao, A.lse, d.dao, d.dqr, d.dkr, d.dvv, scratch, stream);
    }
    {
      ProfScope ps = scope("elementwise", "rope (bwd)", 0, 4 * n * (Hq + Hkv) * c.rotary_dim());
      K::rope_apply(d.dqr, N, Hq, hd, c.rotary_dim(), B.cos_t, B.sin_t, true, stream);
      K::rope_apply(d.dkr, N, Hkv, hd, c.rotary_dim(), B.cos_t, B.sin_t, true, stream);
    }
    {
      ProfScope ps = scope("norm", "q/k rmsnorm (bwd)", 0, 6 * n * (Hq + Hkv) * hd);  // x, dy -> dx
      K::rmsnorm_backward(A.qraw, m.q_norm, A.rstd_q, d.dqr, d.dqr, gw.q_norm, N * Hq, hd, true, scratch, stream);
      K::rmsnorm_backward(A.kraw, m.k_norm, A.rstd_k, d.dkr, d.dkr, gw.k_norm, N * Hkv, hd, true, scratch, stream);
    }
    {
      ProfScope ps = scope("elementwise", "copy_rows q/gate (bwd)", 0, 8 * n * Hq * hd);  // dqr, dgate -> dqg
      K::copy_rows(d.dqr, hd, d.dqg, 2 * hd, N * Hq, hd, stream);
      K::copy_rows(d.dgate, hd, d.dqg + hd, 2 * hd, N * Hq, hd, stream);
    }
    ProfScope ps = scope("gemm", "attn qkv (bwd)", 4 * n * H * (2 * Hq + 2 * Hkv) * hd);
    linears_backward(A.xn1, H, Fp8Input::MixerIn, d.dxn,
                     {{d.dqg, w.q_proj, Hq * 2 * hd, gw.q_proj}, {d.dkr, w.k_proj, Hkv * hd, gw.k_proj},
                      {d.dvv, w.v_proj, Hkv * hd, gw.v_proj}});
  }

  // Decoder layer i (HF Qwen3_5DecoderLayer, docs/model.md §2.3): hs[i] -> hs[i+1].
  void layer_forward(int64_t i) {
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    const GpuParamStore::Layer p = store->layer_params(i);
    enter_layer(i, p);
    GpuLayerActs& A = acts.layers[static_cast<size_t>(i)];
    bf16 *h_in = acts.hs[i], *h_out = acts.hs[i + 1];
    const float eps = static_cast<float>(c.rms_norm_eps);
    const double n = static_cast<double>(N);
    {
      ProfScope ps = scope("norm", "rmsnorm", 0, 4 * n * H);
      K::rmsnorm_forward(h_in, p.master.input_layernorm, A.xn1, A.rstd1, N, H, eps, true, stream,
                         fp8_input_amax(Fp8Input::MixerIn));
    }
    if (p.compute.full_attention) attn_forward(p, A, h_in);
    else gdn_forward(p, A, h_in);
    {
      ProfScope ps = scope("norm", "rmsnorm", 0, 4 * n * H);
      K::rmsnorm_forward(A.h_mid, p.master.post_attention_layernorm, A.xn2, A.rstd2, N, H, eps, true, stream,
                         fp8_input_amax(Fp8Input::MlpIn));
    }
    {
      ProfScope ps = scope("gemm", "mlp gate_up", 2 * n * H * 2 * I);
      linears_forward(A.xn2, H, Fp8Input::MlpIn, {{p.compute.mlp.gate_up, 2 * I, A.gu}});  // [gate | up] per token
    }
    {
      ProfScope ps = scope("elementwise", "swiglu", 0, 6 * n * I);  // gu -> act
      K::swiglu_forward(A.gu, A.act, N, I, stream, fp8_input_amax(Fp8Input::MlpOut));
    }
    {
      ProfScope ps = scope("gemm", "mlp down", 2 * n * I * H);
      linears_forward(A.act, I, Fp8Input::MlpOut, {{p.compute.mlp.down, H, h_out, A.h_mid}});  // + the residual
    }
  }

  // dh holds d hs[i+1] on entry and d hs[i] on exit.
  void layer_backward(int64_t i) {
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    const GpuParamStore::Layer p = store->layer_params(i);
    enter_layer(i, p);
    GpuLayerActs& A = acts.layers[static_cast<size_t>(i)];
    const GpuGradBufs& d = acts.grad;
    bf16* h_in = acts.hs[i];
    void* scratch = acts.op_scratch;
    const float eps = static_cast<float>(c.rms_norm_eps);
    const double n = static_cast<double>(N);
    begin_unit(static_cast<size_t>(1 + i));
    if (rebuild()) {  // xn2, (mlp: gu,) act (shared buffers) exactly as layer_forward made them
      mark_rebuild(true);
      {
        ProfScope ps = scope("norm", "rmsnorm", 0, 4 * n * H);
        K::rmsnorm_forward(A.h_mid, p.master.post_attention_layernorm, A.xn2, A.rstd2, N, H, eps, true, stream);
      }
      if (layer_rc(cur_layer) == Recompute::Mlp) {  // (a kept layer kept its gate|up output: rebuild() is false)
        ProfScope ps = scope("gemm", "mlp gate_up", 2 * n * H * 2 * I);
        linears_forward(A.xn2, H, Fp8Input::MlpIn, {{p.compute.mlp.gate_up, 2 * I, A.gu}});
      }
      {
        ProfScope ps = scope("elementwise", "swiglu", 0, 6 * n * I);
        K::swiglu_forward(A.gu, A.act, N, I, stream);
      }
      mark_rebuild(false);
    }
    // dact in the layer's act buffer (read by the down projection's wgrad before the dgrad writes it) unless a
    // LoRA run, dgu in place of gu (model/gpu_activations.cpp)
    bf16* dact = d.dact ? d.dact : A.act;
    bf16* dgu = A.gu;
    {
      ProfScope ps = scope("gemm", "mlp down (bwd)", 4 * n * I * H);
      linears_backward(A.act, I, Fp8Input::MlpOut, dact,
                       {{d.dh, p.compute.mlp.down, H, p.grad.mlp.down, std::exchange(dh_amax, nullptr)}});
    }
    float* dgu_amax = fp8_grad_amax(kAmaxDgu);
    {
      ProfScope ps = scope("elementwise", "swiglu (bwd)", 0, 10 * n * I);  // gu, dact -> dgu (over gu)
      K::swiglu_backward(A.gu, dact, dgu, N, I, stream, dgu_amax);
    }
    {
      ProfScope ps = scope("gemm", "mlp gate_up (bwd)", 4 * n * H * 2 * I);
      linears_backward(A.xn2, H, Fp8Input::MlpIn, d.dxn,
                       {{dgu, p.compute.mlp.gate_up, 2 * I, p.grad.mlp.gate_up, dgu_amax}});
    }
    {
      // x, dy -> dx, added to the residual stream's gradient dh in the same pass
      ProfScope ps = scope("norm", "rmsnorm (bwd)", 0, 8 * n * H);
      dh_amax = fp8_grad_amax(kAmaxDh);  // the mixer's output projection's dy
      K::rmsnorm_backward(A.h_mid, p.master.post_attention_layernorm, A.rstd2, d.dxn, d.dh,
                          p.grad.post_attention_layernorm, N, H, true, scratch, stream, d.dh, dh_amax);
    }
    if (rebuild()) {
      mark_rebuild(true);
      ProfScope ps = scope("norm", "rmsnorm", 0, 4 * n * H);
      K::rmsnorm_forward(h_in, p.master.input_layernorm, A.xn1, A.rstd1, N, H, eps, true, stream);
      mark_rebuild(false);
    }
    if (p.compute.full_attention) attn_backward(p, A);
    else gdn_backward(p, A);
    {
      ProfScope ps = scope("norm", "rmsnorm (bwd)", 0, 8 * n * H);  // + dh, as above
      dh_amax = i > 0 ? fp8_grad_amax(kAmaxDh) : nullptr;          // the next layer down's down_proj dy
      K::rmsnorm_backward(h_in, p.master.input_layernorm, A.rstd1, d.dxn, d.dh, p.grad.input_layernorm, N, H, true,
                          scratch, stream, d.dh, dh_amax);
    }
    store->after_layer_backward(i, stream);
    unit_final(static_cast<size_t>(1 + i));  // layer i's gradients are complete
  }

  // The step: embedding, layers, final norm, fused linear + cross-entropy (its backward in the same call), then
  // the layers in reverse and the embedding backward.
  // The forward of the prepared batch up to the final norm: embedding, layers, final rmsnorm -> acts.hf.
  void trunk_forward(const GpuParamStore::Model& mp) {
    const int64_t H = c.hidden_size, L = c.num_hidden_layers;
    const double n = static_cast<double>(N);
    if (f8) f8->begin_pass();  // a new pass: the FP8 amax table is stale (the weights may have changed)
    dh_amax = nullptr;
    {
      wait_updated(0);
      offload_before_write(0);
      ProfScope ps = scope("embedding", "embedding", 0, n * (4 * H + 4));  // ids, bf16 rows -> hs[0]
      K::embedding_forward(acts.batch.ids, mp.compute.embed_tokens, acts.hs[0], N, H, stream);
    }
    offload_after_write(0);
    for (int64_t i = 0; i < L; ++i) {
      wait_updated(static_cast<size_t>(1 + i));
      offload_before_write(i + 1);
      layer_forward(i);
      offload_after_write(i + 1);
    }
    wait_updated(static_cast<size_t>(L + 1));
    waits_pending = false;
    ProfScope ps = scope("norm", "final rmsnorm", 0, 4 * n * H);
    K::rmsnorm_forward(acts.hs[L], mp.master.norm, acts.hf, acts.rstd_f, N, H, static_cast<float>(c.rms_norm_eps),
                       true, stream);
  }

  LossResult run(const PackedBatch& b, double grad_scale, double z_loss, ForwardCapture* cap) {
    DS_CHECK(!cap || !cap->hidden_states || !offloads(), "gpu: the hidden states of every layer are not on the "
             "device with --offload-activations (run `forward` without it)");
    prepare_batch(b);
    const int64_t H = c.hidden_size, L = c.num_hidden_layers;
    const GpuParamStore::Model mp = store->model_params();
    const GpuBatchBufs& B = acts.batch;
    const GpuGradBufs& d = acts.grad;
    const double n = static_cast<double>(N);
    const bool backward = grad_scale != 0.0;
    offload_pass = offloads() && backward;
    wgrad_overwrite = backward && !store->frozen() && engine_knob("DELTASTACK_WGRAD_OVERWRITE") &&
                      (store->slotted() || backwards_since_zero == 0);
    if (backward) ++backwards_since_zero;
    // As the CPU engine: dropout in a pass with a backward while the adapter has a dropout key (the trainer's).
    lora_dropout = lora && backward && adapter->dropout_key() && adapter->config().lora_dropout > 0;
    trunk_forward(mp);
    DS_CHECK(!backward || !in_backward() || ib_armed, "internal: a --gradients in-backward backward without "
             "arm_in_backward()");
    if (backward && bf16_grads()) {
      grad_key = ops::bf16_state::grad_key(grad_step, grad_micro++);
    }
    if (backward && store->slotted()) {
      ib_armed = false;
      begin_unit(static_cast<size_t>(L + 1));                      // the head: final norm (and lm_head untied)
      if (c.tie_word_embeddings) begin_unit(0);                    // lm_head is the embedding: from the loss on
    }
    ops::LinearCeOptions opt;
    opt.z_loss = z_loss;
    opt.grad_scale = grad_scale;
    opt.dW_overwrite = wgrad_overwrite;  // lm_head's gradient written by the loss (begin_unit did not zero it)
    if (cap) capture(cap, mp);
    {
      // logits, and for the backward dh and dW: one GEMM of 2 N H V FLOPs each
      ProfScope ps = scope("loss", backward ? "lm head + cross-entropy (fwd+bwd)" : "lm head + cross-entropy",
                           (backward ? 6.0 : 2.0) * n * H * c.vocab_size);
      ce->run(acts.hf, mp.compute.lm_head, B.targets, N, opt, B.loss, backward ? d.dhf : nullptr,
              backward ? mp.grad.lm_head : nullptr, acts.ce_scratch, stream);
    }
    embed_rest_pending = false;
    if (backward && in_backward() && ib_update && split_embed()) update_embedding_early();
    double loss[2];
    {
      ProfScope ps = scope("copy", "loss download (D2H)");
      DS_CUDA_CHECK(cudaMemcpyAsync(loss, B.loss, sizeof(loss), cudaMemcpyDeviceToHost, stream));
    }
    LossResult r;
    r.num_valid = b.num_targets();
    if (backward) {
      {
        ProfScope ps = scope("norm", "final rmsnorm (bwd)", 0, 6 * n * H);
        K::rmsnorm_backward(acts.hs[L], mp.master.norm, acts.rstd_f, d.dhf, d.dh, mp.grad.norm, N, H, true,
                            acts.op_scratch, stream);
      }
      unit_final(static_cast<size_t>(L + 1));  // the head: the final norm, and lm_head when untied
      for (int64_t i = L - 1; i >= 0; --i) {
        offload_before_backward(i);
        // full recompute: the layer's activations again (the last layer's are still there from the forward; a kept
        // layer, GpuPlan::kept_layers, has its own, and an mlp layer, GpuPlan::mlp_layers, mlp's)
        if (layer_rc(i) == Recompute::Full && i != L - 1) {
          mark_rebuild(true);
          layer_forward(i);
          mark_rebuild(false);
        }
        layer_backward(i);
      }
      if (!c.tie_word_embeddings) begin_unit(0);
      if (mp.grad.embed_tokens) {  // (a frozen base has none)
        // dh bf16 in, the fp32 gradient rows of the distinct ids read and written, ids / positions
        ProfScope ps = scope("embedding", "embedding (bwd)", 0, n * (2 * H + 12) + 8.0 * num_uniq * H);
        K::embedding_backward(B.emb_uniq, B.emb_starts, B.emb_pos, num_uniq, d.dh, mp.grad.embed_tokens, H, stream);
      }
      unit_final(0);  // the embedding (and a tied lm_head): last
    } else if (in_backward() && ib_armed) {
      // An armed pass over a batch without targets (grad_scale 0, no backward): every unit's gradients are zero;
      // their sums and the armed update run over the zeroed slots in the backward's unit order, as the fp32 mode's
      // step runs over its zeroed buffer (model/engine.h arm_in_backward).
      ib_armed = false;
      for (size_t u = static_cast<size_t>(L + 1);; --u) {
        begin_unit(u);
        update_in_backward(u);
        if (u == 0) break;
      }
    }
    reduce = nullptr;  // armed for one backward
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
    note_peak();
    r.loss_sum = loss[0];
    r.z_loss_sum = loss[1];
    return r;
  }

  // GpuModel::last_logits: the trunk, then logits[1, V] = hf[N-1, :] lm_head^T (fp32 out) in the loss scratch.
  std::vector<float> last_logits(const PackedBatch& b) {
    DS_CHECK(b.size() > 0, "last_logits: an empty batch has no last position");
    prepare_batch(b);
    offload_pass = false;
    lora_dropout = false;
    const int64_t H = c.hidden_size, V = c.vocab_size;
    const GpuParamStore::Model mp = store->model_params();
    trunk_forward(mp);
    DS_CHECK(ce->workspace_bytes() >= static_cast<size_t>(V) * sizeof(float),
             "gpu: the loss scratch ({} bytes) cannot hold a row of {} logits", ce->workspace_bytes(), V);
    float* row = static_cast<float*>(acts.ce_scratch);
    std::vector<float> out(static_cast<size_t>(V));
    {
      ProfScope ps = scope("loss", "lm head (last position)", 2.0 * H * V);
      K::gemm(false, true, 1, V, H, 1.0f, acts.hf + (N - 1) * H, H, mp.compute.lm_head, H, 0.0f, row, true, V, stream);
    }
    {
      ProfScope ps = scope("copy", "logits download (D2H)");
      DS_CUDA_CHECK(cudaMemcpyAsync(out.data(), row, static_cast<size_t>(V) * sizeof(float), cudaMemcpyDeviceToHost,
                                    stream));
    }
    DS_CUDA_CHECK(cudaStreamSynchronize(stream));
    note_peak();
    return out;
  }

  // Hidden states (bf16 -> fp32) and full fp32 logits, for `deltastack forward --device cuda` on small inputs.
  void capture(ForwardCapture* cap, const GpuParamStore::Model& mp) {
    const int64_t H = c.hidden_size, V = c.vocab_size;
    auto down_bf16 = [&](const bf16* src, int64_t n) {
      std::vector<float> out(static_cast<size_t>(n));
      download_bf16_as_f32(src, n, out.data(), stream);  // model/gpu_params.h
      return out;
    };
    if (cap->hidden_states) {
      cap->hidden.clear();
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) cap->hidden.push_back(down_bf16(acts.hs[i], N * H));
      cap->hidden.push_back(down_bf16(acts.hf, N * H));
    }
    if (cap->logits) {
      float* logits = nullptr;  // a one-off tool path, outside any training loop
      DS_CUDA_CHECK(cudaMalloc(&logits, static_cast<size_t>(N * V) * sizeof(float)));
      K::gemm(false, true, N, V, H, 1.0f, acts.hf, H, mp.compute.lm_head, H, 0.0f, logits, true, V, stream);
      cap->logits_values.resize(static_cast<size_t>(N * V));
      DS_CUDA_CHECK(cudaMemcpyAsync(cap->logits_values.data(), logits, N * V * sizeof(float), cudaMemcpyDeviceToHost,
                                    stream));
      DS_CUDA_CHECK(cudaStreamSynchronize(stream));
      DS_CUDA_CHECK(cudaFree(logits));
    }
  }

  void note_peak() {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) peak = std::max(peak, total_b - free_b);
  }
};

GpuModel::GpuModel(const Qwen35Model& host, const GpuPlan& plan) : impl_(std::make_unique<Impl>()) {
  DS_CHECK(cuda_device_count() > 0, "--device cuda: no CUDA device is available");
  DS_CHECK(plan.max_tokens > 0 && plan.max_seqs > 0, "gpu plan: max_tokens and max_seqs must be positive");
  // Numeric self-probe of every CUDA op against the CPU reference (once per process); a failing kernel stops
  // here with its op name, error and band instead of training on wrong numbers.
  ops::require_cuda_backends();
  Impl& m = *impl_;
  m.c = host.config();
  // Shapes the CUDA kernels are instantiated for (docs/cuda_backend.md); others need --device cpu.
  auto one_of = [](int64_t v, std::initializer_list<int64_t> ok) { return std::find(ok.begin(), ok.end(), v) != ok.end(); };
  DS_CHECK(one_of(m.c.linear_key_head_dim, {16, 32, 64, 128}) && one_of(m.c.linear_value_head_dim, {16, 32, 64, 128}),
           "--device cuda: linear_key_head_dim / linear_value_head_dim must be 16, 32, 64 or 128 (got {} / {}); use "
           "--device cpu", m.c.linear_key_head_dim, m.c.linear_value_head_dim);
  DS_CHECK(one_of(m.c.head_dim, {32, 64, 128, 256}), "--device cuda: head_dim must be 32, 64, 128 or 256 (got {}); use "
           "--device cpu", m.c.head_dim);
  DS_CHECK(m.c.linear_conv_kernel_dim <= 4, "--device cuda: linear_conv_kernel_dim must be at most 4 (got {})",
           m.c.linear_conv_kernel_dim);
  m.params = host.params();
  m.layout = std::make_shared<const ParamLayout>(m.c, m.params);
  GpuPlan want = plan;
  want.lora = host.adapter() ? host.adapter()->config() : LoraConfig{};
  m.plan = resolved(want);  // a LoRA run: the frozen base's layout
  m.adapter = host.shared_adapter();
  m.P = host.num_parameters();
  DS_CHECK(m.plan.max_seqlen <= m.plan.max_tokens, "gpu: max_seqlen {} exceeds max_tokens {}", m.plan.max_seqlen,
           m.plan.max_tokens);
  // The step's stream at the device's greatest priority; `side` (the overlapped optimizer updates, in-backward
  // updates and overlapped reduces) at the default, the least: where both have blocks waiting for SMs, the step's
  // go first, and the updates fill what the step leaves idle (their short-lived blocks give the SMs back soon:
  // ops/adamw/cuda.cu).
  // DELTASTACK_STREAM_PRIORITY=0: both at the default (model/engine.h engine_knob).
  int least_priority = 0, greatest_priority = 0;
  DS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
  m.prioritized = engine_knob("DELTASTACK_STREAM_PRIORITY");
  DS_CUDA_CHECK(cudaStreamCreateWithPriority(&m.stream, cudaStreamNonBlocking,
                                             m.prioritized ? greatest_priority : least_priority));
  size_t free_b = 0, total_b = 0;
  DS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  free_b = plannable_free_bytes(free_b, m.plan.memory_limit);  // --max-memory (the checks below keep the slack)
  if (m.plan.precision == Precision::Fp8 && !ops::fp8_gemm_usable()) {
    // before the modes and the layout: an FP8 plan reserves the casts' buffers, keeps some inputs in FP8 only and
    // stores a LoRA run's frozen base in FP8 (model/gpu_fp8.h), so the modes are chosen for what will run
    log_warn("gpu: --precision fp8: the FP8 GEMM backend failed its probe (`deltastack probe` shows it); the GEMMs "
             "run in bf16");
    m.plan.precision = Precision::Bf16;
    m.plan.fp8_lm_head = false;
  }
  // The least recompute and the leanest state that fit, by the planner's estimate (model/gpu_plan.h), and the layer
  // gradient slots (given modes stay as given).
  m.plan = resolve_memory_modes(m.c, m.plan, [&](const GpuMemoryPlan& p) { return p.allocation + kAllocationSlack < free_b; });
  // Whether the planner chose the layer slots (GpuPlan::layer_slots): a third one is then given back before the
  // attention falls back to the simple kernel below.
  const bool slots_chosen = plan.layer_slots == 0 && layer_slots() == 0 && m.plan.layer_slots == 3;
  m.units = param_units(m.c, m.params);
  auto make_store = [&] {
    m.optimizer.reset();
    m.store = std::make_unique<GpuParamStore>(
        *m.layout, m.params, m.plan.optimizer_state, ParamShard{m.plan.shard_rank, m.plan.shard_world}, m.units,
        m.plan.gradients, /*frozen=*/m.adapter != nullptr,
        fp8_stored_units(m.c, *m.layout, m.plan.precision == Precision::Fp8, m.adapter != nullptr),
        gpu_layer_slots(m.plan));
    if (!m.adapter) m.optimizer = std::make_unique<GpuAdamW>(*m.store);
  };
  make_store();
  if (m.adapter) m.lora = std::make_unique<GpuLora>(m.c, m.plan.lora, m.plan.max_tokens);
  bool has_attention = false, has_gdn = false;
  for (int64_t i = 0; i < m.c.num_hidden_layers; ++i) (m.c.is_full_attention(i) ? has_attention : has_gdn) = true;
  if (has_gdn) m.gdn = K::make_gated_delta_rule_plan(gdn_limits(m.c, m.plan));
  if (has_attention) m.attn = std::make_unique<K::AttentionPlan>(attn_limits(m.c, m.plan));
  m.conv = std::make_unique<K::Conv1dPlan>(conv_plan(m.c, m.plan));
  m.ce = std::make_unique<K::LinearCrossEntropyPlan>(ce_plan(m.c, m.plan));
  Arena sizing;
  m.layout_memory(sizing);
  m.arena_bytes = sizing.off;
  if (slots_chosen && m.arena_bytes + kAllocationSlack >= free_b) {  // the estimate was short: two slots
    m.plan.layer_slots = 2;
    make_store();
    sizing = Arena{};
    m.layout_memory(sizing);
    m.arena_bytes = sizing.off;
  }
  if (m.attn && m.arena_bytes + kAllocationSlack >= free_b && m.attn->name() != "cuda-simple") {
    // cuDNN's deterministic backward keeps an S^2 workspace; when that is what does not fit, drop to the simple
    // kernel (no workspace) rather than fail (ds::Error instead when DELTASTACK_ATTENTION names cuDNN).
    const size_t cudnn_ws = m.attn->workspace_bytes();
    m.attn->drop_to_simple();
    log_warn("attention: the plan with cuDNN's {:.2f} GiB workspace does not fit in {:.2f} GiB free; using the "
             "simple attention kernel", cudnn_ws / 1073741824.0, free_b / 1073741824.0);
    sizing = Arena{};
    m.layout_memory(sizing);
    m.arena_bytes = sizing.off;
  }
  DS_CHECK(m.arena_bytes + kAllocationSlack < free_b,
           "gpu: the memory plan (optimizer state {}, recompute {}, gradients {}) needs {:.2f} GiB but only {:.2f} GiB "
           "is free; lower --micro-batch or --seq-len, or choose leaner modes (--optimizer-state bf16 or 8bit, "
           "--recompute full, --gradients in-backward; `deltastack plan` shows each)",
           ds::optimizer_state_name(m.plan.optimizer_state), ds::recompute_name(m.plan.recompute),
           ds::gradients_name(m.plan.gradients),
           m.arena_bytes / 1073741824.0, free_b / 1073741824.0);
  DS_CUDA_CHECK(cudaMalloc(&m.arena_base, m.arena_bytes));
  Arena real;
  real.base = m.arena_base;
  m.layout_memory(real);
  if (offloaded_layers(m.c, m.plan) > 0) {
    const size_t host_bytes = offload_host_bytes(m.c, m.plan);
    const cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&m.host_hs), host_bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail("gpu: --offload-activations needs {:.2f} GiB of pinned host memory for the layer inputs ({} layers x {} "
           "tokens x hidden_size {} in bf16), and cudaHostAlloc refused it ({}); lower --micro-batch or --seq-len, or "
           "run without it", host_bytes / 1073741824.0, offloaded_layers(m.c, m.plan), m.plan.max_tokens,
           m.c.hidden_size, cudaGetErrorString(e));
    }
    DS_CUDA_CHECK(cudaStreamCreateWithFlags(&m.copy, cudaStreamNonBlocking));
    for (auto* v : {&m.hs_written, &m.hs_copied, &m.hs_freed, &m.hs_fetched}) {
      v->assign(static_cast<size_t>(m.c.num_hidden_layers), nullptr);
      for (cudaEvent_t& ev : *v) DS_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    }
    log_info("gpu: --offload-activations: {} of the {} layer inputs in {:.2f} GiB of pinned host memory, a ring of {} "
             "on the device", offloaded_layers(m.c, m.plan), m.c.num_hidden_layers, host_bytes / 1073741824.0,
             m.ring());
  }
  if (m.optimizer) m.optimizer->zero_state(m.stream);
  if (m.plan.precision == Precision::Fp8) {
    const Fp8Recipe recipe = Fp8Recipe::from_env();
    // A LoRA run's base is frozen (uploaded below, never written again): its weights' amax is taken once.
    m.f8.emplace(m.acts.fp8, recipe, m.stream, m.c.num_hidden_layers, /*frozen_weights=*/m.lora != nullptr);
    // the frozen base's GEMM weights as their casts, if stored so (scales set by the upload below)
    m.f8->use_stored_weights(m.store->fp8_stored_weights());
    log_info("gpu: --precision fp8: the decoder's matrix GEMMs in FP8 ({}){}{}", recipe.describe(),
             m.acts.fp8.saved_scale ? "; the FP8-only GEMM inputs kept for the backward in FP8" : "",
             !m.plan.fp8_lm_head ? ""
             : m.lora            ? "; --fp8-lm-head: the frozen lm head's dgrad in FP8 (dlogits e5m2 at their bound)"
                                 : "; --fp8-lm-head: the lm head's dgrad and wgrad in FP8 (dlogits e5m2 at their bound)");
  }
  DS_CHECK(host.deferred() || static_cast<int64_t>(host.weights().size()) == m.P,
           "gpu: the host model holds {} weights, expected {} (released or not loaded)", host.weights().size(), m.P);
  m.store->upload([&](size_t k, float* dst) { host.fill_param(k, dst); }, m.stream);
  if (m.lora) {
    m.lora->upload(m.adapter->values(), m.stream);
    log_info("gpu: LoRA rank {}: {} adapted matrices, {} adapter parameters (fp32 masters and AdamW), the base "
             "frozen in bf16{}", m.plan.lora.r, m.lora->specs().size(), m.lora->size(),
             m.store->fp8_units().empty() ? std::string() : fmt::format(
                 " and its {} FP8 GEMM weights stored as their E4M3 casts ({:.2f} GiB)", m.store->fp8_units().size(),
                 m.store->fp8_bytes() / 1073741824.0));
  }
  m.note_peak();
  log_info("gpu: {} (bf16 compute; optimizer state {}, recompute {}, gradients {}{}), one allocation of {:.2f} GiB "
           "for {} tokens x {} documents per micro-batch; gated delta rule: {}, attention: {}", cuda_device_name(),
           m.lora ? "fp32 (the adapters'; the base frozen)" : ds::optimizer_state_name(m.plan.optimizer_state),
           ds::recompute_label(m.plan, m.c.num_hidden_layers), ds::gradients_name(m.plan.gradients),
           m.store->slotted() ? fmt::format(", {} layer gradient slots", gpu_layer_slots(m.plan)) : std::string(),
           m.arena_bytes / 1073741824.0, plan.max_tokens, plan.max_seqs,
           m.gdn ? m.gdn->name() : "-", m.attn ? m.attn->name() : "-");
}

GpuModel::~GpuModel() = default;

LossResult GpuModel::forward_backward(const PackedBatch& batch, double grad_scale, double z_loss,
                                      ForwardCapture* capture) {
  return impl_->run(batch, grad_scale, z_loss, capture);
}

std::vector<float> GpuModel::last_logits(const PackedBatch& batch) { return impl_->last_logits(batch); }

void GpuModel::arm_in_backward(const ops::AdamWParams* update) {
  Impl& m = *impl_;
  DS_CHECK(m.in_backward(), "internal: arm_in_backward() needs --gradients in-backward");
  m.ib_armed = true;  // the last pass's updates may still run on `side`: begin_unit and the forward wait for them
  m.ib_update = update != nullptr;
  if (update) m.ib_params = *update;
}

Gradients GpuModel::gradients() const { return impl_->plan.gradients; }

void GpuModel::begin_step(int64_t step) { impl_->grad_step = step; }

void GpuModel::zero_grads() {
  impl_->grad_micro = 0;
  impl_->backwards_since_zero = 0;
  if (impl_->grads_zeroed) {  // done on the side stream by the overlapped optimizer step, unit by unit
    impl_->grads_zeroed = false;
    return;
  }
  impl_->join_side();  // an update still reading the gradients on the side stream comes first
  if (impl_->lora) return impl_->lora->zero_grads(impl_->stream);  // the frozen base has none
  ProfScope ps = impl_->scope("optimizer", "zero grads", 0, 4.0 * impl_->P);
  impl_->store->zero_grads(impl_->stream);
}

// The two scopes below end after the synchronisation their calls finish with (a few microseconds late).
double GpuModel::grad_sum_squares() {
  if (impl_->in_backward()) {  // the backward's sums, taken on the side stream (update_in_backward)
    if (impl_->sums_pending) DS_CUDA_CHECK(cudaStreamWaitEvent(impl_->stream, impl_->sums_done, 0));
    impl_->sums_pending = false;
    return impl_->store->grad_sum_squares(impl_->stream, false);
  }
  impl_->join_side();
  if (impl_->lora) {  // the adapters' gradients only
    ProfScope ps = impl_->scope("optimizer", "grad sum of squares (LoRA)", 0, 4.0 * impl_->lora->size());
    return impl_->lora->grad_sum_squares(impl_->stream);
  }
  ProfScope ps = impl_->scope("optimizer", "grad sum of squares", 0, 4.0 * impl_->P);
  return impl_->store->grad_sum_squares(impl_->stream);
}

void GpuModel::adamw_step(const ops::AdamWParams& p, double weight_decay) {
  DS_CHECK(!impl_->in_backward(), "internal: adamw_step() with --gradients in-backward (the update runs in the "
           "backward: arm_in_backward)");
  ops::AdamWParams q = p;
  q.weight_decay = weight_decay;
  if (impl_->lora) {  // the adapters only (every element decays: HF Trainer's rule for lora_A / lora_B)
    impl_->join_side();
    ProfScope ps = impl_->scope("optimizer", "adamw (LoRA)", 0, 30.0 * impl_->lora->size());
    return impl_->lora->step(q, impl_->stream);
  }
  // Bytes per element: fp32 state reads master, grad, m, v and writes master, m, v (4 B each) and the bf16 copy
  // (2 B): 30; bf16 state reads the bf16 weight, m, v (2 B) and the fp32 grad, writes weight, m, v: 16; 8bit
  // state: the bf16 weight (2 B), the grad (4 B), two codes (1 B each) read, weight and codes written: 12.
  double bytes = 0;
  if (impl_->prof) {
    const std::vector<ParamSpec>& specs = impl_->store->params();
    const double low = impl_->store->state() == OptimizerState::EightBit ? 12.0 : 16.0;
    const double bf16_grad = impl_->bf16_grads() ? 2.0 : 0.0;  // a bf16 gradient reads 2 bytes of the 4 counted
    for (size_t k = 0; k < specs.size(); ++k)
      bytes += ((impl_->store->fp32_offset(k) >= 0 ? 30.0 : low) - bf16_grad) * static_cast<double>(specs[k].numel);
  }
  impl_->join_side();
  if (impl_->async_optimizer && !impl_->prof) return impl_->async_adamw_step(q);
  ProfScope ps = impl_->scope("optimizer", "adamw", 0, bytes);
  impl_->optimizer->step(*impl_->store, q, impl_->stream);
}

void GpuModel::set_async_optimizer(bool on) {
  impl_->join_side();
  impl_->async_optimizer = on;
}

void GpuModel::set_profiler(cuda::StepProfiler* prof) {
  impl_->join_side();
  impl_->prof = prof;
}

GpuModel::DeviceGrads GpuModel::device_grads() {
  DS_CHECK(impl_->store->gradients() == Gradients::Fp32, "--gradients {} keeps no fp32 gradient buffer to reduce "
           "over ranks: use --gradients fp32", gradients_name(impl_->store->gradients()));
  impl_->join_side();
  if (impl_->lora) return {impl_->lora->grads(), impl_->lora->size(), impl_->stream};  // the adapters' only
  return {impl_->store->grads(), impl_->P, impl_->stream};
}

void GpuModel::reduce_grads_during_next_backward(std::function<void(float*, int64_t, void*)> reduce) {
  Impl& m = *impl_;
  if (m.units.empty()) m.units = param_units(m.c, m.params);
  m.reduce = std::move(reduce);
}

bool GpuModel::join_reduce() {
  Impl& m = *impl_;
  m.reduce = nullptr;
  m.join_side();
  const bool issued = m.reduce_issued;
  m.reduce_issued = false;
  return issued;
}

GpuModel::ShardBuffers GpuModel::shard_buffers() {
  impl_->join_side();
  const GpuParamStore& st = *impl_->store;
  ShardBuffers b;
  b.grads = st.grads();
  b.compute = st.compute_base();
  b.master = st.master_base();
  b.master_flat = st.state() == OptimizerState::Fp32;
  b.world = st.shard().world;
  b.padded = st.padded_size();
  b.share = st.share_size();
  b.lo = st.share_lo();
  b.hi = st.share_hi();
  for (int r = 0; r < std::max(1, st.shard().world); ++r) b.master_ranges.push_back(st.fp32_range_of(r));
  b.stream = impl_->stream;
  return b;
}

double GpuModel::share_grad_sum_squares() {
  ProfScope ps = impl_->scope("optimizer", "grad sum of squares", 0, 4.0 * impl_->P);
  return impl_->store->share_grad_sum_squares(impl_->stream);
}

void GpuModel::gather_optimizer_state(const std::function<void(void*, int64_t, int)>& broadcast, int rank,
                                      std::vector<std::vector<float>>* out) {
  impl_->join_side();
  const GpuParamStore& st = *impl_->store;
  const int world = std::max(1, st.shard().world), n_state = optimizer_state_count();
  const int64_t P = impl_->P;
  if (rank == 0) out->assign(static_cast<size_t>(n_state), std::vector<float>(static_cast<size_t>(P)));
  constexpr int64_t kPiece = int64_t{1} << 22;  // fp32 values per broadcast (16 MiB)
  float* dev = nullptr;
  std::vector<float> host;
  if (world > 1) {
    DS_CUDA_CHECK(cudaMalloc(&dev, kPiece * sizeof(float)));
    host.resize(static_cast<size_t>(kPiece));
  }
  cudaStream_t stream = impl_->stream;
  try {
    for (const ParamSpec& p : st.params())
      for (int r = 0; r < world; ++r) {
        const auto [lo, hi] = st.share_range(r);
        const int64_t a = std::max(p.offset, lo), b = std::min(p.offset + p.numel, hi);
        for (int64_t x = a; x < b; x += kPiece) {
          const int64_t n = std::min(kPiece, b - x);
          for (int which = 0; which < n_state; ++which) {
            if (r == 0) {  // rank 0's own share: straight into its copy
              if (rank == 0) read_optimizer_state(which, x, n, (*out)[static_cast<size_t>(which)].data() + x);
              continue;
            }
            if (rank == r) {
              read_optimizer_state(which, x, n, host.data());
              DS_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream));
            }
            broadcast(dev, n * static_cast<int64_t>(sizeof(float)), r);
            if (rank == 0)
              DS_CUDA_CHECK(cudaMemcpyAsync((*out)[static_cast<size_t>(which)].data() + x, dev, n * sizeof(float),
                                            cudaMemcpyDeviceToHost, stream));
            DS_CUDA_CHECK(cudaStreamSynchronize(stream));
          }
        }
      }
  } catch (...) {
    if (dev) cudaFree(dev);
    throw;
  }
  if (dev) DS_CUDA_CHECK(cudaFree(dev));
}

void GpuModel::read(Buffer which, int64_t first, int64_t count, float* dst) const {
  DS_CHECK(first >= 0 && count >= 0 && first + count <= impl_->P, "gpu: read of [{}, {}) outside the {} parameters",
           first, first + count, impl_->P);
  if (count == 0) return;
  impl_->join_side();
  if (which == Buffer::Weights) return impl_->store->read_weights(first, count, dst, impl_->stream);
  DS_CHECK(!impl_->in_backward(), "--gradients in-backward keeps no gradient buffer to read (each unit's gradients "
           "are consumed by its update in the backward): use --gradients fp32");
  DS_CHECK(!impl_->lora, "internal: a LoRA run's base is frozen: it has no gradients (the adapters': read_lora)");
  if (impl_->bf16_grads()) return download_bf16_as_f32(impl_->store->grads_bf16() + first, count, dst, impl_->stream);
  DS_CUDA_CHECK(cudaMemcpyAsync(dst, impl_->store->grads() + first, count * sizeof(float), cudaMemcpyDeviceToHost,
                                impl_->stream));
  DS_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

LoraAdapter* GpuModel::adapter() const { return impl_->adapter.get(); }

namespace {
GpuLora::Buffer lora_buffer(GpuModel::LoraBuffer b) {
  switch (b) {
    case GpuModel::LoraBuffer::Values: return GpuLora::Buffer::Values;
    case GpuModel::LoraBuffer::Grads: return GpuLora::Buffer::Grads;
    case GpuModel::LoraBuffer::ExpAvg: return GpuLora::Buffer::ExpAvg;
    case GpuModel::LoraBuffer::ExpAvgSq: return GpuLora::Buffer::ExpAvgSq;
  }
  return GpuLora::Buffer::Values;
}
}  // namespace

void GpuModel::read_lora(LoraBuffer which, int64_t first, int64_t count, float* dst) const {
  DS_CHECK(impl_->lora, "internal: read_lora() without a LoRA adapter");
  impl_->join_side();
  impl_->lora->read(lora_buffer(which), first, count, dst, impl_->stream);
}

void GpuModel::write_lora(LoraBuffer which, int64_t first, int64_t count, const float* src) {
  DS_CHECK(impl_->lora, "internal: write_lora() without a LoRA adapter");
  impl_->join_side();
  impl_->lora->write(lora_buffer(which), first, count, src, impl_->stream);
}

int GpuModel::optimizer_state_count() const {
  DS_CHECK(impl_->optimizer, "internal: a LoRA run's base has no optimizer state (the adapters': read_lora)");
  return impl_->optimizer->num_state_tensors();
}
std::string GpuModel::optimizer_state_name(int which, const ParamSpec& p) const {
  return impl_->optimizer->state_name(which, p);
}
void GpuModel::read_optimizer_state(int which, int64_t first, int64_t count, float* dst) const {
  impl_->join_side();
  impl_->optimizer->read_state(which, first, count, dst, impl_->stream);
}
void GpuModel::write_optimizer_state(int which, int64_t first, int64_t count, const float* src) {
  impl_->join_side();
  impl_->optimizer->write_state(which, first, count, src, impl_->stream);
}

bool GpuModel::optimizer_codes_8bit(size_t k) const { return impl_->optimizer->codes_8bit(k); }
void GpuModel::read_optimizer_codes(int which, int64_t first, int64_t count, uint8_t* dst) const {
  impl_->join_side();
  impl_->optimizer->read_codes(which, first, count, dst, impl_->stream);
}
void GpuModel::read_optimizer_block_scales(int which, size_t k, int64_t first_block, int64_t count, float* dst) const {
  impl_->join_side();
  impl_->optimizer->read_block_scales(which, k, first_block, count, dst, impl_->stream);
}

void GpuModel::write_optimizer_codes(int which, int64_t first, int64_t count, const uint8_t* src) {
  impl_->join_side();
  impl_->optimizer->write_codes(which, first, count, src, impl_->stream);
}
void GpuModel::write_optimizer_block_scales(int which, size_t k, int64_t first_block, int64_t count, const float* src) {
  impl_->join_side();
  impl_->optimizer->write_block_scales(which, k, first_block, count, src, impl_->stream);
}

void GpuModel::download_grads(std::vector<float>& out) const {
  out.resize(static_cast<size_t>(impl_->P));
  read(Buffer::Grads, 0, impl_->P, out.data());
}

size_t GpuModel::planned_bytes() const { return impl_->arena_bytes; }
OptimizerState GpuModel::optimizer_state() const { return impl_->plan.optimizer_state; }
Recompute GpuModel::recompute() const { return impl_->plan.recompute; }
std::string GpuModel::recompute_label() const { return ds::recompute_label(impl_->plan, impl_->c.num_hidden_layers); }
Precision GpuModel::precision() const { return impl_->f8 ? Precision::Fp8 : Precision::Bf16; }
size_t GpuModel::peak_bytes() const { return impl_->peak; }

int64_t embedding_update_splits() { return g_embedding_update_splits.load(); }

}  // namespace ds

#else  // !DELTASTACK_CUDA

namespace ds {
int64_t embedding_update_splits() { return 0; }
struct GpuModel::Impl {};
GpuModel::GpuModel(const Qwen35Model&, const GpuPlan&) {
  fail("--device cuda: this build has no CUDA support (configure with -DDELTASTACK_CUDA=ON and nvcc on PATH)");
}
GpuModel::~GpuModel() = default;
LossResult GpuModel::forward_backward(const PackedBatch&, double, double, ForwardCapture*) { return {}; }
std::vector<float> GpuModel::last_logits(const PackedBatch&) { return {}; }
void GpuModel::zero_grads() {}
void GpuModel::begin_step(int64_t) {}
void GpuModel::arm_in_backward(const ops::AdamWParams*) {}
Gradients GpuModel::gradients() const { return Gradients::Fp32; }
double GpuModel::grad_sum_squares() { return 0; }
void GpuModel::adamw_step(const ops::AdamWParams&, double) {}
void GpuModel::set_async_optimizer(bool) {}
void GpuModel::set_profiler(cuda::StepProfiler*) {}
void GpuModel::read(Buffer, int64_t, int64_t, float*) const {}
int GpuModel::optimizer_state_count() const { return 0; }
std::string GpuModel::optimizer_state_name(int, const ParamSpec&) const { return {}; }
void GpuModel::read_optimizer_state(int, int64_t, int64_t, float*) const {}
void GpuModel::write_optimizer_state(int, int64_t, int64_t, const float*) {}
void GpuModel::download_grads(std::vector<float>&) const {}
LoraAdapter* GpuModel::adapter() const { return nullptr; }
void GpuModel::read_lora(LoraBuffer, int64_t, int64_t, float*) const {}
void GpuModel::write_lora(LoraBuffer, int64_t, int64_t, const float*) {}
bool GpuModel::optimizer_codes_8bit(size_t) const { return false; }
void GpuModel::read_optimizer_codes(int, int64_t, int64_t, uint8_t*) const {}
void GpuModel::read_optimizer_block_scales(int, size_t, int64_t, int64_t, float*) const {}
void GpuModel::write_optimizer_codes(int, int64_t, int64_t, const uint8_t*) {}
void GpuModel::write_optimizer_block_scales(int, size_t, int64_t, int64_t, const float*) {}
GpuModel::DeviceGrads GpuModel::device_grads() { return {nullptr, 0, nullptr}; }
GpuModel::ShardBuffers GpuModel::shard_buffers() { return {}; }
void GpuModel::reduce_grads_during_next_backward(std::function<void(float*, int64_t, void*)>) {}
bool GpuModel::join_reduce() { return false; }
void GpuModel::gather_optimizer_state(const std::function<void(void*, int64_t, int)>&, int,
                                      std::vector<std::vector<float>>*) {}
double GpuModel::share_grad_sum_squares() { return 0; }
size_t GpuModel::planned_bytes() const { return 0; }
OptimizerState GpuModel::optimizer_state() const { return OptimizerState::Fp32; }
Recompute GpuModel::recompute() const { return Recompute::Selective; }
std::string GpuModel::recompute_label() const { return "selective"; }
Precision GpuModel::precision() const { return Precision::Bf16; }
size_t GpuModel::peak_bytes() const { return 0; }
}  // namespace ds

#endif
