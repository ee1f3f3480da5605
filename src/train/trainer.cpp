#include "train/trainer.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>  // AT_FDCWD

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>  // renameat2, RENAME_EXCHANGE (glibc >= 2.28)
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "core/cuda/device.h"
#include "model/engine.h"
#include "model/model.h"
#include "ops/adamw/adamw.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace ds {

std::string bundled_data_path() { return std::string(DELTASTACK_SOURCE_DIR) + "/data/tiny_shakespeare.txt"; }
std::string bundled_tokenizer_path() { return std::string(DELTASTACK_SOURCE_DIR) + "/data/qwen3_tokenizer/tokenizer.json"; }

namespace {

// The step of a checkpoint directory name as this trainer writes it ("checkpoint-N", N in canonical decimal);
// -1 for any other name.
int64_t checkpoint_step(const std::string& name) {
  if (name.rfind("checkpoint-", 0) != 0) return -1;
  const std::string digits = name.substr(11);
  if (digits.empty() || digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos ||
      (digits.size() > 1 && digits[0] == '0'))
    return -1;
  return std::stoll(digits);
}

// Who wrote a checkpoint (trainer_state.json): the run, kept across resumes, and the process. Empty strings when
// absent (checkpoints of earlier versions) or unreadable.
struct CheckpointOwner {
  std::string run_id, session_id;
};
CheckpointOwner checkpoint_owner(const std::filesystem::path& dir) {
  CheckpointOwner o;
  try {
    const json st = json::parse(read_file((dir / "trainer_state.json").string()));
    if (st.contains("run_id") && st["run_id"].is_string()) o.run_id = st["run_id"].get<std::string>();
    if (st.contains("session_id") && st["session_id"].is_string()) o.session_id = st["session_id"].get<std::string>();
  } catch (const std::exception&) {
  }
  return o;
}

// A fresh run's id: 64 random bits in hex (kept across resumes; only used to tell runs apart in one --out).
std::string new_run_id() {
  std::random_device rd;
  const uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                     static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return fmt::format("{:016x}", x);
}

json options_to_json(const TrainOptions& o) {
  return json{{"model", o.model},           {"data", o.data},
              {"tokenizer", o.tokenizer},   {"txt_split", o.txt_split},
              {"seq_len", o.seq_len},       {"micro_batch", o.micro_batch},
              {"grad_accum", o.grad_accum}, {"steps", o.steps},
              {"warmup", o.warmup},         {"schedule", o.schedule},
              {"lr", o.lr},                 {"min_lr_ratio", o.min_lr_ratio},
              {"weight_decay", o.weight_decay}, {"beta1", o.beta1},
              {"beta2", o.beta2},           {"adam_eps", o.adam_eps},
              {"clip", o.clip},             {"z_loss", o.z_loss},
              {"val_fraction", o.val_fraction}, {"val_data", o.val_data},
              {"eval_interval", o.eval_interval},
              {"eval_batches", o.eval_batches}, {"save_interval", o.save_interval},
              {"keep_last", o.keep_last},   {"max_shard_mb", o.max_shard_mb},
              {"seed", o.seed},             {"nan_policy", o.nan_policy},
              {"device", o.device}};
}

void options_from_json(const json& j, TrainOptions& o, const std::string& src) {
  try {
    o.model = j.at("model");
    o.data = j.at("data").get<std::vector<std::string>>();
    o.tokenizer = j.at("tokenizer");
    o.txt_split = j.at("txt_split");
    o.seq_len = j.at("seq_len");
    o.micro_batch = j.at("micro_batch");
    o.grad_accum = j.at("grad_accum");
    o.steps = j.at("steps");
    o.warmup = j.at("warmup");
    o.schedule = j.at("schedule");
    o.lr = j.at("lr");
    o.min_lr_ratio = j.at("min_lr_ratio");
    o.weight_decay = j.at("weight_decay");
    o.beta1 = j.at("beta1");
    o.beta2 = j.at("beta2");
    o.adam_eps = j.at("adam_eps");
    o.clip = j.at("clip");
    o.z_loss = j.at("z_loss");
    o.val_fraction = j.at("val_fraction");
    o.val_data = j.value("val_data", std::vector<std::string>{});
    o.eval_interval = j.at("eval_interval");
    o.eval_batches = j.at("eval_batches");
    o.save_interval = j.at("save_interval");
    o.keep_last = j.value("keep_last", int64_t{0});  // absent in checkpoints of earlier versions
    o.max_shard_mb = j.value("max_shard_mb", int64_t{5000});
    o.seed = j.at("seed");
    o.nan_policy = j.at("nan_policy");
    o.device = j.value("device", std::string("auto"));
  } catch (const json::exception& e) {
    fail("{}: bad or missing training option ({})", src, e.what());
  }
}

void validate(const TrainOptions& o) {
  DS_CHECK(o.seq_len >= 2, "--seq-len must be >= 2, got {}", o.seq_len);
  DS_CHECK(o.micro_batch >= 1, "--micro-batch must be >= 1, got {}", o.micro_batch);
  DS_CHECK(o.grad_accum >= 1, "--grad-accum must be >= 1, got {}", o.grad_accum);
  DS_CHECK(o.steps >= 0, "--steps must be >= 0, got {}", o.steps);
  DS_CHECK(o.warmup >= 0, "--warmup must be >= 0, got {}", o.warmup);
  DS_CHECK(o.lr > 0 && std::isfinite(o.lr), "--lr must be positive, got {}", o.lr);
  DS_CHECK(o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1], got {}", o.min_lr_ratio);
  DS_CHECK(o.schedule == "cosine" || o.schedule == "linear" || o.schedule == "constant",
           "--schedule must be cosine, linear or constant, got \"{}\"", o.schedule);
  DS_CHECK(o.weight_decay >= 0, "--weight-decay must be >= 0");
  DS_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, "--beta1/--beta2 must be in [0, 1)");
  DS_CHECK(o.clip >= 0, "--clip must be >= 0");
  DS_CHECK(o.adam_eps > 0 && std::isfinite(o.adam_eps), "--adam-eps must be positive, got {}", o.adam_eps);
  DS_CHECK(o.threads >= 0 && o.threads <= 1024, "--threads must be in [0, 1024] (0 = all cores), got {}", o.threads);
  DS_CHECK(o.z_loss >= 0, "--z-loss must be >= 0");
  DS_CHECK(o.val_fraction >= 0 && o.val_fraction < 1, "--val-fraction must be in [0, 1), got {}", o.val_fraction);
  DS_CHECK(o.val_data.empty() || o.val_fraction == 0 ||
               std::find(o.given.begin(), o.given.end(), "val-fraction") == o.given.end(),
           "--val-data and --val-fraction contradict each other: with a separate evaluation set nothing is held out "
           "of --data");
  DS_CHECK(o.eval_interval >= 0 && o.eval_batches >= 0 && o.save_interval >= 0 && o.keep_last >= 0,
           "--eval-interval, --eval-batches, --save-interval and --keep-last must be >= 0");
  DS_CHECK(o.max_shard_mb >= 1 && o.max_shard_mb <= 1000000, "--max-shard-mb must be in [1, 1000000], got {}",
           o.max_shard_mb);
  DS_CHECK(o.nan_policy == "stop" || o.nan_policy == "skip", "--nan-policy must be stop or skip, got \"{}\"",
           o.nan_policy);
  DS_CHECK(o.device == "cpu" || o.device == "auto" || o.device == "cuda", "--device must be auto, cpu or cuda, got \"{}\"",
           o.device);
  DS_CHECK(!o.out.empty(), "--out must not be empty");
}

double lr_at(const TrainOptions& o, int64_t step) {  // step is 1-based
  if (o.warmup > 0 && step <= o.warmup) return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup);
  if (o.schedule == "constant") return o.lr;
  double span = static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup));
  double p = std::min(1.0, static_cast<double>(step - o.warmup) / span);
  double min_lr = o.lr * o.min_lr_ratio;
  if (o.schedule == "linear") return o.lr + (min_lr - o.lr) * p;
  return min_lr + 0.5 * (o.lr - min_lr) * (1.0 + std::cos(M_PI * p));
}

// Window order: a fresh seeded permutation per epoch, so micro-batch k is a pure function of (seed, k).
class WindowSampler {
 public:
  WindowSampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {}
  int64_t at(int64_t global_index) {
    int64_t epoch = global_index / n_;
    if (epoch != epoch_) {
      perm_.resize(static_cast<size_t>(n_));
      std::iota(perm_.begin(), perm_.end(), 0);
      Rng rng(seed_, 0x5eed0000ull + static_cast<uint64_t>(epoch));
      for (int64_t i = n_ - 1; i > 0; --i) std::swap(perm_[static_cast<size_t>(i)], perm_[rng.below(i + 1)]);
      epoch_ = epoch;
    }
    return perm_[static_cast<size_t>(global_index % n_)];
  }

 private:
  int64_t n_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> perm_;
};


}  // namespace

int train(TrainOptions opt) {
  auto t_start = std::chrono::steady_clock::now();
  // ---- resume: the checkpoint's options define the run; --steps, --out and --threads may change.
  json resume_state;
  if (!opt.resume.empty()) {
    std::string sp = (fs::path(opt.resume) / "trainer_state.json").string();
    DS_CHECK(file_exists(sp), "--resume {}: not a deltastack checkpoint (no trainer_state.json)", opt.resume);
    try {
      resume_state = json::parse(read_file(sp));
    } catch (const json::exception& e) {
      fail("{}: invalid JSON ({})", sp, e.what());
    }
    TrainOptions saved = opt;
    DS_CHECK(resume_state.is_object() && resume_state.contains("options") && resume_state.contains("step"),
             "{}: missing \"options\" or \"step\"", sp);
    DS_CHECK(resume_state["step"].is_number_integer() && resume_state["step"].get<int64_t>() >= 0,
             "{}: \"step\" must be a non-negative integer", sp);
    options_from_json(resume_state["options"], saved, sp);
    // The checkpoint's options define the run. Only these may change on --resume; the others are an error, so
    // a flag is never silently ignored.
    const std::set<std::string> may_change = {"steps", "out", "resume", "threads", "device", "eval-interval",
                                              "save-interval", "keep-last", "max-shard-mb", "nan-policy"};
    for (const std::string& g : opt.given)
      DS_CHECK(may_change.count(g), "--{} cannot change on --resume: the checkpoint's options define the run "
               "(only --steps, --out, --threads, --device, --eval-interval, --save-interval, --keep-last, --max-shard-mb, "
               "--nan-policy may)", g);
    auto given = [&](const char* n) { return std::find(opt.given.begin(), opt.given.end(), n) != opt.given.end(); };
    saved.resume = opt.resume;
    saved.threads = opt.threads;
    if (given("steps")) saved.steps = opt.steps;
    if (given("out")) saved.out = opt.out;
    else {  // continue in the run's own directory ("run/checkpoint-3/" too)
      // The real directory (symlinks resolved; also "--resume ." inside it, or a trailing slash).
      const fs::path ck = fs::canonical(fs::path(opt.resume));
      saved.out = ck.parent_path().string();
    }
    if (given("device")) saved.device = opt.device;  // else the device the run used (bitwise resume)
    if (given("eval-interval")) saved.eval_interval = opt.eval_interval;
    if (given("save-interval")) saved.save_interval = opt.save_interval;
    if (given("keep-last")) saved.keep_last = opt.keep_last;
    if (given("max-shard-mb")) saved.max_shard_mb = opt.max_shard_mb;
    if (given("nan-policy")) saved.nan_policy = opt.nan_policy;
    saved.given = opt.given;
    opt = saved;
  }
  if (opt.data.empty()) opt.data = {bundled_data_path()};
  if (opt.tokenizer.empty()) opt.tokenizer = bundled_tokenizer_path();
  if (opt.resume.empty()) {  // saved in checkpoints: absolute, so a resume works from any directory
    auto absolute_if_exists = [](std::string& p) {
      std::error_code ec;
      if (!p.empty() && fs::exists(p, ec)) p = fs::absolute(p).lexically_normal().string();
    };
    for (std::string& p : opt.data) absolute_if_exists(p);
    for (std::string& p : opt.val_data) absolute_if_exists(p);
    absolute_if_exists(opt.tokenizer);
    absolute_if_exists(opt.model);  // a path; preset names ("tiny", "2b") stay as they are
  }
  validate(opt);
  set_num_threads(opt.threads);

  // ---- model
  ModelConfig cfg = ModelConfig::resolve(opt.model);
  bool model_is_checkpoint = fs::is_directory(opt.model);
  DS_CHECK(opt.seq_len <= cfg.max_position_embeddings, "--seq-len {} is above the model's max_position_embeddings {}",
           opt.seq_len, cfg.max_position_embeddings);
  Qwen35Model model(cfg);
  const int64_t num_params = model.num_parameters();
  if (!opt.resume.empty()) model.load(opt.resume);
  else if (model_is_checkpoint && (file_exists(opt.model + "/model.safetensors") ||
                                   file_exists(opt.model + "/model.safetensors.index.json")))
    model.load(opt.model);
  else model.init_weights(opt.seed);
  log_info("model: {} layers ({} full attention), hidden {}, vocab {}, {:.2f}M parameters", cfg.num_hidden_layers,
           std::count(cfg.layer_types.begin(), cfg.layer_types.end(), "full_attention"), cfg.hidden_size,
           cfg.vocab_size, num_params / 1e6);

  // ---- data
  Tokenizer tok = Tokenizer::from_file(opt.tokenizer);
  DS_CHECK(tok.vocab_size() <= cfg.vocab_size, "{}: tokenizer has {} ids but the model's vocab_size is {}",
           opt.tokenizer, tok.vocab_size(), cfg.vocab_size);
  int32_t eos = tok.token_to_id("<|endoftext|>");
  std::vector<std::string> texts = read_documents(opt.data, parse_txt_split(opt.txt_split));
  std::vector<std::vector<int32_t>> docs = tokenize_documents(tok, texts, eos);
  int64_t n_val = 0;
  std::vector<std::vector<int32_t>> train_docs, val_docs;
  if (!opt.val_data.empty()) {  // a separate evaluation set: all of --data trains
    val_docs = tokenize_documents(tok, read_documents(opt.val_data, parse_txt_split(opt.txt_split)), eos);
    n_val = static_cast<int64_t>(val_docs.size());
    train_docs = std::move(docs);
    docs = {};
  } else {
    n_val = static_cast<int64_t>(std::floor(opt.val_fraction * static_cast<double>(docs.size())));
    if (opt.val_fraction > 0 && n_val == 0 && docs.size() >= 2) n_val = 1;
    train_docs.assign(docs.begin(), docs.end() - n_val);
    val_docs.assign(docs.end() - n_val, docs.end());
  }
  DS_CHECK(!train_docs.empty(), "data: no training documents left after holding out {} for validation", n_val);
  PackedDataset train_set(train_docs, opt.seq_len);
  std::unique_ptr<PackedDataset> val_set;
  if (!val_docs.empty()) val_set = std::make_unique<PackedDataset>(val_docs, opt.seq_len);
  log_info("data: {} training documents, {} validation documents{}, {} training tokens in {} windows of {}; "
           "validation {} tokens", train_docs.size(), n_val, opt.val_data.empty() ? " (held out)" : " (--val-data)",
           train_set.num_tokens(), train_set.num_windows(), opt.seq_len, val_set ? val_set->num_tokens() : 0);

  // Fixed evaluation windows, evenly spread over the validation set.
  std::vector<PackedBatch> eval_batches;
  if (val_set && opt.eval_batches > 0) {
    int64_t want = std::min(val_set->num_windows(), opt.eval_batches * opt.micro_batch);
    std::vector<int64_t> ws;
    for (int64_t i = 0; i < want; ++i) ws.push_back(i * val_set->num_windows() / want);
    for (size_t i = 0; i < ws.size(); i += static_cast<size_t>(opt.micro_batch)) {
      std::vector<int64_t> part(ws.begin() + static_cast<long>(i),
                                ws.begin() + static_cast<long>(std::min(ws.size(), i + static_cast<size_t>(opt.micro_batch))));
      eval_batches.push_back(val_set->batch(part));
    }
  }
  // ---- device: the GPU when there is one (auto), else the CPU reference engine.
  const int64_t docs_per_window =
      std::max(train_set.max_docs_per_window(), val_set ? val_set->max_docs_per_window() : 1);
  std::unique_ptr<Engine> engine =
      make_engine(opt.device, std::move(model), GpuPlan::windows(opt.micro_batch, opt.seq_len, docs_per_window));
  opt.device = engine->device();  // saved in checkpoints: a resume continues on the same engine
  log_info("device: {}", opt.device);
  auto fb = [&](const PackedBatch& b, double scale, double z) { return engine->forward_backward(b, scale, z); };
  auto evaluate = [&]() {
    double sum = 0;
    int64_t n = 0;
    for (const PackedBatch& b : eval_batches) {
      LossResult r = fb(b, 0.0, 0.0);
      sum += r.loss_sum;
      n += r.num_valid;
    }
    return n > 0 ? sum / static_cast<double>(n) : NAN;
  };

  // ---- optimizer state
  int64_t start_step = 0, opt_steps = 0, tokens_seen = 0;
  std::string run_id = new_run_id();
  // This process's saves. --keep-last prunes this run's checkpoints up to the resumed step (the history this
  // process continues) and this session's own; later steps of an abandoned history are left alone.
  const std::string session_id = new_run_id();
  double elapsed_before = 0;
  if (!opt.resume.empty()) {
    // optimizer.safetensors, or optimizer.safetensors.index.json with its shards.
    const fs::path oidx = fs::path(opt.resume) / "optimizer.safetensors.index.json";
    CheckpointReader os(fs::exists(oidx) ? oidx.string() : (fs::path(opt.resume) / "optimizer.safetensors").string());
    engine->load_optimizer([&](const std::string& name, int64_t numel) {
      std::vector<float> x = os.read_f32(name);
      DS_CHECK(static_cast<int64_t>(x.size()) == numel, "{}: optimizer state {} has {} values, expected {}",
               os.path(), name, x.size(), numel);
      return x;
    });
    start_step = resume_state["step"].get<int64_t>();
    // The run's id, kept across resumes (empty for checkpoints written before run ids existed: those count as
    // this run's too).
    run_id = resume_state.contains("run_id") && resume_state["run_id"].is_string()
                 ? resume_state["run_id"].get<std::string>()
                 : std::string();
    opt_steps = resume_state.value("optimizer_steps", start_step);
    tokens_seen = resume_state.value("tokens_seen", int64_t{0});
    elapsed_before = resume_state.value("elapsed_s", 0.0);
    log_info("resuming from {} at step {}", opt.resume, start_step);
  }
  DS_CHECK(opt.steps >= start_step, "--steps {} is below the checkpoint's step {}", opt.steps, start_step);

  // ---- output dir and metrics (on resume, later lines of an earlier attempt are dropped)
  fs::create_directories(opt.out);
  {  // Temp dirs of checkpoint saves that a killed run left behind (never valid checkpoints): remove them.
    std::vector<fs::path> stale;
    for (const auto& e : fs::directory_iterator(opt.out)) {
      const std::string n = e.path().filename().string();
      if (n.rfind(".checkpoint-", 0) == 0 && n.size() > 16 && n.compare(n.size() - 4, 4, ".tmp") == 0)
        stale.push_back(e.path());
    }
    std::error_code ec;
    if (!opt.resume.empty()) {  // never the directory this run was just loaded from
      const fs::path src = fs::canonical(opt.resume, ec);
      std::erase_if(stale, [&](const fs::path& p) { return fs::canonical(p, ec) == src; });
    }
    for (const fs::path& p : stale) {
      log_info("removing {} (left by an interrupted checkpoint save)", p.string());
      fs::remove_all(p);
    }
  }
  {  // One look at the checkpoints already in --out: a file (not a directory) named like a checkpoint this run will
     // write stops the run now, not after the training; another run's checkpoints get a warning.
    std::vector<std::string> foreign;
    for (const auto& e : fs::directory_iterator(opt.out)) {
      const std::string n = e.path().filename().string();
      const int64_t s = checkpoint_step(n);
      if (s < 0) continue;
      if (!e.is_directory()) {
        const bool planned = s > start_step && s <= opt.steps &&
                             (s == opt.steps || (opt.save_interval > 0 && s % opt.save_interval == 0));
        DS_CHECK(!planned, "{} exists and is not a directory, but this run saves checkpoint-{} there; move it away",
                 e.path().string(), s);
      } else if (checkpoint_owner(e.path()).run_id != run_id) {
        foreign.push_back(n);
      }
    }
    if (!foreign.empty())
      log_warn("{} holds {} checkpoint(s) of another run ({}{}): a save of the same step replaces one, --keep-last "
               "leaves them alone; use another --out to keep them apart", opt.out, foreign.size(), foreign.front(),
               foreign.size() > 1 ? ", ..." : "");
  }
  std::string metrics_path = (fs::path(opt.out) / "metrics.jsonl").string();
  {
    std::string kept;
    if (file_exists(metrics_path) && start_step > 0) {
      std::istringstream in(read_file(metrics_path));
      std::string line;
      while (std::getline(in, line)) {
        try {
          json j = json::parse(line);
          if (j.value("step", int64_t{0}) <= start_step) kept += line + "\n";
        } catch (...) {
        }
      }
    }
    write_file_atomic(metrics_path, kept);
  }
  std::ofstream metrics(metrics_path, std::ios::app);
  DS_CHECK(metrics.good(), "{}: cannot open for appending", metrics_path);

  // --keep-last: after checkpoint-`step` is durable, the older checkpoints of this run's current history (N < step,
  // canonical decimal names, the same run_id in trainer_state.json, and N <= the resumed step or written by this
  // process) beyond the newest keep_last - 1 are removed: each is first renamed to .checkpoint-N.old.tmp (which a
  // later start removes, so a kill mid-delete never leaves a partial checkpoint-N), then deleted. Another run's
  // checkpoints and the later steps of an abandoned history (a resume from an earlier checkpoint) are never counted
  // or removed. Failures only warn, one checkpoint at a time.
  auto prune_checkpoints = [&](int64_t step) {
    std::vector<std::pair<int64_t, fs::path>> older;
    try {
      for (const auto& e : fs::directory_iterator(opt.out)) {
        const int64_t s = checkpoint_step(e.path().filename().string());
        if (s < 0 || s >= step || !e.is_directory()) continue;
        const CheckpointOwner owner = checkpoint_owner(e.path());
        if (owner.run_id == run_id && (s <= start_step || owner.session_id == session_id))
          older.emplace_back(s, e.path());
      }
    } catch (const std::exception& e) {
      log_warn("--keep-last: cannot list {}: {}", opt.out, e.what());
      return;
    }
    std::sort(older.begin(), older.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (size_t i = static_cast<size_t>(opt.keep_last - 1); i < older.size(); ++i) {
      try {
        const fs::path doomed = fs::path(opt.out) / fmt::format(".checkpoint-{}.old.tmp", older[i].first);
        fs::remove_all(doomed);
        fs::rename(older[i].second, doomed);
        fsync_dir(opt.out);
        fs::remove_all(doomed);
        log_info("removed {} (--keep-last {})", older[i].second.string(), opt.keep_last);
      } catch (const std::exception& e) {
        log_warn("--keep-last: could not remove {}: {}", older[i].second.string(), e.what());
      }
    }
  };
  const std::string tokenizer_json = read_file(opt.tokenizer);  // copied into every checkpoint

  auto save_checkpoint = [&](int64_t step, double elapsed) {
    std::string final_dir = (fs::path(opt.out) / fmt::format("checkpoint-{}", step)).string();
    std::string tmp_dir = (fs::path(opt.out) / fmt::format(".checkpoint-{}.tmp", step)).string();
    fs::remove_all(tmp_dir);
    const int64_t shard_bytes = opt.max_shard_mb * 1000000;
    save_model_dir(tmp_dir, engine->config(), engine->weight_tensors(DType::F32), DType::F32, shard_bytes);
    // Fault-injection hook for the crash-safety tests: a pause inside every save, so that a kill aimed at "a save
    // in progress" lands there however fast the disk is. Unset in normal use.
    if (const char* pause = std::getenv("DELTASTACK_TEST_SAVE_PAUSE_MS"))
      std::this_thread::sleep_for(std::chrono::milliseconds(std::strtol(pause, nullptr, 10)));
    // The optimizer's state (AdamW moments, fp32, HF-style names), streamed from the engine, sharded like the weights.
    write_safetensors_sharded(tmp_dir, "optimizer", engine->optimizer_tensors(), shard_bytes);
    write_file_atomic((fs::path(tmp_dir) / "tokenizer.json").string(), tokenizer_json);
    json st{{"step", step},         {"optimizer_steps", opt_steps}, {"tokens_seen", tokens_seen},
            {"elapsed_s", elapsed}, {"options", options_to_json(opt)}, {"deltastack_version", DELTASTACK_VERSION},
            {"run_id", run_id},     {"session_id", session_id}};
    write_file_atomic((fs::path(tmp_dir) / "trainer_state.json").string(), st.dump(2) + "\n");
    fsync_dir(tmp_dir);
    DS_CHECK(!fs::exists(final_dir) || fs::is_directory(final_dir),
             "{} exists and is not a directory: not replacing it (the new checkpoint is in {})", final_dir, tmp_dir);
    if (fs::exists(final_dir)) {
      // Replacing a checkpoint of the same step (a resume from an earlier one into the same --out): swap the two
      // directories in one atomic rename so checkpoint-N never goes missing; the old one ends up in tmp_dir.
      if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
        fs::remove_all(tmp_dir);
      } else {  // filesystem without RENAME_EXCHANGE: a short window where only checkpoint-N.old exists
        std::string old = final_dir + ".old";
        fs::remove_all(old);
        fs::rename(final_dir, old);
        fs::rename(tmp_dir, final_dir);
        fs::remove_all(old);
      }
    } else {
      fs::rename(tmp_dir, final_dir);
    }
    fsync_dir(opt.out);
    log_info("saved {}", final_dir);
    if (opt.keep_last > 0) prune_checkpoints(step);
  };

  auto elapsed_now = [&]() {
    return elapsed_before + std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  };
  auto write_metrics = [&](const json& j) {
    metrics << j.dump() << "\n";
    metrics.flush();
  };

  if (start_step == 0 && !eval_batches.empty()) {
    double el = evaluate();
    log_info("step 0 | eval_loss {:.4f}", el);
    write_metrics({{"step", 0}, {"eval_loss", el}, {"elapsed_s", elapsed_now()}});
  }

  WindowSampler sampler(train_set.num_windows(), opt.seed);
  for (int64_t step = start_step + 1; step <= opt.steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<PackedBatch> micro;
    int64_t valid = 0, ntok = 0;
    for (int64_t a = 0; a < opt.grad_accum; ++a) {
      std::vector<int64_t> ws;
      for (int64_t b = 0; b < opt.micro_batch; ++b)
        ws.push_back(sampler.at(((step - 1) * opt.grad_accum + a) * opt.micro_batch + b));
      micro.push_back(train_set.batch(ws));
      valid += micro.back().num_targets();
      ntok += micro.back().size();
    }
    engine->zero_grads();
    double loss_sum = 0;
    for (const PackedBatch& b : micro)
      loss_sum += fb(b, valid > 0 ? 1.0 / static_cast<double>(valid) : 0.0, opt.z_loss).loss_sum;
    double loss = valid > 0 ? loss_sum / static_cast<double>(valid) : 0.0;
    double gnorm = std::sqrt(engine->grad_sum_squares());
    double lr = lr_at(opt, step);
    bool bad = !std::isfinite(loss) || !std::isfinite(gnorm);
    tokens_seen += ntok;
    if (bad) {
      std::string reason = !std::isfinite(loss) ? fmt::format("loss is {}", loss) : fmt::format("grad norm is {}", gnorm);
      if (opt.nan_policy == "stop")
        fail("step {}: {}; stopping (--nan-policy stop). The last checkpoint is intact; try a lower --lr or "
             "--nan-policy skip", step, reason);
      log_warn("step {}: {}; skipping the update (--nan-policy skip)", step, reason);
      write_metrics({{"step", step}, {"skipped", true}, {"reason", reason}, {"lr", lr}, {"tokens", ntok},
                     {"elapsed_s", elapsed_now()}});
    } else {
      ++opt_steps;
      double scale = (opt.clip > 0 && gnorm > opt.clip) ? opt.clip / (gnorm + 1e-6) : 1.0;
      ops::AdamWParams ap;
      ap.lr = lr;
      ap.beta1 = opt.beta1;
      ap.beta2 = opt.beta2;
      ap.eps = opt.adam_eps;
      ap.weight_decay = opt.weight_decay;
      ap.step = opt_steps;
      ap.grad_scale = scale;
      engine->optimizer_step(ap);
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double el = elapsed_now();
      json line{{"step", step}, {"loss", loss}, {"grad_norm", gnorm}, {"lr", lr}, {"tokens", ntok},
                {"tokens_per_s", ntok / dt}, {"elapsed_s", el}};
      if (engine->device() == "cuda") line["peak_gib"] = engine->peak_bytes() / 1073741824.0;
      write_metrics(line);
      fmt::print("step {:>5}/{} | loss {:.4f} | grad_norm {:.3f} | lr {:.2e} | {} tok | {:.0f} tok/s | {:.1f} s\n",
                 step, opt.steps, loss, gnorm, lr, ntok, ntok / dt, el);
      std::fflush(stdout);
    }
    bool last = step == opt.steps;
    if (!eval_batches.empty() && (last || (opt.eval_interval > 0 && step % opt.eval_interval == 0))) {
      double el = evaluate();
      fmt::print("step {:>5}/{} | eval_loss {:.4f}\n", step, opt.steps, el);
      std::fflush(stdout);
      write_metrics({{"step", step}, {"eval_loss", el}, {"elapsed_s", elapsed_now()}});
    }
    if (last || (opt.save_interval > 0 && step % opt.save_interval == 0)) save_checkpoint(step, elapsed_now());
  }
  if (opt.steps == start_step && start_step == 0) save_checkpoint(0, elapsed_now());
  log_info("done: {} steps, {} tokens, {:.1f} s; metrics in {}", opt.steps, tokens_seen, elapsed_now(), metrics_path);
  return 0;
}

}  // namespace ds
