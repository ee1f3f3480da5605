// Device discovery that is safe in every build: without CUDA support, or on a machine without a GPU,
// cuda_device_count() is 0 and nothing CUDA is touched.
#pragma once
#include <string>

namespace ds {

bool cuda_compiled();          // built with DELTASTACK_CUDA
int cuda_device_count();       // 0 when not compiled, no driver, or no device
std::string cuda_device_name();  // "" when none
// PCI bus id of GPU `device` ("0000:18:00.0", as sysfs and hwloc name it; lowercase); "" when there is none.
std::string cuda_pci_bus_id(int device = 0);

}  // namespace ds
