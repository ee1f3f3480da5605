#include "core/cuda/cuda_utils.h"
#include "core/cuda/device.h"

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

}  // namespace ds
