// Stack configuration: a valid stack round-trips into typed values, `extends:` merges, and
// every kind of mistake is reported as file:line:col: key.path: message, all at once.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include <sys/stat.h>

#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk/sampler.h"

namespace {

using namespace tessera;
namespace fs = std::filesystem;

fs::path test_plugin_dir() {
  return test::env_or("TESSERA_TEST_PLUGIN_DIR", (test::build_dir() / "test-plugins").string());
}

// Built-in stand-ins for the default engine plugins (but backend.cpu, which the core always
// registers) and a few others, so these tests do not depend on the real plugins. Their create always fails: only their schemas matter here.
Status create_stub(const PluginConfig&, const PluginContext&, void**) {
  return unimplemented("stub");
}
void destroy_stub(void*) {}

#define STUB_HEADER TESSERA_PLUGIN_MANIFEST_HEADER

const ParamSpec kSchedulerParams[] = {
    {"max_num_seqs", ParamType::kInt, "8", "sequences per step", 1, 4096},
    {"max_batch_tokens", ParamType::kInt, "512", "tokens per step", 1},
};
const ParamSpec kKvParams[] = {
    {"memory", ParamType::kBytes, "256MiB", "KV pool size", 1048576.0},
    {"block_size", ParamType::kInt, "16", "tokens per block", 1, 1024},
    {"dtype", ParamType::kEnum, "f16", "element type", -INFINITY, INFINITY, "f16|f32"},
    {"prefix_caching", ParamType::kBool, "false", "reuse prompt prefixes"},
};
const ParamSpec kExactParams[] = {
    {"ttl", ParamType::kDuration, "10m", "time to live", 0},
};
const ParamSpec kSemanticParams[] = {
    {"threshold", ParamType::kFloat, "0.92", "cosine similarity", 0, 1},
    {"ttl", ParamType::kDuration, "1h", "time to live", 0},
};
const ParamSpec kRouterParams[] = {
    {"routes", ParamType::kStringMap, nullptr, "class -> deployment"},
    {"fallback", ParamType::kString, nullptr, "", -INFINITY, INFINITY, nullptr, true},
};
const ParamSpec kDrafterParams[] = {
    {"num_draft_tokens", ParamType::kInt, "4", "drafts per step", 1, 16},
};

template <size_t N>
PluginManifest stub(PluginKind kind, const char* name, const ParamSpec (&params)[N]) {
  return {STUB_HEADER, kind, name, "1.0.0", "stub", PluginStatus::kStable, params, N,
          &create_stub, &destroy_stub, "", "", sizeof(ParamSpec)};
}
PluginManifest stub(PluginKind kind, const char* name) {
  return {STUB_HEADER, kind, name, "1.0.0", "stub", PluginStatus::kStable, nullptr, 0,
          &create_stub, &destroy_stub};
}

const PluginManifest kStubs[] = {
    stub(PluginKind::kScheduler, "static", kSchedulerParams),
    stub(PluginKind::kScheduler, "chunked-prefill", kSchedulerParams),
    stub(PluginKind::kKvCache, "contiguous", kKvParams),
    stub(PluginKind::kKvCache, "paged", kKvParams),
    stub(PluginKind::kAttention, "naive"),
    stub(PluginKind::kQuantizer, "gguf"),
    stub(PluginKind::kSampler, "standard"),
    stub(PluginKind::kCacheLayer, "exact", kExactParams),
    stub(PluginKind::kCacheLayer, "semantic", kSemanticParams),
    stub(PluginKind::kRouter, "classifier", kRouterParams),
    stub(PluginKind::kDrafter, "ngram", kDrafterParams),
};

// A registry with the stubs (but `skip`) and the test plugins (test-greedy;
// test-abi-mismatch refused).
std::unique_ptr<PluginRegistry> make_registry(const char* skip = nullptr) {
  auto registry = std::make_unique<PluginRegistry>();
  for (const auto& m : kStubs)
    if (!skip || std::string(skip) != m.name) registry->add_builtin(&m);
  registry->scan_directory(test_plugin_dir());
  return registry;
}

fs::path write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
  return path;
}

// Loads and expects failure; returns the issues.
std::vector<ConfigIssue> load_errors(const fs::path& path, PluginRegistry& registry) {
  try {
    load_stack_config(path.string(), registry);
  } catch (const ConfigError& e) {
    return e.issues();
  }
  FAIL("expected ConfigError for " << path);
  return {};
}

std::vector<ConfigIssue> load_errors(const fs::path& path) {
  auto registry = make_registry();
  return load_errors(path, *registry);
}

bool has_issue(const std::vector<ConfigIssue>& issues, const std::string& text) {
  for (const auto& i : issues)
    if (i.to_string() == text) return true;
  return false;
}

// Whether some issue's text contains `text` (for messages whose position is not the point).
bool mentions_issue(const std::vector<ConfigIssue>& issues, const std::string& text) {
  for (const auto& i : issues)
    if (i.to_string().find(text) != std::string::npos) return true;
  return false;
}

std::string dump(const std::vector<ConfigIssue>& issues) {
  std::string out;
  for (const auto& i : issues) out += i.to_string() + "\n";
  return out;
}

// Exactly one issue, equal to `expected`.
void check_single(const std::vector<ConfigIssue>& issues, const std::string& expected) {
  INFO(dump(issues));
  REQUIRE(issues.size() == 1);
  CHECK(issues[0].to_string() == expected);
}

ParamSpec spec_named(const PluginManifest& m, const std::string& name) {
  for (size_t i = 0; i < m.num_params; ++i)
    if (name == manifest_param(m, i).name) return manifest_param(m, i);
  FAIL("no param " << name);
  return ParamSpec{};
}

}  // namespace

TEST_CASE("ConfigIssue and ConfigError formatting") {
  ConfigIssue a{"configs/x.yaml", 12, 5, "engine.scheduler.max_batch_tokens",
                "expected an integer >= 1, got \"abc\""};
  CHECK(a.to_string() ==
        "configs/x.yaml:12:5: engine.scheduler.max_batch_tokens: expected an integer >= 1, got "
        "\"abc\"");
  ConfigIssue b{"configs/x.yaml", 0, 0, "", "cannot open file: No such file or directory"};
  CHECK(b.to_string() == "configs/x.yaml: cannot open file: No such file or directory");
  ConfigError error({a, b});
  CHECK(std::string(error.what()) == a.to_string() + "\n" + b.to_string());
  CHECK(error.issues().size() == 2);
}

TEST_CASE("default_engine_plugin") {
  CHECK(std::string(default_engine_plugin(PluginKind::kBackend)) == "cpu");
  CHECK(std::string(default_engine_plugin(PluginKind::kScheduler)) == "static");
  CHECK(std::string(default_engine_plugin(PluginKind::kKvCache)) == "contiguous");
  CHECK(std::string(default_engine_plugin(PluginKind::kAttention)) == "naive");
  CHECK(std::string(default_engine_plugin(PluginKind::kQuantizer)) == "gguf");
  CHECK(std::string(default_engine_plugin(PluginKind::kSampler)) == "standard");
  CHECK(default_engine_plugin(PluginKind::kDrafter) == nullptr);
}

TEST_CASE("a full valid stack round-trips into typed values") {
  auto dir = test::scratch_dir("config-valid");
  auto plugin_rel = fs::relative(test_plugin_dir(), dir).string();
  auto file = write_file(dir / "stack.yaml", R"(# a full stack
plugin_paths: [)" + plugin_rel + R"(]
model:   {path: smollm2-135m-instruct-q4_1, threads: 2, context_length: 2048}
engine:
  backend:   {plugin: cpu}
  scheduler: {plugin: chunked-prefill, max_num_seqs: 32, max_batch_tokens: 512}
  kv_cache:  {plugin: paged, block_size: 16, memory: 256MiB, prefix_caching: true}
  attention: {plugin: naive}
  quantizer: {plugin: gguf}
  sampler:
    plugin: test-greedy
    temperature_floor: 0.25
    top_k: 40
    tie_break: highest
    scratch: 512KiB
    timeout: 250ms
    label: "my sampler"
    verbose: yes
    banned_words: [foo, bar]
    aliases: {a: b, c: d}
  drafter:   {plugin: ngram, num_draft_tokens: 4}
gateway:
  cache:  [{plugin: exact, ttl: 10m}, {plugin: semantic, threshold: 0.92, ttl: 1h}]
  router: {plugin: classifier, routes: {simple: small, complex: large}}
server:  {host: 0.0.0.0, port: 9000, api_keys: [k1, k2]}
)");
  // The test plugin dir comes from plugin_paths; start from a registry without it.
  PluginRegistry fresh;
  for (const auto& m : kStubs) fresh.add_builtin(&m);
  StackConfig config = load_stack_config(file.string(), fresh);

  CHECK(config.file == file.string());
  REQUIRE(config.plugin_paths.size() == 1);
  CHECK(fs::equivalent(config.plugin_paths[0], test_plugin_dir()));
  CHECK(config.model.path == "smollm2-135m-instruct-q4_1");
  CHECK(config.model.name == "smollm2-135m-instruct-q4_1");
  CHECK(config.model.threads == 2);
  CHECK(config.model.context_length == 2048);

  REQUIRE(config.engine.size() == 7);
  CHECK(config.engine.at(PluginKind::kBackend).plugin == "cpu");
  const PluginSlot& scheduler = config.engine.at(PluginKind::kScheduler);
  CHECK(scheduler.plugin == "chunked-prefill");
  CHECK(scheduler.file == file.string());
  CHECK(scheduler.config.plugin_name() == "chunked-prefill");
  CHECK(scheduler.config.key_path() == "engine.scheduler");
  CHECK(scheduler.config.get_int("max_num_seqs") == 32);
  const PluginConfig& kv = config.engine.at(PluginKind::kKvCache).config;
  CHECK(kv.get_int("memory") == 256 * 1024 * 1024);
  CHECK(kv.get_bool("prefix_caching"));
  CHECK(kv.get_string("dtype") == "f16");  // default filled in

  const PluginConfig& sampler = config.engine.at(PluginKind::kSampler).config;
  CHECK(sampler.get_float("temperature_floor") == doctest::Approx(0.25));
  CHECK(sampler.get_int("top_k") == 40);
  CHECK(sampler.get_string("tie_break") == "highest");
  CHECK(sampler.get_int("scratch") == 512 * 1024);
  CHECK(sampler.get_float("timeout") == doctest::Approx(0.25));
  CHECK(sampler.get_string("label") == "my sampler");
  CHECK(sampler.get_bool("verbose"));
  CHECK(sampler.get_string_list("banned_words") == std::vector<std::string>{"foo", "bar"});
  CHECK(sampler.get_string_map("aliases") ==
        std::map<std::string, std::string>{{"a", "b"}, {"c", "d"}});
  CHECK_FALSE(sampler.has("note"));  // optional, absent

  CHECK(config.engine.at(PluginKind::kDrafter).config.get_int("num_draft_tokens") == 4);

  REQUIRE(config.cache_layers.size() == 2);
  CHECK(config.cache_layers[0].plugin == "exact");
  CHECK(config.cache_layers[0].config.get_float("ttl") == 600.0);
  CHECK(config.cache_layers[0].config.key_path() == "gateway.cache[0]");
  CHECK(config.cache_layers[1].config.get_float("ttl") == 3600.0);
  CHECK(config.cache_layers[1].config.get_float("threshold") == doctest::Approx(0.92));
  REQUIRE(config.router.has_value());
  CHECK(config.router->config.get_string_map("routes").at("complex") == "large");

  CHECK(config.server.host == "0.0.0.0");
  CHECK(config.server.port == 9000);
  CHECK(config.server.api_keys == std::vector<std::string>{"k1", "k2"});

  // Plugins created from validated slots work.
  auto object = fresh.create<Sampler>("test-greedy", sampler, {});
  CHECK(object != nullptr);
}

TEST_CASE("missing engine slots get the default plugins; the drafter is off unless set") {
  auto dir = test::scratch_dir("config-defaults");
  auto registry = make_registry();
  auto file = write_file(dir / "min.yaml", "model: {path: m.gguf}\n");
  StackConfig config = load_stack_config(file.string(), *registry);
  CHECK(config.engine.size() == 6);
  CHECK(config.engine.count(PluginKind::kDrafter) == 0);
  CHECK(config.engine.at(PluginKind::kScheduler).plugin == "static");
  CHECK(config.engine.at(PluginKind::kScheduler).config.get_int("max_batch_tokens") == 512);
  CHECK(config.engine.at(PluginKind::kKvCache).config.get_int("memory") == 256 << 20);
  CHECK(config.model.name == "m");
  CHECK(config.server.port == 8080);
  CHECK(config.server.host == "127.0.0.1");
  CHECK(config.cache_layers.empty());
  CHECK_FALSE(config.router.has_value());

  // A section with everything commented out is empty, not an error.
  file = write_file(dir / "empty-sections.yaml", "model: {path: m.gguf}\nengine:\ngateway:\nserver:\n");
  config = load_stack_config(file.string(), *registry);
  CHECK(config.engine.size() == 6);
  CHECK(config.server.port == 8080);

  // `plugin: none` switches the drafter off explicitly.
  file = write_file(dir / "none.yaml",
                    "model: {path: m.gguf}\nengine: {drafter: {plugin: none}, sampler: {plugin: "
                    "test-greedy}}\n");
  config = load_stack_config(file.string(), *registry);
  CHECK(config.engine.count(PluginKind::kDrafter) == 0);
  CHECK(config.engine.at(PluginKind::kSampler).plugin == "test-greedy");
}

TEST_CASE("a missing default plugin is reported against its slot") {
  auto dir = test::scratch_dir("config-missing-default");
  auto file = write_file(dir / "min.yaml", "model: {path: m.gguf}\n");
  auto registry = make_registry(/*skip=*/"static");
  check_single(load_errors(file, *registry),
               file.string() +
                   ": engine.scheduler: not set, and the default scheduler plugin is not "
                   "available: unknown scheduler plugin 'static'; registered scheduler plugins: "
                   "chunked-prefill");
  file = write_file(dir / "with-engine.yaml", "model: {path: m.gguf}\nengine: {}\n");
  check_single(load_errors(file, *registry),
               file.string() +
                   ":2:1: engine.scheduler: not set, and the default scheduler plugin is not "
                   "available: unknown scheduler plugin 'static'; registered scheduler plugins: "
                   "chunked-prefill");

  // A registry with only the core's built-ins knows backend.cpu and its schema.
  PluginRegistry bare;
  REQUIRE(bare.find(PluginKind::kBackend, "cpu") != nullptr);
  file = write_file(dir / "bare.yaml",
                    "model: {path: m.gguf}\nengine: {backend: {plugin: cpu, threads: -2}}\n");
  auto issues = load_errors(file, bare);
  INFO(dump(issues));
  CHECK(has_issue(issues, file.string() + ":2:42: engine.backend.threads: expected an integer in "
                                          "[0, 512], got -2"));
  CHECK(has_issue(issues, file.string() + ":2:1: engine.scheduler: not set, and the default "
                                          "scheduler plugin is not available: unknown scheduler "
                                          "plugin 'static'; no scheduler plugins are registered"));
}

TEST_CASE("extends: the child overrides the base; maps merge, other values replace") {
  auto dir = test::scratch_dir("config-extends");
  write_file(dir / "base" / "base.yaml", R"(model: {path: base.gguf, threads: 4}
engine:
  scheduler: {plugin: static, max_num_seqs: 16, max_batch_tokens: 1024}
  kv_cache: {plugin: paged, block_size: 32}
  sampler: {plugin: test-greedy, banned_words: [a, b]}
gateway:
  cache: [{plugin: exact}]
server: {port: 8001, api_keys: [base-key]}
)");
  auto child = write_file(dir / "variants" / "child.yaml", R"(extends: ../base/base.yaml
model: {threads: 8}
engine:
  scheduler: {max_num_seqs: 64}
  kv_cache: {plugin: contiguous}
  sampler: {banned_words: [c]}
gateway:
  cache: [{plugin: semantic}]
server: {api_keys: [child-key]}
)");
  auto registry = make_registry();
  StackConfig config = load_stack_config(child.string(), *registry);
  CHECK(config.model.path == "base.gguf");
  CHECK(config.model.threads == 8);
  const auto& scheduler = config.engine.at(PluginKind::kScheduler);
  CHECK(scheduler.plugin == "static");
  CHECK(scheduler.config.get_int("max_num_seqs") == 64);       // child
  CHECK(scheduler.config.get_int("max_batch_tokens") == 1024);  // base
  // A different plugin replaces the slot: the base's block_size is not carried over.
  const auto& kv = config.engine.at(PluginKind::kKvCache);
  CHECK(kv.plugin == "contiguous");
  CHECK(kv.config.get_int("block_size") == 16);
  CHECK(config.engine.at(PluginKind::kSampler).config.get_string_list("banned_words") ==
        std::vector<std::string>{"c"});
  REQUIRE(config.cache_layers.size() == 1);
  CHECK(config.cache_layers[0].plugin == "semantic");
  CHECK(config.server.port == 8001);
  CHECK(config.server.api_keys == std::vector<std::string>{"child-key"});

  // An error in a value set by the base file points into the base file.
  auto bad = write_file(dir / "variants" / "bad.yaml",
                        "extends: ../base/base.yaml\nengine: {scheduler: {max_batch_tokens: 0}}\n");
  check_single(load_errors(bad, *registry),
               (dir / "variants" / "bad.yaml").string() +
                   ":2:40: engine.scheduler.max_batch_tokens: expected an integer >= 1, got 0");
  write_file(dir / "base" / "broken.yaml", "model: {path: x, threads: -1}\n");
  auto uses_broken = write_file(dir / "v2.yaml", "extends: base/broken.yaml\nengine: {sampler: {plugin: test-greedy}}\n");
  check_single(load_errors(uses_broken, *registry),
               (dir / "base" / "broken.yaml").string() +
                   ":1:27: model.threads: expected an integer in [0, 512], got -1");
}

TEST_CASE("extends: cycles and missing bases are reported where extends is written") {
  auto dir = test::scratch_dir("config-extends-errors");
  write_file(dir / "a.yaml", "extends: b.yaml\nmodel: {path: x}\n");
  write_file(dir / "b.yaml", "extends: a.yaml\n");
  auto issues = load_errors(dir / "a.yaml");
  INFO(dump(issues));
  REQUIRE(issues.size() == 1);
  CHECK(issues[0].file == (dir / "b.yaml").string());
  CHECK(issues[0].line == 1);
  CHECK(issues[0].column == 10);
  CHECK(issues[0].key_path == "extends");
  CHECK(issues[0].message == "extends cycle: " + (dir / "a.yaml").string() + " -> " +
                                 (dir / "b.yaml").string() + " -> " + (dir / "a.yaml").string());

  write_file(dir / "self.yaml", "extends: ./self.yaml\n");
  issues = load_errors(dir / "self.yaml");
  REQUIRE(issues.size() == 1);
  CHECK(issues[0].message.find("extends cycle") == 0);

  auto missing = write_file(dir / "missing.yaml", "model: {path: x}\nextends: nope/base.yaml\n");
  check_single(load_errors(missing),
               missing.string() + ":2:10: extends: cannot read '" +
                   (dir / "nope" / "base.yaml").string() +
                   "': cannot open file: No such file or directory");

  auto not_string = write_file(dir / "list.yaml", "extends: [a.yaml]\n");
  check_single(load_errors(not_string),
               not_string.string() +
                   ":1:10: extends: expected the path of a base config file, got a list");
}

TEST_CASE("a file that does not exist, and YAML syntax errors with their line") {
  auto dir = test::scratch_dir("config-syntax");
  check_single(load_errors(dir / "absent.yaml"),
               (dir / "absent.yaml").string() + ": cannot open file: No such file or directory");

  auto file = write_file(dir / "syntax.yaml", "model: {path: x}\nengine:\n  scheduler: {plugin: static\n");
  auto issues = load_errors(file);
  INFO(dump(issues));
  REQUIRE(issues.size() == 1);
  CHECK(issues[0].file == file.string());
  CHECK(issues[0].line >= 3);
  CHECK(issues[0].message.find("YAML syntax error: ") == 0);

  file = write_file(dir / "tabs.yaml", "model:\n  path: x\n   bad: indentation\n");
  issues = load_errors(file);
  REQUIRE(issues.size() == 1);
  CHECK(issues[0].line == 3);
  CHECK(issues[0].message.find("YAML syntax error") == 0);

  file = write_file(dir / "scalar.yaml", "just a string\n");
  check_single(load_errors(file), file.string() +
                                      ":1:1: the top level of a config file must be a mapping, "
                                      "got \"just a string\"");

  file = write_file(dir / "dup.yaml", "model: {path: x}\nserver: {port: 1}\nserver: {port: 2}\n");
  check_single(load_errors(file), file.string() + ":3:1: duplicate key 'server' (first set at line 2)");
}

TEST_CASE("unknown keys at every level, gathered in one ConfigError with line:col") {
  auto dir = test::scratch_dir("config-unknown");
  auto file = write_file(dir / "unknown.yaml", R"(model: {path: x, thread: 2}
engin: {}
engine:
  schedular: {plugin: static}
  kv_cache: {plugin: paged, blocksize: 8}
  attention: {plugin: naive, tiles: 4}
gateway:
  cache: [{plugin: exact, ttl: 1m, size: 10}]
  routers: {}
server: {host: localhost, prot: 80}
)");
  auto issues = load_errors(file);
  INFO(dump(issues));
  const std::string f = file.string();
  CHECK(has_issue(issues, f + ":2:1: unknown key 'engin'; did you mean 'engine'? expected one "
                              "of: extends, plugin_paths, model, engine, deployments, gateway, embedding, server, "
                              "disaggregation, replicas"));
  CHECK(has_issue(issues, f + ":1:18: model: unknown key 'thread'; did you mean 'threads'? "
                              "expected one of: path, name, threads, context_length"));
  CHECK(has_issue(issues, f + ":4:3: engine: unknown key 'schedular'; did you mean "
                              "'scheduler'? expected one of: backend, scheduler, kv_cache, "
                              "attention, quantizer, sampler, drafter, constraint, requires"));
  CHECK(has_issue(issues, f + ":5:29: engine.kv_cache: unknown key 'blocksize'; did you mean "
                              "'block_size'? expected one of: plugin, memory, block_size, dtype, "
                              "prefix_caching"));
  CHECK(has_issue(issues, f + ":6:30: engine.attention: unknown key 'tiles'; plugin 'naive' "
                              "takes no parameters"));
  CHECK(has_issue(issues, f + ":8:36: gateway.cache[0]: unknown key 'size'; expected one of: "
                              "plugin, ttl"));
  CHECK(has_issue(issues, f + ":9:3: gateway: unknown key 'routers'; did you mean 'router'? "
                              "expected one of: cache, router"));
  CHECK(has_issue(issues, f + ":10:27: server: unknown key 'prot'; did you mean 'port'? "
                              "expected one of: host, port, api_keys, max_body_size, max_header_size, header_timeout, "
                              "read_timeout, idle_timeout, write_timeout, max_queued_requests, shutdown_timeout, shutdown_grace, defaults"));
  CHECK(issues.size() == 8);
}

TEST_CASE("wrong types, ranges, enums, sizes and required values") {
  auto dir = test::scratch_dir("config-values");
  auto file = write_file(dir / "values.yaml", R"(model:
  threads: "abc"
  context_length: 1.5
engine:
  scheduler: {plugin: static, max_num_seqs: 0, max_batch_tokens: "abc"}
  kv_cache: {plugin: paged, dtype: f8, memory: 256XB, prefix_caching: maybe, block_size: [16]}
  sampler: {plugin: test-greedy, timeout: 5y, scratch: 2GiB, temperature_floor: hot, label: {a: b}}
gateway:
  cache: {plugin: exact}
  router: {plugin: classifier}
server: {port: 70000, api_keys: key}
)");
  auto issues = load_errors(file);
  INFO(dump(issues));
  const std::string f = file.string();
  CHECK(has_issue(issues, f + ":1:1: model: missing required key 'path' (a string)"));
  CHECK(has_issue(issues, f + ":2:12: model.threads: expected an integer in [0, 512], got \"abc\""));
  CHECK(has_issue(issues, f + ":3:19: model.context_length: expected an integer in [0, "
                              "1073741824], got 1.5"));
  CHECK(has_issue(issues, f + ":5:45: engine.scheduler.max_num_seqs: expected an integer in [1, "
                              "4096], got 0"));
  CHECK(has_issue(issues, f + ":5:66: engine.scheduler.max_batch_tokens: expected an integer "
                              ">= 1, got \"abc\""));
  CHECK(has_issue(issues, f + ":6:36: engine.kv_cache.dtype: expected one of: f16, f32, got "
                              "\"f8\""));
  CHECK(has_issue(issues, f + ":6:48: engine.kv_cache.memory: unknown size unit 'XB'; use B, KB, "
                              "MB, GB, TB, KiB, MiB, GiB or TiB in \"256XB\" (a size >= 1MiB (e.g. "
                              "4096, 512KiB, 256MiB, 1GB))"));
  CHECK(has_issue(issues, f + ":6:71: engine.kv_cache.prefix_caching: expected a boolean (true "
                              "or false), got \"maybe\""));
  CHECK(has_issue(issues, f + ":6:90: engine.kv_cache.block_size: expected an integer in [1, "
                              "1024], got a list"));
  CHECK(has_issue(issues, f + ":7:43: engine.sampler.timeout: unknown duration unit 'y'; use ms, "
                              "s, m, h or d (a plain number is seconds) in \"5y\" (a duration in "
                              "[0s, 1h] (e.g. 250ms, 10s, 10m, 1h))"));
  CHECK(has_issue(issues, f + ":7:56: engine.sampler.scratch: expected a size in [0, 1GiB] (e.g. "
                              "4096, 512KiB, 256MiB, 1GB), got \"2GiB\""));
  CHECK(has_issue(issues, f + ":7:81: engine.sampler.temperature_floor: expected a number in [0, "
                              "10], got \"hot\""));
  CHECK(has_issue(issues, f + ":7:93: engine.sampler.label: expected a string, got a mapping"));
  CHECK(has_issue(issues, f + ":9:10: gateway.cache: expected a list of cache layer slots, got a "
                              "mapping"));
  CHECK(has_issue(issues, f + ":10:3: gateway.router: missing required parameter 'routes' (a "
                              "mapping of strings to strings)"));
  CHECK(has_issue(issues, f + ":11:16: server.port: expected an integer in [0, 65535], got 70000"));
  CHECK(has_issue(issues, f + ":11:33: server.api_keys: expected a list of strings, got \"key\""));
  CHECK(issues.size() == 17);
}

TEST_CASE("plugin names: unknown lists the registered ones, wrong kind, refused library") {
  auto dir = test::scratch_dir("config-plugins");
  auto file = write_file(dir / "plugins.yaml", R"(model: {path: x}
engine:
  sampler: {plugin: static}
  scheduler: {plugin: continuous}
  kv_cache: {max_blocks: 3}
  drafter: {plugin: test-abi-mismatch}
  attention: naive
gateway:
  cache: [{plugin: redis}]
)");
  auto issues = load_errors(file);
  INFO(dump(issues));
  const std::string f = file.string();
  CHECK(has_issue(issues, f + ":3:21: engine.sampler: plugin 'static' is a scheduler, not a "
                              "sampler"));
  CHECK(has_issue(issues, f + ":4:23: engine.scheduler: unknown scheduler plugin 'continuous'; "
                              "registered scheduler plugins: chunked-prefill, static"));
  CHECK(has_issue(issues, f + ":5:3: engine.kv_cache: missing key 'plugin' (the kv_cache "
                              "plugin's name; registered: contiguous, paged)"));
  CHECK(has_issue(issues, f + ":6:21: engine.drafter: plugin 'test-abi-mismatch' could not be "
                              "loaded: libtessera-test-abi-mismatch.so: built for Tessera SDK ABI "
                              "3.0, this host implements ABI " + std::to_string(kSdkAbiMajor) + "." +
                              std::to_string(kSdkAbiMinor) + " (the major versions must match)"));
  CHECK(has_issue(issues, f + ":7:14: engine.attention: expected a plugin slot {plugin: NAME, "
                              "...parameters}, got \"naive\""));
  CHECK(has_issue(issues, f + ":9:20: gateway.cache[0]: unknown cache_layer plugin 'redis'; "
                              "registered cache_layer plugins: exact, semantic"));
  CHECK(issues.size() == 6);
}

TEST_CASE("plugin_paths are relative to the file that names them and must exist") {
  auto dir = test::scratch_dir("config-plugin-paths");
  auto rel = fs::relative(test_plugin_dir(), dir / "sub").string();
  write_file(dir / "sub" / "base.yaml", "plugin_paths: [" + rel + "]\nmodel: {path: x}\n");
  auto file = write_file(dir / "child.yaml",
                         "extends: sub/base.yaml\nengine: {sampler: {plugin: test-greedy}}\n");
  PluginRegistry registry;
  for (const auto& m : kStubs) registry.add_builtin(&m);
  StackConfig config = load_stack_config(file.string(), registry);
  CHECK(config.engine.at(PluginKind::kSampler).plugin == "test-greedy");

  auto bad = write_file(dir / "bad.yaml", "plugin_paths: [no-such-dir, 3]\nmodel: {path: x}\n"
                                          "engine: {sampler: {plugin: test-greedy}}\n");
  auto issues = load_errors(bad);
  INFO(dump(issues));
  CHECK(has_issue(issues, bad.string() + ":1:16: plugin_paths[0]: plugin folder '" +
                              (dir / "no-such-dir").string() + "' does not exist"));
  CHECK(has_issue(issues, bad.string() + ":1:29: plugin_paths[1]: plugin folder '" +
                              (dir / "3").string() + "' does not exist"));
  CHECK(issues.size() == 2);
}

TEST_CASE("validate_plugin_params: value syntaxes and defaults") {
  auto registry = make_registry();
  const PluginManifest& m = *registry->find(PluginKind::kSampler, "test-greedy")->manifest;
  PluginConfig defaults = validate_plugin_params(m, "engine.sampler", "");
  CHECK(defaults.plugin_name() == "test-greedy");
  CHECK(defaults.get_int("scratch") == 1 << 20);
  CHECK(defaults.get_float("timeout") == 10.0);
  CHECK(defaults.get_string("label") == "greedy");
  CHECK(defaults.get_bool("verbose") == false);
  CHECK(defaults.get_string_list("banned_words").empty());
  CHECK(defaults.has("aliases"));
  CHECK_FALSE(defaults.has("note"));

  struct Case {
    const char* yaml;
    const char* param;
    double expected;
  };
  const Case cases[] = {
      {"scratch: 4096", "scratch", 4096},
      {"scratch: 512KiB", "scratch", 512 * 1024},
      {"scratch: 256MiB", "scratch", 256.0 * 1024 * 1024},
      {"scratch: 1GiB", "scratch", 1024.0 * 1024 * 1024},
      {"scratch: 1GB", "scratch", 1e9},
      {"scratch: 10MB", "scratch", 1e7},
      {"scratch: \"4096\"", "scratch", 4096},
      {"scratch: 1.5KiB", "scratch", 1536},
      {"scratch: 2 KiB", "scratch", 2048},
      {"timeout: 250ms", "timeout", 0.25},
      {"timeout: 10s", "timeout", 10},
      {"timeout: 10m", "timeout", 600},
      {"timeout: 1h", "timeout", 3600},
      {"timeout: 30", "timeout", 30},
      {"timeout: 1.5", "timeout", 1.5},
      {"temperature_floor: 1", "temperature_floor", 1},
      {"temperature_floor: 0.5", "temperature_floor", 0.5},
      {"top_k: 7", "top_k", 7},
      {"top_k: +7", "top_k", 7},
  };
  for (const auto& c : cases) {
    CAPTURE(c.yaml);
    PluginConfig config = validate_plugin_params(m, "s", c.yaml);
    CHECK(config.get_float(c.param) == doctest::Approx(c.expected));
  }
  for (const char* yes : {"true", "yes", "on", "True"})
    CHECK(validate_plugin_params(m, "s", std::string("verbose: ") + yes).get_bool("verbose"));
  for (const char* no : {"false", "no", "off"})
    CHECK_FALSE(validate_plugin_params(m, "s", std::string("verbose: ") + no).get_bool("verbose"));

  auto message = [&](const std::string& yaml) -> std::string {
    try {
      validate_plugin_params(m, "engine.sampler", yaml);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(no error)";
  };
  CHECK(message("top_k: abc") ==
        "<params>:1:8: engine.sampler.top_k: expected an integer in [1, 1000], got \"abc\"");
  CHECK(message("top_k: 1.5") ==
        "<params>:1:8: engine.sampler.top_k: expected an integer in [1, 1000], got 1.5");
  CHECK(message("top_k: 0") ==
        "<params>:1:8: engine.sampler.top_k: expected an integer in [1, 1000], got 0");
  CHECK(message("scratch: 1.5") ==
        "<params>:1:10: engine.sampler.scratch: expected a size in [0, 1GiB] (e.g. 4096, "
        "512KiB, 256MiB, 1GB), got 1.5");
  CHECK(message("scratch: -1") ==
        "<params>:1:10: engine.sampler.scratch: expected a size in [0, 1GiB] (e.g. 4096, "
        "512KiB, 256MiB, 1GB), got -1");
  CHECK(message("timeout: -1s") ==
        "<params>:1:10: engine.sampler.timeout: expected a duration in [0s, 1h] (e.g. 250ms, "
        "10s, 10m, 1h), got \"-1s\"");
  CHECK(message("temperature_floor: .nan") ==
        "<params>:1:20: engine.sampler.temperature_floor: expected a number in [0, 10], got "
        "\".nan\"");
  CHECK(message("banned_words: [a, [b]]") ==
        "<params>:1:15: engine.sampler.banned_words: element 1 is a list (a list of strings)");
  CHECK(message("label:") == "<params>:1:1: engine.sampler.label: expected a string, got nothing");
  CHECK(message("plugin: x") ==
        "<params>:1:1: engine.sampler: unknown key 'plugin'; expected one of: temperature_floor, "
        "top_k, tie_break, scratch, timeout, label, verbose, banned_words, aliases, note");
  CHECK(message("[1, 2]") == "<params>:1:1: engine.sampler: expected a mapping of parameters, got a list");
  CHECK(message("{a: ") .find("<params>:1:") == 0);
  CHECK(message("top_k: 2\ntie_break: middle\nverbose: 3") ==
        "<params>:2:12: engine.sampler.tie_break: expected one of: lowest, highest, got "
        "\"middle\"\n<params>:3:10: engine.sampler.verbose: expected a boolean (true or false), "
        "got 3");
}

TEST_CASE("describe_param_expectation and format_param_value") {
  auto registry = make_registry();
  const PluginManifest& m = *registry->find(PluginKind::kSampler, "test-greedy")->manifest;
  CHECK(describe_param_expectation(spec_named(m, "top_k")) == "an integer in [1, 1000]");
  CHECK(describe_param_expectation(spec_named(m, "tie_break")) == "one of: lowest, highest");
  CHECK(describe_param_expectation(kSchedulerParams[1]) == "an integer >= 1");
  PluginConfig defaults = validate_plugin_params(m, "s", "{aliases: {x: y}, banned_words: [p, q]}");
  auto fmt = [&](const char* name) {
    return format_param_value(spec_named(m, name), defaults.values().at(name));
  };
  CHECK(fmt("scratch") == "1MiB");
  CHECK(fmt("timeout") == "10s");
  CHECK(fmt("temperature_floor") == "0");
  CHECK(fmt("verbose") == "false");
  CHECK(fmt("aliases") == "{x: y}");
  CHECK(fmt("banned_words") == "[p, q]");
  CHECK(format_param_value(spec_named(m, "timeout"), ParamValue(0.25)) == "250ms");
  CHECK(format_param_value(spec_named(m, "timeout"), ParamValue(600.0)) == "10m");
  CHECK(format_param_value(spec_named(m, "scratch"), ParamValue(int64_t{1000})) == "1000");
}

TEST_CASE("model paths: cache dir, aliases, paths relative to the config file") {
  auto dir = test::scratch_dir("config-models");
  auto cache = dir / "cache";
  write_file(cache / "SmolLM2-135M-Instruct.Q4_1.gguf", "GGUF");
  write_file(cache / "other.gguf", "GGUF");
  write_file(dir / "stacks" / "local.gguf", "GGUF");
  setenv("TESSERA_MODEL_DIR", cache.c_str(), 1);
  CHECK(model_cache_dir() == cache.string());
  CHECK(resolve_model_path("smollm2-135m-instruct-q4_1") ==
        (cache / "SmolLM2-135M-Instruct.Q4_1.gguf").string());
  CHECK(resolve_model_path("other") == (cache / "other.gguf").string());
  CHECK(resolve_model_path("OTHER.gguf") == (cache / "other.gguf").string());
  CHECK(resolve_model_path((dir / "stacks" / "local.gguf").string()) ==
        (dir / "stacks" / "local.gguf").string());
  CHECK(resolve_model_path("local.gguf", (dir / "stacks").string()) ==
        (dir / "stacks" / "local.gguf").string());
  try {
    resolve_model_path("nope-7b");
    FAIL("expected an error");
  } catch (const std::runtime_error& e) {
    std::string what = e.what();
    CHECK(what.find("model 'nope-7b' not found (looked in ") == 0);
    CHECK(what.find((cache / "nope-7b.gguf").string()) != std::string::npos);
    CHECK(what.find("); run scripts/fetch-models.sh to download it") != std::string::npos);
  }

  // A relative model path in a config is relative to that config's folder.
  auto file = write_file(dir / "stacks" / "s.yaml",
                         "model: {path: local.gguf}\nengine: {sampler: {plugin: test-greedy}}\n");
  auto registry = make_registry();
  StackConfig config = load_stack_config(file.string(), *registry);
  CHECK(config.model.path == (dir / "stacks" / "local.gguf").string());
  CHECK(config.model.name == "local");

  unsetenv("TESSERA_MODEL_DIR");
  const char* home = std::getenv("HOME");
  if (home && *home)
    CHECK(model_cache_dir() == (fs::path(home) / ".cache" / "tessera" / "models").string());
}

TEST_CASE("server: limits, timeouts and queue size are typed, and mistakes name the key") {
  auto dir = test::scratch_dir("config-server");
  auto registry = make_registry();
  auto file = write_file(dir / "server.yaml",
                         "model: {path: m.gguf}\n"
                         "server: {port: 0, max_body_size: 64KiB, header_timeout: 1500ms, idle_timeout: 2m,\n"
                         "         max_queued_requests: 3, shutdown_timeout: 0}\n");
  StackConfig config = load_stack_config(file.string(), *registry);
  CHECK(config.server.port == 0);
  CHECK(config.server.max_body_bytes == 64 << 10);
  CHECK(config.server.max_header_bytes == 16 << 10);
  CHECK(config.server.header_timeout == doctest::Approx(1.5));
  CHECK(config.server.idle_timeout == doctest::Approx(120));
  CHECK(config.server.read_timeout == doctest::Approx(30));
  CHECK(config.server.max_queued_requests == 3);
  CHECK(config.server.shutdown_timeout == 0);

  file = write_file(dir / "bad-server.yaml",
                    "model: {path: m.gguf}\n"
                    "server: {max_queued_requests: 0, header_timeout: soon, max_body_size: 10, api_keys: [''],\n"
                    "         max_conections: 5}\n");
  const auto issues = load_errors(file, *registry);
  const std::string all = dump(issues);
  INFO(all);
  CHECK(issues.size() == 5);
  CHECK(all.find("server.max_queued_requests: expected an integer in [1, 1048576], got 0") != std::string::npos);
  CHECK(all.find("server.header_timeout: expected a duration") != std::string::npos);
  CHECK(all.find("server.max_body_size: expected a size in [1KiB, 1GiB]") != std::string::npos);
  CHECK(all.find("server.api_keys: an API key must not be empty") != std::string::npos);
  CHECK(all.find("server: unknown key 'max_conections'") != std::string::npos);
}

// Regressions of the adversarial probe in issue 12: each of these used to exhaust memory,
// hang or abort; each now gives one clear issue and allocates nothing big.
TEST_CASE("hostile configs: alias bombs, deep nesting, devices, FIFOs, huge files, NULs") {
  auto dir = test::scratch_dir("config-hostile");

  // "Billion laughs": 9 levels of 9 aliases would copy 9^9 nodes (8 GB before the bound).
  std::string bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n";
  for (int level = 1; level <= 9; ++level) {
    std::string prev = "*a" + std::to_string(level - 1);
    bomb += "a" + std::to_string(level) + ": &a" + std::to_string(level) + " [" + prev;
    for (int i = 1; i < 9; ++i) bomb += ", " + prev;
    bomb += "]\n";
  }
  auto file = write_file(dir / "bomb.yaml", bomb);
  auto issues = load_errors(file);
  INFO(dump(issues));
  REQUIRE(issues.size() == 1);
  CHECK(issues[0].message ==
        "config too large: the document expands to more than 100000 nodes (nested YAML aliases?)");

  // Nesting past our bound (64) and past yaml-cpp's own guard (which says only "bad file").
  for (int depth : {100, 5000}) {
    file = write_file(dir / ("deep" + std::to_string(depth) + ".yaml"),
                      "model: " + std::string(depth, '[') + std::string(depth, ']') + "\n");
    issues = load_errors(file);
    INFO(dump(issues));
    REQUIRE(issues.size() == 1);
    CHECK(issues[0].message == "config too large: nesting deeper than 64 levels");
  }

  // A file past 1 MiB is refused unread.
  file = write_file(dir / "big.yaml", "model: {path: x}\n# " + std::string(1 << 20, 'x') + "\n");
  check_single(load_errors(file),
               file.string() + ": is larger than 1MiB, the most a config file may be");

  // extends: a device or a FIFO (the FIFO used to block forever in open()).
  file = write_file(dir / "zero.yaml", "extends: /dev/zero\nmodel: {path: x}\n");
  check_single(load_errors(file),
               file.string() + ":1:10: extends: cannot read '/dev/zero': is not a regular file "
                               "(a device, FIFO or socket); configs are read from files");
  const fs::path fifo = dir / "pipe.yaml";
  fs::remove(fifo);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  file = write_file(dir / "fifo.yaml", "extends: pipe.yaml\nmodel: {path: x}\n");
  check_single(load_errors(file),
               file.string() + ":1:10: extends: cannot read '" + fifo.string() +
                   "': is not a regular file (a device, FIFO or socket); configs are read from "
                   "files");

  // A NUL in a path would cut it short where it reaches open().
  file = write_file(dir / "nul.yaml", "model: {path: \"models/a\\0b.gguf\"}\n");
  check_single(load_errors(file), file.string() + ":1:15: a value contains a NUL character");

  // model.threads is bounded (4000 used to abort the process once the pool was built).
  file = write_file(dir / "threads.yaml", "model: {path: x, threads: 4000}\n");
  check_single(load_errors(file),
               file.string() + ":1:27: model.threads: expected an integer in [0, 512], got 4000");
}

TEST_CASE("deployments: each is a stack served under its key; extends takes a file's model and engine") {
  auto dir = test::scratch_dir("config-deployments");
  write_file(dir / "base.yaml", R"(model: {path: base.gguf, threads: 2}
engine:
  scheduler: {plugin: static, max_num_seqs: 8}
server: {port: 9001}
)");
  auto file = write_file(dir / "gw.yaml", R"(deployments:
  small: {extends: base.yaml}
  large:
    extends: base.yaml
    engine: {scheduler: {plugin: chunked-prefill}}
  other: {model: {path: other.gguf}}
gateway:
  cache: [{plugin: exact}]
  router: {plugin: classifier, name: auto, routes: {simple: small, complex: large}}
)");
  auto registry = make_registry();
  StackConfig config = load_stack_config(file.string(), *registry);
  REQUIRE(config.deployments.size() == 3);
  CHECK(config.deployments[0].name == "small");
  CHECK(config.deployments[0].model.name == "small");
  CHECK(config.deployments[0].model.threads == 2);
  CHECK(config.deployments[0].engine.at(PluginKind::kScheduler).config.get_int("max_num_seqs") == 8);
  CHECK(config.deployments[1].engine.at(PluginKind::kScheduler).plugin == "chunked-prefill");
  CHECK(config.deployments[2].model.path.find("other.gguf") != std::string::npos);
  CHECK(config.deployments[2].engine.at(PluginKind::kScheduler).plugin == "static");  // the default
  // The default deployment is what the single-model commands run; the base's server: is not taken.
  CHECK(config.model.name == "small");
  CHECK(config.server.port == 8080);
  CHECK(config.router_name == "auto");
  REQUIRE(config.router.has_value());
  CHECK(config.router->config.get_string_map("routes").size() == 2);
  CHECK(deployment_stack(config, 1).engine.at(PluginKind::kScheduler).plugin == "chunked-prefill");

  // A single stack is one deployment named after its model.
  auto single = write_file(dir / "single.yaml", "model: {path: m.gguf}\n");
  StackConfig one = load_stack_config(single.string(), *registry);
  REQUIRE(one.deployments.size() == 1);
  CHECK(one.deployments[0].name == "m");
  CHECK(one.router_name.empty());
}

TEST_CASE("deployments: mistakes name the deployment's key path") {
  auto dir = test::scratch_dir("config-deployments-errors");
  auto both = write_file(dir / "both.yaml", "model: {path: m.gguf}\ndeployments: {a: {model: {path: a.gguf}}}\n");
  check_single(load_errors(both), both.string() +
                                      ":1:1: model: with 'deployments:' each deployment has its own model and "
                                      "engine; move this section into one of them");
  auto named = write_file(dir / "named.yaml", "deployments: {a: {model: {path: a.gguf, name: b}}}\n");
  check_single(load_errors(named), named.string() +
                                       ":1:41: deployments.a.model.name: a deployment is served under its key "
                                       "'a'; remove 'name'");
  auto bad = write_file(dir / "bad.yaml", R"(deployments:
  a: {model: {path: a.gguf}, engine: {scheduler: {plugin: static, max_batch_tokens: 0}}}
  b: {modle: {path: b.gguf}}
)");
  auto issues = load_errors(bad);
  INFO(dump(issues));
  CHECK(has_issue(issues, bad.string() + ":2:85: deployments.a.engine.scheduler.max_batch_tokens: expected an "
                                         "integer >= 1, got 0"));
  CHECK(has_issue(issues, bad.string() + ":3:7: deployments.b: unknown key 'modle'; did you mean 'model'? expected one of: model, engine, disaggregation, replicas"));
  auto clash = write_file(dir / "clash.yaml", R"(deployments: {auto: {model: {path: a.gguf}}}
gateway: {router: {plugin: classifier, name: auto, routes: {x: auto}}}
)");
  check_single(load_errors(clash), clash.string() +
                                       ":2:11: gateway.router.name: 'auto' is also a deployment's name; give "
                                       "the router another");
}

TEST_CASE("embedding: a model directory by path or cache name; a missing one names the key") {
  auto dir = test::scratch_dir("config-embedding");
  auto cache = dir / "cache";
  write_file(cache / "All-MiniLM-L6-v2" / "config.json", "{}");
  write_file(dir / "stacks" / "enc" / "config.json", "{}");
  setenv("TESSERA_MODEL_DIR", cache.c_str(), 1);
  auto registry = make_registry();
  auto file = write_file(dir / "stacks" / "e.yaml",
                         "model: {path: m.gguf}\nembedding: {model: {path: all-minilm-l6-v2, threads: 2}}\n");
  StackConfig config = load_stack_config(file.string(), *registry);
  REQUIRE(config.embedding);
  CHECK(config.embedding->model.path == (cache / "All-MiniLM-L6-v2").string());
  CHECK(config.embedding->model.name == "all-minilm-l6-v2");
  CHECK(config.embedding->model.threads == 2);
  CHECK(config.embedding->max_inputs == 256);
  file = write_file(dir / "stacks" / "rel.yaml", "model: {path: m.gguf}\nembedding: {model: {path: enc}, max_inputs: 8}\n");
  config = load_stack_config(file.string(), *registry);
  CHECK(config.embedding->model.path == (dir / "stacks" / "enc").string());
  CHECK(config.embedding->max_inputs == 8);
  file = write_file(dir / "stacks" / "bad.yaml", "model: {path: m.gguf}\nembedding: {model: {path: nope}, max_inputs: 0}\n");
  auto issues = load_errors(file, *registry);
  INFO(dump(issues));
  REQUIRE(issues.size() == 2);
  CHECK(issues[0].to_string().find("embedding.model.path: embedding model 'nope' not found (looked in ") !=
        std::string::npos);
  CHECK(issues[1].to_string().find("embedding.max_inputs: expected an integer in [1, 65536], got 0") !=
        std::string::npos);
  unsetenv("TESSERA_MODEL_DIR");
}

TEST_CASE("capabilities: a slot's needs and engine.requires are checked before anything is created") {
  // As cuda-flash and backend.cuda declare themselves: each needs the other's capability.
  static const PluginManifest device_attention = {
      STUB_HEADER, PluginKind::kAttention, "device-flash", "1.0.0", "stub", PluginStatus::kStable,
      nullptr, 0, &create_stub, &destroy_stub, "device_attention", "backend.forward_runner"};
  static const PluginManifest device_backend = {
      STUB_HEADER, PluginKind::kBackend, "device", "1.0.0", "stub", PluginStatus::kStable,
      nullptr, 0, &create_stub, &destroy_stub, "forward_runner", "attention.device_attention"};
  auto registry = make_registry();
  registry->add_builtin(&device_attention);
  registry->add_builtin(&device_backend);
  auto dir = test::scratch_dir("config-capabilities");

  // The device kernel with the default (CPU) backend: refused, naming both plugins and the capability.
  auto file = write_file(dir / "attention-only.yaml",
                         "model: {path: m.gguf}\nengine:\n  attention: {plugin: device-flash}\n");
  check_single(load_errors(file, *registry),
               file.string() + ":3:14: engine.attention: attention plugin 'device-flash' needs capability "
                               "'forward_runner' of the backend, which backend plugin 'cpu' does not offer "
                               "(it offers: none)");
  // The device backend with the default (host) attention kernel.
  file = write_file(dir / "backend-only.yaml",
                    "model: {path: m.gguf}\nengine:\n  backend: {plugin: device}\n");
  check_single(load_errors(file, *registry),
               file.string() + ":3:12: engine.backend: backend plugin 'device' needs capability "
                               "'device_attention' of the attention, which attention plugin 'naive' does not "
                               "offer (it offers: none)");
  // Both: accepted.
  file = write_file(dir / "both.yaml",
                    "model: {path: m.gguf}\nengine:\n  backend: {plugin: device}\n"
                    "  attention: {plugin: device-flash}\n  requires: [backend.forward_runner]\n");
  auto config = load_stack_config(file.string(), *registry);
  CHECK(config.engine.at(PluginKind::kBackend).plugin == "device");

  // engine.requires: the stub quantizer 'gguf' declares nothing; an unset drafter; bad entries.
  file = write_file(dir / "requires.yaml",
                    "model: {path: m.gguf}\nengine:\n  requires: [quantizer.grouped_matmul, drafter.x, "
                    "grouped_matmul, gateway.x, [1]]\n");
  auto issues = load_errors(file, *registry);
  INFO(dump(issues));
  CHECK(issues.size() == 5);
  CHECK(has_issue(issues, file.string() + ":3:14: engine.requires[0]: the stack requires capability "
                                          "'grouped_matmul' of the quantizer, which quantizer plugin 'gguf' "
                                          "does not offer (it offers: none)"));
  CHECK(has_issue(issues, file.string() + ":3:40: engine.requires[1]: the stack requires capability 'x' of "
                                          "the drafter, but no drafter is configured (engine.drafter)"));
  const std::string expected_format =
      ": expected <kind>.<capability> with an engine kind (backend, scheduler, kv_cache, attention, "
      "quantizer, sampler, drafter, constraint), e.g. quantizer.grouped_matmul, got ";
  CHECK(has_issue(issues, file.string() + ":3:51: engine.requires[2]" + expected_format + "\"grouped_matmul\""));
  CHECK(has_issue(issues, file.string() + ":3:67: engine.requires[3]" + expected_format + "\"gateway.x\""));
  file = write_file(dir / "requires-map.yaml", "model: {path: m.gguf}\nengine:\n  requires: {a: b}\n");
  check_single(load_errors(file, *registry),
               file.string() + ":3:13: engine.requires: expected a list of <kind>.<capability>, e.g. "
                               "[quantizer.grouped_matmul], got a mapping");
}

TEST_CASE("disaggregation: roles, addresses and the connector slot are validated together") {
  auto dir = test::scratch_dir("config-disagg");
  auto registry = make_registry();
  registry->scan_directory(test::plugin_dir());  // the real kv_connector.grpc
  REQUIRE_MESSAGE(registry->find(PluginKind::kKvConnector, "grpc"),
                  "kv_connector.grpc is not built (scripts/install-deps.sh installs gRPC)");
  auto file = write_file(dir / "decode.yaml",
                         "model: {path: m.gguf}\n"
                         "disaggregation: {role: decode, connector: {plugin: grpc}, prefill: [127.0.0.1:50061, "
                         "h:2], transfer_timeout: 5s}\n");
  StackConfig config = load_stack_config(file.string(), *registry);
  const DisaggregationConfig& d = config.deployments.at(0).disaggregation;
  CHECK(d.role == "decode");
  REQUIRE(d.connector.has_value());
  CHECK(d.connector->plugin == "grpc");
  CHECK(d.prefill == std::vector<std::string>{"127.0.0.1:50061", "h:2"});
  CHECK(d.transfer_timeout == doctest::Approx(5.0));

  file = write_file(dir / "bad.yaml",
                    "model: {path: m.gguf}\n"
                    "disaggregation: {role: decode, prefill: [localhost, \"h:99999\"], listen: 1.2.3.4:5}\n");
  auto issues = load_errors(file, *registry);
  INFO(dump(issues));
  CHECK(mentions_issue(issues, "disaggregation: role 'decode' needs a connector"));
  CHECK(mentions_issue(issues, "disaggregation.prefill: expected HOST:PORT (port 0..65535), got \"localhost\""));
  CHECK(mentions_issue(issues, "got \"h:99999\""));
  CHECK(mentions_issue(issues, "disaggregation.listen: only a prefill engine listens"));

  file = write_file(dir / "prefill.yaml",
                    "model: {path: m.gguf}\n"
                    "disaggregation: {role: prefill, connector: {plugin: grpc, bogus: 1}}\n");
  issues = load_errors(file, *registry);
  INFO(dump(issues));
  CHECK(mentions_issue(issues, "role 'prefill' needs 'listen'"));
  CHECK(mentions_issue(issues, "disaggregation.connector: unknown key 'bogus'"));

  file = write_file(dir / "both.yaml",
                    "model: {path: m.gguf}\ndisaggregation: {role: both, listen: 127.0.0.1:1}\n");
  issues = load_errors(file, *registry);
  CHECK(mentions_issue(issues, "role 'both' (the default) serves prefill and decode here"));
}

TEST_CASE("replicas: listen, endpoints, the connector and the default router are validated together") {
  auto dir = test::scratch_dir("config-replicas");
  auto registry = make_registry();
  registry->scan_directory(test::plugin_dir());  // the real kv_connector.grpc and router.prefix-affinity
  REQUIRE(registry->find(PluginKind::kKvConnector, "grpc"));
  REQUIRE(registry->find(PluginKind::kRouter, "prefix-affinity"));
  auto file = write_file(dir / "gateway.yaml",
                         "model: {path: m.gguf}\n"
                         "replicas: {connector: {plugin: grpc}, endpoints: [127.0.0.1:50071, h:2], local: false, "
                         "health_interval: 250ms}\n");
  StackConfig config = load_stack_config(file.string(), *registry);
  const ReplicasConfig& r = config.deployments.at(0).replicas;
  REQUIRE(r.enabled());
  CHECK(r.endpoints == std::vector<std::string>{"127.0.0.1:50071", "h:2"});
  CHECK_FALSE(r.local);
  CHECK(r.health_interval == doctest::Approx(0.25));
  REQUIRE(r.router.has_value());
  CHECK(r.router->plugin == "prefix-affinity");  // the default
  CHECK(r.router->config.get_int("prefix_tokens", 0) == 256);

  file = write_file(dir / "bad.yaml",
                    "model: {path: m.gguf}\n"
                    "replicas: {endpoints: [localhost], local: maybe, max_concurrent: 0}\n");
  auto issues = load_errors(file, *registry);
  INFO(dump(issues));
  CHECK(mentions_issue(issues, "replicas: missing required key 'connector'"));
  CHECK(mentions_issue(issues, "replicas.endpoints: expected HOST:PORT (port 0..65535), got \"localhost\""));
  CHECK(mentions_issue(issues, "replicas.local"));
  CHECK(mentions_issue(issues, "replicas.max_concurrent"));

  file = write_file(dir / "neither.yaml", "model: {path: m.gguf}\nreplicas: {connector: {plugin: grpc}, local: true}\n");
  issues = load_errors(file, *registry);
  INFO(dump(issues));
  CHECK(mentions_issue(issues, "give 'listen'"));
  CHECK(mentions_issue(issues, "replicas.local: only a gateway with 'endpoints'"));

  file = write_file(dir / "both.yaml",
                    "model: {path: m.gguf}\n"
                    "disaggregation: {role: decode, connector: {plugin: grpc}, prefill: [127.0.0.1:1]}\n"
                    "replicas: {connector: {plugin: grpc}, endpoints: [127.0.0.1:2], router: {plugin: prefix-affinity, "
                    "max_imbalance: -1}}\n");
  issues = load_errors(file, *registry);
  INFO(dump(issues));
  CHECK(mentions_issue(issues, "either disaggregated (role decode) or replicated"));
  CHECK(mentions_issue(issues, "replicas.router.max_imbalance"));
}
