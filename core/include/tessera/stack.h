// Assembles an engine from a validated stack config: creates each plugin of the engine slots
// through the registry, loads the model with the chosen quantizer, and wires them together.
#pragma once

#include <memory>

#include "tessera/config.h"
#include "tessera/engine.h"
#include "tessera/model.h"
#include "tessera/plugin_registry.h"

namespace tessera {

// Throws PluginError / std::runtime_error naming the slot (e.g. "engine.kv_cache: ...").
// The plugins and the model of `config`'s engine, before they become an Engine: for tools
// that drive a runner themselves (`tessera eval`) and tests that wrap a component (e.g. to
// inject a failing scheduler).
EngineComponents build_engine_components(const StackConfig& config, PluginRegistry& registry,
                                         const Model::ProgressFn& progress = {});

std::unique_ptr<Engine> build_engine(const StackConfig& config, PluginRegistry& registry,
                                     const Model::ProgressFn& progress = {});

}  // namespace tessera
