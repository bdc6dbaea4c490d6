// constraint.json-schema: structured output. Compiles JSON mode, a JSON Schema, a tool-call
// spec (tessera/sdk/constraint.h), a regex (regex.h) or a GBNF grammar (gbnf.cpp) to a
// byte-level pushdown matcher (grammar.h, matcher.h);
// per step the allowed-token mask comes from walking the vocabulary trie from the matcher
// state, cached by state (token_mask.h). Compiled specs are cached too, so requests that send
// the same schema share one grammar and its masks.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <list>
#include <map>
#include <memory>
#include <mutex>

#include "grammar.h"
#include "matcher.h"
#include "tessera/sdk.h"
#include "token_mask.h"

namespace tessera {
namespace {

using json_constraint::ByteMatcher;
using json_constraint::Grammar;
using json_constraint::GrammarLimits;
using json_constraint::MaskCache;
using json_constraint::State;
using json_constraint::TokenTrie;

const ParamSpec kParams[] = {
    {"max_whitespace", ParamType::kInt, "8",
     "most consecutive whitespace bytes allowed between JSON tokens (0: compact JSON only)", 0, 64},
    {"max_depth", ParamType::kInt, "16", "deepest nesting of free-form (schema-less) objects and arrays", 1, 20},
    {"mask_cache_entries", ParamType::kInt, "512",
     "token masks kept per compiled spec, by matcher state (vocabulary / 8 bytes each)", 0, 1 << 20},
    {"compiled_cache_entries", ParamType::kInt, "32", "compiled specs kept for reuse by later requests", 0, 4096},
    // Read by the engine, not by this plugin (as a drafter's `adaptive` is).
    {"prepare_masks", ParamType::kEnum, "auto",
     "compute the masks on a helper thread while the forward runs: on, off, or auto (when the forward leaves a "
     "core free: a GPU backend, or fewer CPU threads than cores)",
     -INFINITY, INFINITY, "auto|on|off"},
};

struct Vocabulary {
  std::vector<std::string> bytes;
  std::vector<TokenId> end_tokens;  // sorted
  std::shared_ptr<const TokenTrie> trie;

  bool is_end(TokenId t) const { return std::binary_search(end_tokens.begin(), end_tokens.end(), t); }
};

class CompiledGrammar final : public CompiledConstraint,
                              public std::enable_shared_from_this<CompiledGrammar> {
 public:
  CompiledGrammar(Grammar grammar, std::shared_ptr<const Vocabulary> vocab, size_t cache_entries)
      : matcher_(std::move(grammar)), vocab_(std::move(vocab)),
        masks_(vocab_->trie, vocab_->end_tokens, cache_entries) {}

  Status new_matcher(std::unique_ptr<ConstraintMatcher>* out) const override;

  const ByteMatcher& matcher() const { return matcher_; }
  const Vocabulary& vocab() const { return *vocab_; }
  MaskCache& masks() const { return masks_; }

 private:
  ByteMatcher matcher_;
  std::shared_ptr<const Vocabulary> vocab_;
  mutable MaskCache masks_;  // thread-safe
};

class GrammarMatcher final : public ConstraintMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> g)
      : g_(std::move(g)), state_(g_->matcher().initial()) {}

  Status fill_mask(std::span<uint32_t> allowed) override {
    if (ended_) return Status::ok();  // nothing may follow the end
    g_->masks().fill(g_->matcher(), state_, allowed);
    return Status::ok();
  }

  bool accept(TokenId token) override {
    if (ended_) return false;
    const Vocabulary& v = g_->vocab();
    if (v.is_end(token)) {
      if (!g_->matcher().can_end(state_)) return false;
      ended_ = true;
      return true;
    }
    if (token < 0 || static_cast<size_t>(token) >= v.bytes.size()) return false;
    const std::string& bytes = v.bytes[static_cast<size_t>(token)];
    if (bytes.empty()) return false;
    scratch_ = state_;
    if (!g_->matcher().feed_all(&scratch_, bytes)) return false;
    std::swap(state_, scratch_);
    return true;
  }

  bool is_complete() const override { return ended_ || g_->matcher().is_complete(state_); }

  std::unique_ptr<ConstraintMatcher> clone() const override {
    return std::make_unique<GrammarMatcher>(*this);
  }

 private:
  std::shared_ptr<const CompiledGrammar> g_;
  State state_;
  State scratch_;
  bool ended_ = false;
};

Status CompiledGrammar::new_matcher(std::unique_ptr<ConstraintMatcher>* out) const {
  *out = std::make_unique<GrammarMatcher>(shared_from_this());
  return Status::ok();
}

class JsonSchemaConstraint final : public Constraint {
 public:
  JsonSchemaConstraint(GrammarLimits limits, size_t mask_entries, size_t compiled_entries)
      : limits_(limits), mask_entries_(mask_entries), compiled_entries_(compiled_entries) {}

  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<Constraint>* out) {
    GrammarLimits limits;
    limits.max_whitespace = static_cast<int32_t>(config.get_int("max_whitespace"));
    limits.max_depth = static_cast<int32_t>(config.get_int("max_depth"));
    *out = std::make_unique<JsonSchemaConstraint>(limits, static_cast<size_t>(config.get_int("mask_cache_entries")),
                                                  static_cast<size_t>(config.get_int("compiled_cache_entries")));
    return Status::ok();
  }

  Status set_vocabulary(const ConstraintVocabulary& vocabulary) override {
    auto v = std::make_shared<Vocabulary>();
    v->bytes.assign(vocabulary.token_bytes.begin(), vocabulary.token_bytes.end());
    v->end_tokens.assign(vocabulary.end_tokens.begin(), vocabulary.end_tokens.end());
    std::sort(v->end_tokens.begin(), v->end_tokens.end());
    // The trie is built by the first compile: stacks that never see a constrained request
    // do not pay for it.
    std::lock_guard<std::mutex> lock(mutex_);
    vocab_ = std::move(v);
    compiled_.clear();
    order_.clear();
    return Status::ok();
  }

  Status compile(const ConstraintSpec& spec, std::shared_ptr<const CompiledConstraint>* out) override {
    std::shared_ptr<const Vocabulary> vocab;
    const std::string key = spec.kind + '\0' + spec.source;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!vocab_) return internal_error("compile before set_vocabulary");
      if (!vocab_->trie) {
        auto v = std::make_shared<Vocabulary>(*vocab_);
        v->trie = std::make_shared<const TokenTrie>(v->bytes);
        vocab_ = std::move(v);
      }
      vocab = vocab_;
      if (auto it = compiled_.find(key); it != compiled_.end()) {
        order_.splice(order_.begin(), order_, it->second.second);
        *out = it->second.first;
        return Status::ok();
      }
    }
    Grammar grammar;
    Status st;
    if (spec.kind == "json") {
      st = json_constraint::compile_json_object(limits_, &grammar);
    } else if (spec.kind == "json_schema" || spec.kind == "tool_calls") {
      nlohmann::ordered_json doc;
      try {
        doc = nlohmann::ordered_json::parse(spec.source);
      } catch (const std::exception& e) {
        return invalid_argument(std::string("schema: not valid JSON: ") + e.what());
      }
      st = spec.kind == "json_schema" ? json_constraint::compile_json_schema(doc, limits_, &grammar)
                                      : json_constraint::compile_tool_calls(doc, limits_, &grammar);
    } else if (spec.kind == "regex") {
      st = json_constraint::compile_regex_output(spec.source, limits_, &grammar);
    } else if (spec.kind == "grammar") {
      st = json_constraint::compile_gbnf(spec.source, limits_, &grammar);
    } else {
      return invalid_argument("kind: unknown constraint kind \"" + spec.kind +
                              "\" (expected json, json_schema, tool_calls, regex or grammar)");
    }
    if (!st.is_ok()) return st;
    auto compiled = std::make_shared<CompiledGrammar>(std::move(grammar), vocab, mask_entries_);
    *out = compiled;
    if (compiled_entries_ == 0) return Status::ok();
    std::lock_guard<std::mutex> lock(mutex_);
    if (compiled_.count(key) || vocab != vocab_) return Status::ok();
    if (compiled_.size() >= compiled_entries_) {
      compiled_.erase(order_.back());
      order_.pop_back();
    }
    order_.push_front(key);
    compiled_.emplace(key, std::make_pair(std::move(compiled), order_.begin()));
    return Status::ok();
  }

 private:
  GrammarLimits limits_;
  size_t mask_entries_;
  size_t compiled_entries_;
  std::mutex mutex_;
  std::shared_ptr<const Vocabulary> vocab_;
  std::list<std::string> order_;  // most recently used first
  std::map<std::string, std::pair<std::shared_ptr<const CompiledGrammar>, std::list<std::string>::iterator>> compiled_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::JsonSchemaConstraint, tessera::Constraint, "json-schema", "0.1.0",
                        "structured output: JSON mode, JSON Schema, tool calls, regex and GBNF grammars as token masks from a "
                        "byte-level pushdown matcher over a vocabulary trie",
                        tessera::kParams)
