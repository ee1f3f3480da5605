#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/cuda/device.h"
#include "core/files.h"
#include "core/log.h"
#include "data/chat.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/model.h"
#include "train/lora_train.h"

namespace ds::cli {

namespace {
std::string tokenizer_for(const std::string& model_dir, const std::string& tokenizer) {
  if (!tokenizer.empty()) return tokenizer;
  std::string p = (std::filesystem::path(model_dir) / "tokenizer.json").string();
  DS_CHECK(file_exists(p), "{}: no tokenizer.json in the checkpoint; pass --tokenizer", model_dir);
  return p;
}

// eval's and generate's --device: auto, cpu or cuda (ds::Error naming --device otherwise, and for cuda without a
// usable device, before anything is read), resolved as every command resolves it (resolve_device, model/engine.h).
std::string chosen_device(const std::string& device) {
  DS_CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda, got \"{}\"",
           device);
  DS_CHECK(device != "cuda" || cuda_device_count() > 0, "--device cuda: no CUDA device is available");
  check_engine_knobs();  // not a reason for --device auto to leave the GPU (gpu_engine)
  return resolve_device(device);
}

// The checkpoint's model, its weights read per parameter by the engine that takes it (Qwen35Model::Deferred).
Qwen35Model deferred_model(const std::string& model_dir) {
  Qwen35Model model(ModelConfig::from_file(model_dir), Qwen35Model::Deferred{});
  model.defer_load(model_dir);
  return model;
}

// --adapter DIR (a PEFT adapter directory, or a LoRA run's checkpoint) onto `model`; nothing when empty.
// A LoRA checkpoint's recorded base must be `model_dir`'s weights (load_adapter).
void apply_adapter(Qwen35Model& model, const std::string& adapter, const std::string& model_dir) {
  if (!adapter.empty()) model.set_adapter(load_adapter(adapter, model, model_dir));
}

// The GPU engine for `plan`, or null when the device resolved to cpu. With --device auto a model the GPU engine
// cannot take (a shape its kernels lack, a plan larger than the free memory) is left to the CPU with a warning
// naming the reason (null); with --device cuda that is the error.
std::unique_ptr<Engine> gpu_engine(const std::string& device, const std::string& model_dir, const GpuPlan& plan,
                                   const char* command, const std::string& adapter) {
  if (chosen_device(device) != "cuda") return nullptr;
  try {
    Qwen35Model model = deferred_model(model_dir);
    apply_adapter(model, adapter, model_dir);
    return make_engine("cuda", std::move(model), plan);
  } catch (const Error& e) {
    if (device == "cuda") throw;
    log_warn("{}: the GPU engine cannot take this model ({}); running on the CPU", command, e.what());
    return nullptr;
  }
}
}  // namespace

int cmd_generate(const std::string& model_dir, const std::string& tokenizer, const std::string& prompt,
                 int64_t max_new_tokens, double temperature, int64_t top_k, uint64_t seed, double top_p, bool chat,
                 const std::string& device_flag, const std::string& adapter) {
  const std::string& device = device_flag;
  GenerateOptions opt;
  opt.sampling = {temperature, top_k, top_p};
  check_sampling(opt.sampling);
  DS_CHECK(max_new_tokens >= 0, "--max-new-tokens must be >= 0, got {}", max_new_tokens);
  opt.max_new_tokens = max_new_tokens;
  opt.seed = seed;
  chosen_device(device);  // a bad --device, or cuda without a GPU: an error before the checkpoint is read
  const ModelConfig cfg = ModelConfig::from_file(model_dir);
  Tokenizer tok = Tokenizer::from_file(tokenizer_for(model_dir, tokenizer));
  check_vocab(tok, cfg.vocab_size, cfg.source);
  DS_CHECK(!prompt.empty(), "--prompt must not be empty");
  if (chat) check_chat_tokens(tok);
  ChatTemplateOptions chat_opt;
  chat_opt.add_generation_prompt = true;
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(chat ? render_qwen3_chat({{"user", prompt, std::nullopt}}, chat_opt).text : prompt);
  } catch (const Error& e) {
    fail("--prompt: {}", e.what());
  }
  const int64_t total = static_cast<int64_t>(ids.size()) + max_new_tokens;
  DS_CHECK(total <= cfg.max_position_embeddings, "--max-new-tokens {}: the prompt's {} tokens + {} new ones exceed the "
           "model's max_position_embeddings = {}", max_new_tokens, ids.size(), max_new_tokens,
           cfg.max_position_embeddings);
  opt.stop_ids = {tok.token_to_id("<|endoftext|>")};
  if (chat) opt.stop_ids.push_back(tok.token_to_id("<|im_end|>"));
  opt.usable = std::min(cfg.vocab_size, tok.vocab_size());  // only ids the tokenizer knows can be sampled
  // The GPU: one document of the prompt and every new token, its plan sized once for all of them (forward only,
  // so the memory modes are left to the engine: the leanest that fits), the forward over the whole prefix again
  // per token. The CPU: the prompt once, then one token per step on the carried state (Qwen35Model::decode: O(1)
  // per token in the GDN layers, one row of scores in the attention layers).
  std::unique_ptr<Engine> engine = gpu_engine(device, model_dir, GpuPlan::forward_windows(1, total, 1), "generate",
                                              adapter);
  std::optional<Qwen35Model> cpu;
  NextLogits next;
  if (engine) {
    next = prefix_logits(*engine);
  } else {
    cpu.emplace(cfg);
    cpu->load(model_dir);
    apply_adapter(*cpu, adapter, model_dir);
    next = decode_logits(*cpu);
  }
  // Streamed: the prompt at once, then each token's text as it comes. A token may end inside a UTF-8 character
  // (decoded as a trailing U+FFFD until the next token completes it): that part waits for the next token.
  size_t printed = 0;
  auto emit = [&](const std::string& text) {
    DS_CHECK(std::fwrite(text.data(), 1, text.size(), stdout) == text.size() && std::fflush(stdout) == 0,
             "generate: cannot write to stdout ({})", std::strerror(errno));
  };
  emit(prompt);
  const std::vector<int32_t> generated = generate_tokens(next, ids, opt, [&](const std::vector<int32_t>& so_far) {
    std::string text = tok.decode(so_far);
    while (text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0) text.resize(text.size() - 3);
    if (text.size() > printed) {
      emit(text.substr(printed));
      printed = text.size();
    }
  });
  const std::string text = tok.decode(generated);
  emit(text.substr(std::min(printed, text.size())) + "\n");
  return 0;
}

int cmd_eval(const std::string& model_dir, const std::string& tokenizer, const std::vector<std::string>& data,
             int64_t seq_len, int64_t micro_batch, const std::string& txt_split, const std::string& device_flag,
             const std::string& precision, const std::string& adapter) {
  const std::string& device = device_flag;
  chosen_device(device);
  const Precision prec = parse_precision(precision);
  const ModelConfig cfg = ModelConfig::from_file(model_dir);
  Tokenizer tok = Tokenizer::from_file(tokenizer_for(model_dir, tokenizer));
  check_vocab(tok, cfg.vocab_size, cfg.source);
  DS_CHECK(seq_len >= 2 && seq_len <= cfg.max_position_embeddings,
           "--seq-len {} must be in [2, max_position_embeddings = {}]", seq_len, cfg.max_position_embeddings);
  DS_CHECK(micro_batch >= 1, "--micro-batch must be >= 1");
  const int32_t eos = document_separator(tok);
  const auto store = std::make_shared<MemoryTokenStore>(
      tokenize_documents(tok, read_documents(data, parse_txt_split(txt_split)), eos));
  require_labelled_target(*store, 0, store->num_documents(), "documents of --data", "evaluate");
  PackedDataset set(store, 0, store->num_documents(), seq_len);
  // The GPU engine (as the trainer's evaluation uses it) when asked, or by default when a GPU is present and takes
  // the model; else the CPU engine.
  GpuPlan plan = GpuPlan::forward_windows(micro_batch, seq_len, set.max_docs_per_window());
  plan.precision = prec;
  std::unique_ptr<Engine> engine = gpu_engine(device, model_dir, plan, "eval", adapter);
  if (!engine) {
    Qwen35Model model = deferred_model(model_dir);
    apply_adapter(model, adapter, model_dir);
    engine = make_engine("cpu", std::move(model), plan);
  }
  double sum = 0;
  int64_t n = 0;
  for (int64_t w = 0; w < set.num_windows(); w += micro_batch) {
    std::vector<int64_t> ws;
    for (int64_t i = w; i < std::min(set.num_windows(), w + micro_batch); ++i) ws.push_back(i);
    const PackedBatch b = set.batch(ws);
    LossResult r = engine->forward_backward(b, 0.0);
    sum += r.loss_sum;
    n += r.num_valid;
  }
  DS_CHECK(n > 0, "eval: no targets in the data");
  // Always one JSON object: a non-finite loss or perplexity is null, with the reason, and the exit code is 1.
  const double loss = sum / static_cast<double>(n), ppl = std::exp(loss);
  auto number = [](double v, int digits) { return std::isfinite(v) ? fmt::format("{:.{}f}", v, digits) : "null"; };
  std::string error;
  if (!std::isfinite(loss))
    error = fmt::format("the loss is {}: the checkpoint's weights give non-finite logits on this data", loss);
  fmt::print("{{\"eval_loss\": {}, \"perplexity\": {}, \"tokens\": {}{}}}\n", number(loss, 6), number(ppl, 4), n,
             error.empty() ? "" : ", \"error\": " + nlohmann::json(error).dump());
  if (error.empty()) return 0;
  log_warn("eval: {}", error);
  return 1;
}

int cmd_inspect(const std::string& path) {
  ModelConfig c = ModelConfig::from_file(path);
  fmt::print("config: {}\n", c.source);
  fmt::print("  hidden_size {} | layers {} ({}) | intermediate {} | vocab {} | tied {}\n", c.hidden_size,
             c.num_hidden_layers, fmt::join(c.layer_types, ","), c.intermediate_size, c.vocab_size,
             c.tie_word_embeddings);
  fmt::print("  attention: {} q / {} kv heads, head_dim {}, rotary_dim {}, rope_theta {}\n", c.num_attention_heads,
             c.num_key_value_heads, c.head_dim, c.rotary_dim(), c.rope_theta);
  fmt::print("  GDN: {} k-heads / {} v-heads, d_k {}, d_v {}, conv {}\n", c.linear_num_key_heads,
             c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim);
  fmt::print("  parameters: {} ({:.3f} B)\n", c.num_parameters(), c.num_parameters() / 1e9);
  if (std::filesystem::is_directory(path) && (file_exists(path + "/model.safetensors") ||
                                              file_exists(path + "/model.safetensors.index.json"))) {
    CheckpointReader ck(path);
    auto names = ck.names();
    fmt::print("tensors: {}\n", names.size());
    for (const auto& n : names) {
      const TensorInfo& ti = ck.info(n);
      fmt::print("  {:<60} {:<5} [{}]\n", n, dtype_name(ti.dtype), fmt::join(ti.shape, ", "));
    }
    Qwen35Model m(c);
    m.load(path);  // validates every parameter is present with the right shape
    fmt::print("load check: ok (every parameter present, shapes match, values finite)\n");
  }
  return 0;
}

}  // namespace ds::cli
