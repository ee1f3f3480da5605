// `deltastack tokenize`: JSONL samples -> JSONL token ids (and loss masks) with a Hugging Face tokenizer.json.
//
// Input: one JSON object per line, a sample as data/chat.h parse_sample takes it: {"text": ...} (other fields
// are ignored), a chat {"messages": [...], "add_generation_prompt"?, "enable_thinking"?} rendered with the bundled
// Qwen3 chat template, or {"prompt": ..., "completion": ...}. A trailing newline after the last line is allowed;
// "\r\n" line ends are accepted. Every other line must be a JSON object: an empty (or all-whitespace) line,
// invalid JSON, a non-object, or a sample parse_sample rejects (a missing / non-string field, an unknown role,
// tools) is a ds::Error naming the file, the 1-based line number and the field.
// Output: one line per input line, in order: {"ids":[...]} for a text, {"ids":[...],"loss_mask":[...]} for a chat
// or prompt / completion (1 on the labelled tokens: an assistant turn after its header through its <|im_end|>, or
// the completion), written atomically (ds::AtomicFileWriter), so a failed run leaves any previous output untouched;
// an existing output is replaced only with --overwrite, never the input or the tokenizer (outputs.h), and only if
// it is still the file checked at the start (fs_safety.h: a file written there meanwhile stays, and this run fails). Lines are
// encoded in parallel (OpenMP); ids are the same as Tokenizer::encode on each (rendered) text.
#include <nlohmann/json.hpp>
#include <charconv>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "cli/commands/commands.h"
#include "cli/commands/outputs.h"
#include "core/error.h"
#include "core/files.h"
#include "core/fs_safety.h"
#include "core/log.h"
#include "data/chat.h"
#include "data/tokenizer.h"

namespace ds::cli {

int cmd_tokenize(const std::string& tokenizer_path, const std::string& input_jsonl, const std::string& output_jsonl,
                 bool overwrite) {
  check_outputs({{"--output", output_jsonl}}, {input_jsonl, tokenizer_path}, overwrite);
  const FileIdentity existing = file_identity(output_jsonl);  // all the final rename may replace
  DS_CHECK(input_jsonl.ends_with(".jsonl"), "--input {}: --format jsonl reads one .jsonl file of samples ({{\"text\"}}, "
           "{{\"messages\"}} or {{\"prompt\", \"completion\"}} lines); .txt and other files are tokenized into a dataset "
           "directory (--format dataset, an --output that does not end in .jsonl)", input_jsonl);
  std::string input = read_file(input_jsonl);

  // Parse every line first (serially, so errors name the first bad line).
  std::vector<LabelledText> texts;
  size_t pos = 0, line_no = 0;
  while (pos < input.size()) {
    size_t nl = input.find('\n', pos);
    size_t end = nl == std::string::npos ? input.size() : nl;
    ++line_no;
    std::string_view line(input.data() + pos, end - pos);
    pos = nl == std::string::npos ? input.size() : nl + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos)
      fail("{}:{}: empty line (expected a JSON object with \"text\", \"messages\" or \"prompt\" and \"completion\")",
           input_jsonl, line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail("{}:{}: invalid JSON ({})", input_jsonl, line_no, printable(e.what()));
    }
    try {
      texts.push_back(parse_sample(j));
    } catch (const Error& e) {
      fail("{}:{}: {}", input_jsonl, line_no, e.what());
    }
  }

  const Tokenizer tok = Tokenizer::from_file(tokenizer_path);  // after the input's checks: a bad line fails at once
  // Encode in parallel; exceptions cannot leave an OpenMP region, so keep the first one (lowest line).
  const long n = static_cast<long>(texts.size());
  std::vector<std::string> lines(texts.size());
  std::vector<std::exception_ptr> errors(texts.size());
  size_t total_ids = 0;
#pragma omp parallel for schedule(dynamic, 16) reduction(+ : total_ids)
  for (long i = 0; i < n; ++i) {
    try {
      const TokenizedSample t = tokenize_sample(tok, texts[i]);
      total_ids += t.ids.size();
      std::string& s = lines[i];
      s.reserve(24 + t.ids.size() * (t.loss_mask.empty() ? 7 : 9));
      s += "{\"ids\":[";
      char buf[16];
      for (size_t k = 0; k < t.ids.size(); ++k) {
        if (k) s.push_back(',');
        auto r = std::to_chars(buf, buf + sizeof(buf), t.ids[k]);
        s.append(buf, r.ptr);
      }
      s += "]";
      if (texts[i].masked) {
        s += ",\"loss_mask\":[";
        for (size_t k = 0; k < t.loss_mask.size(); ++k) {
          if (k) s.push_back(',');
          s.push_back(t.loss_mask[k] ? '1' : '0');
        }
        s += "]";
      }
      s += "}\n";
    } catch (...) {
      errors[i] = std::current_exception();
    }
  }
  for (long i = 0; i < n; ++i) {
    if (!errors[i]) continue;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const std::exception& e) {
      fail("{}:{}: {}: {}", input_jsonl, i + 1, texts[i].masked ? "the rendered sample" : "field \"text\"", e.what());
    }
  }

  std::string out;
  size_t bytes = 0;
  for (const auto& s : lines) bytes += s.size();
  out.reserve(bytes);
  for (const auto& s : lines) out += s;
  AtomicFileWriter w(output_jsonl);
  w.replace_only(existing);  // another tokenize's output, or a file made there meanwhile, stays (this run fails)
  w.write(out.data(), out.size());
  test_replace_gate();
  w.commit();
  log_info("tokenize: {} lines, {} tokens -> {}", texts.size(), total_ids, output_jsonl);
  return 0;
}

}  // namespace ds::cli
