#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"

#include <cctype>

namespace ds {

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return n;
}

std::string cuda_device_name() {
  if (cuda_device_count() == 0) return "";
  cudaDeviceProp p;
  DS_CUDA_CHECK(cudaGetDeviceProperties(&p, cuda_current_device()));
  return p.name;
}

std::string cuda_pci_bus_id(int device) {
  if (device < 0 || device >= cuda_device_count()) return "";
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, static_cast<int>(sizeof id), device) != cudaSuccess) return "";
  std::string s(id);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

int cuda_current_device() {
  int d = 0;
  if (cuda_device_count() == 0 || cudaGetDevice(&d) != cudaSuccess) return 0;
  return d;
}

size_t cuda_free_bytes() {
  size_t free_b = 0, total_b = 0;
  if (cuda_device_count() == 0 || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return 0;
  return free_b;
}

int cuda_select_device(int local_rank, int local_world) {
  const int n = cuda_device_count();
  if (n == 0) cuda::throw_error("local rank " + std::to_string(local_rank) + ": no CUDA GPU is visible");
  const int d = n == 1 ? 0 : local_rank;
  if (d >= n)
    cuda::throw_error("local rank " + std::to_string(local_rank) + " of " + std::to_string(local_world) + " has no GPU: this "
                "host shows " + std::to_string(n) + " (one rank per GPU)");
  DS_CUDA_CHECK(cudaSetDevice(d));
  return d;
}

}  // namespace ds
