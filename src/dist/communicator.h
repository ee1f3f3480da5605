// Collectives between the ranks of one training run (no home-made collectives): Open MPI for the CPU engine
// (Debian's libopenmpi), NVIDIA's NCCL for the GPU engine (dist/nccl.cpp: device buffers directly, host values
// staged through the GPU), a single-process stand-in for one plain process. Every rank calls every collective
// in the same order with the same sizes. docs/distributed.md.
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
  virtual std::string backend() const = 0;  // "single" | "mpi" | "nccl <version> on GPU <n>"

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

  // Collectives on device memory (the GPU engine's buffers), enqueued on `stream` (a cudaStream_t) in its order
  // and finished when the stream gets there; NCCL only (on_device()), ds::Error from the others. In place where
  // send == recv. device_all_reduce_sum: x[0, n) fp32 summed over the ranks, the same bits on every rank.
  // device_reduce_scatter_sum: send holds world() * per_rank fp32 values; recv (per_rank) = the sum over ranks of
  // this rank's part [rank * per_rank, (rank + 1) * per_rank). device_all_gather: recv (world() * per_rank_bytes)
  // gets every rank's send (per_rank_bytes) in rank order.
  virtual bool on_device() const { return false; }
  virtual void device_all_reduce_sum(float* x, int64_t n, void* stream);
  virtual void device_reduce_scatter_sum(const float* send, float* recv, int64_t per_rank, void* stream);
  virtual void device_all_gather(const void* send, void* recv, int64_t per_rank_bytes, void* stream);
  // `bytes` bytes at p (device) from rank `root` to every rank. Between device_group_start and _end, the
  // collectives are issued as one group (NCCL's ncclGroupStart / ncclGroupEnd).
  virtual void device_broadcast(void* p, int64_t bytes, int root, void* stream);
  virtual void device_group_start() {}
  virtual void device_group_end() {}

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
  [[noreturn]] void no_device_collectives() const;  // ds::Error: the device collectives of a non-NCCL communicator
  LaunchInfo launch_;
};

// The communicator for how this process was launched and the engine it runs ("cpu" | "cuda"):
//   - "cuda" under a launcher (torchrun or mpirun, any world size, 1 included): NCCL, on GPU local_rank (the only
//     GPU when the launcher made one visible per rank); see open_nccl_communicator;
//   - otherwise world size 1 -> single process; mpirun -> Open MPI (MPI_Init_thread; MPI_Finalize when it is
//     destroyed).
// ds::Error when the binary was built without MPI (NCCL) and the launch needs it, and for torchrun starting several
// CPU ranks (the CPU engine's ranks talk over MPI: mpirun).
std::unique_ptr<Communicator> open_communicator(const LaunchInfo& launch, const std::string& device = "cpu");
// NCCL (dlopen of libnccl.so.2, or DELTASTACK_NCCL_LIBRARY): selects this rank's GPU first; the ranks meet through
// MPI (mpirun: rank 0's ncclUniqueId broadcast) or NCCL_COMM_ID (torchrun: MASTER_ADDR:MASTER_PORT+1 unless set).
// ds::Error naming the library, the rank and NCCL's message when anything fails.
std::unique_ptr<Communicator> open_nccl_communicator(const LaunchInfo& launch);
bool have_nccl();  // whether this build has the NCCL communicator

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
