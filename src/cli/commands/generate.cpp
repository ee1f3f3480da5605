#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/cuda/device.h"
#include "core/files.h"
#include "core/log.h"
#include "core/rng.h"
#include "data/chat.h"
#include "data/dataset.h"
#include "data/tokenizer.h"
#include "model/engine.h"
#include "model/model.h"

namespace ds::cli {

namespace {
std::string tokenizer_for(const std::string& model_dir, const std::string& tokenizer) {
  if (!tokenizer.empty()) return tokenizer;
  std::string p = (std::filesystem::path(model_dir) / "tokenizer.json").string();
  DS_CHECK(file_exists(p), "{}: no tokenizer.json in the checkpoint; pass --tokenizer", model_dir);
  return p;
}
}  // namespace

int cmd_generate(const std::string& model_dir, const std::string& tokenizer, const std::string& prompt,
                 int64_t max_new_tokens, double temperature, int64_t top_k, uint64_t seed, double top_p, bool chat) {
  DS_CHECK(std::isfinite(top_p) && top_p > 0 && top_p <= 1, "--top-p must be in (0, 1], got {}", top_p);
  DS_CHECK(max_new_tokens >= 0, "--max-new-tokens must be >= 0, got {}", max_new_tokens);
  DS_CHECK(std::isfinite(temperature) && temperature >= 0, "--temperature must be finite and >= 0, got {}", temperature);
  DS_CHECK(top_k >= 0, "--top-k must be >= 0, got {}", top_k);
  Qwen35Model model(ModelConfig::from_file(model_dir));
  model.load(model_dir);
  Tokenizer tok = Tokenizer::from_file(tokenizer_for(model_dir, tokenizer));
  DS_CHECK(!prompt.empty(), "--prompt must not be empty");
  ChatTemplateOptions chat_opt;
  chat_opt.add_generation_prompt = true;
  std::vector<int32_t> ids = tok.encode(chat ? render_qwen3_chat({{"user", prompt, std::nullopt}}, chat_opt).text : prompt);
  const int32_t eos = tok.token_to_id("<|endoftext|>"), im_end = chat ? tok.token_to_id("<|im_end|>") : -1;
  const int64_t V = model.config().vocab_size, tok_v = tok.vocab_size();
  Rng rng(seed);
  std::vector<int32_t> generated;
  // Streamed: the prompt at once, then each token's text as it comes. A token may end inside a UTF-8 character
  // (decoded as a trailing U+FFFD until the next token completes it): that part waits for the next token.
  size_t printed = 0;
  auto emit = [&](const std::string& text) {
    DS_CHECK(std::fwrite(text.data(), 1, text.size(), stdout) == text.size() && std::fflush(stdout) == 0,
             "generate: cannot write to stdout ({})", std::strerror(errno));
  };
  emit(prompt);
  // The prompt once, then one token per step on the carried state (Qwen35Model::decode: O(1) per token in the
  // GDN layers, one row of scores in the attention layers).
  Qwen35Model::DecodeState state;
  std::vector<int32_t> feed = ids;
  for (int64_t n = 0; n < max_new_tokens; ++n) {
    std::vector<float> logits = model.decode(state, feed);
    // Only ids the tokenizer knows can be sampled.
    int64_t usable = std::min(V, tok_v);
    int32_t next = 0;
    if (temperature <= 0) {
      next = static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + usable) - logits.begin());
    } else {
      std::vector<int32_t> order(static_cast<size_t>(usable));
      std::iota(order.begin(), order.end(), 0);
      int64_t k = top_k > 0 ? std::min(top_k, usable) : usable;
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int32_t a, int32_t c) { return logits[a] > logits[c]; });
      double mx = logits[order[0]], total = 0;
      std::vector<double> p(static_cast<size_t>(k));
      for (int64_t i = 0; i < k; ++i) total += p[i] = std::exp((logits[order[i]] - mx) / temperature);
      if (top_p < 1) {  // the most likely ids (sorted) until their probability reaches top_p
        double kept = 0;
        int64_t n = 0;
        while (n < k && kept < top_p * total) kept += p[static_cast<size_t>(n++)];
        k = std::max<int64_t>(n, 1);
        total = kept > 0 ? kept : p[0];
      }
      double u = rng.uniform() * total;
      next = order[static_cast<size_t>(k - 1)];
      for (int64_t i = 0; i < k; ++i) {
        if ((u -= p[i]) <= 0) {
          next = order[static_cast<size_t>(i)];
          break;
        }
      }
    }
    if (next == eos || next == im_end) break;
    ids.push_back(next);
    feed = {next};
    generated.push_back(next);
    std::string text = tok.decode(generated);
    while (text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0) text.resize(text.size() - 3);
    if (text.size() > printed) {
      emit(text.substr(printed));
      printed = text.size();
    }
    if (static_cast<int64_t>(ids.size()) >= model.config().max_position_embeddings) break;
  }
  const std::string text = tok.decode(generated);
  emit(text.substr(std::min(printed, text.size())) + "\n");
  return 0;
}

int cmd_eval(const std::string& model_dir, const std::string& tokenizer, const std::vector<std::string>& data,
             int64_t seq_len, int64_t micro_batch, const std::string& txt_split, const std::string& device) {
  DS_CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device must be auto, cpu or cuda, got \"{}\"",
           device);
  DS_CHECK(device != "cuda" || cuda_device_count() > 0, "--device cuda: no CUDA device is available");
  Qwen35Model model(ModelConfig::from_file(model_dir), Qwen35Model::Deferred{});  // read per parameter by the engine
  model.defer_load(model_dir);
  Tokenizer tok = Tokenizer::from_file(tokenizer_for(model_dir, tokenizer));
  DS_CHECK(seq_len >= 2 && seq_len <= model.config().max_position_embeddings,
           "--seq-len {} must be in [2, max_position_embeddings = {}]", seq_len, model.config().max_position_embeddings);
  DS_CHECK(micro_batch >= 1, "--micro-batch must be >= 1");
  auto docs = tokenize_documents(tok, read_documents(data, parse_txt_split(txt_split)), tok.token_to_id("<|endoftext|>"));
  PackedDataset set(docs, seq_len);
  // The GPU engine (as the trainer's evaluation uses it) when asked, or by default when a GPU is present; with
  // auto, a model the GPU engine cannot take is evaluated on the CPU (read again: the first reader went to the GPU
  // engine).
  const GpuPlan plan = GpuPlan::forward_windows(micro_batch, seq_len, set.max_docs_per_window());
  std::unique_ptr<Engine> engine;
  if (resolve_device(device) == "cuda") {
    try {
      engine = make_engine("cuda", std::move(model), plan);
    } catch (const Error& e) {
      if (device == "cuda") throw;
      log_warn("eval: the GPU engine cannot take this model ({}); evaluating on the CPU", e.what());
      Qwen35Model again(ModelConfig::from_file(model_dir), Qwen35Model::Deferred{});
      again.defer_load(model_dir);
      engine = make_engine("cpu", std::move(again), plan);
    }
  } else {
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
