#include "train/trainer.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "data/dataset.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "dist/cpu_bind.h"
#include "core/cuda/device.h"
#include "model/engine.h"
#include "model/gpu_plan.h"
#include "model/model.h"
#include "ops/adamw/adamw.h"
#include "ops/registry.h"
#include "train/checkpoint.h"
#include "train/interrupt.h"
#include "train/lora_train.h"
#include "train/run_dir.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace ds {

std::string bundled_data_path() { return std::string(DELTASTACK_SOURCE_DIR) + "/data/tiny_shakespeare.txt"; }
std::string bundled_tokenizer_path() { return std::string(DELTASTACK_SOURCE_DIR) + "/data/qwen3_tokenizer/tokenizer.json"; }

namespace {

// ---- set-up

// The run's options: on --resume the checkpoint's (options.h: resumed_options), the bundled data and tokenizer when
// none are given, input paths absolute (saved in checkpoints, so a resume works from any directory); validated.
TrainOptions run_options(const TrainOptions& cli, const SavedCheckpoint* resumed) {
  TrainOptions opt = resumed ? resumed_options(cli, resumed->options, resumed->path) : cli;
  if (opt.data.empty()) opt.data = {bundled_data_path()};
  if (opt.tokenizer.empty()) opt.tokenizer = bundled_tokenizer_path();
  auto absolute_if_exists = [](std::string& p) {
    std::error_code ec;
    if (!p.empty() && fs::exists(p, ec)) p = fs::absolute(p).lexically_normal().string();
  };
  for (std::string& p : opt.data) absolute_if_exists(p);  // also a resume's --data (a moved corpus)
  for (std::string& p : opt.val_data) absolute_if_exists(p);
  if (!resumed) {  // a resume reads neither: the checkpoint has its own config.json and tokenizer.json
    absolute_if_exists(opt.tokenizer);
    absolute_if_exists(opt.model);  // a path; preset names ("tiny", "2b") stay as they are
    absolute_if_exists(opt.adapter);  // LoRA: the adapter a run started from (recorded; a resume reads its own)
  }
  validate(opt);
  return opt;
}

// The tokenizer.json a run reads: the checkpoint's own copy on --resume (the tokenizer the run trained with; the
// original --tokenizer may be gone or edited since, so it is never read then), else --tokenizer. Every checkpoint
// gets a copy; a checkpoint without it is an error naming the file and the way out.
std::string tokenizer_path(const TrainOptions& opt) {
  if (opt.resume.empty()) return opt.tokenizer;
  const std::string own = (fs::path(opt.resume) / "tokenizer.json").string();
  DS_CHECK(file_exists(own), "--resume {}: {} is missing; a resume trains with the checkpoint's own copy of the "
           "tokenizer its run used (options.tokenizer in trainer_state.json: {}). Put that tokenizer.json back into the "
           "checkpoint (only the same file continues the run)", opt.resume, own, opt.tokenizer);
  return own;
}

// Refuses at once (before the data is read and the weights made) a run whose micro-batch cannot be indexed, or
// that cannot fit the host memory on the CPU engine, naming the flag or the config at fault. The CPU engine keeps
// fp32 weights, gradients and two AdamW moments (16 bytes per parameter) and every activation of a micro-batch:
// at least each layer's input and its MLP gate and up projections (4 bytes each: (hidden + 2 x intermediate) x 4
// per token and layer), a lower bound, so a refusal is never wrong (docs/cpu_engine.md). On the GPU the same plan
// as the engine's (`deltastack plan`) with one document per window (the fewest: the engine's plan, made once the
// data is read, is at least as large) in the leanest modes the flags allow, with either attention kernel, must fit
// the free device memory (docs/memory.md).
// The run's memory flags into plan (apply_memory_flags). --gradients auto may choose in-backward only where that
// mode runs (one micro-batch per step, one rank, no --shard, no LoRA; check_run_options refuses it given
// explicitly otherwise), and knows whether its step needs the norm pass (--clip > 0 or --nan-policy skip).
void apply_train_memory_flags(GpuPlan& plan, const TrainOptions& opt, const dist::Communicator& comm) {
  apply_memory_flags(plan, opt.memory, opt.optimizer_state, opt.recompute, opt.gradients, opt.offload_activations);
  plan.memory_limit = static_cast<size_t>(opt.max_memory * 1073741824.0);  // --max-memory (0: none)
  const bool in_backward_runs = opt.grad_accum == 1 && comm.world() == 1 && opt.shard == "none" &&
                                opt.lora_rank == 0 && opt.adapter.empty();
  if (plan.gradients == Gradients::Auto && !in_backward_runs) plan.gradients = Gradients::Fp32;
  plan.norm_pass = opt.clip > 0 || opt.nan_policy == "skip";
  if (lora_run(opt)) plan.lora = run_lora_config(opt);  // the GPU plan of a frozen base and its adapters
}

void check_fits(const TrainOptions& opt, const ModelConfig& cfg, const std::string& device,
                const dist::Communicator& comm) {
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();  // int32 token and document indices
  DS_CHECK(opt.seq_len <= kMaxTokens / opt.micro_batch, "--micro-batch {} x --seq-len {} is more than {} tokens per "
           "micro-batch (token and document indices are 32-bit; `deltastack plan` shows what fits)", opt.micro_batch,
           opt.seq_len, kMaxTokens);
  constexpr double GiB = 1073741824.0;
  if (device == "cuda") {
    size_t free = cuda_free_bytes();
    const size_t slack = kAllocationSlack;  // the engine's margin (model/gpu_plan.h)
    if (free == 0) return;
    GpuPlan plan = GpuPlan::windows(opt.micro_batch, opt.seq_len, 1);
    apply_train_memory_flags(plan, opt, comm);
    free = plannable_free_bytes(free, plan.memory_limit);  // --max-memory: what the engine will allow itself
    if (opt.shard == "optimizer") {
      plan.shard_rank = comm.rank();
      plan.shard_world = comm.world();
    }
    size_t least = std::numeric_limits<size_t>::max();
    // --precision fp8 where the FP8 GEMMs run, bf16 where the engine's probe finds they do not: the smaller plan of
    // the two is the bound (an FP8 LoRA plan stores its frozen base in 1 byte per weight, model/gpu_fp8.h; a full
    // run's adds the casts' buffers).
    std::vector<Precision> precisions = {Precision::Bf16};
    if (const Precision given = parse_precision(opt.precision); given != Precision::Bf16) precisions.push_back(given);
    for (const Precision precision : precisions) {
      plan.precision = precision;
      plan.fp8_lm_head = opt.fp8_lm_head && precision == Precision::Fp8;
      for (const char* attention : {"cudnn", "simple"}) {
        try {  // a kernel that cannot take these shapes is not one the engine would use: the other decides
          const GpuPlan leanest = resolve_memory_modes(
              cfg, plan, [&](const GpuMemoryPlan& q) { return q.allocation + slack < free; }, attention);
          least = std::min(least, plan_gpu_memory(cfg, leanest, attention).allocation);
        } catch (const Error&) {
        }
      }
    }
    if (least == std::numeric_limits<size_t>::max()) return;  // no plan at all: the engine's own error says why
    DS_CHECK(least + slack < free, "the model ({}: {} parameters) with --micro-batch {} x --seq-len {} needs at least "
             "{:.2f} GiB of GPU memory in the leanest memory modes{}, but {:.2f} GiB is free{}: lower --micro-batch "
             "(--grad-accum keeps the step's batch) or --seq-len, or use a smaller model (`deltastack plan` shows the "
             "breakdown)", cfg.source, cfg.num_parameters(), opt.micro_batch, opt.seq_len, (least + slack) / GiB,
             opt.memory == "fixed" || opt.was_given("optimizer-state") || opt.was_given("recompute")
                 ? " the flags allow" : "", free / GiB,
             plan.memory_limit > 0 ? fmt::format(" within --max-memory {}", opt.max_memory) : std::string());
    return;
  }
  if (device != "cpu") return;
  const double host = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  // LoRA: the frozen base's weights only (its adapters' state is small).
  const double state = (lora_run(opt) ? 4.0 : 16.0) * static_cast<double>(cfg.num_parameters());
  const double acts = 4.0 * static_cast<double>(opt.micro_batch * opt.seq_len) *
                      static_cast<double>(cfg.num_hidden_layers) *
                      static_cast<double>(cfg.hidden_size + 2 * cfg.intermediate_size);
  if (host <= 0) return;
  DS_CHECK(state <= host, "the model ({}: {} parameters; num_hidden_layers {}, hidden_size {}, intermediate_size {}, "
           "vocab_size {}) needs {:.1f} GiB of host memory for the CPU engine's weights, gradients and AdamW moments "
           "alone; this machine has {:.1f} GiB", cfg.source, cfg.num_parameters(), cfg.num_hidden_layers,
           cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, state / GiB, host / GiB);
  DS_CHECK(state + acts <= host, "--micro-batch {} x --seq-len {} ({} tokens) needs at least {:.1f} GiB of host "
           "memory on the CPU engine ({:.1f} GiB of activations beside the model's {:.1f} GiB of weights, gradients "
           "and moments); this machine has {:.1f} GiB: lower --micro-batch (--grad-accum keeps the step's batch)",
           opt.micro_batch, opt.seq_len, opt.micro_batch * opt.seq_len, (state + acts) / GiB, acts / GiB, state / GiB,
           host / GiB);
}

// The host model: the checkpoint's config and weights on --resume, an HF checkpoint's for --model DIR, else seeded
// init.
Qwen35Model build_model(const TrainOptions& opt, const std::string& device, const dist::Communicator& comm) {
  const ModelConfig cfg = opt.resume.empty() ? ModelConfig::resolve(opt.model) : ModelConfig::from_file(opt.resume);
  DS_CHECK(opt.seq_len <= cfg.max_position_embeddings, "--seq-len {} is above the model's max_position_embeddings {}",
           opt.seq_len, cfg.max_position_embeddings);
  check_fits(opt, cfg, device, comm);  // before any parameter is listed
  // For the GPU engine the weights are produced per parameter while it uploads them (no full host copy).
  Qwen35Model model(cfg, Qwen35Model::Deferred{});
  if (!opt.resume.empty() && !lora_run(opt)) model.defer_load(opt.resume);  // LoRA: the checkpoint has no base
  else if (fs::is_directory(opt.model) && (file_exists(opt.model + "/model.safetensors") ||
                                           file_exists(opt.model + "/model.safetensors.index.json")))
    model.defer_load(opt.model);
  else model.defer_init(opt.seed);
  log_info("model: {} layers ({} full attention), hidden {}, vocab {}, {:.2f}M parameters", cfg.num_hidden_layers,
           std::count(cfg.layer_types.begin(), cfg.layer_types.end(), "full_attention"), cfg.hidden_size,
           cfg.vocab_size, model.num_parameters() / 1e6);
  return model;
}

struct TrainData {
  std::unique_ptr<PackedDataset> train, val;  // val: null without validation documents
  std::vector<PackedBatch> eval_batches;      // fixed evaluation windows, evenly spread over val
  json fingerprint;                           // saved with each checkpoint: the documents a resume must see again
  int64_t docs_per_window() const {
    return std::max(train->max_docs_per_window(), val ? val->max_docs_per_window() : 1);
  }
};

// The documents of data files, tokenized into memory, or a pre-tokenized dataset directory (data/token_dataset.h)
// mapped read-only; either gives the same token stream, labels and fingerprints for the same corpus. A dataset must
// have been made with the run's tokenizer (its fingerprint) and hold only ids of the model's vocabulary.
std::shared_ptr<const TokenStore> load_store(const std::vector<std::string>& files, const char* flag,
                                             const TrainOptions& opt, const ModelConfig& cfg, const Tokenizer& tok,
                                             const std::string& tokenizer_json, int32_t eos) {
  const bool dir = std::any_of(files.begin(), files.end(), [](const std::string& f) { return is_dataset_dir(f); });
  if (!dir) return std::make_shared<MemoryTokenStore>(
      tokenize_documents(tok, read_documents(files, parse_txt_split(opt.txt_split)), eos));
  DS_CHECK(files.size() == 1, "--{}: a dataset directory ({}) must be the only --{} (tokenize all files into one)",
           flag, *std::find_if(files.begin(), files.end(), [](const std::string& f) { return is_dataset_dir(f); }),
           flag);
  auto store = std::make_shared<MappedTokenStore>(files[0]);
  const std::string ix = files[0] + "/index.json";
  const std::string want = tokenizer_fingerprint(tokenizer_json);
  const json& j = store->index();
  DS_CHECK(j.value("tokenizer_fingerprint", std::string()) == want, "{}: field \"tokenizer_fingerprint\" is {}, but "
           "the run's tokenizer.json hashes to \"{}\": the dataset was made with another tokenizer (tokenize it again)",
           ix, j.value("tokenizer_fingerprint", json()).dump(), want);
  DS_CHECK(j.value("eos_id", json()) == json(eos), "{}: field \"eos_id\" is {}, the tokenizer's <|endoftext|> is {}",
           ix, j.value("eos_id", json()).dump(), eos);
  store->check_ids(cfg.vocab_size);
  log_info("data: {} mapped ({} tokens, {} documents, {} shards)", files[0], store->num_tokens(),
           store->num_documents(), j["shards"].size());
  return store;
}

// Tokenized, packed documents: --val-data, or the last --val-fraction of --data, is held out for evaluation.
TrainData load_data(const TrainOptions& opt, const ModelConfig& cfg, const std::string& tokenizer_json,
                    const std::string& tokenizer_file) {
  Tokenizer tok = Tokenizer::from_json_string(tokenizer_json, tokenizer_file);
  check_vocab(tok, cfg.vocab_size, cfg.source);
  const int32_t eos = document_separator(tok);
  const std::shared_ptr<const TokenStore> store = load_store(opt.data, "data", opt, cfg, tok, tokenizer_json, eos);
  std::shared_ptr<const TokenStore> val_store = store;
  const int64_t n_docs = store->num_documents();
  int64_t n_val = 0, train_end = n_docs, val_begin = n_docs, val_end = n_docs;
  if (!opt.val_data.empty()) {  // a separate evaluation set: all of --data trains
    val_store = load_store(opt.val_data, "val-data", opt, cfg, tok, tokenizer_json, eos);
    n_val = val_store->num_documents();
    val_begin = 0;
    val_end = n_val;
  } else {
    n_val = static_cast<int64_t>(std::floor(opt.val_fraction * static_cast<double>(n_docs)));
    if (opt.val_fraction > 0 && n_val == 0 && n_docs >= 2) n_val = 1;
    train_end = val_begin = n_docs - n_val;
  }
  DS_CHECK(train_end > 0, "data: no training documents left after holding out {} for validation", n_val);
  // Chat / SFT data whose loss masks label nothing (only user turns, an empty completion): every step would report
  // loss 0 and still move the weights (weight decay, the moments), and the evaluation would be NaN.
  require_labelled_target(*store, 0, train_end, "training documents", "train on");
  TrainData d;
  d.fingerprint = {{"train_documents", train_end}, {"train_fingerprint", documents_fingerprint(*store, 0, train_end)},
                   {"val_documents", n_val},
                   {"val_fingerprint", documents_fingerprint(*val_store, val_begin, val_end)}};
  d.train = std::make_unique<PackedDataset>(store, 0, train_end, opt.seq_len);
  if (n_val > 0) d.val = std::make_unique<PackedDataset>(val_store, val_begin, val_end, opt.seq_len);
  log_info("data: {} training documents, {} validation documents{}, {} training tokens in {} windows of {}; "
           "validation {} tokens", train_end, n_val, opt.val_data.empty() ? " (held out)" : " (--val-data)",
           d.train->num_tokens(), d.train->num_windows(), opt.seq_len, d.val ? d.val->num_tokens() : 0);
  if (d.val && opt.eval_batches > 0) {
    const int64_t want = std::min(d.val->num_windows(), opt.eval_batches * opt.micro_batch);
    std::vector<int64_t> ws;
    for (int64_t i = 0; i < want; ++i) ws.push_back(i * d.val->num_windows() / want);
    for (size_t i = 0; i < ws.size(); i += static_cast<size_t>(opt.micro_batch)) {
      const size_t end = std::min(ws.size(), i + static_cast<size_t>(opt.micro_batch));
      d.eval_batches.push_back(d.val->batch(std::vector<int64_t>(ws.begin() + static_cast<long>(i),
                                                                 ws.begin() + static_cast<long>(end))));
    }
  }
  return d;
}

// A resume on other data than the checkpoint's (an edited or another file) trains, but not bitwise like the run it
// continues: said as a warning, or an error with --data-changed error. Checkpoints of earlier versions have no
// fingerprint to compare.
void check_data_fingerprint(const TrainOptions& opt, const json& saved, const json& now) {
  if (saved.is_null()) {
    log_info("{}: no data fingerprint (an earlier version's checkpoint): cannot tell whether the data changed",
             opt.resume);
    return;
  }
  std::vector<std::string> what;
  for (const char* part : {"train", "val"}) {
    const std::string n = std::string(part) + "_documents", f = std::string(part) + "_fingerprint";
    if (saved.value(f, std::string()) != now[f].get<std::string>())
      what.push_back(fmt::format("{} documents: {} (fingerprint {}), the checkpoint's {} ({})",
                                 part == std::string("train") ? "training" : "validation", now[n].dump(),
                                 now[f].get<std::string>(), saved.value(n, json()).dump(), saved.value(f, std::string())));
  }
  if (what.empty()) return;
  const std::string msg = fmt::format("--resume {}: the data differs from the checkpoint's ({}); the run continues on "
                                      "other documents than it was trained on, not bitwise like an uninterrupted run",
                                      opt.resume, fmt::join(what, "; "));
  DS_CHECK(opt.data_changed != "error", "{} (--data-changed error)", msg);
  log_warn("{} (--data-changed error makes this an error)", msg);
}

// --out must not be a checkpoint directory or lie inside one (`--resume R/checkpoint-2 --out R/checkpoint-2`): the
// run's lock, metrics and checkpoints would go into it, and --keep-last of the run it belongs to would delete them
// with it.
void check_out_is_no_checkpoint(const std::string& out) {
  std::error_code ec;
  for (fs::path p = fs::weakly_canonical(fs::absolute(out), ec);; p = p.parent_path()) {
    DS_CHECK(!fs::exists(p / "trainer_state.json", ec), "--out {}: {} is a checkpoint directory; a run's directory "
             "holds checkpoints, it is not inside one (give another --out)", out, p.string());
    if (p == p.parent_path() || p.empty()) break;
  }
}

// Whether checkpoint `ckpt` (of step `step`) is a copy of --out's own checkpoint-`step`: both name the same run and
// the same writing process (session_id) in trainer_state.json. Checkpoints without ids are never copies.
bool is_copy_of_own_checkpoint(const std::string& ckpt, const std::string& out, int64_t step) {
  const CheckpointOwner a = checkpoint_owner(ckpt);
  const CheckpointOwner b = checkpoint_owner(fs::path(out) / fmt::format("checkpoint-{}", step));
  return !a.run_id.empty() && !a.session_id.empty() && a.run_id == b.run_id && a.session_id == b.session_id;
}

// Appends `text` to `path` and fsyncs it (created when missing). ds::Error naming the path on failure.
// A failed write is cut back to the file's earlier length, so a retry never glues a line onto a torn fragment.
void append_durably(const std::string& path, const std::string& text) {
  const int fd = open_no_follow(path, O_WRONLY | O_CREAT | O_APPEND, 0644, "metrics file");
  const off_t before = ::lseek(fd, 0, SEEK_END);
  errno = 0;
  const ssize_t w = ::write(fd, text.data(), text.size());
  const bool ok = w == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  const int err = errno ? errno : ENOSPC;  // a short write sets no errno: the disk is full
  if (!ok && before >= 0 && ::ftruncate(fd, before) == 0) ::fsync(fd);
  ::close(fd);
  DS_CHECK(ok, "{}: write failed ({})", path, std::strerror(err));
}

// metrics.jsonl in --out, one JSON object a line, each naming the run (RunDirectory::claim keeps other runs' files
// out). On resume, the lines past the resumed step (an earlier attempt's, which this run does again) are moved to
// metrics-abandoned.jsonl first: appended there and fsync'ed before metrics.jsonl is replaced, so a kill in between
// loses no line. `resumed_from` (not null: a branch starts here) goes into the first line this run writes.
class MetricsLog {
 public:
  MetricsLog(const std::string& out, int64_t start_step, std::string run_id, json resumed_from = nullptr)
      : path_((fs::path(out) / RunDirectory::kMetricsName).string()),
        run_id_(std::move(run_id)),
        resumed_from_(std::move(resumed_from)) {
    if (file_exists(path_)) {
      std::string kept, later;
      const std::string text = read_file(path_);
      // A last line without its newline (a run killed or a disk filled while writing it): a line of this run would
      // be appended onto it, so the file is rewritten, and a torn line that does not parse goes with the abandoned.
      const bool unterminated = !text.empty() && text.back() != '\n';
      std::istringstream in(text);
      std::string line;
      while (std::getline(in, line)) {
        bool past = false;
        try {
          const json j = json::parse(line);
          past = j.is_object() && j.value("step", int64_t{0}) > start_step;
          if (!past && j.is_object() && j.contains("eval_loss")) evals_.insert(j.value("step", int64_t{-1}));
        } catch (const json::exception&) {  // not ours to judge: kept as it is, unless it is a torn last line
          past = unterminated && in.eof();
        }
        (past ? later : kept) += line + "\n";
      }
      if (!later.empty()) {
        const std::string abandoned = (fs::path(out) / RunDirectory::kAbandonedMetricsName).string();
        append_durably(abandoned, later);
        write_file_atomic(path_, kept);
        log_info("{}: the lines past step {} (an earlier attempt's) moved to {}", path_, start_step, abandoned);
      } else if (unterminated) {
        write_file_atomic(path_, kept);
      }
    }
    fd_ = open_no_follow(path_, O_WRONLY | O_CREAT | O_APPEND, 0644, "metrics file");
  }
  ~MetricsLog() {
    if (fd_ >= 0) ::close(fd_);
  }
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  // Whether the kept history holds an evaluation at `step` (a resume in its own directory).
  bool has_eval(int64_t step) const { return evals_.count(step) > 0; }
  // Appends one line. A line that cannot be written whole (a full disk, a quota, an I/O error) stops the run with
  // an error instead of training on without its metrics: the file is cut back to its last complete line, so no
  // torn line is left and every later line would be missing (an ofstream in a failed state drops them all).
  void write(json j) {
    if (!run_id_.empty()) j["run_id"] = run_id_;
    if (!resumed_from_.is_null()) j["resumed_from"] = resumed_from_;
    const std::string line = j.dump() + "\n";
    struct stat st {};
    const bool sized = ::fstat(fd_, &st) == 0;
    size_t done = 0;
    int err = 0;
    while (done < line.size()) {
      const ssize_t w = ::write(fd_, line.data() + done, line.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        err = w < 0 ? errno : ENOSPC;
        break;
      }
      done += static_cast<size_t>(w);
    }
    if (done == line.size()) {
      resumed_from_ = nullptr;  // written: only the branch's first line carries it
      return;
    }
    if (sized && ::ftruncate(fd_, st.st_size) != 0)
      log_warn("{}: could not cut the partial line off ({})", path_, std::strerror(errno));
    fail("{}: cannot append the metrics line of step {} ({}); stopping rather than training on without its metrics. "
         "{}", path_, j.value("step", int64_t{-1}), std::strerror(err),
         last_checkpoint_.empty() ? std::string("This run has saved no checkpoint yet")
                                  : fmt::format("Free space, then resume with: deltastack train --resume {}",
                                                last_checkpoint_));
  }
  // Makes the lines written so far durable (before a checkpoint of their step is: a crash of the machine must not
  // keep the checkpoint and lose the metrics lines up to it, which the resume would never write again).
  void sync() {
    if (::fsync(fd_) != 0) fail("{}: fsync failed ({})", path_, std::strerror(errno));
  }
  void set_last_checkpoint(const std::string& dir) { last_checkpoint_ = dir; }
  const std::string& path() const { return path_; }

 private:
  std::string path_, run_id_, last_checkpoint_;
  json resumed_from_;
  int fd_ = -1;
  std::set<int64_t> evals_;
};

// A progress line on stdout; a failed write (a closed pipe: `train | head -1`) never stops the run.
void print_progress(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
}

// A duration as "42s", "3m07s" or "2h05m" (the progress line's ETA).
std::string short_duration(double seconds) {
  const int64_t t = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  if (t < 60) return fmt::format("{}s", t);
  if (t < 3600) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
}

// ---- the step

double lr_at(const TrainOptions& o, int64_t step) {  // step is 1-based
  if (o.warmup > 0 && step <= o.warmup) return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup);
  if (o.schedule == "constant") return o.lr;
  double span = static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup));
  double p = std::min(1.0, static_cast<double>(step - o.warmup) / span);
  double min_lr = o.lr * o.min_lr_ratio;
  if (o.schedule == "linear") return o.lr + (min_lr - o.lr) * p;
  return min_lr + 0.5 * (o.lr - min_lr) * (1.0 + std::cos(M_PI * p));
}

// Window order: a fresh seeded permutation per epoch, so micro-batch k is a pure function of (seed, k). Held as
// 4-byte indices below 2^32 windows (80 MB for the 20M windows of 128 in 10 GB of text), else 8-byte.
class WindowSampler {
 public:
  WindowSampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {}
  int64_t at(int64_t global_index) {
    int64_t epoch = global_index / n_;
    if (epoch != epoch_) {
      if (n_ <= int64_t{std::numeric_limits<uint32_t>::max()}) shuffle(perm32_, epoch);
      else shuffle(perm64_, epoch);
      epoch_ = epoch;
    }
    const size_t i = static_cast<size_t>(global_index % n_);
    return perm32_.empty() ? perm64_[i] : static_cast<int64_t>(perm32_[i]);
  }

 private:
  int64_t n_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<uint32_t> perm32_;
  std::vector<int64_t> perm64_;
  template <typename T>
  void shuffle(std::vector<T>& perm, int64_t epoch) {
    perm.resize(static_cast<size_t>(n_));
    std::iota(perm.begin(), perm.end(), T{0});
    Rng rng(seed_, 0x5eed0000ull + static_cast<uint64_t>(epoch));
    for (int64_t i = n_ - 1; i > 0; --i) std::swap(perm[static_cast<size_t>(i)], perm[rng.below(i + 1)]);
  }
};

// One step's micro-batches of this rank, grad_accum of micro_batch windows each, built one at a time (a large
// --grad-accum never holds them all). The step's batch is world x grad_accum micro-batches, in the order one rank
// with world x grad_accum would take them (rank r takes the r-th run of grad_accum), so N ranks see the same
// windows as one. The loss is normalised by the target count of the whole step (over every rank), so a first pass
// counts this rank's targets and tokens, the ranks sum them, and the step builds each micro-batch again as it runs
// it (packing is cheap next to a forward).
class StepBatches {
 public:
  StepBatches(WindowSampler& sampler, const PackedDataset& set, const TrainOptions& opt, int64_t step,
              dist::Communicator& comm)
      : sampler_(sampler), set_(set), opt_(opt), step_(step), rank_(comm.rank()), world_(comm.world()) {
    int64_t counts[2] = {0, 0};
    for (int64_t a = 0; a < opt.grad_accum; ++a) {
      const PackedBatch b = micro(a);
      counts[0] += b.num_targets();
      counts[1] += b.size();
    }
    comm.all_reduce_sum(counts, 2);
    targets = counts[0];
    tokens = counts[1];
  }
  PackedBatch micro(int64_t a) const {
    const int64_t first = ((step_ - 1) * world_ + rank_) * opt_.grad_accum;  // this rank's first micro-batch
    std::vector<int64_t> ws;
    for (int64_t b = 0; b < opt_.micro_batch; ++b) ws.push_back(sampler_.at((first + a) * opt_.micro_batch + b));
    return set_.batch(ws);
  }
  int64_t targets = 0, tokens = 0;  // of the whole step, over every rank

 private:
  WindowSampler& sampler_;
  const PackedDataset& set_;
  const TrainOptions& opt_;
  int64_t step_, rank_, world_;
};

// Mean loss per target over the evaluation batches (forward only); NaN without targets. With several ranks, rank r
// evaluates batches r, r + world, ... and the ranks sum the losses and counts. Every rank runs as many forwards
// (a rank past the last batch one without a batch): a forward of --shard full gathers with the other ranks.
double evaluate(Engine& engine, const std::vector<PackedBatch>& batches, dist::Communicator& comm) {
  double sum = 0;
  int64_t n = 0;
  const size_t world = static_cast<size_t>(comm.world());
  for (size_t i = static_cast<size_t>(comm.rank()); i < (batches.size() + world - 1) / world * world; i += world) {
    if (i >= batches.size()) {
      engine.forward_without_batch();
      continue;
    }
    const LossResult r = engine.forward_backward(batches[i], 0.0, 0.0);
    sum += r.loss_sum;
    n += r.num_valid;
  }
  comm.all_reduce_sum(&sum, 1);
  comm.all_reduce_sum(&n, 1);
  return n > 0 ? sum / static_cast<double>(n) : NAN;
}

// Several ranks must run the same command on the same data, or their replicas drift apart (or a collective
// hangs): rank 0's values (its options, its data's fingerprint: a JSON object) are compared on every rank; a rank
// that differs stops the run, naming itself and each field that differs, with both values.
void check_same_on_every_rank(dist::Communicator& comm, const std::string& what, const json& values) {
  if (comm.world() == 1) return;
  const std::string mine = values.dump();
  int64_t n = static_cast<int64_t>(mine.size());
  comm.broadcast(&n, sizeof n, 0);
  std::string root = comm.is_root() ? mine : std::string(static_cast<size_t>(n), '\0');
  comm.broadcast(root.data(), n, 0);
  if (root == mine) return;
  const json theirs = json::parse(root, nullptr, false);
  std::vector<std::string> differ;
  for (const auto& [k, v] : values.items())
    if (!theirs.is_object() || theirs.value(k, json()) != v)
      differ.push_back(fmt::format("{} is {} here, {} on rank 0", k, v.dump(),
                                   theirs.is_object() ? theirs.value(k, json()).dump() : "?"));
  fail("rank {} has other {} than rank 0 ({}; every rank must run the same `deltastack train` command on the same "
       "files)", comm.rank(), what, fmt::join(differ, "; "));
}

// Rank 0's value of a flag on every rank (decisions only rank 0 can make: what its files say).
bool from_root(dist::Communicator& comm, bool v) {
  int64_t x = comm.is_root() && v ? 1 : 0;
  comm.all_reduce_max(&x, 1);
  return x != 0;
}

ops::AdamWParams adamw_params(const TrainOptions& opt, double lr, int64_t step, double grad_scale) {
  ops::AdamWParams p;
  p.lr = lr;
  p.beta1 = opt.beta1;
  p.beta2 = opt.beta2;
  p.eps = opt.adam_eps;
  p.weight_decay = opt.weight_decay;
  p.step = step;
  p.grad_scale = grad_scale;
  return p;
}


// ---- train()'s set-up: the ranks, the checks, the resume, --out, the engine

// The communicator of this launch for the engine it runs (MPI: CPU ranks; NCCL: GPU ranks, also one rank under
// torchrun or mpirun), opened once the options (a resume's device included) are known; tests that call train()
// in-process run as one plain process.
dist::Communicator& open_world(const std::string& device) {
  const dist::LaunchInfo launch = dist::detect_launch();
  if (dist::world().backend() == "single" && launch.launcher != "single")
    dist::install(dist::open_communicator(launch, device));
  return dist::world();
}

// A resume at another world size keeps the step's batch (ranks x grad_accum micro-batches) and so its windows:
// opt.grad_accum becomes this world's share. ds::Error when the ranks cannot share it evenly.
void keep_step_batch(TrainOptions& opt, const SavedCheckpoint& resumed, const dist::Communicator& comm) {
  if (resumed.state.world_size == comm.world()) return;
  const int64_t per_step = resumed.state.world_size * opt.grad_accum;
  DS_CHECK(per_step % comm.world() == 0, "{} was saved by {} ranks with --grad-accum {} ({} micro-batches per "
           "step), which {} ranks cannot share evenly; resume it on a number of ranks that divides {}", opt.resume,
           resumed.state.world_size, opt.grad_accum, per_step, comm.world(), per_step);
  log_info("resuming {} ranks' run on {}: --grad-accum {} -> {} per rank (the same {} micro-batches per step)",
           resumed.state.world_size, comm.world(), opt.grad_accum, per_step / comm.world(), per_step);
  opt.grad_accum = per_step / comm.world();
}

// Before --out is touched: the options every rank must share, the engine knobs, and the GPU engine's modes asked of
// the CPU (`device` is the engine the run builds; `resumed`: a --resume). ds::Error naming the flag or knob.
void check_run_options(const TrainOptions& opt, bool resumed, const std::string& device, dist::Communicator& comm) {
  json same = options_to_json(opt);
  same["resume"] = opt.resume;
  same["out"] = opt.out;
  same["shard"] = opt.shard;
  check_same_on_every_rank(comm, "options", same);
  // GPU ranks that overlap the all-reduce and ranks that do not would issue different NCCL collectives (a hang).
  if (comm.on_device())
    check_same_on_every_rank(comm, "DELTASTACK_DP_OVERLAP", {{"DELTASTACK_DP_OVERLAP", engine_knob("DELTASTACK_DP_OVERLAP")}});
  if (opt.shard == "optimizer" && comm.world() == 1 && comm.on_device())
    log_info("--shard optimizer with one rank: the sharded path over one share (the whole state)");
  else if (opt.shard != "none" && comm.world() == 1)
    log_info("--shard {} with one rank: nothing to shard, the whole state stays here", opt.shard);
  DS_CHECK(opt.shard != "full" || device != "cuda", "--shard full is built for the CPU engine "
           "only: the GPU engine has no per-layer parameter gathers yet (use --shard optimizer or none, or --device cpu)");
  if (opt.gradients == "in-backward" || opt.gradients == "bf16") {  // model/engine.h Gradients
    DS_CHECK(opt.gradients != "in-backward" || opt.grad_accum == 1, "--gradients in-backward updates each layer "
             "during the backward, so every backward is a whole step: --grad-accum must be 1 (got {}{}); {}use "
             "--gradients fp32{}", opt.grad_accum,
             resumed ? fmt::format(": the run of --resume {} has it, and a resume keeps it", opt.resume) : "",
             resumed ? "" : "raise --micro-batch, or ", " or bf16");
    // No fp32 gradient buffer to sum over ranks or to shard: in-backward keeps none, bf16 keeps a bf16 one.
    DS_CHECK(comm.world() == 1, "--gradients {} runs on one rank (this launch has {}): use --gradients fp32",
             opt.gradients, comm.world());
    DS_CHECK(opt.shard == "none", "--gradients {} keeps no fp32 gradient buffer to shard: use --shard none or "
             "--gradients fp32", opt.gradients);
    DS_CHECK(opt.lora_rank == 0 && opt.adapter.empty(), "--gradients {} with LoRA (--lora-rank / --adapter) is not "
             "supported (the adapters' gradients are small: use --gradients fp32)", opt.gradients);
  }
  ops::check_knobs();  // a bad DELTASTACK_<OP> fails here, before --out is touched
  check_engine_knobs();  // and a bad DELTASTACK_ASYNC_OPTIMIZER / _DP_OVERLAP (the GPU engine reads them later)
  if (device != "cuda") {  // the GPU engine's memory modes, on the CPU: errors now
    DS_CHECK(opt.max_memory == 0, "--max-memory {} limits the GPU engine's memory; this run trains on the CPU (use "
             "--device cuda on a machine with a GPU, or leave --max-memory out)", opt.max_memory);
    DS_CHECK(!opt.was_given("recompute") || opt.recompute == "auto" || opt.recompute == "none",
             "--recompute {} is a mode of the GPU engine; the CPU engine keeps every activation (use --device cuda)",
             opt.recompute);
    DS_CHECK(!opt.offload_activations, "--offload-activations is a mode of the GPU engine; this run trains on the "
             "CPU, whose activations are in host memory already (use --device cuda on a machine with a GPU, or leave "
             "it out)");
    const bool gpu_state = bf16_weights(parse_optimizer_state(opt.optimizer_state));  // bf16, 8bit
    DS_CHECK(!resumed || opt.was_given("optimizer-state") || !gpu_state,
             "{} is a checkpoint of a run with --optimizer-state {}, a mode of the GPU engine; to continue it on "
             "the CPU, give --optimizer-state fp32 (its bf16 weights widen exactly, its moments are stored fp32 or "
             "bf16)", opt.resume, opt.optimizer_state);
    DS_CHECK(!gpu_state, "--optimizer-state {} is a mode of the GPU engine; the CPU engine keeps fp32 weights and "
             "moments (use --device cuda, or --optimizer-state auto / fp32)", opt.optimizer_state);
  }
}

// --out is no checkpoint directory (check_out_is_no_checkpoint) and no symbolic link to nothing. ds::Error naming it.
void check_out(const std::string& out) {
  check_out_is_no_checkpoint(out);
  std::error_code ec;
  DS_CHECK(!fs::is_symlink(out, ec) || fs::exists(out, ec), "--out {}: a symbolic link to {}, which does not "
           "exist (create that directory first, or give another --out)", out, fs::read_symlink(out, ec).string());
}

// Whose run the steps continue (run_identity).
struct RunIdentity {
  std::string run_id;
  json resumed_from;     // where the run's branch starts ({"run_id", "step", "path"}); null for a run started fresh
  bool own_dir = false;  // a resume in the checkpoint's own directory
  bool branch = false;   // a resume into another directory: a new branch starts here
};

// The run's id. A resume in the checkpoint's own directory (also one that was moved, or entered as `.`), or of a
// copy of one of --out's own checkpoints (the same step, run and writing process), continues its run; a resume
// into another directory starts a branch with its own id (branch_run_id) and "resumed_from" in its checkpoints and
// first metrics line, so two continuations of one checkpoint never share an id: the directory of either refuses
// the other's lines (claim_run_dir) instead of splicing the two histories. Every rank computes the same id (a
// fresh run's random one is rank 0's).
RunIdentity run_identity(const TrainOptions& opt, const std::optional<SavedCheckpoint>& resumed,
                         dist::Communicator& comm) {
  RunIdentity id;
  std::error_code ec;
  id.own_dir = resumed && fs::equivalent(opt.out, fs::canonical(opt.resume).parent_path(), ec);
  id.run_id = resumed ? resumed->run_id : new_run_id();
  if (comm.world() > 1 && !resumed) {
    id.run_id.resize(16, '0');
    comm.broadcast(id.run_id.data(), 16, 0);
  }
  id.resumed_from = resumed ? resumed->resumed_from : json();
  id.branch = resumed && !id.own_dir && !is_copy_of_own_checkpoint(opt.resume, opt.out, resumed->state.step);
  if (id.branch) {
    id.resumed_from = {{"run_id", resumed->run_id}, {"step", resumed->state.step},
                       {"path", fs::canonical(opt.resume).string()}};
    id.run_id = branch_run_id(resumed->run_id, resumed->state.step, fs::weakly_canonical(opt.out).string());
    log_info("--out {} is not the checkpoint's directory: a new branch (run_id {}) of run {} from step {}", opt.out,
             id.run_id, resumed->run_id.empty() ? std::string("(no id)") : resumed->run_id, resumed->state.step);
  }
  return id;
}

// Rank 0 alone owns --out: the lock, stale temps, the claim. Returns rank 0's locked directory (null on the other
// ranks), once --out exists and is rank 0's on every rank. ds::Error when --out is locked, unwritable or another
// run's (RunDirectory), or when a --no-save resume from `resumed_step` would set aside this run's later checkpoints
// there (it saves none in their place).
std::unique_ptr<RunDirectory> claim_run_dir(const TrainOptions& opt, const RunIdentity& id, int64_t resumed_step,
                                            dist::Communicator& comm) {
  std::unique_ptr<RunDirectory> run_dir;
  if (comm.is_root()) {
    run_dir = std::make_unique<RunDirectory>(opt.out);
    run_dir->remove_stale_temps(opt.resume);
    // Another run's metrics or checkpoints in --out: refused, or moved aside (--move-aside). Metrics lines without a
    // run id (earlier versions) are this run's in the checkpoint's own directory.
    run_dir->claim(id.run_id, id.own_dir, opt.move_aside);
    if (opt.no_save && resumed_step >= 0) {
      const std::vector<std::string> later = run_dir->later_checkpoints(id.run_id, resumed_step);
      DS_CHECK(later.empty(), "--no-save: resuming {} in {} would set aside this run's later {} (the abandoned "
               "history) and save nothing in its place; give --out another directory, or resume without --no-save",
               opt.resume, opt.out, fmt::join(later, ", "));
    }
  }
  comm.barrier();  // --out exists and is rank 0's before any rank reads it
  return run_dir;
}

// Each rank's cores (before any thread starts: OpenMP's workers inherit them): near its GPU, or its share of the
// host; rank 0 logs every rank's.
void bind_rank_cpus(dist::Communicator& comm, const std::string& device) {
  std::string bound = dist::bind_cpus(comm.launch(), device == "cuda" ? cuda_pci_bus_id(cuda_current_device()) : std::string());
  if (comm.world() == 1) {
    log_info("CPU binding: {}", bound);
  } else {
    std::string all;
    for (int r = 0; r < comm.world(); ++r) {
      std::string b = bound;
      b.resize(200, ' ');
      comm.broadcast(b.data(), 200, r);
      b.erase(b.find_last_not_of(' ') + 1);
      all += fmt::format("{}rank {}: {}", r ? "; " : "", r, b);
    }
    log_info("CPU binding: {}", all);
  }
}

// The engine that trains `model` on `data`'s windows: the GPU when there is one (auto), else the CPU reference
// engine, its state shared out per --shard. Sets opt.device, opt.optimizer_state and opt.shard to the engine's.
std::unique_ptr<Engine> make_train_engine(TrainOptions& opt, Qwen35Model&& model, const TrainData& data,
                                          dist::Communicator& comm) {
  GpuPlan plan = GpuPlan::windows(opt.micro_batch, opt.seq_len, data.docs_per_window());
  apply_train_memory_flags(plan, opt, comm);
  plan.precision = parse_precision(opt.precision);
  plan.fp8_lm_head = opt.fp8_lm_head;
  if (opt.shard == "optimizer" && comm.on_device()) {  // the GPU engine plans its memory for this rank's share
    plan.shard_rank = comm.rank();
    plan.shard_world = comm.world();
  }
  const auto built = std::chrono::steady_clock::now();
  std::unique_ptr<Engine> engine = make_engine(opt.device, std::move(model), plan);
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - built).count();
  opt.device = engine->device();  // saved in checkpoints: a resume continues on the same engine
  // The optimizer state in use, saved too: a resume keeps the numerics unless --optimizer-state changes them.
  opt.optimizer_state = optimizer_state_name(engine->optimizer_state());
  engine->distribute(comm, opt.shard == "full"        ? Engine::ShardMode::Full
                          : opt.shard == "optimizer" ? Engine::ShardMode::Optimizer
                                                     : Engine::ShardMode::None);
  // The seconds the engine took to build: the weights initialised or read, and uploaded (minutes at 27B).
  log_info("device: {}{} (engine and weights ready in {:.1f} s)", opt.device,
           comm.world() > 1 || comm.backend() != "single"
               ? fmt::format(", {} rank{} ({}), --shard {}, {} communicator", comm.world(), comm.world() > 1 ? "s" : "",
                             comm.launch().launcher, opt.shard, comm.backend())
               : std::string(),
           build_s);
  // The mode in effect, which the free-space check's estimate reads (checkpoint_bytes_estimate: a sharded 8bit
  // state is saved as F32 moments, 10 bytes a parameter, an unsharded one as codes, about 4): one process without a
  // device communicator shards nothing, whatever --shard says (distribute).
  if (comm.world() == 1 && !comm.on_device()) opt.shard = "none";
  return engine;
}

// Where the run starts: a resume's state (step, optimizer steps, tokens, time), its optimizer state loaded into
// `engine`; step 0 of a new run. ds::Error when --steps is below the checkpoint's step.
TrainerState start_state(Engine& engine, const TrainOptions& opt, const std::optional<SavedCheckpoint>& resumed,
                         const dist::Communicator& comm) {
  TrainerState progress;
  if (resumed) {
    const auto t0 = std::chrono::steady_clock::now();
    load_optimizer_state(engine, opt.resume);
    progress = resumed->state;
    log_info("resuming from {} at step {} (optimizer state read in {:.1f} s)", opt.resume, progress.step,
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  progress.world_size = comm.world();
  DS_CHECK(opt.steps >= progress.step, "--steps {} is below the checkpoint's step {}", opt.steps, progress.step);
  return progress;
}

// Settles --out for a run that starts at start_step (resumed: a --resume), once every rank is set up: the checks of
// `checkpoints` (made by the caller, first), then rank 0's metrics log, opened (null on the other ranks).
std::unique_ptr<MetricsLog> settle_run_dir(const TrainOptions& opt, const RunIdentity& id, bool resumed,
                                           int64_t start_step, const Checkpoints& checkpoints, const Engine& engine,
                                           const RunDirectory* run_dir, dist::Communicator& comm) {
  const bool root = comm.is_root();
  if (root) checkpoints.check_room_for_next_save(engine.config(), start_step, "");  // a full disk stops it now
  // Rank 0 writes the metrics; the other ranks' MetricsLog is never made.
  std::unique_ptr<MetricsLog> metrics;
  if (root) metrics = std::make_unique<MetricsLog>(opt.out, start_step, id.run_id, id.branch ? id.resumed_from : json());
  if (resumed && root) run_dir->set_aside_later_checkpoints(id.run_id, start_step);
  comm.barrier();  // the other ranks read --out later (saves, evaluation decisions) only after it is settled
  if (root && resumed) metrics->set_last_checkpoint(opt.resume);
  return metrics;
}

// ---- the loop's state

// Whether the run evaluates after `step`: every --eval-interval steps and at the last one (with evaluation data).
bool eval_due(const TrainOptions& opt, const TrainData& data, int64_t step) {
  return !data.eval_batches.empty() && (step == opt.steps || (opt.eval_interval > 0 && step % opt.eval_interval == 0));
}

// What the steps of a run share (train()): its options, ranks and engine, where it stands, --out's files (rank 0's
// run directory and metrics; null on the other ranks) and the newest complete checkpoint of its history.
struct Run {
  TrainOptions& opt;
  dist::Communicator& comm;
  const bool root;
  Engine& engine;
  TrainerState& progress;
  Checkpoints& checkpoints;
  RunDirectory* run_dir;  // rank 0's
  MetricsLog* metrics;    // rank 0's
  InterruptGuard& interrupt;
  const std::chrono::steady_clock::time_point t_start;
  const double elapsed_before;  // the seconds of the run's history before this session
  const int64_t start_step;
  int64_t saved_step;  // the newest complete checkpoint of this run's history (-1: none)
  std::string saved_dir;
  std::chrono::steady_clock::time_point t_loop{};  // the ETA: this session's mean time per step, evals included
  int stop_signal = 0;

  double elapsed() const {
    return elapsed_before + std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  }

  // Saves checkpoint-<progress.step> (collective); with --no-save nothing is written and saved_step stays.
  void save() {
    if (opt.no_save) return;
    progress.elapsed_s = elapsed();
    engine.gather_for_save();  // a sharded optimizer state, whole on every rank until the save is written
    if (root) {  // every rank holds the same weights and (gathered) optimizer state: rank 0's copy is the checkpoint
      // A run directory renamed while the run trained: the lock and metrics.jsonl (open files) went with it, so the
      // checkpoints follow them there instead of recreating --out's old path, unlocked and without its metrics.
      const std::string now = run_dir->current_path();
      DS_CHECK(!now.empty(), "--out {}: the run directory was deleted while the run trained; not saving "
               "checkpoint-{}{}", opt.out, progress.step,
               saved_dir.empty() ? std::string() : fmt::format(" (the last checkpoint was {})", saved_dir));
      std::error_code ec;
      if (!fs::equivalent(now, opt.out, ec)) {
        log_warn("--out {} was moved to {} while the run trained: saving there, beside its lock and metrics",
                 opt.out, now);
        opt.out = now;
        checkpoints.move_to(now);
      }
      metrics->sync();  // the lines up to this step are durable before the checkpoint is
      checkpoints.save(engine, progress, [&](const std::string& dir) {  // before --keep-last prunes the older ones
        saved_dir = dir;
        saved_step = progress.step;
        interrupt.set_last_checkpoint(saved_dir);
        metrics->set_last_checkpoint(saved_dir);
      });
    }
    else
      saved_step = progress.step;
    engine.release_after_save();
    comm.barrier();  // a rank 0 that fails to save stops every rank (main.cpp) instead of leaving them training
  }

  // A signal on any rank stops every rank at the same point: the ranks agree before each step, before each
  // evaluation and at the end (one tiny all-reduce each; with one rank just the signal flag).
  bool signalled() {
    int64_t sig = interrupt.signal();
    comm.all_reduce_max(&sig, 1);
    stop_signal = static_cast<int>(sig);
    return stop_signal != 0;
  }

  // A dataset file changed under the run (a mapped shard truncated in place: DataChangedError, thrown before the
  // step's update): the weights are still those of the last step, saved (one rank: a save is collective) before
  // the error stops the run.
  template <typename Read>
  auto read_data(const Read& read) {
    try {
      return read();
    } catch (const DataChangedError& e) {
      if (comm.world() == 1 && progress.step > saved_step && progress.step > 0) save();
      fail("{}. Step {} was not taken; {}", e.what(), progress.step + 1,
           saved_step < 0 ? std::string(opt.no_save ? "no checkpoint was saved by this run (--no-save)"
                                                    : "no checkpoint was saved by this run")
                          : fmt::format("the last checkpoint is {} (step {}): resume from it once the data is whole "
                                        "again", saved_dir, saved_step));
    }
  }

  // The NaN/Inf guard's step (a non-finite `loss` or `gnorm`): stops the run (--nan-policy stop), or skips the
  // update, logged in the metrics (skip).
  void skip_update(int64_t step, double loss, double gnorm, double lr, int64_t tokens) {
    const std::string reason =
        !std::isfinite(loss) ? fmt::format("loss is {}", loss) : fmt::format("grad norm is {}", gnorm);
    if (opt.nan_policy == "stop")
      fail("step {}: {}; stopping (--nan-policy stop). {}; try a lower --lr or --nan-policy skip", step, reason,
           saved_step < 0 ? std::string("No checkpoint was saved by this run")
                          : fmt::format("The last checkpoint, {} (step {}), is intact", saved_dir, saved_step));
    log_warn("step {}: {}; skipping the update (--nan-policy skip)", step, reason);
    if (root) metrics->write({{"step", step}, {"skipped", true}, {"reason", reason}, {"lr", lr}, {"tokens", tokens},
                   {"elapsed_s", elapsed()}});
  }

  // An updated step's metrics line and progress line (rank 0); `t0`: when the step began.
  void log_step(int64_t step, double loss, double gnorm, double lr, int64_t tokens,
                std::chrono::steady_clock::time_point t0) {
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double el = elapsed();
    json line{{"step", step}, {"loss", loss}, {"grad_norm", gnorm}, {"lr", lr}, {"tokens", tokens},
              {"tokens_per_s", tokens / dt}, {"elapsed_s", el}};
    if (engine.device() == "cuda") line["peak_gib"] = engine.peak_bytes() / 1073741824.0;
    if (root) metrics->write(line);
    const double per_step = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_loop).count() /
                            static_cast<double>(step - start_step);
    if (root) print_progress(fmt::format("step {:>5}/{} | loss {:.4f} | grad_norm {:.3f} | lr {:.2e} | {} tok | {:.0f} tok/s | "
                               "{:.1f} s | ETA {}\n", step, opt.steps, loss, gnorm, lr, tokens,
                               tokens / dt, el, short_duration(per_step * static_cast<double>(opt.steps - step))));
  }

  // The evaluation after `step`: its metrics line and progress line (rank 0).
  void evaluate_after(int64_t step, const std::vector<PackedBatch>& eval_batches) {
    const double el = evaluate(engine, eval_batches, comm);
    if (root) {
      print_progress(fmt::format("step {:>5}/{} | eval_loss {:.4f}\n", step, opt.steps, el));
      metrics->write({{"step", step}, {"eval_loss", el}, {"elapsed_s", elapsed()}});
    }
  }

  // A signal stopped the run (signalled()): the steps not yet saved are, and the exit code is 128 + the signal.
  int stop_by_signal() {
    const int sig = stop_signal;
    if (progress.step > saved_step && progress.step > 0) save();
    std::string where =
        saved_step < 0 ? "no step was taken, so there is nothing to save (a new run starts over)"
                       : fmt::format("the last checkpoint is {} (step {}); resume with: deltastack train --resume {}",
                                     saved_dir, saved_step, saved_dir);
    if (opt.no_save && progress.step > start_step)  // steps were taken and not saved
      where = "--no-save, so no checkpoint was written" +
              (saved_step < 0 ? std::string() : fmt::format("; the last checkpoint is {} (step {})", saved_dir,
                                                            saved_step));
    if (root)
      detail::log_line(fmt::format("[deltastack] stopped by {} after step {} of {}: {}\n", signal_name(sig),
                                   progress.step, opt.steps, where));
    return 128 + sig;
  }
};

}  // namespace

int train(TrainOptions cli) {
  const auto t_start = std::chrono::steady_clock::now();
  // Several ranks (mpirun; dist/communicator.h): every rank trains the same model on its share of each step's
  // micro-batches; rank 0 alone owns --out (lock, metrics, checkpoints, progress lines).
  // ---- set-up: options, model, data, engine, resumed state, --out
  std::optional<SavedCheckpoint> resumed;
  if (!cli.resume.empty()) resumed = read_checkpoint_state(cli.resume);
  TrainOptions opt = run_options(cli, resumed ? &*resumed : nullptr);
  const std::string tokenizer_file = tokenizer_path(opt);  // a checkpoint without its tokenizer.json: an error now
  const std::string device = resolve_device(opt.device);  // "cpu" | "cuda": the engine make_engine will build
  dist::Communicator& comm = open_world(device);
  const bool root = comm.is_root();
  if (resumed) keep_step_batch(opt, *resumed, comm);
  check_run_options(opt, resumed.has_value(), device, comm);
  // --out is created and locked before anything slow: a second run into it, or an --out that cannot be written,
  // stops now. Temp dirs of an interrupted save are removed only under the lock (never a running save's).
  check_out(opt.out);
  const RunIdentity id = run_identity(opt, resumed, comm);
  const std::unique_ptr<RunDirectory> run_dir =
      claim_run_dir(opt, id, resumed ? resumed->state.step : -1, comm);  // rank 0's; null on the others
  bind_rank_cpus(comm, device);
  set_num_threads(opt.threads);
  Qwen35Model model = build_model(opt, device, comm);
  const std::string tokenizer_json = read_file(tokenizer_file);
  const TrainData data = load_data(opt, model.config(), tokenizer_json, tokenizer_file);
  check_same_on_every_rank(comm, "data (its fingerprint)", data.fingerprint);
  if (resumed) check_data_fingerprint(opt, resumed->data, data.fingerprint);
  const json lora_base = lora_run(opt) ? attach_lora(opt, model, resumed ? &*resumed : nullptr) : json();
  const std::unique_ptr<Engine> engine = make_train_engine(opt, std::move(model), data, comm);
  TrainerState progress = start_state(*engine, opt, resumed, comm);
  const int64_t start_step = progress.step;
  // Every rank got through its model, data, engine and optimizer state before rank 0 changes --out (a rank that
  // failed has stopped the run; one that hangs keeps rank 0 waiting here, before any change).
  comm.barrier();
  // Then, in an order where whatever fails leaves the directory as it was: the checks on --out (Checkpoints), the
  // metrics rewrite (MetricsLog: the lines past the resumed step appended to metrics-abandoned.jsonl first; a full
  // disk stops it there), and last the abandoned history's later checkpoints set aside (renames, no new bytes), out
  // of the way of this run's saves of the same steps.
  Checkpoints checkpoints(opt, start_step, id.run_id, tokenizer_json, data.fingerprint, id.resumed_from);
  if (engine->adapter()) checkpoints.set_lora(lora_base, static_cast<int64_t>(engine->adapter()->values().size()));
  const std::unique_ptr<MetricsLog> metrics =
      settle_run_dir(opt, id, resumed.has_value(), start_step, checkpoints, *engine, run_dir.get(), comm);

  // From here on SIGINT / SIGTERM stop after the current step (or between its micro-batches, the step left
  // untaken), with a checkpoint of the last step taken (interrupt.h).
  InterruptGuard interrupt;
  Run run{.opt = opt, .comm = comm, .root = root, .engine = *engine, .progress = progress,
          .checkpoints = checkpoints, .run_dir = run_dir.get(), .metrics = metrics.get(), .interrupt = interrupt,
          .t_start = t_start, .elapsed_before = progress.elapsed_s, .start_step = start_step,
          .saved_step = resumed ? start_step : -1, .saved_dir = resumed ? opt.resume : std::string()};
  if (resumed) interrupt.set_last_checkpoint(run.saved_dir);

  // The evaluation at the start step: step 0 of a new run, or one that an interrupted run skipped at the step it
  // was due (a signal goes straight to the save), unless the kept history already has it.
  if (!data.eval_batches.empty() && (start_step == 0 || eval_due(opt, data, start_step)) &&
      !from_root(comm, root && metrics->has_eval(start_step))) {
    const double el = evaluate(*engine, data.eval_batches, comm);
    log_info("step {} | eval_loss {:.4f}", start_step, el);
    if (root) metrics->write({{"step", start_step}, {"eval_loss", el}, {"elapsed_s", run.elapsed()}});
  }

  // ---- the steps
  WindowSampler sampler(data.train->num_windows(), opt.seed);
  run.t_loop = std::chrono::steady_clock::now();
  // Fault-injection hook for the multi-rank tests: "R:S" makes rank R fail at step S (unset in normal use).
  int64_t fail_rank = -1, fail_step = -1;
  if (const char* f = std::getenv("DELTASTACK_TEST_FAIL_RANK")) std::sscanf(f, "%ld:%ld", &fail_rank, &fail_step);
  for (int64_t step = start_step + 1; step <= opt.steps && !run.signalled(); ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    DS_CHECK(!(comm.rank() == fail_rank && step == fail_step), "step {}: failure injected by "
             "DELTASTACK_TEST_FAIL_RANK={}:{}", step, fail_rank, fail_step);
    // The step's micro-batches (StepBatches: this rank's share; targets and tokens counted over every rank).
    const StepBatches batches = run.read_data([&] { return StepBatches(sampler, *data.train, opt, step, comm); });
    const double per_target = batches.targets > 0 ? 1.0 / static_cast<double>(batches.targets) : 0.0;
    const double lr = lr_at(opt, step);
    double loss_sum = 0, sum_squares = 0;
    bool updated = false;  // the update ran inside the backward (--gradients in-backward)
    if (engine->gradients() == Gradients::InBackward) {
      // One micro-batch on one rank, the update in the backward (model/engine.h in_backward_step), after a
      // norm-only pass unless --clip 0 and --nan-policy stop.
      const InBackwardStep r = in_backward_step(*engine, run.read_data([&] { return batches.micro(0); }), per_target,
                                                opt.z_loss, adamw_params(opt, lr, progress.optimizer_steps + 1, 1.0),
                                                opt.clip, opt.nan_policy == "skip");
      loss_sum = r.result.loss_sum;
      sum_squares = r.grad_sum_squares;
      updated = r.updated;
      if (updated) ++progress.optimizer_steps;
    } else {
      // Forward and backward over each micro-batch, the gradients accumulating (the last backward also starts their
      // reduction over the ranks).
      engine->begin_step(step);  // keys --gradients bf16's stochastic rounding
      engine->zero_grads();
      // A signal between micro-batches stops the step unfinished (a long --grad-accum step is no wait for a signal):
      // its partial gradients are dropped, the weights stay those of the previous step, which is what is saved.
      bool unfinished = false;
      for (int64_t a = 0; a < opt.grad_accum; ++a) {
        if (a > 0 && run.signalled()) {
          unfinished = true;
          break;
        }
        if (a == opt.grad_accum - 1) engine->reduce_grads_during_next_backward();
        set_lora_dropout(*engine, opt.seed, ((step - 1) * comm.world() + comm.rank()) * opt.grad_accum + a);
        loss_sum += engine->forward_backward(run.read_data([&] { return batches.micro(a); }), per_target, opt.z_loss).loss_sum;
      }
      if (unfinished) break;
      // The loss and the gradients, summed over the ranks.
      comm.all_reduce_sum(&loss_sum, 1);
      engine->reduce_grads();
      sum_squares = engine->grad_sum_squares();
    }
    const double loss = batches.targets > 0 ? loss_sum / static_cast<double>(batches.targets) : 0.0;
    const double gnorm = std::sqrt(sum_squares);
    progress.step = step;
    progress.tokens_seen += batches.tokens;
    // The NaN/Inf guard, else the clipped AdamW update; the step's metrics. (In-backward: the norm pass found it
    // non-finite and nothing was updated, or with --clip 0 the update already ran and --nan-policy stop ends the
    // run with the last checkpoint intact.)
    if (!std::isfinite(loss) || !std::isfinite(gnorm) || (engine->gradients() == Gradients::InBackward && !updated)) {
      run.skip_update(step, loss, gnorm, lr, batches.tokens);
    } else {
      if (!updated) {
        engine->optimizer_step(adamw_params(opt, lr, ++progress.optimizer_steps, clip_factor(gnorm, opt.clip)));
      }
      run.log_step(step, loss, gnorm, lr, batches.tokens, t0);
    }
    // The evaluation (interrupted: straight to the save), the checkpoint.
    if (eval_due(opt, data, step) && !run.signalled()) run.evaluate_after(step, data.eval_batches);
    if (checkpoints.due(step)) {
      run.save();
      if (root) checkpoints.check_room_for_next_save(engine->config(), step, run.saved_dir);
    }
  }
  if (run.signalled()) return run.stop_by_signal();
  if (opt.steps == 0 && start_step == 0) run.save();  // --steps 0: the initial weights as checkpoint-0
  // --nan-policy skip that skipped every step of this session: the weights never changed, which is no success.
  const int64_t updates = progress.optimizer_steps - (resumed ? resumed->state.optimizer_steps : 0);
  DS_CHECK(opt.steps == start_step || updates > 0, "every step ({} to {}) had a non-finite loss or grad norm and was "
           "skipped (--nan-policy skip): the weights are unchanged{}; try a lower --lr", start_step + 1, opt.steps,
           run.saved_step < 0 ? std::string() : fmt::format(" in {}", run.saved_dir));
  log_info("done: {} steps, {} tokens, {:.1f} s; metrics in {}", opt.steps, progress.tokens_seen, run.elapsed(),
           root ? metrics->path() : std::string());
  return 0;
}

}  // namespace ds
