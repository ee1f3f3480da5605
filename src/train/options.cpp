#include "train/options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <type_traits>

#include "core/error.h"
#include "core/log.h"
#include "model/engine.h"
#include "model/lora.h"

namespace ds {

namespace {

using O = TrainOptions;

// Range checks: each takes the flag and the value, and throws ds::Error saying what the flag must be.
template <class B>
auto at_least(B lo) {
  return [lo](const std::string& f, auto v) { DS_CHECK(v >= lo, "--{} must be >= {}, got {}", f, lo, v); };
}
auto positive() {
  return [](const std::string& f, double v) { DS_CHECK(v > 0 && std::isfinite(v), "--{} must be positive, got {}", f, v); };
}
// [lo, hi] or, with open_hi, [lo, hi).
template <class B>
auto in_range(B lo, B hi, bool open_hi = false) {
  return [=](const std::string& f, auto v) {
    DS_CHECK(v >= lo && (open_hi ? v < hi : v <= hi), "--{} must be in [{}, {}{}, got {}", f, lo, hi,
             open_hi ? ")" : "]", v);
  };
}
auto one_of(std::vector<std::string> names) {
  return [names](const std::string& f, const std::string& v) {
    DS_CHECK(std::find(names.begin(), names.end(), v) != names.end(), "--{} must be {} or {}, got \"{}\"", f,
             fmt::join(names.begin(), names.end() - 1, ", "), names.back(), v);
  };
}
// File names: not empty, and not a flag (`--data --steps 1` would read "--steps" as a file).
auto file_names() {
  return [](const std::string& f, const std::vector<std::string>& v) {
    for (const std::string& p : v) {
      DS_CHECK(!p.empty(), "--{}: an empty file name", f);
      DS_CHECK(p.rfind("--", 0) != 0, "--{} got the flag \"{}\" as a file name: give --{} its files first", f, p, f);
    }
  };
}
auto not_empty() {
  return [](const std::string& f, const std::string& v) { DS_CHECK(!v.empty(), "--{} must not be empty", f); };
}

template <class T>
using Check = std::function<void(const std::string& flag, const T& value)>;

template <class T>
TrainOption opt(const char* flag, TrainMember<T> m, std::type_identity_t<T> def, const char* help,
                Check<std::type_identity_t<T>> check = {}, unsigned traits = 0) {
  TrainOption o;
  o.flag = flag;
  o.member = m;
  o.help = help;
  if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::vector<std::string>>)
    o.shows_default = !def.empty();
  else if constexpr (std::is_same_v<T, bool>)
    o.shows_default = false;
  else
    o.shows_default = (traits & kGlobal) == 0;  // --threads' help says what 0 means
  o.traits = traits;
  o.set_default = [m, def](TrainOptions& x) { x.*m = def; };
  if (check) o.check = [m, check, f = o.flag](const TrainOptions& x) { check(f, x.*m); };
  return o;
}

// o, read as `value` from a checkpoint of an earlier version (which lacks its key: kNewerKey).
template <class T>
TrainOption older_reads(TrainOption o, T value) {
  const TrainMember<T> m = std::get<TrainMember<T>>(o.member);
  o.set_older = [m, value](TrainOptions& x) { x.*m = value; };
  return o;
}

}  // namespace

const std::vector<TrainOption>& train_options() {
  static const std::vector<TrainOption> table = {
      opt("model", &O::model, "tiny", "Preset (tiny, 0.8b, 2b, 4b, 9b, 27b), config.json, or HF checkpoint dir"),
      opt("data", &O::data, {}, "Data files (.txt split into documents by --txt-split, .jsonl with a \"text\" field), "
          "or one dataset directory from `deltastack tokenize --format dataset` (memory-mapped); "
          "on --resume, the same data at another path", file_names(), kResumable),
      opt("tokenizer", &O::tokenizer, "", "HF tokenizer.json (default: the bundled Qwen3 tokenizer)"),
      opt("txt-split", &O::txt_split, "paragraph", "How .txt files become documents: paragraph, line, file"),
      opt("seq-len", &O::seq_len, 128, "Tokens per packed window", at_least(2)),
      opt("micro-batch", &O::micro_batch, 8, "Windows per micro-batch", at_least(1)),
      opt("grad-accum", &O::grad_accum, 1, "Micro-batches per optimizer step and rank (the step's batch: ranks x grad-accum x micro-batch; at most 1000000)", in_range(int64_t{1}, int64_t{1000000})),
      opt("steps", &O::steps, 200, "Optimizer steps (total, including resumed ones)", at_least(0), kResumable),
      opt("lr", &O::lr, 3e-3, "Peak learning rate", positive()),
      opt("warmup", &O::warmup, 20, "Linear warmup steps", at_least(0)),
      opt("schedule", &O::schedule, "cosine", "After warmup: cosine, linear or constant",
          one_of({"cosine", "linear", "constant"})),
      opt("min-lr-ratio", &O::min_lr_ratio, 0.1, "Final lr as a fraction of --lr", in_range(0, 1)),
      opt("weight-decay", &O::weight_decay, 0.1, "AdamW decoupled weight decay (matrices only)", at_least(0)),
      opt("beta1", &O::beta1, 0.9, "AdamW beta1", in_range(0, 1, true)),
      opt("beta2", &O::beta2, 0.95, "AdamW beta2", in_range(0, 1, true)),
      opt("adam-eps", &O::adam_eps, 1e-8, "AdamW epsilon", positive()),
      opt("clip", &O::clip, 1.0, "Max global grad norm (0 = off)", at_least(0)),
      opt("z-loss", &O::z_loss, 0.0, "z-loss coefficient on lse^2 (0 = off)", at_least(0)),
      opt("val-fraction", &O::val_fraction, 0.05, "Fraction of documents held out for evaluation", in_range(0, 1, true)),
      opt("val-data", &O::val_data, {}, "Separate evaluation files (then nothing is held out of --data)", file_names(),
          kNewerKey | kResumable),
      opt("eval-interval", &O::eval_interval, 50, "Steps between evaluations (0 = start and end only)", at_least(0),
          kResumable),
      opt("eval-batches", &O::eval_batches, 4, "Micro-batches per evaluation", at_least(0)),
      opt("save-interval", &O::save_interval, 0, "Steps between checkpoints (0 = end only)", at_least(0), kResumable),
      opt("no-save", &O::no_save, false, "Write no checkpoint, not even at the last step or on a signal (benchmarks, "
          "throwaway runs; a run whose checkpoint would not fit in --out). Contradicts --save-interval and --keep-last",
          {}, kResumable | kNotSaved),
      opt("keep-last", &O::keep_last, 0, "Checkpoints kept in --out, newest first (0 = all)", at_least(0),
          kResumable | kNewerKey),
      opt("max-shard-mb", &O::max_shard_mb, 5000, "Checkpoint files split past this size (MB)", in_range(1, 1000000),
          kResumable | kNewerKey),
      opt("seed", &O::seed, 1234, "Seed for init and data order"),
      opt("out", &O::out, "runs/default", "Output dir (metrics.jsonl, checkpoint-STEP/)", not_empty(),
          kResumable | kNotSaved),
      opt("nan-policy", &O::nan_policy, "stop", "On a NaN/Inf loss or grad: stop or skip the step",
          one_of({"stop", "skip"}), kResumable),
      opt("resume", &O::resume, "", "Checkpoint dir to resume from (its options are reused)", {},
          kResumable | kNotSaved),
      opt("device", &O::device, "auto", "auto (a GPU when present), cpu or cuda", one_of({"auto", "cpu", "cuda"}),
          kResumable | kNewerKey),
      // A checkpoint of an earlier version ran with the fp32 state (the only one then): its resume keeps it, where
      // `auto` could pick bf16 and change the run's numerics.
      older_reads(opt("optimizer-state", &O::optimizer_state, "auto",
                      "GPU weights and AdamW state: fp32 (18 bytes per parameter), bf16 (stochastic rounding, 10 "
                      "bytes), 8bit (bf16 weights, 8-bit blockwise moments, 8 bytes) or auto",
                      one_of({"auto", "fp32", "bf16", "8bit"}), kResumable | kNewerKey),
                  std::string("fp32")),
      opt("recompute", &O::recompute, "auto",
          "Activations the GPU backward rebuilds: none, selective, mlp (selective + the gate|up output, its GEMM "
          "again), full (keeps only layer inputs) or auto",
          one_of({"auto", "none", "selective", "mlp", "full"}), kResumable | kNewerKey | kNotSaved),
      opt("precision", &O::precision, "bf16",
          "The decoder's matrix GEMMs: bf16 (exact) or fp8 (E4M3/E5M2 with per-tensor current scaling; the CPU "
          "engine emulates the casts; docs/fp8.md)",
          one_of({"bf16", "fp8"}), kResumable | kNewerKey),
      opt("fp8-lm-head", &O::fp8_lm_head, false, "With --precision fp8: the lm head's two gradient GEMMs (dh, dW) "
          "in FP8 too, the dlogits E5M2 (lossy, opt-in; the logits and the loss stay exact; needs --z-loss 0; "
          "docs/fp8.md)", {}, kResumable | kNewerKey),
      // Checkpoints of earlier versions kept the gradient buffer: their resume keeps it.
      older_reads(opt("gradients", &O::gradients, "auto",
                      "fp32 (one gradient buffer, 4 bytes per parameter), in-backward (each layer's AdamW update "
                      "runs in the backward as soon as its gradients are final: no gradient buffer; with --clip a "
                      "norm-only pass first; --grad-accum 1, one rank; docs/memory.md), bf16 (one bf16 buffer, 2 bytes "
                      "per parameter, each micro-batch added with stochastic rounding: lossy, any --grad-accum, one "
                      "rank) or auto (in-backward only where fp32 does not fit; never bf16)",
                      one_of({"auto", "fp32", "in-backward", "bf16"}), kResumable | kNewerKey),
                  std::string("fp32")),
      opt("offload-activations", &O::offload_activations, false, "GPU, with --recompute full (auto: then full): the "
          "layer inputs full recompute keeps go to pinned host memory during the forward and come back before each "
          "layer's backward, behind the compute (about N x hidden_size x 2 bytes per layer off the GPU; docs/memory.md)",
          {}, kResumable | kNewerKey | kNotSaved),
      opt("memory", &O::memory, "auto",
          "auto: the memory modes not given are chosen to fit the GPU (docs/memory.md); fixed: fp32 and selective",
          one_of({"auto", "fixed"}), kResumable | kNewerKey | kNotSaved),
      opt("max-memory", &O::max_memory, 0.0, "GiB of GPU memory the run may use, the CUDA context included, as "
          "`plan --device-memory` (0 = all that is free): the plan and --memory auto's choice fit into it (a GPU "
          "shared with another job; a run held to another stack's footprint)", in_range(0.0, 1e6),
          kResumable | kNewerKey | kNotSaved),
      opt("shard", &O::shard, "none",
          "With several ranks: none (every rank holds the AdamW state), optimizer (each rank holds and updates "
          "1/ranks of it; gradients reduce-scattered, weights all-gathered) or full (the weights and gradients too: "
          "each layer gathered before its forward and backward; CPU engine)",
          one_of({"none", "optimizer", "full"}), kResumable | kNewerKey | kNotSaved),
      opt("lora-rank", &O::lora_rank, 0, "LoRA: train a new adapter of this rank on the frozen base (--model), in "
          "PEFT's format (docs/lora.md; the CPU and GPU engines); 0 = train every parameter", in_range(int64_t{0}, int64_t{1} << 20),
          kNewerKey),
      opt("lora-alpha", &O::lora_alpha, 8.0, "LoRA: scaling alpha / rank (PEFT's lora_alpha)",
          [](const std::string& f, double v) { DS_CHECK(std::isfinite(v), "--{} must be a finite number, got {}", f, v); },
          kNewerKey),
      opt("lora-dropout", &O::lora_dropout, 0.0, "LoRA: dropout on the adapters' input in training",
          in_range(0.0, 1.0, true), kNewerKey),
      opt("lora-targets", &O::lora_targets, "all-linear", "LoRA: the adapted linear layers: all-linear, or a comma "
          "list of in_proj_qkv, in_proj_z, out_proj, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
          [](const std::string& f, const std::string& v) { parse_lora_targets(split_lora_targets(v), "--" + f); },
          kNewerKey),
      opt("use-rslora", &O::use_rslora, false, "LoRA: scaling alpha / sqrt(rank) (rsLoRA)", {}, kNewerKey),
      opt("adapter", &O::adapter, "", "LoRA: continue training this PEFT adapter directory (its rank, alpha, dropout "
          "and targets) on the frozen base (--model)", {}, kNewerKey),
      opt("move-aside", &O::move_aside, false, "When --out holds another run's files (metrics, checkpoints): move "
          "them into OUT/previous-N/ instead of refusing to start", {}, kResumable | kNotSaved),
      opt("data-changed", &O::data_changed, "warn", "On --resume, when the data's fingerprint differs from the "
          "checkpoint's: warn or error", one_of({"warn", "error"}), kResumable | kNotSaved),
      opt("threads", &O::threads, 0, "CPU threads for every subcommand (0 = all cores)", in_range(0, 1024),
          kResumable | kNotSaved | kGlobal),
  };
  return table;
}

TrainOptions::TrainOptions() {
  for (const TrainOption& e : train_options()) e.set_default(*this);
}

bool TrainOptions::was_given(std::string_view flag) const {
  return std::find(given.begin(), given.end(), flag) != given.end();
}

std::string TrainOption::key() const {
  std::string k = flag;
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

const TrainOption& train_option(std::string_view flag) {
  for (const TrainOption& e : train_options())
    if (e.flag == flag) return e;
  fail("no train option --{}", flag);
}

void validate(const TrainOptions& o) {
  for (const TrainOption& e : train_options())
    if (e.check) e.check(o);
  DS_CHECK(o.val_data.empty() || o.val_fraction == 0 || !o.was_given("val-fraction"),
           "--val-data and --val-fraction contradict each other: with a separate evaluation set nothing is held out "
           "of --data");
  for (const char* f : {"save-interval", "keep-last"})
    DS_CHECK(!o.no_save || !o.was_given(f), "--no-save and --{} contradict each other: --no-save writes no "
             "checkpoint", f);
  check_offload_recompute(o.offload_activations, o.recompute);
  check_fp8_lm_head(o.fp8_lm_head, parse_precision(o.precision), o.z_loss);
  // LoRA: --lora-rank starts an adapter, --adapter continues one (its adapter_config.json sets the rest).
  DS_CHECK(!o.was_given("lora-rank") || o.lora_rank > 0, "--lora-rank 0: a LoRA rank must be at least 1 (leave "
           "--lora-rank out to train every parameter)");
  DS_CHECK(o.lora_rank == 0 || o.adapter.empty(), "--lora-rank and --adapter contradict each other: --adapter {} "
           "continues that adapter with its own rank, alpha, dropout and targets (its adapter_config.json)",
           o.adapter);
  for (const char* f : {"lora-alpha", "lora-dropout", "lora-targets", "use-rslora"})
    DS_CHECK(!o.was_given(f) || o.lora_rank > 0, "--{} {}", f,
             o.adapter.empty() ? "needs --lora-rank (it configures a new LoRA adapter)"
                               : "contradicts --adapter: the adapter's adapter_config.json sets it");
  DS_CHECK(!o.was_given("adapter") || !o.adapter.empty(), "--adapter must not be empty");
  DS_CHECK((o.lora_rank == 0 && o.adapter.empty()) || o.shard == "none", "--shard {}: LoRA trains with --shard none "
           "(every rank holds the adapters and their small AdamW state; the frozen base has none)", o.shard);
}

std::vector<std::string> split_lora_targets(const std::string& list) {
  std::vector<std::string> names;
  size_t at = 0;
  for (size_t comma; (comma = list.find(',', at)) != std::string::npos; at = comma + 1)
    names.push_back(list.substr(at, comma - at));
  names.push_back(list.substr(at));
  for (const std::string& n : names)
    DS_CHECK(!n.empty(), "--lora-targets \"{}\": an empty module name (names are separated by single commas)", list);
  return names;
}

nlohmann::json options_to_json(const TrainOptions& o) {
  nlohmann::json j = nlohmann::json::object();
  for (const TrainOption& e : train_options())
    if (!e.has(kNotSaved)) std::visit([&](auto m) { j[e.key()] = o.*m; }, e.member);
  return j;
}

std::string resumable_flags() {
  std::vector<std::string> may;
  for (const TrainOption& e : train_options())
    if (e.has(kResumable) && e.flag != "resume") may.push_back("--" + e.flag);
  return fmt::format("{}", fmt::join(may, ", "));
}

TrainOptions resumed_options(const TrainOptions& cli, const nlohmann::json& saved, const std::string& src) {
  TrainOptions r = cli;
  DS_CHECK(saved.is_object(), "{}: field \"options\" must be an object, got {}", src, saved.type_name());
  // Each saved option is read and checked on its own, so that an error names its field (not a flag nobody gave).
  for (const TrainOption& e : train_options()) {
    if (e.has(kNotSaved)) continue;
    const std::string field = "options." + e.key();
    try {
      if (e.has(kNewerKey) && !saved.contains(e.key())) (e.set_older ? e.set_older : e.set_default)(r);
      else
        std::visit([&](auto m) {
          using T = std::remove_cvref_t<decltype(r.*m)>;
          const nlohmann::json& v = saved.at(e.key());
          // nlohmann converts 2.5 to the integer 2 (and true to 1) without a word: an integer option takes integers.
          if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
            if (!v.is_number_integer()) throw nlohmann::json::type_error::create(302, "not an integer", &v);
          v.get_to(r.*m);
        }, e.member);
    } catch (const nlohmann::json::exception&) {
      if (!saved.contains(e.key())) fail("{}: field \"{}\" is missing", src, field);
      const char* want = std::visit([](auto m) {
        using T = std::remove_cvref_t<decltype(TrainOptions{}.*m)>;
        return std::is_same_v<T, std::string> ? "a string" : std::is_same_v<T, bool> ? "true or false"
               : std::is_same_v<T, std::vector<std::string>> ? "an array of strings"
               : std::is_integral_v<T> ? "an integer" : "a number";
      }, e.member);
      fail("{}: field \"{}\" must be {}, got {}", src, field, want, saved[e.key()].dump());
    }
    if (e.check && !(e.has(kResumable) && cli.was_given(e.flag))) {  // a value this command line replaces is not read
      try {
        e.check(r);
      } catch (const Error& err) {
        fail("{}: field \"{}\" is invalid: {} (the checkpoint's saved option; was the file edited?)", src, field,
             err.what());
      }
    }
  }
  for (const std::string& g : cli.given)
    DS_CHECK(train_option(g).has(kResumable), "--{} cannot change on --resume: the checkpoint's options define the "
             "run (only {} may)", g, resumable_flags());
  for (const TrainOption& e : train_options())
    if (e.has(kResumable) && cli.was_given(e.flag)) std::visit([&](auto m) { r.*m = cli.*m; }, e.member);
  // A resume that switches to --precision bf16 drops the FP8 lm head the checkpoint's run had (it is a part of the
  // FP8 mode); given together, the two contradict each other (validate).
  if (cli.was_given("precision") && r.precision != "fp8" && !cli.was_given("fp8-lm-head") && r.fp8_lm_head) {
    r.fp8_lm_head = false;
    log_info("resume: --precision {} turns off the checkpoint's --fp8-lm-head", r.precision);
  }
  // Not given: continue in the run's own directory ("run/checkpoint-3/" too), the real one (symlinks resolved; also
  // "--resume ." inside it, or a trailing slash).
  if (!cli.was_given("out")) r.out = std::filesystem::canonical(std::filesystem::path(cli.resume)).parent_path().string();
  return r;
}

}  // namespace ds
