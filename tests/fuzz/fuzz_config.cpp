// Fuzz target: the YAML config loader and validator (parsing, extends chains, every plugin
// schema of the real in-tree plugins). The input is written as a config file next to a small
// valid base it may `extends:` (base.yaml). Only tessera::ConfigError may come out.
#include <cstdint>
#include <string_view>

#include "fuzz_support.h"
#include "tessera/config.h"
#include "tessera/plugin_registry.h"
#include "tessera/thread_pool.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static tessera::PluginRegistry* registry = [] {
    auto* r = new tessera::PluginRegistry();  // lives for the process, as plugins do
    r->scan_default_paths();
    const std::string_view base =
        "model: {path: base.gguf, threads: 2}\nengine: {scheduler: {plugin: continuous}}\n";
    tessera::fuzz::write_input("base.yaml", reinterpret_cast<const uint8_t*>(base.data()),
                               base.size());
    return r;
  }();
  const std::string path = tessera::fuzz::write_input("input.yaml", data, size);
  try {
    const tessera::StackConfig config = tessera::load_stack_config(path, *registry);
    // A config that validated has every engine slot but the optional drafter, and its
    // bounded values inside their bounds.
    for (auto kind : {tessera::PluginKind::kBackend, tessera::PluginKind::kScheduler,
                      tessera::PluginKind::kKvCache, tessera::PluginKind::kAttention,
                      tessera::PluginKind::kQuantizer, tessera::PluginKind::kSampler})
      FUZZ_CHECK(config.engine.count(kind) == 1);
    FUZZ_CHECK(config.model.threads >= 0 && config.model.threads <= tessera::kMaxThreadPoolThreads);
    FUZZ_CHECK(!config.model.path.empty());
  } catch (const tessera::ConfigError&) {
  }
  return 0;
}
