// The test binary's main: the same OpenBLAS kernels as the deltastack binary it spawns (core/cpu_blas.h), then
// GoogleTest.
#include <gtest/gtest.h>

#include "core/cpu_blas.h"

int main(int argc, char** argv) {
  ds::reexec_with_cpu_blas_kernels(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
