// Timed scopes of a training step on the compute stream (`deltastack bench step --profile`): each scope records a
// start and an end CUDA event on the stream its ops run on, so profiling adds no synchronisation inside the step
// and changes no result; after the step, collect() waits for the last event and adds every scope's elapsed time
// to a ProfileTable (core/profile.h). The events are created once and reused across steps.
//
// In the model: ProfScope s(prof, stream, "gemm", "mlp down", 2.0 * N * I * H);  with prof null (profiling off)
// the scope is one pointer test and no CUDA call. Scopes must not nest (the table sums them).
#pragma once
#include <cuda_runtime.h>

#include <vector>

namespace ds {
class ProfileTable;
}

namespace ds::cuda {

class StepProfiler {
 public:
  StepProfiler() = default;
  ~StepProfiler();  // destroys the events
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Opens a scope: its start event recorded on `stream` now. family / role: string literals (kept as pointers).
  // flops / bytes: the scope's work (0: unknown). Returns the scope's index for end(). ds::Error when a scope is
  // already open.
  int begin(const char* family, const char* role, double flops, double bytes, cudaStream_t stream);
  // Closes scope i: its end event recorded on `stream`. Does not throw (it runs in ProfScope's destructor): a
  // failure is reported by the next collect().
  void end(int i, cudaStream_t stream) noexcept;
  // While on, scopes get " (rebuild)" after their role: the backward's recompute of forward activations.
  void set_rebuild(bool on) { rebuild_ = on; }

  // After the step: waits for the last event, adds each scope of the step to `table` (ms from the event pair) and
  // starts the next step; the caller closes the table's step (ProfileTable::end_step with the wall time). gaps (null:
  // none): each scope after the first adds the time from the previous scope's end to its own start, as family
  // "gap before" and role "<family> / <role>" (where the step's stream idled, or ran work no scope covers, ahead of
  // that op).
  void collect(ProfileTable& table, ProfileTable* gaps = nullptr);

 private:
  struct Scope {
    const char* family = nullptr;
    const char* role = nullptr;
    double flops = 0, bytes = 0;
    bool rebuild = false;
    cudaEvent_t start = nullptr, end = nullptr;
  };
  std::vector<Scope> scopes_;  // the event pool: grows to the largest step, reused after
  size_t used_ = 0;            // scopes of the current step
  bool open_ = false;
  bool rebuild_ = false;
  cudaError_t error_ = cudaSuccess;  // the first failure of end()
};

// RAII scope: begin in the constructor, end in the destructor; nothing at all when prof is null.
class ProfScope {
 public:
  ProfScope(StepProfiler* prof, cudaStream_t stream, const char* family, const char* role, double flops = 0,
            double bytes = 0)
      : prof_(prof), stream_(stream) {
    if (prof_) index_ = prof_->begin(family, role, flops, bytes, stream);
  }
  ~ProfScope() {
    if (prof_) prof_->end(index_, stream_);
  }
  ProfScope(const ProfScope&) = delete;
  ProfScope& operator=(const ProfScope&) = delete;

 private:
  StepProfiler* prof_;
  cudaStream_t stream_;
  int index_ = 0;
};

}  // namespace ds::cuda
