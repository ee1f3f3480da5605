#include "dist/communicator.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

#ifdef DELTASTACK_MPI
#include <mpi.h>
#endif

namespace ds::dist {

namespace {

class SingleProcess final : public Communicator {
 public:
  explicit SingleProcess(LaunchInfo l) : Communicator(std::move(l)) {}
  std::string backend() const override { return "single"; }
  void all_reduce_sum(float*, int64_t) override {}
  void all_reduce_sum(double*, int64_t) override {}
  void all_reduce_sum(int64_t*, int64_t) override {}
  void all_reduce_max(int64_t*, int64_t) override {}
  void reduce_scatter_sum(const float* send, float* recv, const std::vector<int64_t>& counts) override {
    if (send != recv) std::memcpy(recv, send, static_cast<size_t>(counts.at(0)) * sizeof(float));
  }
  void all_gather(float*, const std::vector<int64_t>&) override {}
  void broadcast(void*, int64_t, int) override {}
  void barrier() override {}
  [[noreturn]] void abort(int code) override { std::_Exit(code); }
};

#ifdef DELTASTACK_MPI
class Mpi final : public Communicator {
 public:
  explicit Mpi(LaunchInfo l) : Communicator(std::move(l)) {
    int provided = 0;
    // Only the main thread calls MPI (the OpenMP workers never do).
    DS_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) == MPI_SUCCESS,
             "MPI_Init_thread failed ({})", describe(launch()));
    int r = -1, n = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    DS_CHECK(r == rank() && n == world(), "MPI says rank {} of {}, the environment {}", r, n, describe(launch()));
    std::fill(pending_, pending_ + kMaxPending, MPI_REQUEST_NULL);
  }
  ~Mpi() override { MPI_Finalize(); }
  std::string backend() const override { return "mpi"; }
  void all_reduce_sum(float* x, int64_t n) override { reduce(x, n, MPI_FLOAT, MPI_SUM); }
  void all_reduce_sum(double* x, int64_t n) override { reduce(x, n, MPI_DOUBLE, MPI_SUM); }
  void all_reduce_sum(int64_t* x, int64_t n) override { reduce(x, n, MPI_INT64_T, MPI_SUM); }
  void all_reduce_max(int64_t* x, int64_t n) override { reduce(x, n, MPI_INT64_T, MPI_MAX); }
  void reduce_scatter_sum(const float* send, float* recv, const std::vector<int64_t>& counts) override {
    const std::vector<int> c = int_counts(counts, "reduce_scatter");
    check(MPI_Reduce_scatter(send, recv, c.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Reduce_scatter");
  }
  void all_gather(float* x, const std::vector<int64_t>& counts) override {
    const std::vector<int> c = int_counts(counts, "all_gather");
    std::vector<int> displs(c.size(), 0);
    for (size_t i = 1; i < c.size(); ++i) displs[i] = displs[i - 1] + c[i - 1];
    check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, x, c.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD),
          "MPI_Allgatherv");
  }
  void broadcast(void* p, int64_t bytes, int root) override {
    auto* b = static_cast<char*>(p);
    for (int64_t off = 0; off < bytes; off += kPiece) {
      const int c = static_cast<int>(std::min<int64_t>(kPiece, bytes - off));
      check(MPI_Bcast(b + off, c, MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
    }
  }
  void barrier() override { check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }
  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }
  int start_all_gather(float* x, const Parts& p) override {
    DS_CHECK(static_cast<int>(p.icounts.size()) == world(), "start_all_gather: parts for {} ranks, not {}",
             p.icounts.size(), world());
    int t = 0;
    while (t < kMaxPending && pending_[t] != MPI_REQUEST_NULL) ++t;
    DS_CHECK(t < kMaxPending, "start_all_gather: {} gathers already started and not waited for", kMaxPending);
    check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, x, p.icounts.data(), p.displs.data(), MPI_FLOAT,
                          MPI_COMM_WORLD, &pending_[t]), "MPI_Iallgatherv");
    return t;
  }
  void wait(int t) override {
    DS_CHECK(t >= 0 && t < kMaxPending && pending_[t] != MPI_REQUEST_NULL, "wait: no gather started as ticket {}", t);
    check(MPI_Wait(&pending_[t], MPI_STATUS_IGNORE), "MPI_Wait");  // sets it back to MPI_REQUEST_NULL
  }
  void reduce_scatter_sum(const float* send, float* recv, const Parts& p) override {
    DS_CHECK(static_cast<int>(p.icounts.size()) == world(), "reduce_scatter: parts for {} ranks, not {}",
             p.icounts.size(), world());
    check(MPI_Reduce_scatter(send, recv, p.icounts.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Reduce_scatter");
  }

 private:
  static constexpr int64_t kPiece = INT_MAX / 8;  // elements per call (MPI counts are int)
  MPI_Request pending_[kMaxPending];  // started gathers (MPI_REQUEST_NULL: a free ticket)
  template <typename T>
  void reduce(T* x, int64_t n, MPI_Datatype t, MPI_Op op) {
    for (int64_t off = 0; off < n; off += kPiece) {
      const int c = static_cast<int>(std::min<int64_t>(kPiece, n - off));
      check(MPI_Allreduce(MPI_IN_PLACE, x + off, c, t, op, MPI_COMM_WORLD), "MPI_Allreduce");
    }
  }
  std::vector<int> int_counts(const std::vector<int64_t>& counts, const char* what) {
    DS_CHECK(static_cast<int>(counts.size()) == world(), "{}: {} counts for {} ranks", what, counts.size(), world());
    int64_t total = 0;
    std::vector<int> c;
    for (int64_t n : counts) {
      total += n;
      c.push_back(static_cast<int>(n));
    }
    DS_CHECK(total < INT_MAX, "{}: {} elements; the MPI communicator takes buffers below 2^31 elements", what, total);
    return c;
  }
  void check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    fail("{} failed on {}: {}", what, describe(launch()), std::string(msg, static_cast<size_t>(len)));
  }
};
#endif

std::unique_ptr<Communicator>& installed() {
  static std::unique_ptr<Communicator> c;
  return c;
}

}  // namespace

Communicator::Parts Communicator::parts(const std::vector<int64_t>& counts) const {
  DS_CHECK(static_cast<int>(counts.size()) == world(), "parts: {} counts for {} ranks", counts.size(), world());
  Parts p;
  p.counts = counts;
  for (int64_t n : counts) {
    DS_CHECK(n >= 0 && n < INT_MAX && p.total + n < INT_MAX, "parts: {} elements; the MPI communicator takes buffers "
             "below 2^31 elements", p.total + n);
    p.displs.push_back(static_cast<int>(p.total));
    p.icounts.push_back(static_cast<int>(n));
    p.total += n;
  }
  return p;
}

std::vector<int64_t> even_counts(int64_t n, int world) {
  std::vector<int64_t> c(static_cast<size_t>(world), n / world);
  for (int64_t r = 0; r < n % world; ++r) ++c[static_cast<size_t>(r)];
  return c;
}

bool have_mpi() {
#ifdef DELTASTACK_MPI
  return true;
#else
  return false;
#endif
}

void Communicator::no_device_collectives() const {
  fail("the {} communicator has no collectives on device memory (the GPU engine's ranks need NCCL)", backend());
}
void Communicator::device_all_reduce_sum(float*, int64_t, void*) { no_device_collectives(); }
void Communicator::device_reduce_scatter_sum(const float*, float*, int64_t, void*) { no_device_collectives(); }
void Communicator::device_all_gather(const void*, void*, int64_t, void*) { no_device_collectives(); }
void Communicator::device_broadcast(void*, int64_t, int, void*) { no_device_collectives(); }

std::unique_ptr<Communicator> open_communicator(const LaunchInfo& l, const std::string& device) {
  if (device == "cuda" && l.launcher != "single") return open_nccl_communicator(l);
  if (l.world == 1) return std::make_unique<SingleProcess>(l);
  if (l.launcher == "torchrun")
    fail("torchrun started {} ranks (WORLD_SIZE={}) of the CPU engine, whose ranks talk over MPI: start them with "
         "`mpirun -np {} deltastack train ...`; torchrun launches are for the GPU engine (NCCL; docs/distributed.md)",
         l.world, l.world, l.world);
#ifdef DELTASTACK_MPI
  return std::make_unique<Mpi>(l);
#else
  fail("mpirun started {} ranks, but this deltastack was built without MPI (install libopenmpi-dev, which "
       "scripts/setup.sh does, and rebuild)", l.world);
#endif
}

Communicator& world() {
  std::unique_ptr<Communicator>& c = installed();
  if (!c) c = std::make_unique<SingleProcess>(LaunchInfo{});
  return *c;
}

void install(std::unique_ptr<Communicator> c) { installed() = std::move(c); }

void uninstall() { installed().reset(); }

}  // namespace ds::dist
