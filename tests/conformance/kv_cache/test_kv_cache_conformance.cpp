// Conformance suite for kv_cache plugins: every plugin of the kind (kv_cache.contiguous and
// kv_cache.paged at several block sizes), loaded by name through the real plugin registry.
//
// Besides the bookkeeping (all-or-nothing allocation, tables covering the tokens, everything
// returning to free), the suite simulates the KV memory the backend would own: a "runner"
// performs the block copies and writes a value for every token into the slot the block table
// names, where the value stands for the token's K/V (a hash of the whole prefix up to it). A
// sequence must then read back exactly its own prefix values, whatever sharing, copy-on-write,
// prefix reuse and eviction happened in between; and no block may be written while another
// live sequence holds it. Prefix caching and LRU eviction have paged-only cases below.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/plugins.h"
#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk/kv_cache.h"

namespace {

using namespace tessera;

// 64 bytes of K/V per token in f16: 2 (K,V) x 2 layers x 2 heads x 4 dims x 2 bytes.
constexpr KvModelShape kShape{2, 2, 4, /*max_context=*/64, /*max_num_seqs=*/8};
constexpr int64_t kTokenBytes = 64;
// A head_dim that Q8_0 blocks of 32 fit: 272 bytes per token in q8_0 (2 x 2 x 2 x 34), 512 in f16.
constexpr KvModelShape kShape32{2, 2, 32, /*max_context=*/64, /*max_num_seqs=*/8};
constexpr int64_t kTokenBytesQ8 = 272;

struct Variant {
  std::string plugin;  // "contiguous" or "paged"
  int32_t block_size;  // paged only (contiguous uses max_context)
  std::string label() const {
    return plugin == "paged" ? "paged/bs=" + std::to_string(block_size) : plugin;
  }
  bool is_paged() const { return plugin == "paged"; }
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"contiguous", 0}, {"paged", 1}, {"paged", 4}, {"paged", 8}, {"paged", 16}};
  return v;
}

// A configured manager of `variant` whose budget holds `capacity_tokens` token slots.
std::shared_ptr<KvCacheManager> make_kv(const Variant& variant, int64_t capacity_tokens,
                                        KvLayout* layout, const std::string& extra = "",
                                        const KvModelShape& shape = kShape,
                                        int64_t token_bytes = kTokenBytes) {
  std::string yaml = "{memory: " + std::to_string(capacity_tokens * token_bytes);
  if (variant.is_paged()) yaml += ", block_size: " + std::to_string(variant.block_size);
  if (!extra.empty()) yaml += ", " + extra;
  yaml += "}";
  auto kv = test::create_plugin<KvCacheManager>(variant.plugin, yaml);
  REQUIRE(kv);
  Status st = kv->configure(shape, layout);
  REQUIRE_MESSAGE(st.is_ok(), st.message());
  return kv;
}

uint64_t mix(uint64_t h, uint64_t t) {
  h ^= t + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdULL;
  return h ^ (h >> 29);
}

// A sequence as the engine keeps it: tokens, the SequenceInfo view, and what each token's
// K/V "is" (the prefix value the simulated runner writes).
struct Seq {
  std::vector<TokenId> tokens;
  SequenceInfo info;

  Seq(SeqId id, std::vector<TokenId> prompt) : tokens(std::move(prompt)) {
    tokens.reserve(256);
    info.id = id;
    info.num_prompt_tokens = static_cast<int32_t>(tokens.size());
    info.max_new_tokens = 64;
    sync();
  }
  void sync() { info.tokens = tokens; }
  void append(TokenId t) { tokens.push_back(t); sync(); }
  int32_t computed() const { return info.num_computed_tokens; }
  uint64_t value(int32_t t) const {
    uint64_t h = 1;
    for (int32_t i = 0; i <= t; ++i) h = mix(h, static_cast<uint64_t>(tokens[i]));
    return h;
  }
};

// The backend's KV pool, one value per slot.
struct SimPool {
  int32_t block_size = 0;
  std::vector<uint64_t> slots;
  explicit SimPool(const KvLayout& l)
      : block_size(l.block_size), slots(static_cast<size_t>(l.num_blocks) * l.block_size, 0) {}
  size_t slot(std::span<const int32_t> table, int32_t t) const {
    return static_cast<size_t>(table[t / block_size]) * block_size + t % block_size;
  }
  void apply(KvCacheManager& kv) {
    std::vector<BlockCopy> copies;
    kv.take_block_copies(&copies);
    for (const BlockCopy& c : copies)  // in order: a later copy may reuse an earlier source
      std::copy_n(slots.begin() + static_cast<size_t>(c.src) * block_size, block_size,
                  slots.begin() + static_cast<size_t>(c.dst) * block_size);
  }
  void write(KvCacheManager& kv, const Seq& s, int32_t from, int32_t to) {
    auto table = kv.block_table(s.info.id);
    for (int32_t t = from; t < to; ++t) slots[slot(table, t)] = s.value(t);
  }
  // Every computed token of `s` reads back its own prefix value.
  void check(KvCacheManager& kv, const Seq& s) const {
    auto table = kv.block_table(s.info.id);
    REQUIRE(static_cast<int64_t>(table.size()) * block_size >= s.computed());
    for (int32_t t = 0; t < s.computed(); ++t)
      REQUIRE_MESSAGE(slots[slot(table, t)] == s.value(t),
                      "seq " << s.info.id << " token " << t << " reads another token's K/V");
  }
};

// One step for one sequence as scheduler and engine do it: allocate (counted from
// num_computed_tokens, so including a prefix attached this step), the engine adds the
// attached tokens, then copies, writes, marks.
bool run_chunk(KvCacheManager& kv, SimPool& pool, Seq& s, int32_t n, int32_t cached = 0) {
  if (!kv.allocate_slots(s.info, cached + n)) return false;
  s.info.num_computed_tokens += cached;
  pool.apply(kv);
  pool.write(kv, s, s.computed(), s.computed() + n);
  s.info.num_computed_tokens += n;
  kv.mark_computed(s.info, s.info.num_computed_tokens);
  return true;
}

// Attach and let the engine count the attached tokens as computed at once (as if scheduled).
int32_t admit(KvCacheManager& kv, Seq& s) {
  const int32_t cached = kv.attach_cached_prefix(s.info);
  s.info.num_computed_tokens += cached;
  return cached;
}

std::vector<TokenId> make_tokens(int32_t n, TokenId base) {
  std::vector<TokenId> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = base + i;
  return t;
}

void check_all_free(KvCacheManager& kv, const KvLayout& layout) {
  const KvStats st = kv.stats();
  CHECK(st.num_used_blocks == 0);
  CHECK(st.num_slots_reserved == 0);
  CHECK(st.num_slots_filled == 0);
  CHECK(kv.num_free_blocks() == layout.num_blocks);
}

}  // namespace

TEST_CASE("configure sizes the pool and fails clearly when one sequence does not fit") {
  for (const Variant& v : variants()) {
    CAPTURE(v.label());
    KvLayout layout;
    auto kv = make_kv(v, 4 * kShape.max_context, &layout);
    CHECK(layout.k_dtype == KvDtype::kF16);
    CHECK(layout.v_dtype == KvDtype::kF16);
    CHECK(kv->num_free_blocks() == layout.num_blocks);
    CHECK(static_cast<int64_t>(layout.num_blocks) * layout.block_size == 4 * kShape.max_context);
    if (v.is_paged()) CHECK(layout.block_size == v.block_size);
    CHECK(kv->stats().num_blocks == layout.num_blocks);

    // f32 halves the blocks a budget holds.
    KvLayout layout32;
    auto kv32 = make_kv(v, 4 * kShape.max_context, &layout32, "dtype: f32");
    CHECK(layout32.k_dtype == KvDtype::kF32);
    CHECK(layout32.v_dtype == KvDtype::kF32);
    CHECK(layout32.num_blocks * 2 == layout.num_blocks);

    // A budget one token short of max_context.
    std::string yaml = "{memory: " + std::to_string((kShape.max_context - 1) * kTokenBytes);
    if (v.is_paged()) yaml += ", block_size: " + std::to_string(v.block_size);
    yaml += "}";
    auto small = test::create_plugin<KvCacheManager>(v.plugin, yaml);
    KvLayout none;
    const Status st = small->configure(kShape, &none);
    CHECK(st.code() == StatusCode::kResourceExhausted);
    CHECK(st.message().find("engine.kv_cache.memory") != std::string::npos);
  }
}

TEST_CASE("dtype q8_0: 34 bytes per 32 values, K and V separately, head_dim checked") {
  CHECK(kv_row_bytes(KvDtype::kQ8_0, 32) == 34);
  CHECK(KvLayout::block_bytes(kShape32, 1, KvDtype::kQ8_0, KvDtype::kQ8_0) == kTokenBytesQ8);
  CHECK(KvLayout::block_bytes(kShape32, 1, KvDtype::kQ8_0, KvDtype::kF16) == kTokenBytesQ8 / 2 + 256);
  for (const Variant& v : variants()) {
    CAPTURE(v.label());
    KvLayout q8;
    auto kv = make_kv(v, 4 * kShape32.max_context, &q8, "dtype: q8_0", kShape32, kTokenBytesQ8);
    CHECK(q8.k_dtype == KvDtype::kQ8_0);
    CHECK(q8.v_dtype == KvDtype::kQ8_0);
    CHECK(static_cast<int64_t>(q8.num_blocks) * q8.block_size == 4 * kShape32.max_context);
    CHECK(kv->num_free_blocks() == q8.num_blocks);
    // K only: the same budget holds fewer tokens than all-q8_0.
    KvLayout k_only;
    make_kv(v, 4 * kShape32.max_context, &k_only, "k_dtype: q8_0", kShape32, kTokenBytesQ8);
    CHECK(k_only.k_dtype == KvDtype::kQ8_0);
    CHECK(k_only.v_dtype == KvDtype::kF16);
    CHECK(k_only.num_blocks * k_only.block_size < 4 * kShape32.max_context);
    KvLayout v_only;
    make_kv(v, 4 * kShape32.max_context, &v_only, "dtype: f32, v_dtype: q8_0", kShape32, kTokenBytesQ8);
    CHECK(v_only.k_dtype == KvDtype::kF32);
    CHECK(v_only.v_dtype == KvDtype::kQ8_0);
    // head_dim 4 has no room for a block of 32: refused, naming the dtype and head_dim.
    std::string yaml = "{memory: 1MiB, dtype: q8_0";
    if (v.is_paged()) yaml += ", block_size: " + std::to_string(v.block_size);
    yaml += "}";
    auto bad = test::create_plugin<KvCacheManager>(v.plugin, yaml);
    KvLayout none;
    const Status st = bad->configure(kShape, &none);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("q8_0") != std::string::npos);
    CHECK(st.message().find("head_dim is 4") != std::string::npos);
  }
}

TEST_CASE("paged: parameter schema bounds block_size") {
  const PluginInfo* info = test::plugin_registry().find(PluginKind::kKvCache, "paged");
  REQUIRE(info != nullptr);
  CHECK_THROWS(validate_plugin_params(*info->manifest, "engine.kv_cache", "{block_size: 0}"));
  CHECK_THROWS(validate_plugin_params(*info->manifest, "engine.kv_cache", "{block_size: 1025}"));
  CHECK_THROWS(validate_plugin_params(*info->manifest, "engine.kv_cache", "{dtype: q8}"));
  const PluginConfig c = validate_plugin_params(*info->manifest, "engine.kv_cache", "{}");
  CHECK(c.get_int("block_size") == 16);
  CHECK(c.get_int("memory") == 256ll << 20);
  CHECK(c.get_string("dtype") == "f16");
  CHECK(c.get_bool("prefix_caching") == true);
}

TEST_CASE("allocation covers the tokens, is exclusive and all-or-nothing; free returns all") {
  for (const Variant& v : variants()) {
    CAPTURE(v.label());
    KvLayout layout;
    auto kv = make_kv(v, 3 * kShape.max_context, &layout);
    SimPool pool(layout);
    std::vector<std::unique_ptr<Seq>> seqs;
    SeqId next_id = 1;
    // Sequences of various lengths until memory is exhausted.
    for (int i = 0;; ++i) {
      const int32_t len = 5 + (i * 13) % 50;
      auto s = std::make_unique<Seq>(next_id++, make_tokens(len, 1000 * (i + 1)));
      const int32_t free_before = kv->num_free_blocks();
      const KvStats stats_before = kv->stats();
      if (!run_chunk(*kv, pool, *s, len)) {
        // Nothing changed.
        CHECK(kv->num_free_blocks() == free_before);
        CHECK(kv->stats().num_used_blocks == stats_before.num_used_blocks);
        CHECK(kv->stats().num_slots_reserved == stats_before.num_slots_reserved);
        CHECK(kv->block_table(s->info.id).empty());
        break;
      }
      auto table = kv->block_table(s->info.id);
      CHECK(static_cast<int64_t>(table.size()) * layout.block_size >= len);
      CHECK(static_cast<int64_t>(table.size() - 1) * layout.block_size < len);  // no excess block
      for (int32_t b : table) CHECK((b >= 0 && b < layout.num_blocks));
      seqs.push_back(std::move(s));
      REQUIRE(i < 1000);
    }
    CHECK(seqs.size() >= 3);
    // Distinct prompts: no block shared between live sequences.
    std::set<int32_t> seen;
    int64_t reserved = 0, filled = 0;
    for (const auto& s : seqs) {
      pool.check(*kv, *s);
      for (int32_t b : kv->block_table(s->info.id)) CHECK(seen.insert(b).second);
      reserved += static_cast<int64_t>(kv->block_table(s->info.id).size()) * layout.block_size;
      filled += s->computed();
    }
    const KvStats st = kv->stats();
    CHECK(st.num_used_blocks == static_cast<int32_t>(seen.size()));
    CHECK(st.num_used_blocks + kv->num_free_blocks() == layout.num_blocks);
    CHECK(st.num_slots_reserved == reserved);
    CHECK(st.num_slots_filled == filled);

    // Growing a sequence one decode token at a time until memory runs out; a failed grow
    // leaves its table as it was.
    Seq& grow = *seqs.front();
    for (int k = 0; k < 200; ++k) {
      if (grow.computed() >= kShape.max_context) break;
      grow.append(7);
      const std::vector<int32_t> before(kv->block_table(grow.info.id).begin(),
                                        kv->block_table(grow.info.id).end());
      if (!run_chunk(*kv, pool, grow, 1)) {
        CHECK(std::ranges::equal(before, kv->block_table(grow.info.id)));
        break;
      }
    }
    pool.check(*kv, grow);

    for (const auto& s : seqs) kv->free(s->info.id);
    check_all_free(*kv, layout);
    kv->free(12345);  // unknown sequence: no effect
    check_all_free(*kv, layout);
  }
}

TEST_CASE("fork shares, and the first write after it copies: distinct tails, parent intact") {
  for (const Variant& v : variants()) {
    CAPTURE(v.label());
    KvLayout layout;
    auto kv = make_kv(v, 4 * kShape.max_context, &layout);
    SimPool pool(layout);
    Seq parent(1, make_tokens(10, 500));
    REQUIRE(run_chunk(*kv, pool, parent, 10));
    const std::vector<int32_t> parent_table(kv->block_table(1).begin(), kv->block_table(1).end());

    REQUIRE(kv->fork(1, 2).is_ok());
    CHECK(kv->fork(99, 3).code() == StatusCode::kInvalidArgument);  // unknown parent
    Seq child(2, parent.tokens);
    child.info.num_computed_tokens = parent.computed();
    CHECK(kv->stats().num_slots_filled == 20);

    // Each samples a different token and feeds it.
    child.append(1);
    REQUIRE(run_chunk(*kv, pool, child, 1));
    parent.append(2);
    REQUIRE(run_chunk(*kv, pool, parent, 1));
    pool.check(*kv, parent);
    pool.check(*kv, child);

    auto pt = kv->block_table(1);
    auto ct = kv->block_table(2);
    const int32_t tail = 10 / layout.block_size;  // the block receiving token 10
    CHECK(pt[tail] != ct[tail]);
    // Full blocks before the tail may stay shared (paged); nothing else is shared.
    for (int32_t i = 0; i < tail; ++i) {
      if (v.is_paged()) CHECK(pt[i] == ct[i]);
    }
    if (v.is_paged()) {
      if (10 % layout.block_size != 0) {
        // The partial block held tokens 8..9: the child's write copied it.
        std::vector<BlockCopy> none;
        kv->take_block_copies(&none);
        CHECK(none.empty());  // already taken by the simulated runner
        CHECK(pt[tail] == parent_table[tail]);
        CHECK(ct[tail] != parent_table[tail]);
      }
    }

    // Fork again from a sequence that is mid-block, then check the copy record itself.
    if (v.is_paged() && v.block_size == 8) {
      REQUIRE(kv->fork(1, 3).is_ok());
      Seq third(3, parent.tokens);
      third.info.num_computed_tokens = parent.computed();
      third.append(3);
      REQUIRE(kv->allocate_slots(third.info, 1));
      std::vector<BlockCopy> copies;
      kv->take_block_copies(&copies);
      REQUIRE(copies.size() == 1);
      CHECK(copies[0].src == kv->block_table(1)[1]);
      CHECK(copies[0].dst == kv->block_table(3)[1]);
      CHECK(copies[0].src != copies[0].dst);
      kv->free(3);
    }
    if (!v.is_paged()) {
      // A contiguous region cannot be shared: the fork itself copied it.
      CHECK(kv->block_table(1)[0] != kv->block_table(2)[0]);
    }

    kv->free(1);
    pool.check(*kv, child);  // the child's K/V outlives the parent
    kv->free(2);
    check_all_free(*kv, layout);
  }
}

TEST_CASE("paged: prefix hits share full blocks, chained over the whole prefix") {
  for (int32_t bs : {4, 8, 16}) {
    CAPTURE(bs);
    const Variant v{"paged", bs};
    KvLayout layout;
    auto kv = make_kv(v, 8 * kShape.max_context, &layout, "", {2, 2, 4, 256, 8});
    SimPool pool(layout);
    const int32_t len = 3 * bs + 5;
    Seq a(1, make_tokens(len, 100));
    CHECK(admit(*kv, a) == 0);  // empty cache
    CHECK(kv->stats().prefix_query_tokens == len);
    CHECK(kv->stats().prefix_hit_tokens == 0);
    REQUIRE(run_chunk(*kv, pool, a, len));

    // Same 3-block prefix, different tail: 3 blocks hit, shared with the live sequence.
    std::vector<TokenId> b_tokens = a.tokens;
    b_tokens.resize(3 * bs + 2);
    b_tokens.back() = 9999;
    Seq b(2, b_tokens);
    const int32_t free_before = kv->num_free_blocks();
    const int32_t b_cached = kv->attach_cached_prefix(b.info);
    CHECK(b_cached == 3 * bs);
    CHECK(b.computed() == 0);
    CHECK(kv->num_free_blocks() == free_before);  // hits on used blocks cost nothing
    CHECK(kv->stats().prefix_hit_tokens == 3 * bs);
    CHECK(kv->stats().prefix_query_tokens == len + 3 * bs + 2);
    CHECK(kv->stats().num_slots_filled == len + 3 * bs);
    for (int i = 0; i < 3; ++i) CHECK(kv->block_table(2)[i] == kv->block_table(1)[i]);
    // The scheduler asks for `cached + n` from num_computed_tokens == 0.
    REQUIRE(run_chunk(*kv, pool, b, b.info.num_uncomputed() - b_cached, b_cached));
    std::vector<BlockCopy> copies;
    kv->take_block_copies(&copies);
    CHECK(copies.empty());  // the shared prefix is never written, so never copied
    CHECK(kv->block_table(2).size() == 4);
    CHECK(kv->block_table(2)[3] != kv->block_table(1)[3]);
    pool.check(*kv, a);
    pool.check(*kv, b);

    // One token different in block 1: only block 0 hits.
    std::vector<TokenId> c_tokens = a.tokens;
    c_tokens[bs + 1] = 7777;
    Seq c(3, c_tokens);
    CHECK(admit(*kv, c) == bs);
    // Block 0 different, blocks 1..2 equal: no hit at all (keys chain over the prefix).
    std::vector<TokenId> d_tokens = a.tokens;
    d_tokens[0] = 7777;
    Seq d(4, d_tokens);
    CHECK(admit(*kv, d) == 0);
    // Chaining proper: w diverges from a in block 1 and publishes only 2 blocks. A prompt
    // [a0, w1, a2-tokens, ...] hits 2 blocks: a's block 2 holds the same token ids but K/V
    // computed after a different prefix, so it must not be found under w's chain.
    std::vector<TokenId> w_tokens(a.tokens.begin(), a.tokens.begin() + 2 * bs + 1);
    w_tokens[bs + 2 < 2 * bs ? bs + 2 : bs] = 6666;
    Seq w(9, w_tokens);
    CHECK(admit(*kv, w) == bs);
    REQUIRE(run_chunk(*kv, pool, w, w.info.num_uncomputed()));
    std::vector<TokenId> z_tokens = a.tokens;
    z_tokens[bs + 2 < 2 * bs ? bs + 2 : bs] = 6666;
    Seq z(10, z_tokens);
    CHECK(admit(*kv, z) == 2 * bs);
    REQUIRE(run_chunk(*kv, pool, z, z.info.num_uncomputed()));
    pool.check(*kv, z);
    kv->free(9);
    kv->free(10);
    // A prompt of exactly 3 full blocks keeps its last block to compute (logits needed).
    Seq e(5, std::vector<TokenId>(a.tokens.begin(), a.tokens.begin() + 3 * bs));
    CHECK(admit(*kv, e) == 2 * bs);
    Seq f(6, std::vector<TokenId>(a.tokens.begin(), a.tokens.begin() + 3 * bs + 1));
    CHECK(admit(*kv, f) == 3 * bs);
    CHECK(kv->attach_cached_prefix(f.info) == 0);  // already computed > 0: nothing to attach
    Seq g(7, std::vector<TokenId>(a.tokens.begin(), a.tokens.begin() + 3 * bs + 1));
    CHECK(kv->attach_cached_prefix(g.info) == 3 * bs);
    CHECK(kv->attach_cached_prefix(g.info) == 3 * bs);  // asked twice: attached once
    kv->free(7);

    for (Seq* s : {&c, &e, &f}) {
      REQUIRE(run_chunk(*kv, pool, *s, s->info.num_uncomputed()));
      pool.check(*kv, *s);
    }
    REQUIRE(run_chunk(*kv, pool, d, d.info.num_uncomputed()));

    // Everything freed: cached blocks stay findable and count as free.
    for (SeqId id = 1; id <= 6; ++id) kv->free(id);
    check_all_free(*kv, layout);
    CHECK(kv->stats().num_cached_blocks > 0);
    Seq h(8, a.tokens);
    const int32_t free_cached = kv->num_free_blocks();
    const int32_t full_blocks = (len - 1) / bs;  // a's full blocks, leaving a token to compute
    CHECK(admit(*kv, h) == full_blocks * bs);
    CHECK(kv->num_free_blocks() == free_cached - full_blocks);  // the hits left the free queue
    REQUIRE(run_chunk(*kv, pool, h, h.info.num_uncomputed()));
    pool.check(*kv, h);
    kv->free(8);
    check_all_free(*kv, layout);
  }
}

TEST_CASE("paged: after attach, a chunked allocation counts from num_computed_tokens") {
  const Variant v{"paged", 8};
  KvLayout layout;
  auto kv = make_kv(v, 4 * kShape.max_context, &layout);
  SimPool pool(layout);
  Seq a(1, make_tokens(60, 1));
  REQUIRE(run_chunk(*kv, pool, a, 60));
  Seq b(2, make_tokens(60, 1));
  REQUIRE(kv->attach_cached_prefix(b.info) == 56);
  // Chunk of 2 after the 56 cached tokens, asked while num_computed_tokens is still 0.
  const int32_t free_before = kv->num_free_blocks();
  REQUIRE(run_chunk(*kv, pool, b, 2, 56));
  CHECK(kv->block_table(2).size() == 8);  // 58 tokens: 7 shared + 1 own, nothing beyond
  CHECK(kv->num_free_blocks() == free_before - 1);
  REQUIRE(run_chunk(*kv, pool, b, 2));
  pool.check(*kv, b);
  // Cancelled at admission (scheduler gave the attached prefix back): all returns.
  Seq c(3, make_tokens(60, 1));
  REQUIRE(kv->attach_cached_prefix(c.info) == 56);
  kv->free(3);
  kv->free(1);
  kv->free(2);
  check_all_free(*kv, layout);
}

TEST_CASE("paged: prefix caching off never attaches") {
  const Variant v{"paged", 4};
  KvLayout layout;
  auto kv = make_kv(v, 4 * kShape.max_context, &layout, "prefix_caching: false");
  SimPool pool(layout);
  Seq a(1, make_tokens(20, 1));
  REQUIRE(run_chunk(*kv, pool, a, 20));
  Seq b(2, make_tokens(20, 1));
  CHECK(kv->attach_cached_prefix(b.info) == 0);
  kv->free(1);
  CHECK(kv->stats().num_cached_blocks == 0);
  check_all_free(*kv, layout);
}

TEST_CASE("paged: speculative mark_computed beyond the present tokens publishes only those") {
  const Variant v{"paged", 4};
  KvLayout layout;
  auto kv = make_kv(v, 4 * kShape.max_context, &layout);
  SimPool pool(layout);
  Seq a(1, make_tokens(6, 1));
  REQUIRE(run_chunk(*kv, pool, a, 6));
  // Feed 1 token + 3 drafts (tokens 6..9), all accepted: computed 10 while the engine has
  // dropped the drafts from `tokens` (7 present) and appends them after mark_computed.
  a.append(50);
  for (TokenId t : {51, 52, 53}) a.append(t);
  REQUIRE(kv->allocate_slots(a.info, 4));
  pool.apply(*kv);
  pool.write(*kv, a, 6, 10);
  a.tokens.resize(7);
  a.sync();
  a.info.num_computed_tokens = 10;
  kv->mark_computed(a.info, 10);  // blocks 0 (tokens 0..3) and 1 (4..7 not all present)
  for (TokenId t : {51, 52, 53}) a.append(t);
  kv->mark_computed(a.info, 10);  // now block 1 too
  Seq b(2, std::vector<TokenId>(a.tokens.begin(), a.tokens.begin() + 9));
  CHECK(admit(*kv, b) == 8);
  pool.check(*kv, b);
  kv->free(1);
  kv->free(2);
  check_all_free(*kv, layout);
}

TEST_CASE("paged: eviction takes plain blocks first, then cached ones least recently freed") {
  // 6 blocks of 4 tokens; max_context 16 needs 4.
  const Variant v{"paged", 4};
  const KvModelShape shape{2, 2, 4, 16, 4};
  KvLayout layout;
  auto kv = make_kv(v, 24, &layout, "", shape);
  REQUIRE(layout.num_blocks == 6);
  SimPool pool(layout);
  Seq a(1, make_tokens(8, 100));
  Seq b(2, make_tokens(8, 200));
  REQUIRE(run_chunk(*kv, pool, a, 8));
  REQUIRE(run_chunk(*kv, pool, b, 8));
  const std::vector<int32_t> ta(kv->block_table(1).begin(), kv->block_table(1).end());
  const std::vector<int32_t> tb(kv->block_table(2).begin(), kv->block_table(2).end());
  kv->free(1);  // a's blocks are now the least recently freed
  kv->free(2);
  CHECK(kv->stats().num_cached_blocks == 4);
  CHECK(kv->num_free_blocks() == 6);

  // 12 tokens, new prompt: the 2 plain blocks, then evicts a's last block (tail first).
  Seq c(3, make_tokens(12, 300));
  REQUIRE(run_chunk(*kv, pool, c, 12));
  auto tc = kv->block_table(3);
  CHECK(std::ranges::count(tc, ta[1]) == 1);
  CHECK(std::ranges::count(tc, ta[0]) == 0);
  CHECK(kv->stats().num_cached_blocks == 3);

  // a's chain lost its second block: one block hits. b is intact: both hit.
  Seq a2(4, make_tokens(9, 100));
  REQUIRE(admit(*kv, a2) == 4);
  CHECK(kv->block_table(4)[0] == ta[0]);
  Seq b2(5, make_tokens(9, 200));
  REQUIRE(admit(*kv, b2) == 8);
  CHECK(kv->block_table(5)[0] == tb[0]);
  CHECK(kv->block_table(5)[1] == tb[1]);
  CHECK(kv->num_free_blocks() == 0);
  // No room left: all or nothing.
  CHECK_FALSE(kv->allocate_slots(a2.info, a2.info.num_uncomputed()));
  CHECK(kv->block_table(4).size() == 1);
  kv->free(3);
  REQUIRE(run_chunk(*kv, pool, a2, a2.info.num_uncomputed()));
  REQUIRE(run_chunk(*kv, pool, b2, b2.info.num_uncomputed()));
  pool.check(*kv, a2);
  pool.check(*kv, b2);
  for (SeqId id : {4, 5}) kv->free(id);
  check_all_free(*kv, layout);
}

// Thousands of random engine-like steps: admissions (with prefix reuse), prompt chunks,
// decode tokens, forks, preemptions on allocation failure, finishes. After every step: every
// sequence reads back its own K/V, no written block is held by another live sequence, and the
// stats add up. At the end everything is free.
TEST_CASE("stress: random allocate/mark/fork/free keeps every invariant") {
  struct Dtype { const char* extra; KvModelShape shape; int64_t token_bytes; };
  for (const Dtype& dt : {Dtype{"", kShape, kTokenBytes}, Dtype{"dtype: q8_0", kShape32, kTokenBytesQ8}})
  for (const Variant& v : variants()) {
    CAPTURE(v.label());
    CAPTURE(dt.extra);
    KvLayout layout;
    auto kv = make_kv(v, 5 * kShape.max_context, &layout, dt.extra, dt.shape, dt.token_bytes);
    SimPool pool(layout);
    std::mt19937_64 rng(0x5eed + v.block_size);
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

    std::map<SeqId, std::unique_ptr<Seq>> live;  // admitted or waiting, all known to the test
    std::set<SeqId> admitted;                   // the KV manager may hold blocks for these
    SeqId next_id = 1;
    int64_t num_failed = 0, num_forks = 0, num_hits = 0, num_steps = 0;
    // Prompts share prefixes: a few stems followed by random tails.
    const std::vector<std::vector<TokenId>> stems = {make_tokens(40, 10), make_tokens(24, 90),
                                                     make_tokens(9, 300)};

    auto release = [&](SeqId id) {
      kv->free(id);
      admitted.erase(id);
      live.erase(id);
    };
    for (int iter = 0; iter < 4000; ++iter) {
      const int op = uniform(0, 9);
      if (op <= 1 && live.size() < 10) {  // a new request
        std::vector<TokenId> prompt = stems[uniform(0, 2)];
        prompt.resize(std::min<size_t>(prompt.size(), uniform(1, 40)));
        for (int k = uniform(0, 8); k > 0; --k) prompt.push_back(uniform(1000, 1003));
        if (prompt.empty()) prompt.push_back(5);
        live[next_id] = std::make_unique<Seq>(next_id, prompt);
        ++next_id;
        continue;
      }
      if (op == 2 && !live.empty()) {  // finish or cancel
        auto it = std::next(live.begin(), uniform(0, static_cast<int>(live.size()) - 1));
        release(it->first);
        continue;
      }
      if (op == 3 && !admitted.empty()) {  // fork a sequence whose tokens are all computed
        auto it = std::next(admitted.begin(), uniform(0, static_cast<int>(admitted.size()) - 1));
        Seq& parent = *live[*it];
        if (parent.info.num_uncomputed() == 0 && live.size() < 12) {
          Status st = kv->fork(parent.info.id, next_id);
          if (st.is_ok()) {
            auto child = std::make_unique<Seq>(next_id, parent.tokens);
            child->info.num_prompt_tokens = parent.info.num_prompt_tokens;
            child->info.num_computed_tokens = parent.computed();
            live[next_id] = std::move(child);
            admitted.insert(next_id);
            ++num_forks;
          } else {
            CHECK(!v.is_paged());  // only a contiguous fork needs free memory
          }
          ++next_id;
        }
        continue;
      }
      // One engine step over a random subset.
      ++num_steps;
      struct Scheduled { Seq* seq; int32_t cached; int32_t n; };
      std::vector<Scheduled> batch;
      int32_t budget = uniform(1, 48);
      for (auto& [id, sp] : live) {
        if (budget <= 0 || uniform(0, 2) == 0) continue;
        Seq& s = *sp;
        int32_t cached = 0;
        if (!admitted.count(id)) {
          cached = kv->attach_cached_prefix(s.info);
          num_hits += cached;
          admitted.insert(id);
        }
        if (s.info.num_uncomputed() == 0) {
          if (s.info.num_tokens() >= kShape.max_context) continue;
          s.append(uniform(1000, 1003));  // the token sampled last step
        }
        const int32_t n = std::min(s.info.num_uncomputed() - cached, budget);
        const KvStats before = kv->stats();
        const std::vector<int32_t> table_before(kv->block_table(id).begin(), kv->block_table(id).end());
        if (!kv->allocate_slots(s.info, cached + n)) {
          ++num_failed;
          CHECK(kv->stats().num_used_blocks == before.num_used_blocks);
          CHECK(kv->stats().num_slots_reserved == before.num_slots_reserved);
          CHECK(std::ranges::equal(table_before, kv->block_table(id)));
          // Preempt this sequence: blocks back, recompute later from scratch.
          kv->free(id);
          admitted.erase(id);
          s.info.num_computed_tokens = 0;
          ++s.info.num_preemptions;
          continue;
        }
        batch.push_back({&s, cached, n});
        budget -= n;
      }
      // The engine applies the plan: attached tokens count as computed.
      for (auto& [s, cached, n] : batch) s->info.num_computed_tokens += cached;
      pool.apply(*kv);
      // No block about to be written is held by another live sequence.
      std::map<int32_t, int> holders;
      for (SeqId id : admitted)
        for (int32_t b : std::set<int32_t>(kv->block_table(id).begin(), kv->block_table(id).end()))
          ++holders[b];
      for (auto& [s, cached, n] : batch) {
        auto table = kv->block_table(s->info.id);
        for (int32_t t = s->computed(); t < s->computed() + n; ++t)
          REQUIRE_MESSAGE(holders[table[t / layout.block_size]] == 1,
                          "seq " << s->info.id << " writes token " << t << " into a shared block");
        pool.write(*kv, *s, s->computed(), s->computed() + n);
      }
      for (auto& [s, cached, n] : batch) {
        s->info.num_computed_tokens += n;
        kv->mark_computed(s->info, s->computed());
      }
      // Invariants.
      int64_t reserved = 0, filled = 0;
      std::set<int32_t> used;
      for (SeqId id : admitted) {
        const Seq& s = *live[id];
        pool.check(*kv, s);
        auto table = kv->block_table(id);
        reserved += static_cast<int64_t>(table.size()) * layout.block_size;
        filled += s.computed();
        for (int32_t b : table) {
          REQUIRE((b >= 0 && b < layout.num_blocks));
          used.insert(b);
        }
      }
      const KvStats st = kv->stats();
      REQUIRE(st.num_used_blocks == static_cast<int32_t>(used.size()));
      REQUIRE(st.num_used_blocks + kv->num_free_blocks() == layout.num_blocks);
      REQUIRE(st.num_slots_reserved == reserved);
      REQUIRE(st.num_slots_filled == filled);
      REQUIRE(st.num_cached_blocks <= kv->num_free_blocks());
      REQUIRE(st.prefix_hit_tokens <= st.prefix_query_tokens);
    }
    while (!live.empty()) release(live.begin()->first);
    check_all_free(*kv, layout);
    MESSAGE(v.label() << ": " << num_steps << " steps, " << num_forks << " forks, " << num_failed
                      << " failed allocations (preempted), " << num_hits << " prefix-hit tokens");
    CHECK(num_forks > 0);
    CHECK(num_failed > 0);
    if (v.is_paged()) CHECK(num_hits > 0);
  }
}
