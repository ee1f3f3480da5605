// Pinning a rank to CPU cores near its work (hwloc, Debian's libhwloc): xtuner measured +1.7 % at 256 ranks from
// binding each rank to the cores nearest its accelerator. docs/distributed.md.
#pragma once
#include <string>
#include <vector>

#include "dist/launch.h"

namespace ds::dist {

struct CpuBinding {
  std::vector<int> cpus;  // OS indices of the processing units to run on; empty: leave the process where it is
  std::string why;        // for the log: where these cores are, or why nothing is bound
};

// What bind_cpus would do, on the machine's topology or, when `synthetic` is not empty, on an hwloc synthetic one
// (e.g. "pack:2 numa:1 core:4 pu:1"; for tests):
//   - with a GPU (gpu_pci_bus_id "0000:18:00.0"): the cores of the GPU's nearest NUMA node (hwloc: the cpuset of the
//     PCI device's first non-I/O ancestor); with a synthetic topology, which has no PCI devices, NUMA node
//     `synthetic_gpu_numa` stands in for it;
//   - else, with several ranks on this host and no more ranks than cores: local rank r's share of the host's cores
//     (hwloc_distrib over the machine: shares follow packages, NUMA nodes and cores, no core in two shares);
//   - else nothing (one rank, no GPU: the whole machine is its own).
// `current` (OS indices the process may run on now; empty: all) narrower than the machine means a launcher
// (mpirun --bind-to, taskset, numactl, Slurm) bound it already: that binding is kept. Never throws: a failure is
// the reason in `why`, with no cpus.
CpuBinding plan_cpu_binding(const LaunchInfo& l, const std::string& gpu_pci_bus_id, const std::vector<int>& current,
                            const std::string& synthetic = "", int synthetic_gpu_numa = 0);

// Applies plan_cpu_binding on the real topology to this process (before it starts threads: OpenMP's workers
// inherit it), unless DELTASTACK_CPU_BIND is 0 / off / false / no (1 / on / true / yes or unset: bind; anything
// else: not bound, said in the returned text). Returns the log text ("cores 0-15 (NUMA node 0, nearest GPU
// 0000:18:00.0)", "not bound: ..."). Never throws.
std::string bind_cpus(const LaunchInfo& l, const std::string& gpu_pci_bus_id);

// "0-3,8,10-11" for sorted OS indices.
std::string cpu_list(const std::vector<int>& cpus);

}  // namespace ds::dist
