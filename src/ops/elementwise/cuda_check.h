// Numeric checks of the CUDA elementwise helpers (ops/elementwise/cuda.h: the attention output gate, the residual
// add, the strided row copy, the bf16 -> fp32 copy) against their CPU math (output_gate_* in
// ops/attention/attention.h), shared by the registry's start-up probe ("output_gate") and tests/test_cuda_ops.cpp;
// contract in ops/check/check.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/check/check.h"

namespace ds::ops {

// n elements: o (a), gate (b, std 2), dy, bf16. Values: output gate y (forward band), dout, dgate (gradient band);
// add (forward band), add exactly one rounding of the fp32 sum, add in place (y aliasing a) equal to add;
// bf16_to_f32 exact; with twice, two runs bitwise equal.
struct ElementwiseCase {
  int64_t n = 64 * 256;
  size_t offset = 0;  // pointer shift in elements (1: unaligned, the scalar path)
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_elementwise(const ElementwiseCase& c);

// copy_rows of `cols` bf16 values per row from column src_col of [rows, src_stride] rows to column dst_col of
// [rows, dst_stride] rows pre-filled with other values. Values: the copy (rel. L2), the whole destination exactly
// as expected (an exact copy, nothing written outside the rows); with twice, two runs bitwise equal.
struct CopyRowsCase {
  int64_t rows = 64, cols = 128, src_stride = 256, src_col = 128, dst_stride = 384, dst_col = 64;
  size_t offset = 0;
  uint64_t seed = 1;
  bool twice = true;
};
check::Result check_copy_rows(const CopyRowsCase& c);

// The start-up probe of "output_gate": elementwise at n 64 x 256, and copy_rows of 64 rows x 128 from column 128
// of stride 256 to column 64 of stride 384 (the worst error over both).
std::vector<ElementwiseCase> elementwise_probe_cases();
std::vector<CopyRowsCase> copy_rows_probe_cases();
double probe_cuda_output_gate();

}  // namespace ds::ops
