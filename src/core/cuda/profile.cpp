// Compiled only with DELTASTACK_CUDA (core/cuda/profile.h includes cuda_runtime.h).
#ifdef DELTASTACK_CUDA
#include "core/cuda/profile.h"

#include <string>

#include "core/cuda/cuda_utils.h"
#include "core/error.h"
#include "core/profile.h"

namespace ds::cuda {

StepProfiler::~StepProfiler() {
  for (Scope& s : scopes_) {
    if (s.start) cudaEventDestroy(s.start);
    if (s.end) cudaEventDestroy(s.end);
  }
}

int StepProfiler::begin(const char* family, const char* role, double flops, double bytes, cudaStream_t stream) {
  DS_CHECK(!open_, "profile: scope {} / {} opened inside another scope", family, role);
  if (used_ == scopes_.size()) {  // the first profiled step (or a larger one): one more event pair
    Scope s;
    DS_CUDA_CHECK(cudaEventCreate(&s.start));
    DS_CUDA_CHECK(cudaEventCreate(&s.end));
    scopes_.push_back(s);
  }
  Scope& s = scopes_[used_];
  s.family = family;
  s.role = role;
  s.flops = flops;
  s.bytes = bytes;
  s.rebuild = rebuild_;
  DS_CUDA_CHECK(cudaEventRecord(s.start, stream));
  open_ = true;
  return static_cast<int>(used_++);
}

void StepProfiler::end(int i, cudaStream_t stream) noexcept {
  open_ = false;
  const cudaError_t e = cudaEventRecord(scopes_[static_cast<size_t>(i)].end, stream);
  if (e != cudaSuccess && error_ == cudaSuccess) error_ = e;
}

void StepProfiler::collect(ProfileTable& table, ProfileTable* gaps) {
  const cudaError_t e = error_;
  error_ = cudaSuccess;
  const size_t n = used_;
  used_ = 0;
  open_ = false;
  rebuild_ = false;
  DS_CUDA_CHECK(e);
  if (n == 0) return;
  DS_CUDA_CHECK(cudaEventSynchronize(scopes_[n - 1].end));
  for (size_t i = 0; i < n; ++i) {
    const Scope& s = scopes_[i];
    float ms = 0;
    DS_CUDA_CHECK(cudaEventElapsedTime(&ms, s.start, s.end));
    const std::string role = s.rebuild ? std::string(s.role) + " (rebuild)" : std::string(s.role);
    table.add(s.family, role, ms, s.flops, s.bytes);
    if (gaps && i > 0) {
      float g = 0;
      DS_CUDA_CHECK(cudaEventElapsedTime(&g, scopes_[i - 1].end, s.start));
      gaps->add("gap before", std::string(s.family) + " / " + role, g);
    }
  }
}

}  // namespace ds::cuda
#endif
