// Collectives between the ranks of one training run: Open MPI for the CPU engine (Debian's libopenmpi; no
// home-made collectives), a single-process stand-in for world size 1. The NCCL communicator of the GPU engine is
// to come (docs/distributed.md). Every rank calls every collective in the same order with the same sizes.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/launch.h"

namespace ds::dist {

class Communicator {
 public:
  explicit Communicator(LaunchInfo l) : launch_(std::move(l)) {}
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const LaunchInfo& launch() const { return launch_; }
  int rank() const { return launch_.rank; }
  int world() const { return launch_.world; }
  bool is_root() const { return launch_.rank == 0; }
  virtual std::string backend() const = 0;  // "single" | "mpi"

  // In place: x[i] = the sum (max) of x[i] over the ranks, the same bits on every rank. n elements, any n >= 0
  // (larger than INT_MAX is sent in pieces). The order of the additions is the library's (fixed for a given
  // world size and n), so a sum over ranks may differ in its last bits from a sequential sum.
  virtual void all_reduce_sum(float* x, int64_t n) = 0;
  virtual void all_reduce_sum(double* x, int64_t n) = 0;
  virtual void all_reduce_sum(int64_t* x, int64_t n) = 0;
  virtual void all_reduce_max(int64_t* x, int64_t n) = 0;
  // Rank r's part of a buffer of sum(counts) elements: [offset(r), offset(r) + counts[r]) with offset(r) the sum of
  // the counts before r. reduce_scatter_sum: recv (counts[rank] elements) = the sum over ranks of each rank's
  // `send` part for this rank (send: the whole buffer). all_gather: x (the whole buffer) gets every rank's part from
  // that rank, in place. Each count and their sum must be below 2^31 (ds::Error otherwise).
  virtual void reduce_scatter_sum(const float* send, float* recv, const std::vector<int64_t>& counts) = 0;
  virtual void all_gather(float* x, const std::vector<int64_t>& counts) = 0;
  // `bytes` bytes at p from rank `root` to every rank.
  virtual void broadcast(void* p, int64_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // Ends every rank of the run with exit code `code` (no rank is left waiting in a collective).
  [[noreturn]] virtual void abort(int code) = 0;

  // Planned collectives (ShardMode::Full's per-layer gathers and reduce-scatters, model/engine.cpp): the split of a
  // buffer over the ranks checked and converted to MPI's int counts and offsets once (parts()), so that a call
  // allocates nothing. Parts.counts[r] is rank r's part as in all_gather / reduce_scatter_sum above.
  struct Parts {
    std::vector<int64_t> counts;
    std::vector<int> icounts, displs;  // MPI's counts and offsets (elements)
    int64_t total = 0;
  };
  // ds::Error when counts.size() != world() or a count or their sum is 2^31 or more.
  Parts parts(const std::vector<int64_t>& counts) const;
  // all_gather(x, p.counts), started and not waited for (MPI_Iallgatherv, in place): x (p.total floats) holds every
  // rank's part only once wait(ticket) returned, and neither x nor p may be touched or freed before. At most
  // kMaxPending started and not waited for (ds::Error beyond); every rank starts them in the same order. Open MPI
  // moves the data only inside MPI calls (no progress thread), so on the CPU most of the transfer happens in wait().
  // The base class: a blocking all_gather, ticket 0.
  static constexpr int kMaxPending = 4;
  virtual int start_all_gather(float* x, const Parts& p) {
    all_gather(x, p.counts);
    return 0;
  }
  virtual void wait(int /*ticket*/) {}
  // reduce_scatter_sum(send, recv, p.counts) without the per-call conversion (MPI_Reduce_scatter).
  virtual void reduce_scatter_sum(const float* send, float* recv, const Parts& p) {
    reduce_scatter_sum(send, recv, p.counts);
  }

 private:
  LaunchInfo launch_;
};

// The communicator for how this process was launched: world size 1 (any launcher) -> single process; mpirun ->
// Open MPI (MPI_Init_thread; MPI_Finalize when it is destroyed). ds::Error when the binary was built without MPI
// and mpirun started several ranks, and for torchrun with several ranks (the CPU engine's ranks run under mpirun;
// torchrun's rendezvous belongs to the NCCL communicator, not built yet).
std::unique_ptr<Communicator> open_communicator(const LaunchInfo& launch);

// The split of n elements into `world` contiguous parts whose sizes differ by at most 1 (the first n % world are
// one larger): rank r's share of a flat buffer.
std::vector<int64_t> even_counts(int64_t n, int world);

// Whether this build has the Open MPI communicator.
bool have_mpi();

// The process's communicator: the one `install` was given, else a single-process one. `install` is called once,
// by the `train` command, before anything else runs.
Communicator& world();
void install(std::unique_ptr<Communicator> c);
// Releases the installed communicator (MPI_Finalize) at a normal exit.
void uninstall();

}  // namespace ds::dist
