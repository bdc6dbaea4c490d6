// Token masks from matcher states: the vocabulary's byte strings in a prefix trie (built once
// per tokenizer), walked depth-first from a state, each trie edge one ByteMatcher::feed; a
// subtree is skipped as soon as its prefix kills every thread, so structural positions visit
// few nodes. Masks are cached per compiled grammar by state: inside a string or between
// values the same state comes back at every step and every sequence sharing the schema.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "matcher.h"
#include "tessera/sdk/types.h"

namespace tessera::json_constraint {

// The vocabulary in preorder: node i's subtree is [i, end[i]), its parent's state is the one
// at depth[i] - 1, and the tokens whose bytes end at node i are tokens[first[i], first[i + 1]).
class TokenTrie {
 public:
  // token_bytes[t]: the bytes of token t ("" for tokens never allowed).
  explicit TokenTrie(std::span<const std::string> token_bytes);

  size_t size() const { return bytes_.size(); }
  int32_t vocab_size() const { return vocab_size_; }
  int32_t max_depth() const { return max_depth_; }
  uint8_t byte(size_t i) const { return bytes_[i]; }
  int32_t depth(size_t i) const { return depth_[i]; }
  uint32_t subtree_end(size_t i) const { return end_[i]; }
  std::span<const TokenId> tokens_at(size_t i) const {
    return {tokens_.data() + first_[i], tokens_.data() + first_[i + 1]};
  }

 private:
  std::vector<uint8_t> bytes_;
  std::vector<int32_t> depth_;
  std::vector<uint32_t> end_;
  std::vector<uint32_t> first_;  // size() + 1 entries
  std::vector<TokenId> tokens_;
  int32_t vocab_size_ = 0;
  int32_t max_depth_ = 0;
};

// Walks the trie from `state`: sets bit t of `allowed` for every token whose bytes keep the
// state alive. End tokens are the caller's business. A state inside a regex that is the whole
// output walks the regex's DFA (one table lookup per trie edge, 20-50x cheaper than a matcher
// step: a regex with many states misses the mask cache often); any other state feeds the
// matcher.
void compute_token_mask(const ByteMatcher& matcher, const TokenTrie& trie, const State& state,
                        std::span<uint32_t> allowed);
// The general walk, every edge a ByteMatcher::feed (what compute_token_mask does when the DFA
// shortcut does not apply; exposed so tests can check the two agree).
void compute_token_mask_by_matcher(const ByteMatcher& matcher, const TokenTrie& trie, const State& state,
                                   std::span<uint32_t> allowed);

// A whole-output regex's view of the vocabulary, for masks of states the cache has not seen:
// bytes the DFA never tells apart share a class (a regex over words has a handful: capitals,
// small letters, space, comma, ...), so every token becomes a string of classes and tokens
// with the same class string share a trie node ("hello" and "world" are one path). Walking
// that much smaller trie over the DFA compressed to classes costs a fraction of the byte trie
// walk (which visits every live byte prefix of 49k tokens). Immutable once built.
class DfaTokenIndex {
 public:
  DfaTokenIndex(const ByteDfa& dfa, const TokenTrie& tokens);
  // Sets bit t of `allowed` for every token whose bytes keep `dfa_state` alive.
  void fill(int32_t dfa_state, std::span<uint32_t> allowed) const;
  int32_t num_classes() const { return num_classes_; }
  size_t num_nodes() const { return classes_->size(); }

 private:
  int32_t num_classes_ = 0;
  std::vector<int32_t> next_;  // state * num_classes_ + class
  std::unique_ptr<const TokenTrie> classes_;  // the tokens' class strings
};

// compute_token_mask with a bounded cache (least recently used out), end tokens included when
// the state may end. Thread-safe.
class MaskCache {
 public:
  MaskCache(std::shared_ptr<const TokenTrie> trie, std::vector<TokenId> end_tokens, size_t capacity);
  // Fills `allowed` (zeroed by the caller). Returns whether the mask came from the cache.
  bool fill(const ByteMatcher& matcher, const State& state, std::span<uint32_t> allowed);
  size_t size() const;

 private:
  using Mask = std::vector<uint32_t>;
  std::shared_ptr<const TokenTrie> trie_;
  std::vector<TokenId> end_tokens_;
  size_t capacity_;
  // Built on the first mask of a whole-output regex state (the grammar's one regex).
  std::once_flag regex_index_once_;
  std::unique_ptr<const DfaTokenIndex> regex_index_;
  mutable std::mutex mutex_;
  std::list<std::string> order_;  // most recently used first
  std::unordered_map<std::string, std::pair<Mask, std::list<std::string>::iterator>> masks_;
};

}  // namespace tessera::json_constraint
