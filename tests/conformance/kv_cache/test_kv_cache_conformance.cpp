// Conformance suite for kv_cache plugins: every kv_cache plugin the registry holds (the
// build's plugin folder and every folder on TESSERA_PLUGIN_PATH, so a third party runs it on
// its own library), created by name from YAML validated against its schema. Parameters a
// plugin requires come from TESSERA_CONFORMANCE_PARAMS (entry `kv_cache.<name>`); the suite
// adds `memory` (which it needs), `block_size` and the case's own settings on top.
//
// Variants come from each plugin's schema: a plugin with a `block_size` parameter runs at
// block sizes 1, 4, 8 and 16 (those within the parameter's bounds), any other once with the
// block size it chooses, read back from configure's layout. The cases are of three kinds:
//  (a) the contract of tessera/sdk/kv_cache.h, on every variant: configure sizes the pool from
//      the budget and dtypes and fails clearly when one sequence does not fit; allocation
//      covers the tokens, is exclusive and all-or-nothing; fork, copy-on-write and truncate
//      keep each sequence's K/V; free returns everything; the stats add up; a random stress
//      run of allocate/mark/fork/free keeps every invariant;
//  (b) features, where the schema declares them: storage types f32 / q8_0 (the values the
//      `dtype`, `k_dtype`, `v_dtype` enums accept), prefix reuse (a `prefix_caching`
//      parameter: hits, chaining over the whole prefix, turning it off);
//  (c) expectations specific to the in-tree `paged` and `contiguous` plugins (which block ids
//      stay shared, exact block counts, the copy records, paged's eviction order), keyed on
//      those names and labelled "(c)" / "in-tree".
//
// Besides the bookkeeping, the suite simulates the KV memory the backend would own: a
// "runner" performs the block copies and writes a value for every token into the slot the
// block table names, where the value stands for the token's K/V (a hash of the whole prefix
// up to it). A sequence must then read back exactly its own prefix values, whatever sharing,
// copy-on-write, truncation, prefix reuse and eviction happened in between; and no block may
// be written while another live sequence holds it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <yaml-cpp/yaml.h>

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

// --- Which plugins, at which settings ---------------------------------------------------
// Every kv_cache plugin the registry holds (the build's plugin folder and TESSERA_PLUGIN_PATH)
// is tested. What a plugin offers is read from its manifest's parameter schema: a
// `block_size` parameter runs the plugin at several block sizes, a `dtype` / `k_dtype` /
// `v_dtype` enum enables the storage-type cases for the values it accepts, a `prefix_caching`
// parameter enables the prefix-reuse cases. The budget is always given as `memory` (bytes, the
// engine.kv_cache.memory every stack sets), so the suite needs that parameter.

std::optional<ParamSpec> find_param(const std::string& plugin, std::string_view param) {
  return test::find_param(PluginKind::kKvCache, plugin, param);
}

// Whether `plugin` has parameter `param` and (for an enum) accepts `value`.
bool accepts(const std::string& plugin, std::string_view param, std::string_view value = {}) {
  const std::optional<ParamSpec> p = find_param(plugin, param);
  if (!p) return false;
  if (value.empty()) return true;
  if (p->type != ParamType::kEnum || !p->choices) return false;
  std::string_view choices = p->choices;
  for (size_t pos = 0; pos <= choices.size();) {
    const size_t bar = std::min(choices.find('|', pos), choices.size());
    if (choices.substr(pos, bar - pos) == value) return true;
    pos = bar + 1;
  }
  return false;
}

struct Variant {
  std::string plugin;
  int32_t block_size = 0;  // 0: the plugin has no block_size parameter (it chooses; read the layout)
  std::string label() const {
    return block_size > 0 ? plugin + "/bs=" + std::to_string(block_size) : plugin;
  }
  // Features declared through the schema: the cases of part (b) run only where declared.
  bool prefix_caching() const { return accepts(plugin, "prefix_caching"); }
  bool accepts_dtype(std::string_view param, std::string_view dtype) const {
    return accepts(plugin, param, dtype);
  }
  // The in-tree plugins, for the implementation-specific expectations of part (c).
  bool in_tree_paged() const { return plugin == "paged"; }
  bool in_tree_contiguous() const { return plugin == "contiguous"; }
};

// The block sizes a plugin runs at: 1, 4, 8 and 16 where its block_size parameter allows them.
std::vector<Variant> variants_of(const std::string& plugin) {
  const std::optional<ParamSpec> bs = find_param(plugin, "block_size");
  if (!bs || bs->type != ParamType::kInt) return {{plugin, 0}};
  std::vector<Variant> out;
  for (int32_t b : {1, 4, 8, 16})
    if (b >= bs->min_value && b <= bs->max_value) out.push_back({plugin, b});
  if (out.empty()) out.push_back({plugin, 0});  // none allowed: its default
  return out;
}

const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = [] {
    std::vector<Variant> v;
    for (const std::string& name : test::plugin_names(PluginKind::kKvCache)) {
      if (!accepts(name, "memory")) continue;  // reported by the "registered" case
      for (const Variant& x : variants_of(name)) v.push_back(x);
    }
    return v;
  }();
  return all;
}

// The variants of plugins declaring prefix caching whose block size is at least `min_bs`
// (a plugin choosing its own block size is included; the case reads it from the layout).
std::vector<Variant> prefix_variants(int32_t min_bs) {
  std::vector<Variant> out;
  for (const Variant& v : variants())
    if (v.prefix_caching() && (v.block_size == 0 || v.block_size >= min_bs)) out.push_back(v);
  return out;
}

// The parameters a variant is created with: the third party's own (TESSERA_CONFORMANCE_PARAMS),
// then the suite's `memory` and `block_size`, then `extra` (a flow mapping's contents, e.g.
// "dtype: f32"); later keys win.
std::string params_yaml(const Variant& v, int64_t memory, const std::string& extra = "") {
  YAML::Node node = YAML::Load(test::conformance_params(PluginKind::kKvCache, v.plugin, "{}"));
  node["memory"] = memory;
  if (v.block_size > 0) node["block_size"] = v.block_size;
  if (!extra.empty())
    for (const auto& kv : YAML::Load("{" + extra + "}")) node[kv.first.as<std::string>()] = kv.second;
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

std::shared_ptr<KvCacheManager> create_kv(const Variant& v, int64_t memory, const std::string& extra = "") {
  auto kv = test::create_plugin<KvCacheManager>(v.plugin, params_yaml(v, memory, extra));
  REQUIRE(kv);
  return kv;
}

// A configured manager of `variant` whose budget holds `capacity_tokens` token slots.
std::shared_ptr<KvCacheManager> make_kv(const Variant& variant, int64_t capacity_tokens,
                                        KvLayout* layout, const std::string& extra = "",
                                        const KvModelShape& shape = kShape,
                                        int64_t token_bytes = kTokenBytes) {
  auto kv = create_kv(variant, capacity_tokens * token_bytes, extra);
  Status st = kv->configure(shape, layout);
  REQUIRE_MESSAGE(st.is_ok(), st.message());
  REQUIRE(layout->block_size > 0);
  if (variant.block_size > 0) CHECK(layout->block_size == variant.block_size);
  return kv;
}

// The contract of configure for a budget of `memory` bytes: the pool is what the budget holds
// in the layout's block size and dtypes (memory / KvLayout::block_bytes), every block free.
void check_layout(const KvCacheManager& kv, const KvLayout& layout, const KvModelShape& shape,
                  int64_t memory) {
  const auto block = static_cast<int64_t>(
      KvLayout::block_bytes(shape, layout.block_size, layout.k_dtype, layout.v_dtype));
  REQUIRE(block > 0);
  CHECK(layout.num_blocks == memory / block);
  CHECK(kv.num_free_blocks() == layout.num_blocks);
  CHECK(kv.stats().num_blocks == layout.num_blocks);
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
  // Token t's slot; a table too short or a block id outside the pool fails the case (rather
  // than writing outside the simulated pool).
  size_t slot(std::span<const int32_t> table, int32_t t) const {
    if (static_cast<size_t>(t / block_size) >= table.size()) FAIL("token " << t << " has no block");
    const int32_t block = table[t / block_size];
    check_block(block);
    return static_cast<size_t>(block) * block_size + t % block_size;
  }
  void check_block(int32_t block) const {
    if (block < 0 || static_cast<size_t>(block) * block_size >= slots.size())
      FAIL("block id " << block << " outside the pool");
  }
  void apply(KvCacheManager& kv) {
    std::vector<BlockCopy> copies;
    kv.take_block_copies(&copies);
    for (const BlockCopy& c : copies) {  // in order: a later copy may reuse an earlier source
      check_block(c.src);
      check_block(c.dst);
      std::copy_n(slots.begin() + static_cast<size_t>(c.src) * block_size, block_size,
                  slots.begin() + static_cast<size_t>(c.dst) * block_size);
    }
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

// ======================================================================================
// The suite has three parts:
//  (a) the contract of kv_cache.h every KvCacheManager keeps: run on every variant;
//  (b) what a plugin offering a feature must do, run where its schema declares the feature
//      (`dtype` values, `prefix_caching`);
//  (c) implementation-specific expectations of the in-tree `paged` and `contiguous` plugins
//      (which blocks are shared, eviction order, exact block counts), keyed on those names and
//      labelled "in-tree paged:" / "in-tree contiguous:". A third party's plugin never runs them.
// ======================================================================================

TEST_CASE("kv_cache plugins: paged and contiguous are registered; every plugin is tested") {
  test::check_no_load_errors();
  const auto names = test::plugin_names(PluginKind::kKvCache);
  for (const char* want : {"paged", "contiguous"})
    CHECK_MESSAGE(std::find(names.begin(), names.end(), want) != names.end(), std::string(want) << " not found");
  for (const std::string& name : names) {
    // The suite sizes every cache through its byte budget, as every stack does.
    const std::optional<ParamSpec> memory = find_param(name, "memory");
    CHECK_MESSAGE((memory && memory->type == ParamType::kBytes),
                  "kv_cache." << name << " has no `memory` (bytes) parameter: the suite cannot size "
                                 "its cache, so it is not tested");
    std::string list;
    for (const Variant& v : variants())
      if (v.plugin == name) list += (list.empty() ? "" : ", ") + v.label();
    if (list.empty()) list = "not tested";
    if (accepts(name, "prefix_caching")) list += "; prefix caching";
    if (accepts(name, "dtype", "q8_0")) list += "; dtype q8_0";
    MESSAGE("kv_cache." << name << ": " << list);
  }
}

TEST_CASE("configure sizes the pool and fails clearly when one sequence does not fit") {
  for (const Variant& v : variants()) {
    CAPTURE(v.label());
    // (a) The layout's dtypes are the configured ones, the pool is what the budget holds.
    const int64_t memory = 4 * kShape.max_context * kTokenBytes;
    const PluginConfig config = validate_plugin_params(
        *test::plugin_registry().find(PluginKind::kKvCache, v.plugin)->manifest, "engine.kv_cache",
        params_yaml(v, memory));
    KvLayout layout;
    auto kv = make_kv(v, 4 * kShape.max_context, &layout);
    if (accepts(v.plugin, "dtype")) {  // the in-tree plugins: f16 by default
      const KvDtypes configured = kv_dtypes_from_config(config);
      CHECK(layout.k_dtype == configured.k);
      CHECK(layout.v_dtype == configured.v);
    }
    check_layout(*kv, layout, kShape, memory);
    if (4 * kShape.max_context % layout.block_size == 0)
      CHECK(static_cast<int64_t>(layout.num_blocks) * layout.block_size == 4 * kShape.max_context);

    // (b) f32 halves the blocks a budget holds.
    if (v.accepts_dtype("dtype", "f32")) {
      KvLayout layout32;
      auto kv32 = make_kv(v, 4 * kShape.max_context, &layout32, "dtype: f32");
      CHECK(layout32.k_dtype == KvDtype::kF32);
      CHECK(layout32.v_dtype == KvDtype::kF32);
      check_layout(*kv32, layout32, kShape, memory);
      if (layout32.block_size == layout.block_size && 4 * kShape.max_context % (2 * layout.block_size) == 0)
        CHECK(layout32.num_blocks * 2 == layout.num_blocks);
    }

    // (a) A budget one token short of max_context: refused, naming the setting to change.
    auto small = create_kv(v, (kShape.max_context - 1) * kTokenBytes);
    KvLayout none;
    const Status st = small->configure(kShape, &none);
    CHECK(st.code() == StatusCode::kResourceExhausted);
    CHECK(st.message().find("engine.kv_cache.memory") != std::string::npos);
  }
}

// (b) Plugins whose `dtype` accepts q8_0 (and `k_dtype` / `v_dtype`, where declared).
TEST_CASE("dtype q8_0: 34 bytes per 32 values, K and V separately, head_dim checked") {
  CHECK(kv_row_bytes(KvDtype::kQ8_0, 32) == 34);
  CHECK(KvLayout::block_bytes(kShape32, 1, KvDtype::kQ8_0, KvDtype::kQ8_0) == kTokenBytesQ8);
  CHECK(KvLayout::block_bytes(kShape32, 1, KvDtype::kQ8_0, KvDtype::kF16) == kTokenBytesQ8 / 2 + 256);
  for (const Variant& v : variants()) {
    if (!v.accepts_dtype("dtype", "q8_0")) continue;
    CAPTURE(v.label());
    const int64_t memory = 4 * kShape32.max_context * kTokenBytesQ8;
    KvLayout q8;
    auto kv = make_kv(v, 4 * kShape32.max_context, &q8, "dtype: q8_0", kShape32, kTokenBytesQ8);
    CHECK(q8.k_dtype == KvDtype::kQ8_0);
    CHECK(q8.v_dtype == KvDtype::kQ8_0);
    check_layout(*kv, q8, kShape32, memory);
    if (4 * kShape32.max_context % q8.block_size == 0)
      CHECK(static_cast<int64_t>(q8.num_blocks) * q8.block_size == 4 * kShape32.max_context);
    // K only: the same budget holds fewer tokens than all-q8_0.
    if (v.accepts_dtype("k_dtype", "q8_0")) {
      KvLayout k_only;
      auto kv_k = make_kv(v, 4 * kShape32.max_context, &k_only, "k_dtype: q8_0", kShape32, kTokenBytesQ8);
      CHECK(k_only.k_dtype == KvDtype::kQ8_0);
      CHECK(k_only.v_dtype == KvDtype::kF16);
      CHECK(k_only.num_blocks * k_only.block_size < 4 * kShape32.max_context);
      check_layout(*kv_k, k_only, kShape32, memory);
    }
    if (v.accepts_dtype("dtype", "f32") && v.accepts_dtype("v_dtype", "q8_0")) {
      KvLayout v_only;
      auto kv_v = make_kv(v, 4 * kShape32.max_context, &v_only, "dtype: f32, v_dtype: q8_0", kShape32, kTokenBytesQ8);
      CHECK(v_only.k_dtype == KvDtype::kF32);
      CHECK(v_only.v_dtype == KvDtype::kQ8_0);
      check_layout(*kv_v, v_only, kShape32, memory);
    }
    // head_dim 4 has no room for a block of 32: refused, naming the dtype and head_dim.
    auto bad = create_kv(v, 1 << 20, "dtype: q8_0");
    KvLayout none;
    const Status st = bad->configure(kShape, &none);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("q8_0") != std::string::npos);
    CHECK(st.message().find("head_dim is 4") != std::string::npos);
  }
}

// (c) In-tree paged: its schema.
TEST_CASE("in-tree paged: parameter schema bounds block_size") {
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

// (a)
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
      if (v.in_tree_paged() || v.in_tree_contiguous())  // (c) in-tree: no excess block
        CHECK(static_cast<int64_t>(table.size() - 1) * layout.block_size < len);
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

// (a) The content checks; which blocks stay shared is (c).
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

    // (c) In-tree paged: full blocks before the tail stay shared (the same block ids), and
    // the partial block the child wrote into was copied. In-tree contiguous: nothing shared.
    if (v.in_tree_paged()) {
      for (int32_t i = 0; i < tail; ++i) CHECK(pt[i] == ct[i]);
      if (10 % layout.block_size != 0) {
        // The partial block held tokens 8..9: the child's write copied it.
        std::vector<BlockCopy> none;
        kv->take_block_copies(&none);
        CHECK(none.empty());  // already taken by the simulated runner
        CHECK(pt[tail] == parent_table[tail]);
        CHECK(ct[tail] != parent_table[tail]);
      }
    }

    // (c) In-tree paged: fork again from a sequence that is mid-block, then check the copy
    // record itself.
    if (v.in_tree_paged() && layout.block_size == 8) {
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
    if (v.in_tree_contiguous()) {
      // A contiguous region cannot be shared: the fork itself copied it.
      CHECK(kv->block_table(1)[0] != kv->block_table(2)[0]);
    }

    kv->free(1);
    pool.check(*kv, child);  // the child's K/V outlives the parent
    kv->free(2);
    check_all_free(*kv, layout);
  }
}

// (a) Speculative rollback as the engine does it: a sampled token and 5 drafts are fed, 2
// drafts are accepted, then truncate keeps the committed tokens. The kept K/V (and that of a
// forked sibling sharing the first blocks) reads back, truncate takes no memory, and the next
// allocation grows again from there.
TEST_CASE("truncate after rejected drafts keeps the committed K/V and gives slots back") {
  for (const Variant& v : variants()) {
    CAPTURE(v.label());
    KvLayout layout;
    auto kv = make_kv(v, 4 * kShape.max_context, &layout);
    SimPool pool(layout);
    Seq a(1, make_tokens(10, 700));
    REQUIRE(run_chunk(*kv, pool, a, 10));
    REQUIRE(kv->fork(1, 2).is_ok());
    Seq sibling(2, a.tokens);
    sibling.info.num_computed_tokens = a.computed();
    pool.apply(*kv);  // a fork may copy at once (a contiguous region cannot be shared)
    const int32_t free_before = kv->num_free_blocks();

    a.append(60);
    for (TokenId t : {61, 62, 63, 64, 65}) a.append(t);  // tokens 10..15
    REQUIRE(kv->allocate_slots(a.info, 6));
    pool.apply(*kv);
    pool.write(*kv, a, 10, 16);
    const int32_t free_allocated = kv->num_free_blocks();
    // Tokens 10..12 (the fed one, 2 drafts) are computed; the bonus token 99 is committed.
    a.tokens.resize(13);
    a.append(99);
    a.info.num_computed_tokens = 13;
    kv->mark_computed(a.info, 13);
    kv->truncate(a.info, 14);
    CHECK(kv->num_free_blocks() >= free_allocated);
    pool.check(*kv, a);
    pool.check(*kv, sibling);
    auto ta = kv->block_table(1);
    auto ts = kv->block_table(2);
    std::set<int32_t> used(ta.begin(), ta.end());
    used.insert(ts.begin(), ts.end());
    const KvStats st = kv->stats();
    CHECK(st.num_slots_filled == 13 + 10);
    CHECK(st.num_slots_reserved == static_cast<int64_t>(ta.size() + ts.size()) * layout.block_size);
    CHECK(st.num_used_blocks == static_cast<int32_t>(used.size()));
    CHECK(st.num_used_blocks + kv->num_free_blocks() == layout.num_blocks);
    const int32_t bs = layout.block_size;
    if (v.in_tree_paged()) {  // (c) whole blocks past the kept tokens went back
      CHECK(static_cast<int32_t>(ta.size()) == (14 + bs - 1) / bs);
      CHECK(kv->num_free_blocks() == free_before - ((14 + bs - 1) / bs - 10 / bs));
    }
    if (v.in_tree_contiguous()) {  // (c) the region stays whole
      CHECK(ta.size() == 1);
      CHECK(kv->num_free_blocks() == free_before);
    }

    // The next step feeds the bonus token; the sibling feeds its own.
    REQUIRE(run_chunk(*kv, pool, a, 1));
    sibling.append(5);
    REQUIRE(run_chunk(*kv, pool, sibling, 1));
    pool.check(*kv, a);
    pool.check(*kv, sibling);
    kv->free(1);
    kv->free(2);
    check_all_free(*kv, layout);
  }
}

// (b) Plugins declaring `prefix_caching`, at block sizes 4 and up; what is shared how
// (block ids, free counts, no copies) is (c).
TEST_CASE("prefix caching: hits cover full blocks, chained over the whole prefix") {
  for (const Variant& v : prefix_variants(4)) {
    CAPTURE(v.label());
    KvLayout layout;
    auto kv = make_kv(v, 8 * kShape.max_context, &layout, "prefix_caching: true", {2, 2, 4, 256, 8});
    const int32_t bs = layout.block_size;
    if (3 * bs + 5 > 256) {
      MESSAGE(v.label() << ": block size " << bs << " too large for the prefix cases; skipped");
      continue;
    }
    const bool paged = v.in_tree_paged();
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
    CHECK(kv->stats().prefix_hit_tokens == 3 * bs);
    CHECK(kv->stats().prefix_query_tokens == len + 3 * bs + 2);
    CHECK(kv->stats().num_slots_filled == len + 3 * bs);
    if (paged) {  // (c) in-tree paged: the hit shares the live sequence's blocks, at no cost
      CHECK(kv->num_free_blocks() == free_before);  // hits on used blocks cost nothing
      for (int i = 0; i < 3; ++i) CHECK(kv->block_table(2)[i] == kv->block_table(1)[i]);
    }
    // The scheduler asks for `cached + n` from num_computed_tokens == 0.
    REQUIRE(run_chunk(*kv, pool, b, b.info.num_uncomputed() - b_cached, b_cached));
    if (paged) {  // (c) in-tree paged
      std::vector<BlockCopy> copies;
      kv->take_block_copies(&copies);
      CHECK(copies.empty());  // the shared prefix is never written, so never copied
      CHECK(kv->block_table(2).size() == 4);
    }
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
    if (paged) CHECK(kv->attach_cached_prefix(f.info) == 0);  // (c) already computed > 0: nothing to attach
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
    if (paged) CHECK(kv->num_free_blocks() == free_cached - full_blocks);  // (c) the hits left the free queue
    REQUIRE(run_chunk(*kv, pool, h, h.info.num_uncomputed()));
    pool.check(*kv, h);
    kv->free(8);
    check_all_free(*kv, layout);
  }
}

// (b) Plugins declaring `prefix_caching` (block size 8: 56 of the 60 tokens cached).
TEST_CASE("prefix caching: after attach, a chunked allocation counts from num_computed_tokens") {
  for (const Variant& v : prefix_variants(4)) {
    CAPTURE(v.label());
    KvLayout layout;
    auto kv = make_kv(v, 4 * kShape.max_context, &layout, "prefix_caching: true");
    const int32_t bs = layout.block_size;
    const int32_t cached = 59 / bs * bs;  // full blocks, leaving a prompt token to compute
    if (cached == 0 || cached + 4 > 60) {
      MESSAGE(v.label() << ": block size " << bs << " does not suit this case; skipped");
      continue;
    }
    SimPool pool(layout);
    Seq a(1, make_tokens(60, 1));
    REQUIRE(run_chunk(*kv, pool, a, 60));
    Seq b(2, make_tokens(60, 1));
    REQUIRE(kv->attach_cached_prefix(b.info) == cached);
    // Chunk of 2 after the cached tokens, asked while num_computed_tokens is still 0.
    const int32_t free_before = kv->num_free_blocks();
    REQUIRE(run_chunk(*kv, pool, b, 2, cached));
    // Counting the prefix twice would need room for 2 * cached + 2 tokens.
    CHECK(static_cast<int64_t>(kv->block_table(2).size()) * bs < 2 * cached + 2);
    if (v.in_tree_paged()) {  // (c) in-tree paged: e.g. bs 8, 58 tokens: 7 shared + 1 own, nothing beyond
      const int32_t blocks = (cached + 2 + bs - 1) / bs;
      CHECK(static_cast<int32_t>(kv->block_table(2).size()) == blocks);
      CHECK(kv->num_free_blocks() == free_before - (blocks - cached / bs));
    }
    REQUIRE(run_chunk(*kv, pool, b, 2));
    pool.check(*kv, b);
    // Cancelled at admission (scheduler gave the attached prefix back): all returns.
    Seq c(3, make_tokens(60, 1));
    REQUIRE(kv->attach_cached_prefix(c.info) == cached);
    kv->free(3);
    kv->free(1);
    kv->free(2);
    check_all_free(*kv, layout);
  }
}

// (b) Plugins declaring `prefix_caching`: `prefix_caching: false` turns it off.
TEST_CASE("prefix caching off never attaches") {
  for (const Variant& v : prefix_variants(4)) {
    CAPTURE(v.label());
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
}

// (b) Plugins declaring `prefix_caching`, at block size 4.
TEST_CASE("prefix caching: speculative mark_computed beyond the present tokens publishes only those") {
  for (const Variant& v : prefix_variants(4)) {
    CAPTURE(v.label());
    KvLayout layout;
    auto kv = make_kv(v, 4 * kShape.max_context, &layout, "prefix_caching: true");
    if (layout.block_size != 4) continue;  // the case is written for blocks of 4 tokens
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
}

// (c) In-tree paged: its eviction order (README.md), at block size 4.
TEST_CASE("in-tree paged: eviction takes plain blocks first, then cached ones least recently freed") {
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
    if (*dt.extra && !v.accepts_dtype("dtype", "q8_0")) continue;  // (b) q8_0 where declared
    CAPTURE(v.label());
    const std::string dtype = *dt.extra ? dt.extra : "dtype: default";
    CAPTURE(dtype);
    KvLayout layout;
    std::string extra = dt.extra;
    if (v.prefix_caching()) extra += std::string(extra.empty() ? "" : ", ") + "prefix_caching: true";
    auto kv = make_kv(v, 5 * kShape.max_context, &layout, extra, dt.shape, dt.token_bytes);
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
            // A fork may fail (that child alone fails). (c) In-tree: only a contiguous fork
            // needs free memory; a paged one never fails.
            CHECK(!v.in_tree_paged());
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
    if (v.prefix_caching()) CHECK(num_hits > 0);  // (b) the shared stems hit
  }
}
