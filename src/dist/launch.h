// How this process was started: alone, by `mpirun` (Open MPI's OMPI_COMM_WORLD_* variables) or by `torchrun`
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; PyTorch's elastic launch). One rank
// per process; docs/distributed.md.
#pragma once
#include <functional>
#include <optional>
#include <string>

namespace ds::dist {

struct LaunchInfo {
  std::string launcher = "single";  // "single" | "mpirun" | "torchrun"
  int rank = 0, world = 1;           // global rank in [0, world)
  int local_rank = 0, local_world = 1;  // on this host
  std::string master_addr;          // torchrun's rendezvous (empty otherwise)
  int master_port = 0;
};

// Reads the launcher's variables through `getenv` (std::getenv by default; tests pass their own). Open MPI's
// OMPI_COMM_WORLD_SIZE wins when both sets are present (torchrun under mpirun is not a launch anyone means; the
// MPI ranks are the processes). ds::Error naming the variable for a value that is not a number, a rank outside
// [0, world), a local rank outside [0, local world), or torchrun variables without WORLD_SIZE and RANK together.
using GetEnv = std::function<std::optional<std::string>(const std::string&)>;
LaunchInfo detect_launch(const GetEnv& getenv = {});

// "rank 1 of 2 (mpirun, local rank 1 of 2)" for logs and errors; "single process" for world 1.
std::string describe(const LaunchInfo& l);

}  // namespace ds::dist
