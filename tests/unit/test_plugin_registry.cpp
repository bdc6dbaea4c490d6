// Plugin registry: loading the test plugins (tests/plugins), refusing libraries built for
// another SDK ABI, duplicate names, and object lifetimes that outlive the registry.
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/config.h"
#include "tessera/plugin_registry.h"
#include "tessera/sdk/sampler.h"
#include "tessera/sdk/scheduler.h"

namespace {

using namespace tessera;

// The host's ABI as the loader's messages spell it ("2.1").
std::string host_abi() { return std::to_string(kSdkAbiMajor) + "." + std::to_string(kSdkAbiMinor); }

std::filesystem::path test_plugin_dir() {
  return test::env_or("TESSERA_TEST_PLUGIN_DIR", (test::build_dir() / "test-plugins").string());
}

const PluginLoadError* find_load_error(const PluginRegistry& registry, const std::string& file) {
  for (const auto& e : registry.load_errors())
    if (std::filesystem::path(e.library_path).filename() == file) return &e;
  return nullptr;
}

// Whether the dynamic loader still has `path` mapped. RTLD_NOLOAD never loads; the handle it
// returns holds a reference, so it is closed at once.
bool is_loaded(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!handle) return false;
  dlclose(handle);
  return true;
}

int live_objects(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(handle != nullptr);
  auto fn = reinterpret_cast<int (*)()>(dlsym(handle, "tessera_test_live_objects"));
  REQUIRE(static_cast<bool>(fn));
  int n = fn();
  dlclose(handle);
  return n;
}

// A scheduler compiled into the test, registered as a built-in.
Status create_nothing(const PluginConfig&, const PluginContext&, void**) {
  return unimplemented("stub");
}
void destroy_nothing(void*) {}
const PluginManifest kStaticScheduler = {
    TESSERA_PLUGIN_MANIFEST_HEADER,
    PluginKind::kScheduler, "static", "1.0.0", "stub", PluginStatus::kStable,
    nullptr, 0, &create_nothing, &destroy_nothing};

}  // namespace

TEST_CASE("a new registry holds the core's built-in backend.cpu") {
  PluginRegistry registry;
  const PluginInfo* cpu = registry.find(PluginKind::kBackend, "cpu");
  REQUIRE(cpu != nullptr);
  CHECK(cpu->library_path.empty());
  CHECK(cpu->qualified_name() == "backend.cpu");
  CHECK(registry.all().size() == 1);
  CHECK(registry.load_errors().empty());
}

TEST_CASE("parse_plugin_kind knows every kind and nothing else") {
  for (int i = 0; i < kNumPluginKinds; ++i) {
    PluginKind kind{};
    auto expected = static_cast<PluginKind>(i);
    CHECK(parse_plugin_kind(plugin_kind_name(expected), &kind));
    CHECK(kind == expected);
  }
  PluginKind kind{};
  CHECK_FALSE(parse_plugin_kind("kv-cache", &kind));
  CHECK_FALSE(parse_plugin_kind("", &kind));
  CHECK_FALSE(parse_plugin_kind("samplers", &kind));
}

TEST_CASE("the test plugin dir loads the sampler and refuses the ABI 3.0 build") {
  PluginRegistry registry;
  registry.scan_directory(test_plugin_dir());

  const PluginInfo* info = registry.find(PluginKind::kSampler, "test-greedy");
  REQUIRE(info != nullptr);
  CHECK(info->qualified_name() == "sampler.test-greedy");
  CHECK(std::string(info->manifest->version) == "0.1.0");
  CHECK(info->manifest->num_params == 10);
  CHECK(std::filesystem::path(info->library_path).filename() == "libtessera-test-greedy.so");
  CHECK(registry.names_of(PluginKind::kSampler) == "test-greedy");
  CHECK(registry.list(PluginKind::kScheduler).empty());
  CHECK(registry.all().size() == 2);  // and the core's built-in backend.cpu

  // Refused, with a message naming both versions.
  CHECK(registry.find(PluginKind::kSampler, "test-abi-mismatch") == nullptr);
  const PluginLoadError* error = find_load_error(registry, "libtessera-test-abi-mismatch.so");
  REQUIRE(error != nullptr);
  CHECK(error->plugin_name == "test-abi-mismatch");
  CHECK(error->message ==
        "libtessera-test-abi-mismatch.so: built for Tessera SDK ABI 3.0, this host implements "
        "ABI " + host_abi() + " (the major versions must match)");
}

TEST_CASE("a refused library's error is what create reports for its name") {
  PluginRegistry registry;
  registry.scan_directory(test_plugin_dir());
  PluginConfig config("test-abi-mismatch", "engine.sampler", {});
  try {
    registry.create_raw(PluginKind::kSampler, "test-abi-mismatch", config, {});
    FAIL("expected PluginError");
  } catch (const PluginError& e) {
    std::string what = e.what();
    CHECK(what.find("engine.sampler: plugin 'test-abi-mismatch' could not be loaded") == 0);
    CHECK(what.find("ABI 3.0") != std::string::npos);
    CHECK(what.find("ABI " + host_abi()) != std::string::npos);
  }
}

TEST_CASE("newer minor ABI, missing manifest and duplicate names are load errors") {
  PluginRegistry registry;
  registry.scan_directory(test_plugin_dir());
  registry.scan_directory(test_plugin_dir() / "extra");

  const PluginLoadError* newer = find_load_error(registry, "libtessera-test-abi-newer.so");
  REQUIRE(newer != nullptr);
  CHECK(newer->message.find("built for Tessera SDK ABI 2." + std::to_string(kSdkAbiMinor + 1) +
                             ", this host implements ABI " + host_abi()) != std::string::npos);

  const PluginLoadError* no_manifest = find_load_error(registry, "libtessera-test-no-manifest.so");
  REQUIRE(no_manifest != nullptr);
  CHECK(no_manifest->message.find("no 'tessera_plugin_manifest' symbol") != std::string::npos);

  // The copy registers sampler.test-greedy again: the first one wins, the copy is refused.
  const PluginLoadError* duplicate = find_load_error(registry, "libtessera-test-greedy-copy.so");
  REQUIRE(duplicate != nullptr);
  CHECK(duplicate->plugin_name == "test-greedy");
  CHECK(duplicate->message.find("sampler.test-greedy is already registered") != std::string::npos);
  const PluginInfo* info = registry.find(PluginKind::kSampler, "test-greedy");
  REQUIRE(info != nullptr);
  CHECK(std::filesystem::path(info->library_path).filename() == "libtessera-test-greedy.so");
}

TEST_CASE("scanning a folder twice loads each library once; missing folders are ignored") {
  PluginRegistry registry;
  registry.scan_directory(test_plugin_dir());
  size_t errors = registry.load_errors().size();
  registry.scan_directory(test_plugin_dir());
  registry.scan_directory(test_plugin_dir() / "." / "");
  registry.scan_directory(test_plugin_dir() / "does-not-exist");
  CHECK(registry.load_errors().size() == errors);
  CHECK(registry.list(PluginKind::kSampler).size() == 1);
}

TEST_CASE("TESSERA_PLUGIN_PATH and extra folders are scanned by scan_default_paths") {
  std::string dirs = "/nonexistent-tessera-dir:" + test_plugin_dir().string();
  setenv("TESSERA_PLUGIN_PATH", dirs.c_str(), 1);
  PluginRegistry registry;
  registry.scan_default_paths({test_plugin_dir() / "extra"});
  unsetenv("TESSERA_PLUGIN_PATH");
  CHECK(registry.find(PluginKind::kSampler, "test-greedy") != nullptr);
  CHECK(find_load_error(registry, "libtessera-test-greedy-copy.so") != nullptr);
  const auto& dirs_seen = registry.scanned_dirs();
  CHECK(std::find(dirs_seen.begin(), dirs_seen.end(), test_plugin_dir().string()) !=
        dirs_seen.end());
}

TEST_CASE("built-ins: duplicates throw, wrong kind and unknown names are explained") {
  PluginRegistry registry;
  registry.scan_directory(test_plugin_dir());
  registry.add_builtin(&kStaticScheduler);
  CHECK_THROWS_AS(registry.add_builtin(&kStaticScheduler), PluginError);
  CHECK(registry.find(PluginKind::kScheduler, "static")->library_path.empty());

  PluginConfig config("static", "engine.sampler", {});
  try {
    registry.create_raw(PluginKind::kSampler, "static", config, {});
    FAIL("expected PluginError");
  } catch (const PluginError& e) {
    CHECK(std::string(e.what()) == "engine.sampler: plugin 'static' is a scheduler, not a sampler");
  }
  try {
    registry.create_raw(PluginKind::kSampler, "nucleus", config, {});
    FAIL("expected PluginError");
  } catch (const PluginError& e) {
    CHECK(std::string(e.what()) ==
          "engine.sampler: unknown sampler plugin 'nucleus'; registered sampler plugins: "
          "test-greedy");
  }
  // A failing create comes back as a PluginError naming the plugin and slot.
  PluginConfig scheduler_config("static", "engine.scheduler", {});
  try {
    registry.create_raw(PluginKind::kScheduler, "static", scheduler_config, {});
    FAIL("expected PluginError");
  } catch (const PluginError& e) {
    CHECK(std::string(e.what()) == "engine.scheduler: plugin 'static': stub");
  }
  PluginRegistry empty;
  CHECK(empty.describe_missing(PluginKind::kDrafter, "ngram") ==
        "unknown drafter plugin 'ngram'; no drafter plugins are registered");
}

TEST_CASE("a created sampler works and keeps its library loaded after the registry is gone") {
  const std::string path = (test_plugin_dir() / "libtessera-test-greedy.so").string();

  std::shared_ptr<Sampler> sampler;
  {
    PluginRegistry registry;
    registry.scan_directory(test_plugin_dir());
    const PluginInfo* info = registry.find(PluginKind::kSampler, "test-greedy");
    REQUIRE(info != nullptr);
    PluginConfig config =
        validate_plugin_params(*info->manifest, "engine.sampler", "{tie_break: highest}");
    sampler = registry.create<Sampler>("test-greedy", config, {});
    REQUIRE(sampler);
    CHECK(live_objects(path) == 1);
  }
  // The registry is destroyed; the object still owns a reference to its library.
  REQUIRE(is_loaded(path));
  std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f};
  SamplingParams params;
  params.num_logprobs = 2;
  SamplingInput input;
  input.params = &params;
  SamplerState state;
  SampledToken token;
  REQUIRE(sampler->sample(logits, input, &state, &token).is_ok());
  CHECK(token.token == 2);  // tie_break: highest
  CHECK(token.logprob < 0.0f);
  REQUIRE(token.top.size() == 2);
  CHECK(token.top[0].logprob == doctest::Approx(token.logprob));

  // Greedy verification accepts drafts while they are the argmax, then adds one token.
  std::vector<float> r0 = {0, 5, 0}, r1 = {7, 0, 0}, r2 = {0, 0, 9};
  std::vector<std::span<float>> rows = {r0, r1, r2};
  std::vector<TokenId> drafts = {1, 2};
  std::vector<SampledToken> out;
  REQUIRE(sampler->verify(rows, DraftView{drafts, {}}, input, &state, &out).is_ok());
  REQUIRE(out.size() == 2);
  CHECK(out[0].token == 1);
  CHECK(out[1].token == 0);

  CHECK(live_objects(path) == 1);
  sampler.reset();
  // Destroyed through the manifest's destroy; the library itself stays mapped, since accepted
  // libraries are never unloaded while the process runs (objects such as prepared weights may
  // outlive every handle).
  CHECK(live_objects(path) == 0);
  CHECK(is_loaded(path));
}

TEST_CASE("host_logger forwards to spdlog and never throws") {
  Logger& logger = host_logger();
  CHECK(&logger == &host_logger());
  logger.log(LogLevel::kDebug, "host_logger test message");
  CHECK(logger.enabled(LogLevel::kError));
}

TEST_CASE("manifest capabilities (SDK 2.6): listed from 2.6 manifests, ignored before, checked") {
  const PluginManifest with_capabilities = {
      TESSERA_PLUGIN_MANIFEST_HEADER,
      PluginKind::kAttention, "device", "1.0.0", "stub", PluginStatus::kStable, nullptr, 0,
      &create_nothing, &destroy_nothing, " device_attention  fast_path ", "backend.forward_runner"};
  PluginRegistry registry;
  registry.add_builtin(&with_capabilities);
  const PluginInfo* info = registry.find(PluginKind::kAttention, "device");
  REQUIRE(info != nullptr);
  CHECK(info->capabilities() == std::vector<std::string>{"device_attention", "fast_path"});
  CHECK(info->needs() == std::vector<std::string>{"backend.forward_runner"});
  CHECK(info->has_capability("fast_path"));
  CHECK_FALSE(info->has_capability("fast"));
  // The built-in CPU backend declares none (the core's ModelRunner drives it).
  const PluginInfo* cpu = registry.find(PluginKind::kBackend, "cpu");
  REQUIRE(cpu != nullptr);
  CHECK(cpu->capabilities().empty());

  // A 2.5 manifest has no such fields: the registry must not read them (before 2.10 the
  // header's size field was `reserved`, 0).
  PluginManifest old = with_capabilities;
  old.header.abi_minor = 5;
  old.header.manifest_size = 0;
  old.name = "old";
  registry.add_builtin(&old);
  CHECK(registry.find(PluginKind::kAttention, "old")->capabilities().empty());
  CHECK(registry.find(PluginKind::kAttention, "old")->needs().empty());

  // Malformed lists are refused with what was expected.
  PluginManifest bad = with_capabilities;
  bad.name = "bad-capability";
  bad.capabilities = "Grouped-Matmul";
  CHECK_THROWS_WITH_AS(registry.add_builtin(&bad),
                       doctest::Contains("capability 'Grouped-Matmul' is not a lowercase identifier "
                                         "(expected e.g. grouped_matmul)"),
                       PluginError);
  bad.name = "bad-need";
  bad.capabilities = "";
  bad.needs = "engine.forward_runner";
  CHECK_THROWS_WITH_AS(registry.add_builtin(&bad),
                       doctest::Contains("need 'engine.forward_runner' is not <kind>.<capability> "
                                         "(expected e.g. backend.forward_runner)"),
                       PluginError);
  CHECK(split_capability_list(nullptr).empty());
  CHECK(split_capability_list("   ").empty());
}

// An older ParamSpec: the first five fields of today's, as a library of an SDK whose ParamSpec
// ended there would lay out its table (manifest_param must read it with that stride).
struct ShortParamSpec {
  const char* name;
  ParamType type;
  const char* default_value;
  const char* description;
  double min_value;
};

TEST_CASE("manifest sizes (SDK 2.10): appended fields and the parameter table read by the plugin's sizes") {
  const PluginManifest full = {
      TESSERA_PLUGIN_MANIFEST_HEADER,
      PluginKind::kAttention, "sized", "1.0.0", "stub", PluginStatus::kStable, nullptr, 0,
      &create_nothing, &destroy_nothing, "fast_path", "backend.forward_runner",
      static_cast<uint32_t>(sizeof(ParamSpec))};
  CHECK(full.header.manifest_size == sizeof(PluginManifest));
  CHECK(manifest_size(full) == sizeof(PluginManifest));
  CHECK(manifest_has_field(full, offsetof(PluginManifest, needs), sizeof(full.needs)));

  // Before 2.10 the size follows from the version: 2.6-2.9 end after `needs`, older before
  // `capabilities`.
  PluginManifest v29 = full;
  v29.header.abi_minor = 9;
  v29.header.manifest_size = 0;
  CHECK(manifest_size(v29) == offsetof(PluginManifest, param_spec_size));
  v29.header.abi_minor = 3;
  CHECK(manifest_size(v29) == offsetof(PluginManifest, capabilities));
  CHECK_FALSE(manifest_has_field(v29, offsetof(PluginManifest, capabilities), sizeof(v29.capabilities)));

  // A manifest whose size ends before `needs` (a future minor that appended only
  // `capabilities`, say): the registry reads neither list.
  PluginRegistry registry;
  PluginManifest short_manifest = full;
  short_manifest.name = "short";
  short_manifest.header.manifest_size = static_cast<uint32_t>(offsetof(PluginManifest, needs));
  CHECK_FALSE(manifest_has_field(short_manifest, offsetof(PluginManifest, needs), sizeof(full.needs)));

  // 2.10 manifests must carry their sizes (the abi_minor here is the host's, 10 or later): both are refused with what was expected.
  const std::string too_small =
      "manifest_size " + std::to_string(offsetof(PluginManifest, needs)) + " is smaller than a " +
      std::to_string(kSdkAbiMajor) + "." + std::to_string(kSdkAbiMinor) + " manifest";
  CHECK_THROWS_WITH_AS(registry.add_builtin(&short_manifest), doctest::Contains(too_small.c_str()),
                       PluginError);
  static const ParamSpec kOne[] = {{"tile", ParamType::kInt, "8", "tile", 1, 64}};
  PluginManifest no_stride = full;
  no_stride.name = "no-stride";
  no_stride.params = kOne;
  no_stride.num_params = 1;
  no_stride.param_spec_size = 0;
  const std::string bad_stride = "param_spec_size 0 is not in [" +
                                 std::to_string(offsetof(ParamSpec, min_value)) + ", " +
                                 std::to_string(sizeof(ParamSpec)) + "]";
  CHECK_THROWS_WITH_AS(registry.add_builtin(&no_stride), doctest::Contains(bad_stride.c_str()),
                       PluginError);

  // A table written with a shorter ParamSpec reads back entry by entry with that stride; the
  // fields it lacks keep ParamSpec's defaults.
  static const ShortParamSpec kShort[] = {
      {"alpha", ParamType::kInt, "1", "first", 0},
      {"beta", ParamType::kFloat, "0.5", "second", -1},
  };
  PluginManifest older = full;
  older.name = "older-params";
  older.params = reinterpret_cast<const ParamSpec*>(kShort);
  older.num_params = 2;
  older.param_spec_size = sizeof(ShortParamSpec);
  registry.add_builtin(&older);
  const ParamSpec beta = manifest_param(older, 1);
  CHECK(std::string(beta.name) == "beta");
  CHECK(beta.type == ParamType::kFloat);
  CHECK(std::string(beta.default_value) == "0.5");
  CHECK(beta.min_value == -1);
  CHECK(beta.max_value == INFINITY);
  CHECK(beta.choices == nullptr);
  CHECK_FALSE(beta.optional);
  CHECK(std::string(manifest_param(older, 0).name) == "alpha");
  // The host validates a slot against that table as it would against its own.
  const PluginConfig config = validate_plugin_params(older, "engine.attention", "{beta: 0.25}");
  CHECK(config.get_float("beta") == 0.25);
  CHECK(config.get_int("alpha") == 1);
}
