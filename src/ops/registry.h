// Op registry: every op has an ordered list of backends per device (fast first, reference last), an
// environment knob DELTASTACK_<OP>=auto|fast|reference, and a numeric self-probe. At first use, each fast
// backend runs against the reference on fixed-seed inputs (forward and backward, with a partial chunk and a
// packed case: the same inputs on every start); a wrong or non-finite backend is rejected with one log line and
// the next one is used.
// On the CPU the gated delta rule has two backends (chunked = fast, token-recurrent = reference); every other
// op has its reference only. In a CUDA build every op also has device "cuda" backends: the CUDA kernels (probed
// against the fp32 CPU reference on bf16-rounded inputs by probe_cuda_<op>() of src/ops/<op>/cuda_check.h, the
// check functions the GPU tests run too) and, last, a reference entry that stands for "no usable CUDA backend"
// (the GPU engine stops: require_cuda_backends()).
//
// Devices are independent: a selection is per (op, device), the backends of device "cpu" are only ever probed
// against and chosen among themselves, and a CUDA probe's result is stored under its own key
// (op/cuda/backend). So a failed (or throwing, or device-less) CUDA probe only makes that op's "cuda" selection
// fall to its reference entry, i.e. the GPU engine refuses to start; the CPU backend of every op, and so every
// CPU result, is the same whether the CUDA probes pass, fail or never run.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace ds::ops {

enum class KnobMode { Auto, Fast, Reference, Named };

struct KnobSetting {
  KnobMode mode = KnobMode::Auto;
  std::string backend;  // KnobMode::Named: the backend's name (e.g. DELTASTACK_GATED_DELTA_RULE=cuda-simple)
};

// Reads DELTASTACK_<OP> (op name upper-cased): auto | fast | reference | the name of one of the op's backends
// (as `deltastack probe` lists them), which is then used on its device (still self-probed: a named backend that
// fails its probe is an error, not a silent fallback) while the op's other devices behave as with auto. Logs one
// line the first time a knob other than auto is seen. Throws ds::Error naming the variable for any other value.
KnobSetting knob_setting(const std::string& op);
// Reads every op's knob now (ds::Error naming the variable for a bad value), so a run fails before it writes anything.
void check_knobs();

struct Backend {
  std::string name;
  std::string device;      // "cpu" | "cuda"
  bool reference = false;  // the ground truth the others are probed against
  // Relative L2 error against the reference on fixed-seed inputs (max over outputs and gradients);
  // empty for references.
  std::function<double()> probe;
  double band = 0;         // largest accepted probe error
  // Empty string when the backend can run here; else why not (e.g. a library missing). Unset: always available.
  // An unavailable backend is skipped with one log line, without a probe.
  std::function<std::string()> unavailable;
};

struct ProbeRow {
  std::string op, device, backend, status;  // "reference", "selected", "rejected", "passed, not selected", "unavailable (why)"
  double error = 0, band = 0;
};

// The backend an op uses on `device`, after the knob and the self-probe. Thread-safe; probes run once.
const Backend& select_backend(const std::string& op, const std::string& device);
// The same, passing over the backends named in `skip` (e.g. a kernel that does not take this model's shapes).
const Backend& select_backend(const std::string& op, const std::string& device, const std::vector<std::string>& skip);
// Runs every probe (cached) and reports all backends of all ops: device "cpu" rows always, device "cuda" rows
// when a CUDA device is present.
std::vector<ProbeRow> probe_all();

// For the GPU engine: selects (and probes) the "cuda" backend of every op and throws ds::Error naming the first op
// that resolves to its reference entry (probe error over the band, or DELTASTACK_<OP>=reference): the GPU engine
// has no per-op CPU fallback. Also throws when the build has no CUDA support or no device is present.
void require_cuda_backends();
// The one op whose CUDA backend may fail without stopping the GPU engine: the FP8 GEMMs of `--precision fp8`,
// which fall back to the bf16 GEMMs (the engine says so in one log line; model/gpu_fp8.h). require_cuda_backends()
// does not select it; the engine asks fp8_gemm_usable() when the precision is fp8.
inline constexpr const char* kOptionalCudaOp = "linear_fp8";
// Whether the "linear_fp8" CUDA backend passed its probe (and DELTASTACK_LINEAR_FP8 does not say reference).
bool fp8_gemm_usable();

}  // namespace ds::ops
