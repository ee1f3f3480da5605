// Used when the build has no CUDA (DELTASTACK_CUDA=OFF); device.cu replaces it otherwise.
#ifndef DELTASTACK_CUDA
#include "core/cuda/device.h"

namespace ds {
bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_name() { return ""; }
std::string cuda_pci_bus_id(int) { return ""; }
}  // namespace ds
#endif
