#include "train/checkpoint.h"

#include <cmath>

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/files.h"
#include "core/fs_safety.h"
#include "core/log.h"
#include "core/numerics.h"
#include "model/engine.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "ops/adamw/adamw.h"
#include "ops/adamw/q8_state.h"
#include "train/lora_train.h"
#include "train/run_dir.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace ds {

namespace {

// Moves the complete checkpoint in tmp_dir to final_dir. Replacing a checkpoint of the same step (a resume from an
// earlier one into the same --out) swaps the two directories in one atomic rename, so final_dir never goes missing;
// what is replaced must be the entry that was there when the save began (none, or that directory), and a checkpoint of
// run `run_id` holding only checkpoint files: anything else there (a directory made while the run trained, another
// run's checkpoint, a link) stays and the save fails naming it (fs_safety.h, replace_checked).
void rename_into_place(const std::string& tmp_dir, const std::string& final_dir, const FileIdentity& expected,
                       const std::string& run_id) {
  test_replace_gate();
  try {
    replace_checked(tmp_dir, final_dir, expected, fmt::format("cannot save {}", final_dir),
                    [&](const std::string& old) {
      struct stat st;
      DS_CHECK(::lstat(old.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "{} is not a directory: not replacing it",
               final_dir);
      const CheckpointOwner owner = checkpoint_owner(old);
      DS_CHECK(owner.run_id == run_id, "{} is not a checkpoint of this run ({}): not replacing it", final_dir,
               file_identity(old + "/trainer_state.json").exists
                   ? fmt::format("its trainer_state.json names run_id \"{}\", this run is {}", owner.run_id, run_id)
                   : std::string("it has no trainer_state.json"));
      const std::string other = foreign_entry(old, is_checkpoint_file);
      DS_CHECK(other.empty(), "{} holds {}, which is no checkpoint file: not replacing it", final_dir, other);
    });
  } catch (const Error& e) {
    fail("{}. The complete new checkpoint is kept in {}: resume from it (--resume {}), or move {} away; the next "
         "run into this --out keeps it as {}.recovered", e.what(), tmp_dir, tmp_dir, final_dir, final_dir);
  }
}

}  // namespace

int64_t stored_bytes(const std::vector<SaveTensor>& ts) {
  int64_t b = 0;
  for (const SaveTensor& t : ts) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    b += n * static_cast<int64_t>(dtype_size(t.dtype));
  }
  return b;
}

std::string new_run_id() {
  std::random_device rd;
  const uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                     static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return fmt::format("{:016x}", x);
}

std::string branch_run_id(const std::string& run_id, int64_t step, const std::string& out) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (const char c : fmt::format("{}\n{}\n{}", run_id, step, out)) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return fmt::format("{:016x}", h);
}

SavedCheckpoint read_checkpoint_state(const std::string& dir) {
  SavedCheckpoint c;
  c.path = (fs::path(dir) / "trainer_state.json").string();
  DS_CHECK(file_exists(c.path), "--resume {}: not a deltastack checkpoint (no trainer_state.json)", dir);
  json st;
  try {
    st = json::parse(read_file(c.path));
  } catch (const json::exception& e) {
    fail("{}: invalid JSON ({})", c.path, printable(e.what()));
  }
  DS_CHECK(st.is_object() && st.contains("options") && st.contains("step"), "{}: missing \"options\" or \"step\"",
           c.path);
  DS_CHECK(st["step"].is_number_integer() && st["step"].get<int64_t>() >= 0,
           "{}: \"step\" must be a non-negative integer", c.path);
  c.state.step = st["step"].get<int64_t>();
  c.state.optimizer_steps = st.value("optimizer_steps", c.state.step);
  c.state.tokens_seen = st.value("tokens_seen", int64_t{0});
  c.state.elapsed_s = st.value("elapsed_s", 0.0);
  c.state.world_size = st.value("world_size", int64_t{1});
  DS_CHECK(c.state.world_size >= 1, "{}: \"world_size\" must be at least 1", c.path);
  if (st.contains("run_id") && st["run_id"].is_string()) c.run_id = st["run_id"].get<std::string>();
  if (st.contains("resumed_from") && st["resumed_from"].is_object()) c.resumed_from = st["resumed_from"];
  c.options = st["options"];
  if (st.contains("data")) c.data = st["data"];
  if (st.contains("lora")) c.lora = st["lora"];
  return c;
}

// A moment stored as the 8bit state's codes (moment_scale_name, model/engine.h): the U8 codes and their block scales
// as stored, by the flat offset's blocks; returns which moment (0: exp_avg, 1: exp_avg_sq). ds::Error naming the file
// and tensor for a tensor outside the flat parameters, a count that does not match, or a scale that is not finite and
// >= 0, or (exp_avg_sq's) whose square is not finite: every code then decodes to a finite moment, exp_avg_sq's >= 0.
static int read_moment_codes(const CheckpointReader& os, const std::string& name, int64_t numel, int64_t flat_offset,
                             std::set<std::string>& ours, std::string& codes, std::vector<float>& scale) {
  const std::string scale_name = moment_scale_name(name);
  ours.insert(name);
  ours.insert(scale_name);
  DS_CHECK(flat_offset >= 0, "{}: optimizer state {} is stored as 8-bit codes, which only the flat parameters' "
           "moments may be", os.path(), name);
  const int which = name.rfind("exp_avg_sq.", 0) == 0 ? 1 : 0;
  DS_CHECK(which == 1 || name.rfind("exp_avg.", 0) == 0, "{}: optimizer state {} is stored as 8-bit codes, but it "
           "is no AdamW moment (exp_avg / exp_avg_sq)", os.path(), name);
  codes = os.copy_bytes(name);
  DS_CHECK(static_cast<int64_t>(codes.size()) == numel, "{}: optimizer state {} has {} codes, expected {}", os.path(),
           name, codes.size(), numel);
  DS_CHECK(os.has(scale_name), "{}: optimizer state {} is stored as 8-bit codes without its block scales {}",
           os.path(), name, scale_name);
  scale = os.read_f32(scale_name);
  const int64_t blocks = ops::q8_state::num_blocks(flat_offset, numel);
  DS_CHECK(static_cast<int64_t>(scale.size()) == blocks, "{}: {} has {} block scales, expected {} (256-element blocks "
           "of the flat range [{}, {}))", os.path(), scale_name, scale.size(), blocks, flat_offset, flat_offset + numel);
  for (size_t i = 0; i < scale.size(); ++i)
    DS_CHECK(std::isfinite(scale[i]) && scale[i] >= 0.0f && (which == 0 || std::isfinite(scale[i] * scale[i])),
             "{}: {} holds {} at index {}; a block scale must be finite and >= 0 (exp_avg_sq's, of sqrt(v): its "
             "square finite too): the checkpoint is corrupt", os.path(), scale_name, scale[i], i);
  return which;
}

void load_optimizer_state(Engine& engine, const std::string& dir) {
  // optimizer.safetensors, or optimizer.safetensors.index.json with its shards.
  const fs::path index = fs::path(dir) / "optimizer.safetensors.index.json";
  CheckpointReader os(fs::exists(index) ? index.string() : (fs::path(dir) / "optimizer.safetensors").string());
  std::set<std::string> ours;  // the names this engine reads
  const auto stored_as_codes = [&](const std::string& name) {
    return os.has(name) && os.info(name).dtype == DType::U8;
  };
  // Fp32 values: a moment stored as codes dequantized exactly as the kernel decodes it (ops::dequantize_moment_8bit).
  const TensorSource read = [&](const std::string& name, int64_t numel, int64_t flat_offset) {
    ours.insert(name);
    std::vector<float> x;
    if (stored_as_codes(name)) {
      std::string codes;
      std::vector<float> scale;
      const int which = read_moment_codes(os, name, numel, flat_offset, ours, codes, scale);
      x.resize(static_cast<size_t>(numel));
      ops::dequantize_moment_8bit(which, reinterpret_cast<const uint8_t*>(codes.data()), scale.data(), numel,
                                  flat_offset, x.data());
      return x;  // finite, and >= 0 for exp_avg_sq, by the scales' check
    }
    x = os.read_f32(name);
    DS_CHECK(static_cast<int64_t>(x.size()) == numel, "{}: optimizer state {} has {} values, expected {}", os.path(),
             name, x.size(), numel);
    // A corrupt moment would turn into NaN weights at the first update (and a checkpoint that cannot be loaded).
    const bool second_moment = name.rfind("exp_avg_sq.", 0) == 0;
    const int64_t i = first_non_finite(x.data(), static_cast<int64_t>(x.size()), second_moment);
    DS_CHECK(i < 0, "{}: optimizer state {} holds {} at index {} ({}); the checkpoint is corrupt", os.path(), name,
             i < 0 ? 0.0f : x[static_cast<size_t>(i)], i,
             second_moment ? "a second moment must be finite and >= 0" : "it must be finite");
    return x;
  };
  // The codes as stored, for an engine that keeps them (a 27B resume: no host dequantization or re-quantization).
  const CodeSource codes = [&](const std::string& name, int64_t numel, int64_t flat_offset, std::string& c,
                               std::vector<float>& scale) {
    if (!stored_as_codes(name)) return false;
    read_moment_codes(os, name, numel, flat_offset, ours, c, scale);
    return true;
  };
  engine.load_optimizer(read, codes);
  // Every tensor must belong to this model: an extra one means the state is another run's (a larger model's).
  for (const std::string& name : os.names())
    DS_CHECK(ours.count(name), "{}: optimizer state {} has no parameter in this model: the file belongs to another "
             "run or model", os.path(), name);
}

Checkpoints::Checkpoints(const TrainOptions& opt, int64_t start_step, std::string run_id, std::string tokenizer_json,
                         nlohmann::json data, nlohmann::json resumed_from)
    : opt_(opt),
      start_step_(start_step),
      run_id_(std::move(run_id)),
      session_id_(new_run_id()),
      tokenizer_json_(std::move(tokenizer_json)),
      data_(std::move(data)),
      resumed_from_(std::move(resumed_from)) {
  // A file (not a directory) named like a checkpoint this run will write stops the run now, not after the training.
  // (Other runs' checkpoint directories are not here: RunDirectory::claim refused or moved them.)
  for (const auto& e : fs::directory_iterator(opt_.out)) {
    const int64_t s = checkpoint_step(e.path().filename().string());
    DS_CHECK(s < 0 || e.is_directory() || !(s > start_step_ && due(s)),
             "{} exists and is not a directory, but this run saves checkpoint-{} there; move it away",
             e.path().string(), s);
  }
}

int64_t checkpoint_bytes_estimate(const ModelConfig& config, const std::string& optimizer_state,
                                  const std::string& shard) {
  // What the engines write (model/engine.cpp checkpoint_weight_tensors, optimizer_tensors): per parameter, its
  // weights (BF16 for a matrix that the bf16 and 8bit states keep in bf16 only, else F32) and two moments (BF16
  // for the bf16 state's matrices; the 8bit state's matrices, unsharded, as U8 codes plus one F32 scale per block
  // of ops/adamw/q8_state.h; F32 otherwise, as the sharded 8bit state stores them dequantized).
  const bool bf16_matrices = optimizer_state == "bf16" || optimizer_state == "8bit";
  int64_t bytes = kCheckpointSlackBytes;
  for (const ParamSpec& p : qwen35_params(config)) {
    const bool m = is_matrix(p) && bf16_matrices;
    bytes += p.numel * (m ? 2 : 4);
    if (m && optimizer_state == "bf16")
      bytes += 2 * p.numel * 2;
    else if (m && shard == "none")
      bytes += 2 * (p.numel + 4 * ops::q8_state::num_blocks(p.offset, p.numel));
    else
      bytes += 2 * p.numel * 4;
  }
  return bytes;
}

void Checkpoints::check_room(int64_t need, const std::string& what, const std::string& then) const {
  std::error_code ec;
  const fs::space_info sp = fs::space(opt_.out, ec);
  int64_t avail = static_cast<int64_t>(sp.available);
  // Test hook: the free bytes the check sees (a full disk without filling one): a number, or "@FILE" holding one
  // (read at each check, so a test can shrink the disk while the run trains). Unset in normal use.
  if (const char* f = std::getenv("DELTASTACK_TEST_DISK_FREE_BYTES")) {
    std::string v = f;
    if (v.starts_with("@")) v = read_file(v.substr(1));
    avail = std::strtoll(v.c_str(), nullptr, 10);
    ec.clear();
  }
  if (ec || avail >= need) return;
  // GiB with two decimals, or bytes where those would print the same number for both.
  std::string n = fmt::format("{:.2f} GiB", need / 1073741824.0), a = fmt::format("{:.2f} GiB", avail / 1073741824.0);
  if (n == a) n = fmt::format("{} bytes", need), a = fmt::format("{} bytes", avail);
  fail("{} needs {} but only {} is free on the filesystem of {}: free space there, or use --keep-last / a larger "
       "disk{}", what, n, a, opt_.out, then);
}

void Checkpoints::check_room_for_next_save(const ModelConfig& config, int64_t step,
                                           const std::string& last_checkpoint) const {
  if (opt_.no_save) return;  // --no-save: nothing will be written
  // Nothing is due after the last step, except a new run's --steps 0, whose checkpoint-0 is its one save.
  if (step >= opt_.steps && !(opt_.steps == 0 && step == 0 && last_checkpoint.empty())) return;
  int64_t next = opt_.steps;
  if (opt_.save_interval > 0) next = std::min(next, (step / opt_.save_interval + 1) * opt_.save_interval);
  // A LoRA checkpoint: the adapter and its two moments (fp32), the base's config.
  const int64_t need = lora_.is_null() ? checkpoint_bytes_estimate(config, opt_.optimizer_state, opt_.shard)
                                       : 12 * lora_floats_ + kCheckpointSlackBytes;
  if (last_checkpoint.empty())
    check_room(need, fmt::format("not training: checkpoint-{} (due at step {})", next, next), ", before training");
  else
    check_room(need, fmt::format("stopping after step {}: checkpoint-{} (due at step {})", step, next, next),
               fmt::format("; then resume with: deltastack train --resume {}", last_checkpoint));
}

bool Checkpoints::due(int64_t step) const {
  if (opt_.no_save) return false;
  return step == opt_.steps || (step <= opt_.steps && opt_.save_interval > 0 && step % opt_.save_interval == 0);
}

std::string Checkpoints::save(Engine& engine, const TrainerState& state,
                              const std::function<void(const std::string&)>& saved) {
  const std::string final_dir = (fs::path(opt_.out) / fmt::format("checkpoint-{}", state.step)).string();
  const std::string tmp_dir = (fs::path(opt_.out) / fmt::format(".checkpoint-{}.tmp", state.step)).string();
  // What is at checkpoint-N now is all the save may replace (rename_into_place).
  const FileIdentity existing = file_identity(final_dir);
  fs::remove_all(tmp_dir);  // a link there is removed itself, not followed
  // A save that fails before the checkpoint is complete (disk full, an unreadable tensor) removes its temp dir at
  // once, not at the next run's start.
  struct RemoveUnlessDone {
    const std::string& dir;
    bool done = false;
    ~RemoveUnlessDone() {
      std::error_code ec;
      if (!done) fs::remove_all(dir, ec);
    }
  } cleanup{tmp_dir};
  const int64_t shard_bytes = opt_.max_shard_mb * 1000000;
  const LoraAdapter* lora = engine.adapter();  // a LoRA run saves the adapter, not the frozen base
  std::vector<SaveTensor> weights = lora ? lora->tensors(lora->values()) : engine.checkpoint_weight_tensors();
  std::vector<SaveTensor> optimizer = engine.optimizer_tensors();
  // A checkpoint that cannot fit stops here with the sizes, before it fills the disk (which would also starve the
  // run's own log and metrics).
  check_room(stored_bytes(weights) + stored_bytes(optimizer) + kCheckpointSlackBytes,
             fmt::format("cannot save checkpoint-{}: it", state.step), "");
  make_new_dir(tmp_dir, fmt::format("checkpoint-{}'s temporary directory", state.step));
  if (lora) save_lora_checkpoint_weights(tmp_dir, engine.config(), *lora, lora_);
  else save_model_dir(tmp_dir, engine.config(), weights, DType::F32, shard_bytes);
  // Fault-injection hook for the crash-safety tests: a pause inside every save, so that a kill aimed at "a save in
  // progress" lands there however fast the disk is. Unset in normal use.
  if (const char* pause = std::getenv("DELTASTACK_TEST_SAVE_PAUSE_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::strtol(pause, nullptr, 10)));
  // The optimizer's state (AdamW moments, HF-style names; F32, or BF16 where the engine keeps them in bf16),
  // streamed from the engine, sharded like the weights.
  write_safetensors_sharded(tmp_dir, "optimizer", optimizer, shard_bytes);
  write_file_atomic((fs::path(tmp_dir) / "tokenizer.json").string(), tokenizer_json_);
  json st{{"step", state.step},
          {"optimizer_steps", state.optimizer_steps},
          {"tokens_seen", state.tokens_seen},
          {"elapsed_s", state.elapsed_s},
          {"world_size", state.world_size},
          {"options", options_to_json(opt_)},
          {"data", data_},
          {"deltastack_version", DELTASTACK_VERSION},
          {"run_id", run_id_},
          {"session_id", session_id_}};
  if (!resumed_from_.is_null()) st["resumed_from"] = resumed_from_;
  if (lora) st["lora"] = lora_;
  write_file_atomic((fs::path(tmp_dir) / "trainer_state.json").string(), st.dump(2) + "\n");
  fsync_dir(tmp_dir);
  cleanup.done = true;  // complete: kept if the rename fails (its error names it)
  rename_into_place(tmp_dir, final_dir, existing, run_id_);
  fsync_dir(opt_.out);
  log_info("saved {}", final_dir);
  if (saved) saved(final_dir);
  if (opt_.keep_last > 0) prune(state.step);
  return final_dir;
}

// --keep-last: after checkpoint-`step` is durable, the older checkpoints of this run's current history (N < step,
// canonical decimal names, the same run_id in trainer_state.json, and N <= the resumed step or written by this
// process) beyond the newest keep_last - 1 are removed: each is first renamed to .checkpoint-N.old.tmp (which a later
// start removes, so a kill mid-delete never leaves a partial checkpoint-N), then its checkpoint files are deleted
// and the directory with them. Only the files a save writes are deleted (remove_checkpoint_files): a checkpoint that
// also holds anything else (a user's NOTES.md, a directory) loses its checkpoint files in place and keeps the
// rest and its name, with a warning naming it. Another run's checkpoints
// and the later steps of an abandoned history (a resume from an earlier checkpoint) are never counted or removed.
// Failures only warn, one checkpoint at a time.
void Checkpoints::prune(int64_t step) {
  std::vector<std::pair<int64_t, fs::path>> older;
  try {
    for (const auto& e : fs::directory_iterator(opt_.out)) {
      const int64_t s = checkpoint_step(e.path().filename().string());
      if (s < 0 || s >= step || !e.is_directory()) continue;
      const CheckpointOwner owner = checkpoint_owner(e.path());
      if (owner.run_id == run_id_ && (s <= start_step_ || owner.session_id == session_id_))
        older.emplace_back(s, e.path());
    }
  } catch (const std::exception& e) {
    log_warn("--keep-last: cannot list {}: {}", opt_.out, e.what());
    return;
  }
  std::sort(older.begin(), older.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = static_cast<size_t>(opt_.keep_last - 1); i < older.size(); ++i) {
    const fs::path& dir = older[i].second;
    try {
      // A checkpoint that also holds what the user put there (NOTES.md, analysis/): only its own files go.
      std::string other = foreign_entry(dir.string(), is_checkpoint_file);
      if (other.empty()) {
        const fs::path doomed = fs::path(opt_.out) / fmt::format(".checkpoint-{}.old.tmp", older[i].first);
        remove_checkpoint_files(doomed);
        fs::rename(dir, doomed);
        fsync_dir(opt_.out);
        // Fault-injection hook for the crash-safety tests (a signal while an older checkpoint is being removed).
        if (const char* pause = std::getenv("DELTASTACK_TEST_PRUNE_PAUSE_MS"))
          std::this_thread::sleep_for(std::chrono::milliseconds(std::strtol(pause, nullptr, 10)));
        other = remove_checkpoint_files(doomed);
        if (!other.empty()) fs::rename(doomed, dir);  // something was put there meanwhile: back under its name
      } else {
        other = remove_checkpoint_files(dir);
      }
      if (other.empty()) log_info("removed {} (--keep-last {})", dir.string(), opt_.keep_last);
      else log_warn("--keep-last {}: removed the checkpoint files of {} but kept the directory: it also holds {}, "
                    "which a checkpoint save did not write", opt_.keep_last, dir.string(), other);
    } catch (const std::exception& e) {
      log_warn("--keep-last: could not remove {}: {}", dir.string(), e.what());
    }
  }
}

}  // namespace ds
