#!/bin/sh
# Builds the chunked GDN harness (bench/gdn_chunked_harness.cu) from the repo root into ${1:-gdn_h}.
set -e
F="-std=c++20 -gencode arch=compute_90a,code=sm_90a -O3 -lineinfo -Isrc --expt-relaxed-constexpr"
T=${TMPDIR:-/tmp}/gdnh.$$
mkdir -p $T
nvcc $F -Xcompiler -fopenmp -c bench/gdn_chunked_harness.cu -o $T/h.o &
nvcc $F -c src/ops/gated_delta_rule/chunked.cu -o $T/c.o &
nvcc $F -c src/ops/gated_delta_rule/cuda.cu -o $T/o.o &
wait
nvcc $F -Xcompiler -fopenmp $T/h.o $T/c.o $T/o.o -o ${1:-gdn_h}
