// The GPU engine's communicator: NVIDIA's NCCL (libnccl.so.2, opened at run time; no home-made collectives).
// Device buffers (the gradients) go straight to NCCL on the caller's stream; the trainer's host-side values
// (token counts, loss sums, run ids, the barrier) are staged through a small device buffer on the
// communicator's own stream. The ranks find each other through NCCL's own bootstrap: under mpirun rank 0's
// ncclUniqueId is broadcast over MPI; under torchrun NCCL_COMM_ID (NCCL's documented variable: the address of
// rank 0's bootstrap socket) is MASTER_ADDR:MASTER_PORT+1 unless the user set it (MASTER_PORT itself is
// torchrun's own store). docs/distributed.md.
#include "dist/communicator.h"

#ifdef DELTASTACK_NCCL
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/cuda/device.h"
#include "core/error.h"

#ifdef DELTASTACK_MPI
#include <mpi.h>
#endif

namespace ds::dist {

namespace {

// The NCCL entry points deltastack calls, resolved from the library at run time.
struct NcclApi {
  const char* (*get_error_string)(ncclResult_t);
  ncclResult_t (*get_version)(int*);
  ncclResult_t (*get_unique_id)(ncclUniqueId*);
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*comm_destroy)(ncclComm_t);
  ncclResult_t (*comm_abort)(ncclComm_t);
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*reduce_scatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*group_start)();
  ncclResult_t (*group_end)();
  std::string path;
  int version = 0;
};

const NcclApi& nccl_api() {
  static const NcclApi api = [] {
    NcclApi a{};
    const char* env = std::getenv("DELTASTACK_NCCL_LIBRARY");
    a.path = env && *env ? env : "libnccl.so.2";
    void* h = dlopen(a.path.c_str(), RTLD_NOW | RTLD_LOCAL);
    DS_CHECK(h, "cannot open NCCL ({}): {}. The GPU engine's ranks talk over NCCL: install it (NVIDIA's libnccl2, or "
             "the nvidia-nccl wheel) and put its directory on LD_LIBRARY_PATH, or name the library with "
             "DELTASTACK_NCCL_LIBRARY", a.path, dlerror());
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      DS_CHECK(fn, "{} has no symbol {} (not an NCCL 2 library?)", a.path, name);
    };
    sym(a.get_error_string, "ncclGetErrorString");
    sym(a.get_version, "ncclGetVersion");
    sym(a.get_unique_id, "ncclGetUniqueId");
    sym(a.comm_init_rank, "ncclCommInitRank");
    sym(a.comm_destroy, "ncclCommDestroy");
    sym(a.comm_abort, "ncclCommAbort");
    sym(a.all_reduce, "ncclAllReduce");
    sym(a.reduce_scatter, "ncclReduceScatter");
    sym(a.all_gather, "ncclAllGather");
    sym(a.broadcast, "ncclBroadcast");
    sym(a.reduce, "ncclReduce");
    sym(a.group_start, "ncclGroupStart");
    sym(a.group_end, "ncclGroupEnd");
    a.get_version(&a.version);
    DS_CHECK(a.version >= 21800, "{} is NCCL {}; deltastack needs NCCL 2.18 or later", a.path, a.version);
    return a;
  }();
  return api;
}

void cuda_check(cudaError_t e, const char* what, const LaunchInfo& l) {
  if (e != cudaSuccess) fail("{} failed on {}: {}", what, describe(l), cudaGetErrorString(e));
}

class Nccl final : public Communicator {
 public:
  explicit Nccl(LaunchInfo l) : Communicator(std::move(l)) {
    const NcclApi& api = nccl_api();
    const int dev = cuda_select_device(launch().local_rank, launch().local_world);
    ncclUniqueId id{};
    bootstrap(api, id);
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate", launch());
    cuda_check(cudaMalloc(&scratch_, kScratch), "cudaMalloc (NCCL staging buffer)", launch());
    cuda_check(cudaMallocHost(&host_, kScratch), "cudaMallocHost (NCCL staging buffer)", launch());
    check(api.comm_init_rank(&comm_, world(), id, rank()), "ncclCommInitRank");
    device_ = dev;
  }
  ~Nccl() override {
    if (comm_) nccl_api().comm_destroy(comm_);
    if (scratch_) cudaFree(scratch_);
    if (host_) cudaFreeHost(host_);
    if (stream_) cudaStreamDestroy(stream_);
#ifdef DELTASTACK_MPI
    if (mpi_) MPI_Finalize();
#endif
  }
  std::string backend() const override {
    const int v = nccl_api().version;
    return fmt::format("nccl {}.{}.{} on GPU {}", v / 10000, v / 100 % 100, v % 100, device_);
  }
  bool on_device() const override { return true; }

  void all_reduce_sum(float* x, int64_t n) override { staged(x, n, ncclFloat32, ncclSum); }
  void all_reduce_sum(double* x, int64_t n) override { staged(x, n, ncclFloat64, ncclSum); }
  void all_reduce_sum(int64_t* x, int64_t n) override { staged(x, n, ncclInt64, ncclSum); }
  void all_reduce_max(int64_t* x, int64_t n) override { staged(x, n, ncclInt64, ncclMax); }
  void reduce_scatter_sum(const float*, float*, const std::vector<int64_t>&) override {
    fail("the NCCL communicator reduce-scatters device buffers only (device_reduce_scatter_sum)");
  }
  void all_gather(float*, const std::vector<int64_t>&) override {
    fail("the NCCL communicator all-gathers device buffers only (device_all_gather)");
  }
  void broadcast(void* p, int64_t bytes, int root) override {
    through_staging(static_cast<char*>(p), bytes, "ncclBroadcast", [&](int64_t c) {
      check(nccl_api().broadcast(scratch_, scratch_, static_cast<size_t>(c), ncclInt8, root, comm_, stream_),
            "ncclBroadcast");
    });
  }
  void barrier() override {
    int64_t x = 0;
    all_reduce_sum(&x, 1);
  }
  [[noreturn]] void abort(int code) override {
    // The other ranks may wait in a collective for this one: NCCL's abort frees this rank's side; the launcher
    // (torchrun's agent, mpirun) ends the others when this process exits non-zero, MPI_Abort under mpirun at once.
    if (comm_) nccl_api().comm_abort(comm_);
#ifdef DELTASTACK_MPI
    if (mpi_) MPI_Abort(MPI_COMM_WORLD, code);
#endif
    std::_Exit(code);
  }

  void device_all_reduce_sum(float* x, int64_t n, void* stream) override {
    check(nccl_api().all_reduce(x, x, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_,
                                static_cast<cudaStream_t>(stream)), "ncclAllReduce");
  }
  void device_reduce_scatter_sum(const float* send, float* recv, int64_t per_rank, void* stream) override {
    check(nccl_api().reduce_scatter(send, recv, static_cast<size_t>(per_rank), ncclFloat32, ncclSum, comm_,
                                    static_cast<cudaStream_t>(stream)), "ncclReduceScatter");
  }
  void device_all_gather(const void* send, void* recv, int64_t per_rank_bytes, void* stream) override {
    check(nccl_api().all_gather(send, recv, static_cast<size_t>(per_rank_bytes), ncclInt8, comm_,
                                static_cast<cudaStream_t>(stream)), "ncclAllGather");
  }
  void device_broadcast(void* p, int64_t bytes, int root, void* stream) override {
    check(nccl_api().broadcast(p, p, static_cast<size_t>(bytes), ncclInt8, root, comm_, static_cast<cudaStream_t>(stream)),
          "ncclBroadcast");
  }
  void device_group_start() override { check(nccl_api().group_start(), "ncclGroupStart"); }
  void device_group_end() override { check(nccl_api().group_end(), "ncclGroupEnd"); }

 private:
  static constexpr int64_t kScratch = 1 << 20;  // bytes of the host-value staging buffers

  // Every rank gets rank 0's ncclUniqueId (or, under torchrun, the NCCL_COMM_ID address it stands for).
  void bootstrap(const NcclApi& api, ncclUniqueId& id) {
    const LaunchInfo& l = launch();
    if (l.world == 1) {
      check(api.get_unique_id(&id), "ncclGetUniqueId");
      return;
    }
    if (l.launcher == "mpirun") {
#ifdef DELTASTACK_MPI
      int provided = 0;
      DS_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) == MPI_SUCCESS,
               "MPI_Init_thread failed ({})", describe(l));
      mpi_ = true;
      if (l.rank == 0) check(api.get_unique_id(&id), "ncclGetUniqueId");
      DS_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD) == MPI_SUCCESS, "MPI_Bcast of the NCCL id "
               "failed ({})", describe(l));
      return;
#else
      fail("mpirun started {} GPU ranks, but this deltastack was built without MPI, which hands the ranks NCCL's "
           "id: start them with `torchrun --nproc-per-node {} --no-python deltastack train ...`, or rebuild with "
           "libopenmpi-dev", l.world, l.world);
#endif
    }
    // torchrun: NCCL's bootstrap root listens on NCCL_COMM_ID on rank 0; every rank reads the same address.
    const char* given = std::getenv("NCCL_COMM_ID");
    if (!given || !*given) {
      DS_CHECK(!l.master_addr.empty() && l.master_port > 0 && l.master_port < 65535, "{}: torchrun's MASTER_ADDR / "
               "MASTER_PORT are missing; NCCL's bootstrap address comes from them (or set NCCL_COMM_ID=host:port)",
               describe(l));
      const std::string addr = fmt::format("{}:{}", l.master_addr, l.master_port + 1);
      ::setenv("NCCL_COMM_ID", addr.c_str(), 1);
    }
    check(api.get_unique_id(&id), "ncclGetUniqueId (NCCL_COMM_ID)");
  }

  // x[0, n) of host values through the staging buffer: copy in, NCCL all-reduce, copy out.
  template <typename T>
  void staged(T* x, int64_t n, ncclDataType_t t, ncclRedOp_t op) {
    through_staging(x, n, "ncclAllReduce", [&](int64_t c) {
      check(nccl_api().all_reduce(scratch_, scratch_, static_cast<size_t>(c), t, op, comm_, stream_), "ncclAllReduce");
    });
  }
  // Host values x[0, n) in pieces of the staging buffer: each piece copied to the GPU, `collective(count)` on the
  // communicator's stream over scratch_, copied back (synchronised; `what` names it in errors).
  template <typename T, typename F>
  void through_staging(T* x, int64_t n, const char* what, const F& collective) {
    constexpr int64_t per = kScratch / static_cast<int64_t>(sizeof(T));
    for (int64_t off = 0; off < n; off += per) {
      const int64_t c = std::min(per, n - off);
      const size_t bytes = static_cast<size_t>(c) * sizeof(T);
      std::memcpy(host_, x + off, bytes);
      cuda_check(cudaMemcpyAsync(scratch_, host_, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync", launch());
      collective(c);
      cuda_check(cudaMemcpyAsync(host_, scratch_, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync", launch());
      cuda_check(cudaStreamSynchronize(stream_), what, launch());
      std::memcpy(x + off, host_, bytes);
    }
  }
  void check(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return;
    fail("{} failed on {}: {} ({}{})", what, describe(launch()), nccl_api().get_error_string(r), nccl_api().path,
         r == ncclInvalidUsage ? "; one rank per GPU: two ranks on one GPU are refused by NCCL" : "");
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;  // device staging buffer [kScratch bytes]
  void* host_ = nullptr;     // pinned host staging buffer [kScratch bytes]
  int device_ = 0;
  bool mpi_ = false;
};

}  // namespace

std::unique_ptr<Communicator> open_nccl_communicator(const LaunchInfo& l) { return std::make_unique<Nccl>(l); }
bool have_nccl() { return true; }

}  // namespace ds::dist

#else  // built without NCCL's header

#include "core/error.h"

namespace ds::dist {
std::unique_ptr<Communicator> open_nccl_communicator(const LaunchInfo& l) {
  fail("{}: the GPU engine's ranks talk over NCCL, but this deltastack was built without it (a CUDA build finds "
       "nccl.h in the CUDA toolkit or in NCCL_INCLUDE_DIR)", describe(l));
}
bool have_nccl() { return false; }
}  // namespace ds::dist

#endif
