#include "token_mask.h"

#include <algorithm>
#include <array>
#include <map>
#include <numeric>

namespace tessera::json_constraint {

TokenTrie::TokenTrie(std::span<const std::string> token_bytes)
    : vocab_size_(static_cast<int32_t>(token_bytes.size())) {
  std::vector<TokenId> order;
  for (size_t t = 0; t < token_bytes.size(); ++t)
    if (!token_bytes[t].empty()) order.push_back(static_cast<TokenId>(t));
  std::sort(order.begin(), order.end(), [&](TokenId a, TokenId b) {
    return token_bytes[static_cast<size_t>(a)] < token_bytes[static_cast<size_t>(b)];
  });
  // Sorted strings visit the trie in preorder: each one shares a prefix with the previous
  // one and appends its remaining bytes as new nodes.
  auto add_node = [&](uint8_t b, int32_t depth) {
    bytes_.push_back(b);
    depth_.push_back(depth);
    end_.push_back(0);
    first_.push_back(static_cast<uint32_t>(tokens_.size()));
    max_depth_ = std::max(max_depth_, depth);
  };
  add_node(0, 0);                // the root
  std::vector<uint32_t> path{0};  // node of each depth on the current path
  const std::string* prev = nullptr;
  for (TokenId t : order) {
    const std::string& s = token_bytes[static_cast<size_t>(t)];
    size_t common = 0;
    if (prev) {
      const size_t limit = std::min(prev->size(), s.size());
      while (common < limit && (*prev)[common] == s[common]) ++common;
    }
    while (path.size() > common + 1) {
      end_[path.back()] = static_cast<uint32_t>(bytes_.size());
      path.pop_back();
    }
    for (size_t k = common; k < s.size(); ++k) {
      path.push_back(static_cast<uint32_t>(bytes_.size()));
      add_node(static_cast<uint8_t>(s[k]), static_cast<int32_t>(k + 1));
    }
    tokens_.push_back(t);
    prev = &s;
  }
  while (!path.empty()) {
    end_[path.back()] = static_cast<uint32_t>(bytes_.size());
    path.pop_back();
  }
  first_.push_back(static_cast<uint32_t>(tokens_.size()));
}

namespace {

void set_tokens(const TokenTrie& trie, size_t node, std::span<uint32_t> allowed) {
  for (TokenId t : trie.tokens_at(node)) allowed[static_cast<size_t>(t) >> 5] |= 1u << (t & 31);
}

// Depth-first over `trie` from automaton state `start`, `next(state, edge)` giving the state
// after an edge or -1 (dead: the subtree is skipped); sets the bits of the tokens reached.
template <typename Next>
void walk_automaton(const TokenTrie& trie, int32_t start, Next next, std::span<uint32_t> allowed) {
  std::vector<int32_t> states(static_cast<size_t>(trie.max_depth()) + 1);
  states[0] = start;
  const size_t n = trie.size();
  size_t i = 1;
  while (i < n) {
    const auto d = static_cast<size_t>(trie.depth(i));
    const int32_t to = next(states[d - 1], trie.byte(i));
    if (to < 0) {
      i = trie.subtree_end(i);
      continue;
    }
    states[d] = to;
    set_tokens(trie, i, allowed);
    ++i;
  }
}

}  // namespace

void compute_token_mask(const ByteMatcher& matcher, const TokenTrie& trie, const State& state,
                        std::span<uint32_t> allowed) {
  const ByteDfa* dfa = nullptr;
  int32_t start = -1;
  if (!matcher.whole_output_regex(state, &dfa, &start)) {
    compute_token_mask_by_matcher(matcher, trie, state, allowed);
    return;
  }
  walk_automaton(trie, start, [dfa](int32_t state, uint8_t byte) { return dfa->next(state, byte); }, allowed);
}

void compute_token_mask_by_matcher(const ByteMatcher& matcher, const TokenTrie& trie, const State& state,
                                   std::span<uint32_t> allowed) {
  if (state.dead()) return;
  std::vector<State> states(static_cast<size_t>(trie.max_depth()) + 1);
  states[0] = state;
  const size_t n = trie.size();
  size_t i = 1;
  while (i < n) {
    const auto d = static_cast<size_t>(trie.depth(i));
    matcher.feed(states[d - 1], trie.byte(i), &states[d]);
    if (states[d].dead()) {
      i = trie.subtree_end(i);
      continue;
    }
    set_tokens(trie, i, allowed);
    ++i;
  }
}

DfaTokenIndex::DfaTokenIndex(const ByteDfa& dfa, const TokenTrie& tokens) {
  // Byte classes: bytes whose DFA columns are equal.
  const int32_t num_states = dfa.num_states();
  std::map<std::vector<int32_t>, int32_t> class_of_column;
  std::array<uint8_t, 256> class_of_byte{};
  std::vector<int32_t> column(static_cast<size_t>(num_states));
  for (int b = 0; b < 256; ++b) {
    for (int32_t st = 0; st < num_states; ++st) column[static_cast<size_t>(st)] = dfa.next(st, static_cast<uint8_t>(b));
    auto [it, added] = class_of_column.emplace(column, static_cast<int32_t>(class_of_column.size()));
    class_of_byte[static_cast<size_t>(b)] = static_cast<uint8_t>(it->second);
  }
  num_classes_ = static_cast<int32_t>(class_of_column.size());
  next_.assign(static_cast<size_t>(num_states) * static_cast<size_t>(num_classes_), -1);
  for (int b = 0; b < 256; ++b)
    for (int32_t st = 0; st < num_states; ++st)
      next_[static_cast<size_t>(st) * static_cast<size_t>(num_classes_) + class_of_byte[static_cast<size_t>(b)]] =
          dfa.next(st, static_cast<uint8_t>(b));
  // Every token's class string, read back from the byte trie in preorder.
  std::vector<std::string> class_strings(static_cast<size_t>(tokens.vocab_size()));
  std::string path;
  for (size_t i = 1; i < tokens.size(); ++i) {
    path.resize(static_cast<size_t>(tokens.depth(i)) - 1);
    path.push_back(static_cast<char>(class_of_byte[tokens.byte(i)]));
    for (TokenId t : tokens.tokens_at(i)) class_strings[static_cast<size_t>(t)] = path;
  }
  classes_ = std::make_unique<const TokenTrie>(class_strings);
}

void DfaTokenIndex::fill(int32_t dfa_state, std::span<uint32_t> allowed) const {
  const auto k = static_cast<size_t>(num_classes_);
  walk_automaton(
      *classes_, dfa_state,
      [this, k](int32_t state, uint8_t klass) { return next_[static_cast<size_t>(state) * k + klass]; }, allowed);
}

MaskCache::MaskCache(std::shared_ptr<const TokenTrie> trie, std::vector<TokenId> end_tokens, size_t capacity)
    : trie_(std::move(trie)), end_tokens_(std::move(end_tokens)), capacity_(capacity) {}

size_t MaskCache::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return masks_.size();
}

bool MaskCache::fill(const ByteMatcher& matcher, const State& state, std::span<uint32_t> allowed) {
  std::string key(state.key());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = masks_.find(key); it != masks_.end()) {
      order_.splice(order_.begin(), order_, it->second.second);
      const Mask& m = it->second.first;
      std::copy(m.begin(), m.begin() + static_cast<std::ptrdiff_t>(std::min(m.size(), allowed.size())),
                allowed.begin());
      return true;
    }
  }
  // Computed outside the lock: another sequence may compute the same mask meanwhile, which
  // only costs time.
  Mask m((static_cast<size_t>(trie_->vocab_size()) + 31) / 32, 0u);
  const ByteDfa* dfa = nullptr;
  int32_t dfa_state = -1;
  if (matcher.whole_output_regex(state, &dfa, &dfa_state)) {
    std::call_once(regex_index_once_, [&] { regex_index_ = std::make_unique<const DfaTokenIndex>(*dfa, *trie_); });
    regex_index_->fill(dfa_state, m);
  } else {
    compute_token_mask(matcher, *trie_, state, m);
  }
  if (matcher.can_end(state))
    for (TokenId t : end_tokens_)
      if (t >= 0 && t < trie_->vocab_size()) m[static_cast<size_t>(t) >> 5] |= 1u << (t & 31);
  std::copy(m.begin(), m.begin() + static_cast<std::ptrdiff_t>(std::min(m.size(), allowed.size())),
            allowed.begin());
  if (capacity_ == 0) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  if (masks_.count(key)) return false;
  if (masks_.size() >= capacity_) {
    masks_.erase(order_.back());
    order_.pop_back();
  }
  order_.push_front(key);
  masks_.emplace(std::move(key), std::make_pair(std::move(m), order_.begin()));
  return false;
}

}  // namespace tessera::json_constraint
