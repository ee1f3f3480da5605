// Device discovery that is safe in every build: without CUDA support, or on a machine without a GPU,
// cuda_device_count() is 0 and nothing CUDA is touched.
#pragma once
#include <cstddef>
#include <string>

namespace ds {

bool cuda_compiled();          // built with DELTASTACK_CUDA
int cuda_device_count();       // 0 when not compiled, no driver, or no device
std::string cuda_device_name();  // "" when none
// PCI bus id of GPU `device` ("0000:18:00.0", as sysfs and hwloc name it; lowercase); "" when there is none.
std::string cuda_pci_bus_id(int device = 0);
// The GPU this process uses (cudaGetDevice; 0 before any choice and in builds without CUDA).
int cuda_current_device();
// Bytes free on the current GPU (cudaMemGetInfo); 0 without a device or CUDA support.
size_t cuda_free_bytes();
// Makes GPU `local_rank` this process's device (cudaSetDevice), one rank per GPU of the host; when exactly one GPU
// is visible (the launcher gave each rank its own through CUDA_VISIBLE_DEVICES) that one. Returns the device index.
// ds::Error naming the rank when there is no GPU or local_rank has none (more ranks on the host than GPUs).
int cuda_select_device(int local_rank, int local_world);

}  // namespace ds
