// Device discovery that is safe in every build: without CUDA support, or on a machine without a GPU,
// cuda_device_count() is 0 and nothing CUDA is touched.
#pragma once
#include <string>

namespace ds {

bool cuda_compiled();          // built with DELTASTACK_CUDA
int cuda_device_count();       // 0 when not compiled, no driver, or no device
std::string cuda_device_name();  // "" when none

}  // namespace ds
