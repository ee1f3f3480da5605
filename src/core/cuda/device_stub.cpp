// Used when the build has no CUDA (DELTASTACK_CUDA=OFF); device.cu replaces it otherwise.
#ifndef DELTASTACK_CUDA
#include "core/cuda/device.h"
#include "core/error.h"

namespace ds {
bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_name() { return ""; }
std::string cuda_pci_bus_id(int) { return ""; }
int cuda_current_device() { return 0; }
size_t cuda_free_bytes() { return 0; }
int cuda_select_device(int local_rank, int) {
  throw Error("local rank " + std::to_string(local_rank) + ": this deltastack was built without CUDA");
}
}  // namespace ds
#endif
