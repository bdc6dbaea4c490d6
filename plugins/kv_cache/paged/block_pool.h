// The block pool of kv_cache.paged: reference counts, the free queue in eviction order and
// the prefix-cache index (chain hash -> blocks), after vLLM v1's block_pool.py.
//
// A block is in exactly one of three states:
//   used   - ref_count > 0 (held by at least one live sequence);
//   cached - ref_count == 0 but published under a prefix hash: its K/V may still be reused,
//            and it sits in an LRU list, least recently released first (evicted first);
//   plain  - ref_count == 0 and never published (or evicted): free with nothing worth keeping.
// Allocation prefers plain blocks and evicts cached ones only when no plain block is left,
// so reusable K/V survives as long as memory allows. Not thread-safe (engine step thread).
//
// Everything is sized in reset(): the prefix index is a fixed bucket array with chains
// threaded through the blocks, and each block's token ids live in one flat array, so
// allocating, publishing, finding and evicting never touch the heap during serving.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/sdk/types.h"

namespace tessera::paged {

// 64-bit finalizer of MurmurHash3 (a bijection with full avalanche).
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// Hash of the chain "every block up to and including this one": folds the previous block's
// chain hash with this block's token ids, so equal blocks after different prefixes differ.
inline constexpr uint64_t kRootHash = 0x7e55e7a0c0ffee11ULL;
inline uint64_t chain_hash(uint64_t parent_hash, std::span<const TokenId> tokens) {
  uint64_t h = mix64(parent_hash ^ 0x9e3779b97f4a7c15ULL);
  for (TokenId t : tokens)
    h = mix64(h + (static_cast<uint64_t>(static_cast<uint32_t>(t)) + 1) * 0xbf58476d1ce4e5b9ULL);
  return mix64(h ^ static_cast<uint64_t>(tokens.size()));
}

class BlockPool {
 public:
  void reset(int32_t num_blocks, int32_t block_size) {
    blocks_.assign(static_cast<size_t>(num_blocks), Block{});
    block_size_ = block_size;
    block_tokens_.assign(static_cast<size_t>(num_blocks) * block_size, 0);
    // A power of two with at least two buckets per block keeps chains short.
    size_t buckets = 1;
    while (buckets < 2 * static_cast<size_t>(std::max(1, num_blocks))) buckets *= 2;
    bucket_heads_.assign(buckets, -1);
    plain_.clear();
    // A stack popped from the back: block 0 is handed out first, which keeps early tables
    // readable in logs and tests.
    for (int32_t b = num_blocks - 1; b >= 0; --b) plain_.push_back(b);
    lru_head_ = lru_tail_ = -1;
    num_cached_ = 0;
  }

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  // Blocks an allocation may take: plain ones plus evictable cached ones.
  int32_t num_free() const { return static_cast<int32_t>(plain_.size()) + num_cached_; }
  int32_t num_cached() const { return num_cached_; }
  int32_t num_used() const { return num_blocks() - num_free(); }
  int32_t ref_count(int32_t b) const { return blocks_[b].ref_count; }
  bool is_published(int32_t b) const { return blocks_[b].is_published; }

  // Takes an unreferenced block (ref_count becomes 1): a plain one if any, else the least
  // recently released cached one, whose prefix entry is dropped. -1 when none is free.
  int32_t allocate() {
    int32_t b = -1;
    if (!plain_.empty()) {
      b = plain_.back();
      plain_.pop_back();
    } else if (lru_head_ >= 0) {
      b = lru_head_;
      lru_remove(b);
      unpublish(b);
    } else {
      return -1;
    }
    blocks_[b].ref_count = 1;
    return b;
  }

  // One more reference; a cached block leaves the LRU list (it is in use again).
  void add_ref(int32_t b) {
    Block& block = blocks_[b];
    if (block.ref_count++ == 0 && block.in_lru) lru_remove(b);
  }

  // One reference fewer. At zero a published block joins the LRU tail (most recently
  // released, evicted last) and stays findable; an unpublished one becomes plain free.
  void release(int32_t b) {
    Block& block = blocks_[b];
    if (--block.ref_count > 0) return;
    if (block.is_published) {
      lru_push_back(b);
    } else {
      plain_.push_back(b);
    }
  }

  // A published block whose chain matches exactly: same chain hash, same parent chain hash
  // and the same token ids. Comparing the stored content means a 64-bit hash collision can
  // never hand out wrong K/V. Prefers a block already in use, so a hit costs no free block.
  int32_t find(uint64_t hash, uint64_t parent_hash, std::span<const TokenId> tokens) const {
    int32_t found = -1;
    for (int32_t b = bucket_heads_[bucket_of(hash)]; b >= 0; b = blocks_[b].hash_next) {
      const Block& block = blocks_[b];
      if (block.hash != hash || block.parent_hash != parent_hash ||
          !std::ranges::equal(tokens_of(b), tokens))
        continue;
      if (block.ref_count > 0) return b;
      if (found < 0) found = b;
    }
    return found;
  }

  // Makes a full, computed block findable under its chain hash. Several blocks may hold the
  // same chain (two sequences computed it before either published); each stays findable
  // until evicted, so losing one copy does not lose the prefix.
  void publish(int32_t b, uint64_t hash, uint64_t parent_hash, std::span<const TokenId> tokens) {
    Block& block = blocks_[b];
    if (block.is_published) return;
    block.is_published = true;
    block.hash = hash;
    block.parent_hash = parent_hash;
    block.num_tokens = static_cast<int32_t>(std::min<size_t>(tokens.size(), block_size_));
    std::copy_n(tokens.begin(), block.num_tokens, block_tokens_.begin() + static_cast<size_t>(b) * block_size_);
    // Appended at the chain's tail, so among equal chains the first published is found first.
    int32_t* link = &bucket_heads_[bucket_of(hash)];
    while (*link >= 0) link = &blocks_[*link].hash_next;
    *link = b;
    block.hash_next = -1;
  }

  // Cached blocks from least to most recently released (the eviction order), for tests.
  std::vector<int32_t> eviction_order() const {
    std::vector<int32_t> order;
    for (int32_t b = lru_head_; b >= 0; b = blocks_[b].next) order.push_back(b);
    return order;
  }

 private:
  struct Block {
    int32_t ref_count = 0;
    bool is_published = false;
    bool in_lru = false;
    uint64_t hash = 0;
    uint64_t parent_hash = 0;
    int32_t num_tokens = 0;       // of its slice of block_tokens_, kept to verify prefix hits
    int32_t hash_next = -1;       // next published block in the same index bucket
    int32_t prev = -1;            // LRU links (intrusive, so a hit leaves the list in O(1))
    int32_t next = -1;
  };

  size_t bucket_of(uint64_t hash) const { return hash & (bucket_heads_.size() - 1); }

  std::span<const TokenId> tokens_of(int32_t b) const {
    return {block_tokens_.data() + static_cast<size_t>(b) * block_size_,
            static_cast<size_t>(blocks_[b].num_tokens)};
  }

  void unpublish(int32_t b) {
    Block& block = blocks_[b];
    if (!block.is_published) return;
    for (int32_t* link = &bucket_heads_[bucket_of(block.hash)]; *link >= 0; link = &blocks_[*link].hash_next)
      if (*link == b) {
        *link = block.hash_next;
        break;
      }
    block.hash_next = -1;
    block.is_published = false;
    block.num_tokens = 0;
  }

  void lru_push_back(int32_t b) {
    Block& block = blocks_[b];
    block.prev = lru_tail_;
    block.next = -1;
    if (lru_tail_ >= 0) blocks_[lru_tail_].next = b; else lru_head_ = b;
    lru_tail_ = b;
    block.in_lru = true;
    ++num_cached_;
  }

  void lru_remove(int32_t b) {
    Block& block = blocks_[b];
    if (block.prev >= 0) blocks_[block.prev].next = block.next; else lru_head_ = block.next;
    if (block.next >= 0) blocks_[block.next].prev = block.prev; else lru_tail_ = block.prev;
    block.prev = block.next = -1;
    block.in_lru = false;
    --num_cached_;
  }

  std::vector<Block> blocks_;
  std::vector<int32_t> plain_;
  int32_t lru_head_ = -1;
  int32_t lru_tail_ = -1;
  int32_t num_cached_ = 0;
  int32_t block_size_ = 0;
  std::vector<TokenId> block_tokens_;  // num_blocks x block_size token ids
  std::vector<int32_t> bucket_heads_;  // prefix index: first published block per bucket
};

}  // namespace tessera::paged
