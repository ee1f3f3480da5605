#include "dist/cpu_bind.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>

#ifdef DELTASTACK_HWLOC
#include <hwloc.h>
#endif

namespace ds::dist {

std::string cpu_list(const std::vector<int>& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += j == i ? fmt::format("{}", cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return s;
}

namespace {

// The CPUs this process may run on now (sched_getaffinity), sorted.
std::vector<int> current_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> v;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return v;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) v.push_back(c);
  return v;
}

#ifdef DELTASTACK_HWLOC
struct Topology {
  hwloc_topology_t t = nullptr;
  ~Topology() {
    if (t) hwloc_topology_destroy(t);
  }
};

std::vector<int> pus_of(hwloc_const_bitmap_t set) {
  std::vector<int> v;
  for (int i = hwloc_bitmap_first(set); i >= 0; i = hwloc_bitmap_next(set, i)) v.push_back(i);
  return v;
}
#endif

}  // namespace

CpuBinding plan_cpu_binding(const LaunchInfo& l, const std::string& gpu, const std::vector<int>& current,
                            const std::string& synthetic, int synthetic_gpu_numa) {
  CpuBinding b;
#ifndef DELTASTACK_HWLOC
  (void)l, (void)gpu, (void)current, (void)synthetic, (void)synthetic_gpu_numa;
  b.why = "not bound: this build has no hwloc (install libhwloc-dev and rebuild)";
  return b;
#else
  if (gpu.empty() && l.local_world == 1) {
    b.why = "not bound: one rank on this host and no GPU (the whole machine is its own)";
    return b;
  }
  Topology topo;
  if (hwloc_topology_init(&topo.t) != 0) {
    b.why = "not bound: hwloc_topology_init failed";
    return b;
  }
  if (!synthetic.empty() && hwloc_topology_set_synthetic(topo.t, synthetic.c_str()) != 0) {
    b.why = fmt::format("not bound: bad synthetic topology \"{}\"", synthetic);
    return b;
  }
  if (synthetic.empty()) hwloc_topology_set_io_types_filter(topo.t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo.t) != 0) {
    b.why = "not bound: hwloc could not read the machine's topology";
    return b;
  }
  const std::vector<int> all = pus_of(hwloc_topology_get_topology_cpuset(topo.t));
  if (!current.empty() && current.size() < all.size()) {
    b.why = fmt::format("kept the launcher's binding: cores {}", cpu_list(current));
    return b;
  }
  if (!gpu.empty()) {
    hwloc_const_bitmap_t near = nullptr;
    std::string where;
    if (!synthetic.empty()) {
      hwloc_obj_t numa = hwloc_get_obj_by_type(topo.t, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(synthetic_gpu_numa));
      if (numa) near = numa->cpuset, where = fmt::format("NUMA node {}", numa->os_index);
    } else if (hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(topo.t, gpu.c_str())) {
      hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(topo.t, dev);
      if (anc && anc->cpuset) {
        near = anc->cpuset;
        where = fmt::format("{} {}", hwloc_obj_type_string(anc->type), anc->logical_index);
      }
    }
    if (!near || hwloc_bitmap_iszero(near)) {
      b.why = fmt::format("not bound: hwloc found no cores near GPU {}", gpu);
      return b;
    }
    b.cpus = pus_of(near);
    b.why = fmt::format("cores {} ({}, nearest GPU {})", cpu_list(b.cpus), where, gpu);
    return b;
  }
  // Several ranks, no GPU: local rank r's share of the machine (not when there are more ranks than cores: shares
  // would overlap, and a rank pinned to a shared core waits for its neighbour every step).
  if (static_cast<size_t>(l.local_world) > all.size()) {
    b.why = fmt::format("not bound: {} ranks on this host's {} cores", l.local_world, all.size());
    return b;
  }
  hwloc_obj_t root = hwloc_get_root_obj(topo.t);
  std::vector<hwloc_bitmap_t> sets(static_cast<size_t>(l.local_world));
  for (auto& s : sets) s = hwloc_bitmap_alloc();
  if (hwloc_distrib(topo.t, &root, 1, sets.data(), static_cast<unsigned>(l.local_world), INT_MAX, 0) == 0) {
    b.cpus = pus_of(sets[static_cast<size_t>(l.local_rank)]);
    b.why = fmt::format("cores {} (local rank {}'s share of {} on this host)", cpu_list(b.cpus), l.local_rank,
                        l.local_world);
  } else {
    b.why = "not bound: hwloc_distrib failed";
  }
  for (auto& s : sets) hwloc_bitmap_free(s);
  return b;
#endif
}

std::string bind_cpus(const LaunchInfo& l, const std::string& gpu) {
  try {
    const char* v = std::getenv("DELTASTACK_CPU_BIND");
    if (v) {
      const std::string s(v);
      if (s == "0" || s == "off" || s == "false" || s == "no") return "not bound: DELTASTACK_CPU_BIND=" + s;
      if (s != "1" && s != "on" && s != "true" && s != "yes")
        return "not bound: DELTASTACK_CPU_BIND=" + s + " is not 0 or 1 (nor off / on)";
    }
    const CpuBinding b = plan_cpu_binding(l, gpu, current_cpus());
    if (b.cpus.empty()) return b.why;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : b.cpus)
      if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0)
      return fmt::format("not bound: sched_setaffinity to cores {} failed ({})", cpu_list(b.cpus), std::strerror(errno));
    return b.why;
  } catch (const std::exception& e) {
    return fmt::format("not bound: {}", e.what());
  }
}

}  // namespace ds::dist
