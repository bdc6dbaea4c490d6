// constraint plugins decide which tokens may come next (structured output, tool calls): a
// logits-mask stage between the forward and the sampler. A request carries a compiled
// constraint; the engine keeps one matcher per sequence, masks the sequence's logit rows with
// it before sampling (and checks speculative drafts against it), advances it on every token
// the sequence keeps, and ends the sequence when the matcher says the output is complete.
// Since SDK ABI 2.1.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/types.h"

namespace tessera {

// The tokenizer as a constraint sees it, given once per engine.
struct ConstraintVocabulary {
  // Bytes each token id decodes to (byte-level BPE bytes un-mapped, SPM pieces with spaces);
  // empty for control tokens, which a constraint never allows except the end tokens.
  std::span<const std::string> token_bytes;
  // End-of-generation ids: allowed exactly when the output may end here.
  std::span<const TokenId> end_tokens;
};

// What a request asks for. `kind` names the language, `source` is its text:
//  - "json": any JSON object (OpenAI's response_format json_object); source unused.
//  - "json_schema": source is a JSON Schema document (response_format json_schema).
//  - "tool_calls": source is a JSON object {"tools": [{"name", "parameters"}], "begin",
//    "end", "separator", "allow_text", "parallel"}: one or more `begin` JSON `end` blocks
//    joined by `separator`, each JSON {"name": <a tool's name>, "arguments": <that tool's
//    parameters schema>}; with allow_text, plain text that does not start with `begin` instead.
//  - "regex": source is a regular expression the whole output must match (vLLM's guided_regex).
//  - "grammar": source is a grammar in llama.cpp's GBNF format, starting at rule `root`.
// A plugin refuses a kind it does not implement with kInvalidArgument naming it. The kinds are
// strings, so a new kind needs no ABI change; constraint.json-schema implements all five.
struct ConstraintSpec {
  std::string kind;
  std::string source;
};

// The per-sequence state of a compiled constraint. Engine thread only; the engine owns it.
class ConstraintMatcher {
 public:
  virtual ~ConstraintMatcher() = default;
  // Sets bit t (word t / 32, bit t % 32) of `allowed` for every token allowed next, end tokens
  // included when the output may end here. `allowed` holds ceil(vocab / 32) words, zeroed by
  // the caller. A non-OK status fails the sequence with its message.
  virtual Status fill_mask(std::span<uint32_t> allowed) = 0;
  // Advances over `token` (an end token: the output ends). Returns false, state unchanged,
  // when the token is not allowed.
  virtual bool accept(TokenId token) = 0;
  // Nothing but the end may follow: the engine stops the sequence (finish reason "stop").
  virtual bool is_complete() const = 0;
  // An independent copy in the same state (speculative verification walks drafts on one).
  virtual std::unique_ptr<ConstraintMatcher> clone() const = 0;
};

// A constraint compiled once per request (or shared between requests with the same spec).
// Immutable to its users; may be shared by the matchers of several sequences at once.
class CompiledConstraint {
 public:
  virtual ~CompiledConstraint() = default;
  virtual Status new_matcher(std::unique_ptr<ConstraintMatcher>* out) const = 0;
};

class Constraint {
 public:
  virtual ~Constraint() = default;
  // Called once by the engine before any compile. Engine construction thread.
  virtual Status set_vocabulary(const ConstraintVocabulary& vocabulary) = 0;
  // Compiles a spec. Thread-safe (servers call it from their io threads). A bad spec is
  // kInvalidArgument whose message starts with the path of the offending part of the source
  // ("properties.age.type: ..."). Objects handed out must not outlive this Constraint.
  virtual Status compile(const ConstraintSpec& spec, std::shared_ptr<const CompiledConstraint>* out) = 0;
};

template <> struct PluginKindOf<Constraint> {
  static constexpr PluginKind value = PluginKind::kConstraint;
};

}  // namespace tessera
