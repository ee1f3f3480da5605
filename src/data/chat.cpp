// The bundled Qwen3 chat template (data/qwen3_tokenizer/tokenizer_config.json, "chat_template") in C++, and the
// SFT sample forms. See chat.h. The template's Python string methods are reproduced exactly: split('</think>')[-1]
// is the text after the last "</think>", split('</think>')[0] the text before the first, split('<think>')[-1] the
// text after the last "<think>"; strip / lstrip / rstrip('\n') remove only newlines.
#include "data/chat.h"

#include <nlohmann/json.hpp>

#include <string_view>

#include "core/error.h"

namespace ds {

namespace {

using json = nlohmann::json;

std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}
std::string_view after_last(std::string_view s, std::string_view sep) {
  const size_t i = s.rfind(sep);
  return i == std::string_view::npos ? s : s.substr(i + sep.size());
}
std::string_view before_first(std::string_view s, std::string_view sep) {
  const size_t i = s.find(sep);
  return i == std::string_view::npos ? s : s.substr(0, i);
}
bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

}  // namespace

LabelledText render_qwen3_chat(const std::vector<ChatMessage>& messages, const ChatTemplateOptions& options) {
  DS_CHECK(!messages.empty(), "field \"messages\": no messages");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    DS_CHECK(r == "system" || r == "user" || r == "assistant",
             "field \"messages[{}].role\": unknown role \"{}\" (supported: system, user, assistant)", i, r);
    DS_CHECK(r == "assistant" || !messages[i].reasoning_content,
             "field \"messages[{}].reasoning_content\": only assistant messages have reasoning", i);
  }
  LabelledText out;
  out.masked = true;
  std::string& t = out.text;
  if (messages[0].role == "system") t += "<|im_start|>system\n" + messages[0].content + "<|im_end|>\n";
  // The last user query: the last user message that is not a tool response (template: ns.last_query_index).
  size_t last_query = messages.size() - 1;
  for (size_t k = messages.size(); k-- > 0;) {
    const ChatMessage& m = messages[k];
    if (m.role == "user" && !(starts_with(m.content, "<tool_response>") && ends_with(m.content, "</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" || (m.role == "system" && i > 0)) {
      t += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      continue;
    }
    if (m.role != "assistant") continue;  // the leading system turn, written above
    std::string_view content = m.content, reasoning;
    if (m.reasoning_content) {
      reasoning = *m.reasoning_content;
    } else if (content.find("</think>") != std::string_view::npos) {
      reasoning = lstrip_nl(after_last(rstrip_nl(before_first(m.content, "</think>")), "<think>"));
      content = lstrip_nl(after_last(m.content, "</think>"));
    }
    t += "<|im_start|>assistant\n";
    const size_t begin = t.size();
    const bool last = i + 1 == messages.size();
    if (i > last_query && (last || !reasoning.empty())) {
      t += "<think>\n";
      t += rstrip_nl(lstrip_nl(reasoning));
      t += "\n</think>\n\n";
      t += lstrip_nl(content);
    } else {
      t += content;
    }
    t += "<|im_end|>";
    if (i >= options.label_from) out.labels.push_back({begin, t.size()});
    t += "\n";
  }
  if (options.add_generation_prompt) {
    t += "<|im_start|>assistant\n";
    if (!options.enable_thinking) t += "<think>\n\n</think>\n\n";
  }
  return out;
}

namespace {

const char* kinds() { return "\"text\", \"messages\", or \"prompt\" and \"completion\""; }

std::vector<ChatMessage> parse_messages(const json& list, const std::string& field) {
  DS_CHECK(list.is_array(), "field \"{}\" must be an array of messages, got {}", field, list.type_name());
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& m = list[i];
    const std::string at = fmt::format("{}[{}]", field, i);
    DS_CHECK(m.is_object(), "field \"{}\" must be an object with \"role\" and \"content\", got {}", at, m.type_name());
    auto role = m.find("role");
    DS_CHECK(role != m.end(), "field \"{}.role\" is missing", at);
    DS_CHECK(role->is_string(), "field \"{}.role\" must be a string, got {}", at, role->type_name());
    ChatMessage msg;
    msg.role = role->get<std::string>();
    if (auto tc = m.find("tool_calls"); tc != m.end() && !tc->is_null() && !(tc->is_array() && tc->empty()))
      fail("field \"{}.tool_calls\": tool calls are not supported", at);
    if (msg.role == "tool") fail("field \"{}.role\": \"tool\" messages (tool results) are not supported", at);
    DS_CHECK(msg.role == "system" || msg.role == "user" || msg.role == "assistant",
             "field \"{}.role\": unknown role \"{}\" (supported: system, user, assistant)", at, msg.role);
    auto content = m.find("content");
    DS_CHECK(content != m.end(), "field \"{}.content\" is missing", at);
    DS_CHECK(content->is_string(), "field \"{}.content\" must be a string, got {}", at, content->type_name());
    msg.content = content->get<std::string>();
    if (auto rc = m.find("reasoning_content"); rc != m.end() && !rc->is_null()) {
      DS_CHECK(rc->is_string(), "field \"{}.reasoning_content\" must be a string, got {}", at, rc->type_name());
      msg.reasoning_content = rc->get<std::string>();
    }
    out.push_back(std::move(msg));
  }
  return out;
}

bool optional_bool(const json& line, const char* key, bool dflt) {
  auto it = line.find(key);
  if (it == line.end() || it->is_null()) return dflt;
  DS_CHECK(it->is_boolean(), "field \"{}\" must be true or false, got {}", key, it->dump());
  return it->get<bool>();
}

}  // namespace

LabelledText parse_sample(const json& line) {
  DS_CHECK(line.is_object(), "expected a JSON object with {}, got {}", kinds(), line.type_name());
  const bool text = line.contains("text"), chat = line.contains("messages"),
             pc = line.contains("prompt") || line.contains("completion");
  DS_CHECK(int(text) + int(chat) + int(pc) <= 1, "a line holds one of {}, not several", kinds());
  DS_CHECK(text || chat || pc, "expected {}", kinds());
  if (auto tools = line.find("tools"); tools != line.end() && !tools->is_null() && !(tools->is_array() && tools->empty()))
    fail("field \"tools\": tools are not supported by the chat renderer");
  if (text) {
    const json& t = line["text"];
    DS_CHECK(t.is_string(), "field \"text\" must be a string, got {}", t.type_name());
    return LabelledText{t.get<std::string>(), false, {}};
  }
  ChatTemplateOptions opt;
  opt.add_generation_prompt = optional_bool(line, "add_generation_prompt", false);
  opt.enable_thinking = optional_bool(line, "enable_thinking", true);
  if (chat) return render_qwen3_chat(parse_messages(line["messages"], "messages"), opt);
  DS_CHECK(line.contains("prompt"), "field \"prompt\" is missing (a \"completion\" needs its \"prompt\")");
  DS_CHECK(line.contains("completion"), "field \"completion\" is missing (a \"prompt\" needs its \"completion\")");
  const json &p = line["prompt"], &c = line["completion"];
  if (p.is_string() && c.is_string()) {
    DS_CHECK(!opt.add_generation_prompt, "field \"add_generation_prompt\": only for conversations");
    LabelledText out{p.get<std::string>(), true, {}, /*split_at_labels=*/true};
    const size_t begin = out.text.size();
    out.text += c.get<std::string>();
    if (out.text.size() > begin) out.labels.push_back({begin, out.text.size()});
    return out;
  }
  DS_CHECK(p.is_array() && c.is_array(),
           "fields \"prompt\" and \"completion\" must both be strings or both be message lists, got {} and {}",
           p.type_name(), c.type_name());
  std::vector<ChatMessage> msgs = parse_messages(p, "prompt");
  std::vector<ChatMessage> tail = parse_messages(c, "completion");
  opt.label_from = msgs.size();
  msgs.insert(msgs.end(), tail.begin(), tail.end());
  return render_qwen3_chat(msgs, opt);
}

void check_chat_tokens(const Tokenizer& tok) {
  for (const char* marker : {"<|im_start|>", "<|im_end|>"})
    tok.required_id(marker, "the chat template (conversation samples, generate --chat)", true);
}

TokenizedSample tokenize_sample(const Tokenizer& tok, const LabelledText& sample) {
  TokenizedSample out;
  if (!sample.masked) {
    out.ids = tok.encode(sample.text);
    return out;
  }
  if (sample.split_at_labels) {  // each span on its own: the labels are exactly the labelled spans' tokens
    size_t at = 0;
    auto piece = [&](size_t end, uint8_t label) {
      if (end <= at) return;
      const std::vector<int32_t> ids = tok.encode(sample.text.substr(at, end - at));
      out.ids.insert(out.ids.end(), ids.begin(), ids.end());
      out.loss_mask.insert(out.loss_mask.end(), ids.size(), label);
      at = end;
    };
    for (const ByteSpan& l : sample.labels) {
      piece(l.begin, 0);
      piece(l.end, 1);
    }
    piece(sample.text.size(), 0);
    return out;
  }
  check_chat_tokens(tok);  // a conversation: its turn markers must be single tokens
  std::vector<TokenOffset> offsets;
  out.ids = tok.encode_with_offsets(sample.text, offsets);
  out.loss_mask.assign(out.ids.size(), 0);
  size_t s = 0;  // spans and token offsets both ascend
  for (size_t i = 0; i < offsets.size(); ++i) {
    const TokenOffset& o = offsets[i];
    while (s < sample.labels.size() && sample.labels[s].end <= o.begin) ++s;
    if (s < sample.labels.size() && o.end > o.begin && sample.labels[s].begin <= o.begin && o.end <= sample.labels[s].end)
      out.loss_mask[i] = 1;
  }
  return out;
}

}  // namespace ds
