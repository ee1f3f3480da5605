// deltastack command line: train, forward, eval, generate, tokenize, probe, plan, plot, inspect, export, bench.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <new>
#include <thread>

#include "cli/commands/commands.h"
#include "core/cpu_blas.h"
#include "core/error.h"
#include "core/log.h"
#include "core/parallel.h"
#include "dist/communicator.h"
#include "model/engine.h"
#include "train/options_cli.h"
#include "train/trainer.h"

int main(int argc, char** argv) {
  ds::reexec_with_cpu_blas_kernels(argv);  // first: OpenBLAS picked its kernels when it loaded (core/cpu_blas.h)
  std::signal(SIGPIPE, SIG_IGN);  // a closed stdout (`train | head -1`) is a failed write, never a killed run
  CLI::App app{"deltastack: a native training engine for Qwen3.5-class hybrid (Gated DeltaNet + attention) models"};
  app.require_subcommand(0, 1);
  app.fallthrough();  // --threads may come after the subcommand
  // The version, and the OpenBLAS kernel set this process runs (core/cpu_blas.h: what the re-exec chose).
  app.set_version_flag("--version", [] {
    const char* env = std::getenv("OPENBLAS_CORETYPE");
    return fmt::format("{}\nOpenBLAS kernels: {} (OPENBLAS_CORETYPE {}{})", DELTASTACK_VERSION, ds::blas_corename(),
                       env ? env : "unset", std::getenv("DELTASTACK_BLAS_REEXEC") ? ", set by deltastack" : "");
  });
  ds::TrainOptions to;
  auto* train = app.add_subcommand("train", "Train a model (no arguments: the tiny preset on bundled tiny Shakespeare)");
  ds::add_train_flags(app, *train, to);  // and --threads, on the app: it applies to every subcommand
  train->footer(ds::train_help_footer());

  std::string model_dir, inputs, output, grads, tokenizer, prompt, input, txt_split = "paragraph";
  std::vector<std::string> data;
  int64_t max_new = 100, top_k = 50, seq_len = 128, micro_batch = 8;
  double temperature = 0.8;
  uint64_t seed = 0;

  auto* forward = app.add_subcommand("forward", "HF-parity forward/backward on a safetensors input");
  forward->add_option("--model", model_dir, "HF checkpoint dir")->required();
  forward->add_option("--inputs", inputs, "safetensors with input_ids [B,T], optional labels, cu_seqlens")->required();
  forward->add_option("--output", output, "safetensors to write logits, loss, hidden_states_i")->required();
  forward->add_option("--grads", grads, "safetensors to write parameter gradients (needs labels); with --adapter, "
                      "the adapter's (PEFT keys)");
  std::string forward_adapter;
  forward->add_option("--adapter", forward_adapter, "PEFT LoRA adapter dir (adapter_config.json, "
                      "adapter_model.safetensors) applied to the model, on either engine (docs/lora.md)");
  std::string forward_device = "cpu";
  forward->add_option("--device", forward_device, "cpu (fp32 reference, default) or cuda (bf16)");
  bool overwrite = false;
  const char* overwrite_help = "Replace an existing output file (never an input or a checkpoint's file)";
  forward->add_flag("--overwrite", overwrite, overwrite_help);
  const char* precision_help = "The decoder's matrix GEMMs: bf16, or fp8 (E4M3/E5M2, per-tensor scaling; docs/fp8.md)";
  std::string precision = "bf16";
  forward->add_option("--precision", precision, precision_help)->capture_default_str();

  auto* gen = app.add_subcommand("generate", "Sample text from a checkpoint");
  gen->add_option("--model", model_dir, "Checkpoint dir")->required();
  gen->add_option("--prompt", prompt, "Prompt text")->required();
  gen->add_option("--tokenizer", tokenizer, "tokenizer.json (default: the checkpoint's)");
  gen->add_option("--max-new-tokens", max_new, "Tokens to sample (with the prompt's: at most the model's "
                  "max_position_embeddings)")->capture_default_str();
  gen->add_option("--temperature", temperature, "Sampling temperature (0 = greedy)")->capture_default_str();
  gen->add_option("--top-k", top_k, "Sample among the k most likely tokens (0 = all)")->capture_default_str();
  gen->add_option("--seed", seed, "Sampling seed")->capture_default_str();
  double top_p = 1.0;
  bool chat = false;
  gen->add_option("--top-p", top_p, "Sample from the most likely ids whose probability reaches p (1 = off)")
      ->capture_default_str();
  std::string gen_adapter, eval_adapter;
  const char* adapter_help = "PEFT LoRA adapter dir (or a LoRA run's checkpoint) applied to --model, the base, on "
                             "either engine (docs/lora.md)";
  gen->add_option("--adapter", gen_adapter, adapter_help);
  gen->add_flag("--chat", chat, "The prompt is a user turn of the chat template; the reply stops at <|im_end|>");
  std::string gen_device = "auto";
  gen->add_option("--device", gen_device, "auto (GPU when present), cpu (fp32; carried decode state: O(1) work per "
                  "token) or cuda (bf16; the forward over the whole prefix again for every token: O(n) per token)")
      ->capture_default_str();

  auto* eval = app.add_subcommand("eval", "Mean loss of a checkpoint on data files");
  eval->add_option("--model", model_dir, "Checkpoint dir")->required();
  eval->add_option("--data", data, "Data files")->required();
  eval->add_option("--tokenizer", tokenizer, "tokenizer.json (default: the checkpoint's)");
  eval->add_option("--seq-len", seq_len, "Window length")->capture_default_str();
  eval->add_option("--micro-batch", micro_batch, "Windows per forward")->capture_default_str();
  eval->add_option("--txt-split", txt_split, "paragraph, line or file")->capture_default_str();
  std::string eval_device = "auto";
  eval->add_option("--device", eval_device, "auto (GPU when present), cpu or cuda")->capture_default_str();
  eval->add_option("--precision", precision, precision_help)->capture_default_str();
  eval->add_option("--adapter", eval_adapter, adapter_help);

  auto* tokenize = app.add_subcommand("tokenize", "Tokenize a .jsonl of {\"text\"}, chat {\"messages\"} or {\"prompt\", \"completion\"} lines into {\"ids\"} (+ \"loss_mask\") lines");
  tokenize->add_option("--tokenizer", tokenizer, "HF tokenizer.json")->required();
  std::vector<std::string> tok_inputs;
  std::string tok_format = "auto";
  int64_t shard_tokens = 16 << 20;
  tokenize->add_option("--input", tok_inputs, "Input .jsonl (--format jsonl), or .txt / .jsonl files (dataset)")
      ->required();
  tokenize->add_option("--output", output, "Output .jsonl, or dataset directory")->required();
  tokenize->add_option("--format", tok_format, "jsonl ({\"ids\"} lines), dataset (a directory of token shards for "
                       "`train --data DIR`), or auto: dataset unless --output ends in .jsonl or is an existing file")
      ->capture_default_str();
  tokenize->add_option("--txt-split", txt_split, "dataset: how .txt files split into documents (paragraph, line, file)")
      ->capture_default_str();
  tokenize->add_option("--shard-tokens", shard_tokens, "dataset: token ids per shard file (4 bytes each)")
      ->capture_default_str();
  tokenize->add_flag("--overwrite", overwrite, overwrite_help);
  int64_t tok_block_bytes = 0;
  tokenize->add_option("--block-bytes", tok_block_bytes, "dataset: bytes read per piece of an input (tests)")
      ->group("");  // hidden

  auto* bench = app.add_subcommand("bench", "Benchmarks: `bench ops`, `bench step --preset 2b` (GPU), `bench tokenizer` (CPU)");
  bench->require_subcommand(1);
  auto* bench_ops = bench->add_subcommand("ops", "Per-op timings, rates and roofline fractions");
  std::string bench_ops_only;
  bench_ops->add_option("--only", bench_ops_only, "Only these rows: loss (the fused loss at the 2B shape with the FP8 "
                        "head) or adamw (each optimizer state's update, 218M parameters)")
      ->check(CLI::IsMember({"loss", "adamw"}));
  auto* bench_step = bench->add_subcommand("step", "Full training steps: tokens/s, MFU, peak memory");
  std::string bench_preset = "2b";
  int64_t bench_seq = 8192, bench_mb = 2, bench_steps = 5;
  bench_step->add_option("--preset", bench_preset, "Model preset")->capture_default_str();
  bench_step->add_option("--seq-len", bench_seq, "Tokens per sequence")->capture_default_str();
  bench_step->add_option("--micro-batch", bench_mb, "Sequences per step")->capture_default_str();
  bench_step->add_option("--steps", bench_steps, "Timed steps (after one warm-up)")->capture_default_str();
  bool bench_profile = false;
  bench_step->add_flag("--profile", bench_profile,
                       "Also ms per step by op family and role (GEMMs by role, gdn, attention, conv, norm, "
                       "elementwise, loss, embedding, optimizer, copy) from CUDA events on the compute stream, their "
                       "sum against the wall time (gaps = wall - sum), and each one's roofline fraction");
  // --memory, --optimizer-state, --recompute (as `train`'s; model/engine.h)
  auto add_memory_flags = [](CLI::App* cmd, ds::cli::MemoryFlags& m) {
    cmd->add_option("--memory", m.memory, "auto (choose the modes not given to fit) or fixed (fp32, selective)")
        ->capture_default_str();
    cmd->add_option("--optimizer-state", m.optimizer_state, "auto, fp32, bf16 or 8bit")->capture_default_str();
    cmd->add_option("--recompute", m.recompute, ds::recompute_choices() + " (docs/memory.md)")->capture_default_str();
    cmd->add_option("--precision", m.precision, "bf16 or fp8 (the decoder's matrix GEMMs; docs/fp8.md)")
        ->capture_default_str();
    cmd->add_flag("--fp8-lm-head", m.fp8_lm_head, "With --precision fp8: the lm head's gradient GEMMs in FP8 too "
                  "(lossy; the logits and the loss stay exact; docs/fp8.md)");
    cmd->add_option("--gradients", m.gradients, "auto, fp32, in-backward (the update in the backward, no "
                    "gradient buffer) or bf16 (a bf16 buffer, stochastic rounding; docs/memory.md)")
        ->capture_default_str();
    cmd->add_option("--lora-rank", m.lora_rank, "A LoRA run of this rank on every linear layer (the base frozen in "
                    "bf16; docs/lora.md); 0 = a full run")->capture_default_str();
    cmd->add_flag("--offload-activations", m.offload_activations, "With --recompute full (auto: full): the layer "
                  "inputs in pinned host memory, copied back before each layer's backward (docs/memory.md)");
  };
  ds::cli::MemoryFlags bench_memory, plan_memory;
  add_memory_flags(bench_step, bench_memory);
  bench_step->add_option("--max-memory", bench_memory.max_memory_gib, "GiB of device memory the run may use, the CUDA "
                         "context included, as plan --device-memory (0 = all that is free): --memory auto fits the "
                         "modes into it")->capture_default_str();
  bench_step->add_option("--clip", bench_memory.clip, "Max global grad norm (0 = off); with --gradients in-backward "
                         "it adds the norm-only pass")->capture_default_str();
  auto* bench_tok = bench->add_subcommand("tokenizer", "Tokenizer encode speed, MB/s on one core (CPU)");
  std::string bench_tokenizer = ds::bundled_tokenizer_path(), bench_text = ds::bundled_data_path();
  int bench_repeats = 5;
  bench_tok->add_option("--tokenizer", bench_tokenizer, "tokenizer.json")->capture_default_str();
  bench_tok->add_option("--input", bench_text, "Text file to encode")->capture_default_str();
  bench_tok->add_option("--repeats", bench_repeats, "Timed passes after the first")->capture_default_str();
  auto* probe = app.add_subcommand("probe", "Backend per op and its self-probe error");
  auto* plan = app.add_subcommand("plan", "The GPU engine's memory plan for a model and batch (no GPU needed)");
  std::string plan_model = "2b", plan_attention = "cudnn";
  int64_t plan_seq = 8192, plan_mb = 1, plan_docs = 1;
  double plan_mem = 140.4;  // the H200: 143771 MiB
  plan->add_option("--model", plan_model, "Preset, config.json or checkpoint dir")->capture_default_str();
  plan->add_option("--seq-len", plan_seq, "Tokens per packed window")->capture_default_str();
  plan->add_option("--micro-batch", plan_mb, "Windows per micro-batch")->capture_default_str();
  plan->add_option("--docs-per-window", plan_docs, "Most documents in one window (the trainer takes it from the data)")
      ->capture_default_str();
  plan->add_option("--device-memory", plan_mem, "Device memory in GiB (default: an H200's 140.4)")->capture_default_str();
  plan->add_option("--attention", plan_attention, "cudnn or simple")->capture_default_str();
  add_memory_flags(plan, plan_memory);
  plan_memory.clip = 1.0;  // train's default
  plan->add_option("--clip", plan_memory.clip, "The run's max grad norm (0 = off): with --gradients in-backward it "
                   "adds a norm-only pass, which --memory auto weighs")->capture_default_str();
  std::string plan_hf_config;
  plan->add_option("--hf-config", plan_hf_config,
                   "Write the model's HF config.json (Qwen3_5ForCausalLM) to this file instead of the plan");
  plan->add_flag("--overwrite", overwrite, overwrite_help);
  auto* plot = app.add_subcommand("plot", "SVG of runs' loss, eval loss, lr, grad norm and tokens/s against steps");
  std::vector<std::string> plot_runs;
  std::string plot_out;
  plot->add_option("runs", plot_runs, "Run directories (or their metrics.jsonl), one chart for all")->required();
  plot->add_option("--out", plot_out, "Output .svg (default: RUN_DIR/metrics.svg for one run)");
  plot->add_flag("--overwrite", overwrite, overwrite_help);
  auto* inspect = app.add_subcommand("inspect", "Show a checkpoint's config and tensors");
  std::string inspect_path;
  inspect->add_option("checkpoint", inspect_path, "Checkpoint dir or config.json")->required();

  auto* exp = app.add_subcommand("export", "Write a checkpoint as an HF model dir (bf16 weights by default)");
  std::string exp_in, exp_out, exp_dtype = "bf16";
  int64_t exp_shard_mb = 5000;
  exp->add_option("checkpoint", exp_in, "Checkpoint dir")->required();
  exp->add_option("out", exp_out, "New output dir")->required();
  exp->add_option("--dtype", exp_dtype, "bf16 or f32")->capture_default_str();
  exp->add_option("--max-shard-mb", exp_shard_mb, "Split weight files past this size (MB)")->capture_default_str();
  bool exp_merge = false;
  exp->add_flag("--merge", exp_merge, "A LoRA checkpoint: write the base model with the adapter merged into its "
                "weights (default: the PEFT adapter directory)");

  // A scalar flag given twice takes its last value (so scripts can append overrides); lists keep every value.
  std::function<void(CLI::App*)> last_wins = [&](CLI::App* a) {
    for (CLI::Option* o : a->get_options())
      if (o->get_items_expected_max() == 1) o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    for (CLI::App* sub : a->get_subcommands({})) last_wins(sub);
  };
  last_wins(&app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // The error line; a failed write (a closed stderr) changes nothing: the exit code is 1 either way. With several
  // ranks it names the rank, and the run stops on every rank (no rank is left waiting in a collective).
  // Before train() opened the communicator, a failing rank just exits 1 and its launcher ends the others.
  ds::dist::LaunchInfo launch;
  auto error = [&launch](const std::string& message) {
    const std::string what = ds::printable(message);  // bytes of a user's file or argument quoted in it: escaped
    ds::dist::Communicator& w = ds::dist::world();
    if (w.world() == 1 && launch.world == 1 && w.backend() == "single") {
      ds::detail::log_line("error: " + what + "\n");
      return;
    }
    const int rank = w.world() > 1 ? w.rank() : launch.rank, world = w.world() > 1 ? w.world() : launch.world;
    ds::detail::log_line(fmt::format("error on rank {} of {}: {}\n", rank, world, what));
    std::fflush(stderr);
    if (w.world() > 1 || w.backend() != "single") w.abort(1);  // also NCCL at world size 1: no teardown at exit
  };
  try {
    ds::train_option("threads").check(to);
    // Several ranks (mpirun, torchrun): only `train` runs on them, and the default thread count is this host's
    // cores shared among its ranks. Launcher variables that make no launch (a stray RANK from another tool) only
    // matter to `train`.
    try {
      launch = ds::dist::detect_launch();
    } catch (const ds::Error&) {
      if (*train) throw;
    }
    if (launch.world > 1) {
      DS_CHECK(*train, "{} started {} ranks, but only `deltastack train` runs on several ranks; start other commands "
               "as one process", launch.launcher, launch.world);
      // The communicator itself is opened by train() once it knows the engine (MPI for the CPU, NCCL for the GPU).
      if (launch.rank != 0) ds::set_log_muted(true);
      if (to.threads == 0)
        to.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / launch.local_world);
    }
    ds::set_num_threads(to.threads);
    if (*forward) {
      DS_CHECK(forward_device == "cpu" || forward_device == "cuda", "--device must be cpu or cuda, got \"{}\"",
               forward_device);
      return ds::cli::cmd_forward(model_dir, inputs, output, grads, forward_device, overwrite, precision,
                                    forward_adapter);
    }
    if (*gen) return ds::cli::cmd_generate(model_dir, tokenizer, prompt, max_new, temperature, top_k, seed, top_p, chat,
                                           gen_device, gen_adapter);
    if (*eval) return ds::cli::cmd_eval(model_dir, tokenizer, data, seq_len, micro_batch, txt_split, eval_device, precision,
                                       eval_adapter);
    if (*tokenize) {
      std::error_code ec;
      const bool to_file = output.ends_with(".jsonl") || std::filesystem::is_regular_file(output, ec);
      if (tok_format == "auto") tok_format = to_file ? "jsonl" : "dataset";
      if (tok_format == "dataset")
        return ds::cli::cmd_tokenize_dataset(tokenizer, tok_inputs, output, txt_split, shard_tokens, overwrite,
                                             tok_block_bytes);
      if (tok_format != "jsonl")
        throw ds::Error(fmt::format("--format: unknown value \"{}\" (auto, jsonl or dataset)", tok_format));
      if (tok_inputs.size() != 1)
        throw ds::Error(fmt::format("--format jsonl takes one --input file, got {}", tok_inputs.size()));
      return ds::cli::cmd_tokenize(tokenizer, tok_inputs[0], output, overwrite);
    }
    if (*probe) return ds::cli::cmd_probe();
    if (*plan && !plan_hf_config.empty()) return ds::cli::cmd_plan_hf_config(plan_model, plan_hf_config, overwrite);
    if (*plan) return ds::cli::cmd_plan(plan_model, plan_seq, plan_mb, plan_docs, plan_mem, plan_attention, plan_memory);
    if (*bench_ops) return ds::cli::cmd_bench_ops(bench_ops_only);
    if (*bench_tok) return ds::cli::cmd_bench_tokenizer(bench_tokenizer, bench_text, bench_repeats);
    if (*bench_step) return ds::cli::cmd_bench_step(bench_preset, bench_seq, bench_mb, bench_steps, bench_memory,
                                                    bench_profile);
    if (*inspect) return ds::cli::cmd_inspect(inspect_path);
    if (*plot) return ds::cli::cmd_plot(plot_runs, plot_out, overwrite);
    if (*exp) return ds::cli::cmd_export(exp_in, exp_out, exp_dtype, exp_shard_mb, exp_merge);
    if (*train) {
      ds::record_given_flags(app, *train, to);
      const int rc = ds::train(to);
      ds::dist::uninstall();
      return rc;
    }
    fmt::print("{}", app.help());
    return 0;
  } catch (const ds::Error& e) {
    error(e.what());
  } catch (const std::bad_alloc&) {
    error("out of host memory (a larger model or batch than this machine holds; the fp32 engine keeps weights, "
          "gradients and two AdamW moments: 16 bytes per parameter, plus one micro-batch's activations)");
  } catch (const std::exception& e) {
    error(e.what());
  }
  return 1;
}
