#include "dist/launch.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>

#include "core/error.h"

namespace ds::dist {

namespace {

std::optional<std::string> std_getenv(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (!v) return std::nullopt;
  return std::string(v);
}

// A non-negative int from variable `name`, or `fallback` when unset.
int int_var(const GetEnv& env, const std::string& name, int fallback) {
  const std::optional<std::string> v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v->c_str(), &end, 10);
  DS_CHECK(!v->empty() && end && *end == '\0' && errno == 0 && x >= 0 && x <= 1 << 24,
           "environment variable {}={:?} is not a rank count or index (a non-negative integer)", name, *v);
  return static_cast<int>(x);
}

void check_ranks(const LaunchInfo& l, const std::string& rank_var, const std::string& world_var,
                 const std::string& local_var, const std::string& local_world_var) {
  DS_CHECK(l.world >= 1, "{}={} must be at least 1", world_var, l.world);
  DS_CHECK(l.rank < l.world, "{}={} is not below {}={}", rank_var, l.rank, world_var, l.world);
  DS_CHECK(l.local_world >= 1 && l.local_world <= l.world, "{}={} must be between 1 and {}={}", local_world_var,
           l.local_world, world_var, l.world);
  DS_CHECK(l.local_rank < l.local_world, "{}={} is not below {}={}", local_var, l.local_rank, local_world_var,
           l.local_world);
}

}  // namespace

LaunchInfo detect_launch(const GetEnv& getenv) {
  const GetEnv env = getenv ? getenv : GetEnv(std_getenv);
  LaunchInfo l;
  if (env("OMPI_COMM_WORLD_SIZE")) {
    l.launcher = "mpirun";
    l.world = int_var(env, "OMPI_COMM_WORLD_SIZE", 1);
    l.rank = int_var(env, "OMPI_COMM_WORLD_RANK", 0);
    l.local_rank = int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    l.local_world = int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE", l.world);
    check_ranks(l, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE");
    return l;
  }
  const bool has_world = env("WORLD_SIZE").has_value(), has_rank = env("RANK").has_value();
  if (has_world || has_rank) {
    DS_CHECK(has_world && has_rank, "torchrun launch: {} is set but {} is not (both come from torchrun)",
             has_world ? "WORLD_SIZE" : "RANK", has_world ? "RANK" : "WORLD_SIZE");
    l.launcher = "torchrun";
    l.world = int_var(env, "WORLD_SIZE", 1);
    l.rank = int_var(env, "RANK", 0);
    l.local_rank = int_var(env, "LOCAL_RANK", l.rank);
    l.local_world = int_var(env, "LOCAL_WORLD_SIZE", l.world);
    l.master_addr = env("MASTER_ADDR").value_or("");
    l.master_port = int_var(env, "MASTER_PORT", 0);
    check_ranks(l, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    return l;
  }
  return l;
}

std::string describe(const LaunchInfo& l) {
  if (l.world == 1 && l.launcher == "single") return "single process";
  return fmt::format("rank {} of {} ({}, local rank {} of {})", l.rank, l.world, l.launcher, l.local_rank,
                     l.local_world);
}

}  // namespace ds::dist
