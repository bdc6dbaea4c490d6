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
// state alive. End tokens are the caller's business.
void compute_token_mask(const ByteMatcher& matcher, const TokenTrie& trie, const State& state,
                        std::span<uint32_t> allowed);

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
  mutable std::mutex mutex_;
  std::list<std::string> order_;  // most recently used first
  std::unordered_map<std::string, std::pair<Mask, std::list<std::string>::iterator>> masks_;
};

}  // namespace tessera::json_constraint
