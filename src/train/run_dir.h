// The run directory (--out) of a training run: created and locked before the model or the data load, so a second
// run into the same directory stops at once with the holder's pid instead of deleting the first run's files.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace ds {

// An exclusive flock(2) on OUT/.deltastack.lock, held for the life of the object (the kernel releases it when the
// process dies, however it dies; the file itself stays, so there is never a race on its creation). The holder's pid
// is written into the file, for the message another run prints.
class RunDirectory {
 public:
  // Creates `out` if needed and takes the lock. ds::Error naming `out` when it is a file, cannot be created or
  // written, or is locked by another process (with that process's pid).
  explicit RunDirectory(const std::string& out);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return path_; }
  // Where the locked directory is now (a run directory renamed while the run trains keeps its lock and metrics
  // file with it, but `path()` would name the old place): the lock file's current path's parent, from
  // /proc/self/fd. "" when it was deleted or cannot be told.
  std::string current_path() const;
  // The lock file's name inside the run directory.
  static constexpr const char* kLockName = ".deltastack.lock";

  // The run files: metrics.jsonl (each line names its run_id), the lines a resume dropped from it
  // (metrics-abandoned.jsonl), and checkpoint-N directories (trainer_state.json names the run).
  static constexpr const char* kMetricsName = "metrics.jsonl";
  static constexpr const char* kAbandonedMetricsName = "metrics-abandoned.jsonl";

  // Makes sure that the run files in the directory are all run `run_id`'s, so that nothing of another run is
  // replaced, pruned or spliced into this run's metrics. Files of other runs stop the run with a ds::Error naming
  // them, or with `move_aside` are moved into a new OUT/previous-N/ (renames: nothing is copied or deleted).
  // Metrics lines without a run_id (written before run ids were logged) count as this run's when
  // `legacy_lines_are_ours` (a resume in the checkpoint's own directory).
  void claim(const std::string& run_id, bool legacy_lines_are_ours, bool move_aside) const;

  // A resume from step `start_step` abandons this run's later history in this directory: its checkpoints past
  // that step (run `run_id`) are moved into a new OUT/abandoned-K/ (renames; nothing is deleted), so the resumed
  // run's saves never replace them. Returns the directory they went to ("" when there were none).
  std::string set_aside_later_checkpoints(const std::string& run_id, int64_t start_step) const;
  // The names of those checkpoints (checkpoint-STEP directories of run `run_id` past `start_step`), sorted.
  std::vector<std::string> later_checkpoints(const std::string& run_id, int64_t start_step) const;

  // Cleans up the temp dirs that an interrupted checkpoint save left, only under the lock, so never a running
  // save's. ".checkpoint-N.tmp" holding a complete checkpoint (complete_checkpoint: a save whose final rename was
  // refused) is kept, renamed to checkpoint-N.recovered (-2, -3, ... when taken), with a warning; an incomplete one,
  // and ".checkpoint-N.old.tmp" (a --keep-last removal cut short), lose their checkpoint files
  // (remove_checkpoint_files) and go when nothing else is in them (a user's files there stay, with a warning). Only
  // those names with N all digits count (checkpoint_temp_name); a link or a file of such a name is left alone.
  // `keep` (the --resume source, when it is one of them) stays.
  void remove_stale_temps(const std::string& keep) const;

 private:
  std::string path_;
  int fd_ = -1;
};

// The step of a checkpoint directory name as the trainer writes it ("checkpoint-N", N in canonical decimal); -1 for
// any other name.
int64_t checkpoint_step(const std::string& name);

// Whether `name` is one of the files a checkpoint save writes into checkpoint-N (save_model_dir's config.json,
// generation_config.json and model shards / index, the optimizer shards / index, tokenizer.json,
// trainer_state.json): a directory with anything else is not only a checkpoint.
bool is_checkpoint_file(const std::string& name);

// Deletes from the checkpoint directory `dir` only the regular files a save writes (is_checkpoint_file;
// trainer_state.json first, so a kill midway leaves no directory that reads as a checkpoint), then `dir` itself
// when it is empty. Returns the first remaining entry (by name) when anything else is there (the user's files,
// subdirectories, links: all kept, and `dir` with them), "" when `dir` is gone. ds::Error naming what cannot be
// removed; nothing happens when `dir` does not exist.
std::string remove_checkpoint_files(const std::filesystem::path& dir);
// Whether a name in --out is one a checkpoint save's temporary directory has: ".checkpoint-N.tmp" or
// ".checkpoint-N.old.tmp", N all digits.
bool checkpoint_temp_name(const std::string& name);

// Whether `dir` holds everything a checkpoint save writes (trainer_state.json, config.json, tokenizer.json, the
// model and optimizer safetensors or their index): what a save leaves only once it is complete.
bool complete_checkpoint(const std::filesystem::path& dir);

// Who wrote a checkpoint (its trainer_state.json): the run, kept across resumes, and the process. Empty strings when
// absent (checkpoints of earlier versions) or unreadable.
struct CheckpointOwner {
  std::string run_id, session_id;
};
CheckpointOwner checkpoint_owner(const std::filesystem::path& dir);

}  // namespace ds
