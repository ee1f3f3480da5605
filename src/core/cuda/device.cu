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
  DS_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
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

}  // namespace ds
