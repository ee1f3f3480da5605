// Thread control for the CPU backend: OpenMP loops and OpenBLAS GEMMs share one thread count.
#pragma once

namespace ds {

// Sets the OpenMP and OpenBLAS thread counts. n <= 0 means "all hardware threads".
void set_num_threads(int n);
int num_threads();

}  // namespace ds
