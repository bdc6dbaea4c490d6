// `tessera plugins [--kind K] [--json] [--plugin-path DIR]...`: what the registry finds on
// the plugin path, each plugin's parameter schema, and the libraries it refused.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "tessera/config.h"
#include "tessera/plugin_registry.h"

namespace tessera::cli {

namespace {

struct PluginsOptions {
  std::string kind;
  bool json = false;
  std::vector<std::string> plugin_paths;
};

const char* status_name(PluginStatus status) {
  switch (status) {
    case PluginStatus::kStable: return "stable";
    case PluginStatus::kAlpha: return "alpha";
    case PluginStatus::kWip: return "wip";
  }
  return "unknown";
}

const char* type_short_name(ParamType type) {
  switch (type) {
    case ParamType::kBool: return "bool";
    case ParamType::kInt: return "int";
    case ParamType::kFloat: return "float";
    case ParamType::kString: return "string";
    case ParamType::kEnum: return "enum";
    case ParamType::kBytes: return "bytes";
    case ParamType::kDuration: return "duration";
    case ParamType::kStringList: return "list";
    case ParamType::kStringMap: return "map";
  }
  return "?";
}

// A bound in the parameter's own syntax (1MiB, 10s), so it reads like the YAML a user writes.
std::string format_bound(const ParamSpec& spec, double v) {
  if (spec.type == ParamType::kBytes && std::isfinite(v))
    return format_param_value(spec, ParamValue(static_cast<int64_t>(v)));
  if (spec.type == ParamType::kDuration && std::isfinite(v))
    return format_param_value(spec, ParamValue(v));
  ParamSpec plain = spec;
  plain.type = ParamType::kFloat;
  return format_param_value(plain, ParamValue(v));
}

// "[1, 64]", ">= 1", "<= 10", "f16|f32" or "".
std::string constraint_text(const ParamSpec& spec) {
  if (spec.type == ParamType::kEnum) return spec.choices ? spec.choices : "";
  bool lo = std::isfinite(spec.min_value), hi = std::isfinite(spec.max_value);
  if (lo && hi) return "[" + format_bound(spec, spec.min_value) + ", " + format_bound(spec, spec.max_value) + "]";
  if (lo) return ">= " + format_bound(spec, spec.min_value);
  if (hi) return "<= " + format_bound(spec, spec.max_value);
  return "";
}

std::string default_text(const ParamSpec& spec) {
  if (spec.default_value) return *spec.default_value ? spec.default_value : "\"\"";
  return spec.optional ? "(optional)" : "(required)";
}

nlohmann::json plugin_json(const PluginInfo& info) {
  const PluginManifest& m = *info.manifest;
  nlohmann::json params = nlohmann::json::array();
  for (size_t i = 0; i < m.num_params; ++i) {
    const ParamSpec p = manifest_param(m, i);
    nlohmann::json param = {{"name", p.name},
                            {"type", type_short_name(p.type)},
                            {"description", p.description ? p.description : ""},
                            {"required", !p.default_value && !p.optional},
                            {"optional", p.optional}};
    param["default"] = p.default_value ? nlohmann::json(p.default_value) : nlohmann::json(nullptr);
    if (std::isfinite(p.min_value)) param["min"] = p.min_value;
    if (std::isfinite(p.max_value)) param["max"] = p.max_value;
    if (p.type == ParamType::kEnum && p.choices) {
      nlohmann::json choices = nlohmann::json::array();
      std::string all = p.choices;
      size_t start = 0;
      while (true) {
        size_t bar = all.find('|', start);
        choices.push_back(all.substr(start, bar == std::string::npos ? std::string::npos : bar - start));
        if (bar == std::string::npos) break;
        start = bar + 1;
      }
      param["choices"] = choices;
    }
    params.push_back(std::move(param));
  }
  return {{"kind", plugin_kind_name(m.kind)},
          {"name", m.name},
          {"qualified_name", info.qualified_name()},
          {"version", m.version},
          {"status", status_name(m.status)},
          {"description", m.description ? m.description : ""},
          {"library", info.library_path.empty() ? nlohmann::json(nullptr)
                                                : nlohmann::json(info.library_path)},
          {"capabilities", info.capabilities()},
          {"needs", info.needs()},
          {"params", params}};
}

// "a, b" or "none".
std::string join_or_none(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out.empty() ? "none" : out;
}

void print_plugin(const PluginInfo& info) {
  const PluginManifest& m = *info.manifest;
  std::printf("  %s %s [%s]\n", info.qualified_name().c_str(), m.version, status_name(m.status));
  if (m.description && *m.description) std::printf("    %s\n", m.description);
  std::printf("    library: %s\n", info.library_path.empty() ? "(built in)" : info.library_path.c_str());
  std::printf("    capabilities: %s\n", join_or_none(info.capabilities()).c_str());
  if (!info.needs().empty()) std::printf("    needs: %s\n", join_or_none(info.needs()).c_str());
  if (m.num_params == 0) {
    std::printf("    parameters: none\n");
    return;
  }
  // One aligned row per parameter: name, type, default, range/choices, description.
  std::vector<std::vector<std::string>> rows;
  for (size_t i = 0; i < m.num_params; ++i) {
    const ParamSpec p = manifest_param(m, i);
    rows.push_back({p.name, type_short_name(p.type), default_text(p), constraint_text(p),
                    p.description ? p.description : ""});
  }
  size_t widths[4] = {0, 0, 0, 0};
  for (const auto& row : rows)
    for (int c = 0; c < 4; ++c) widths[c] = std::max(widths[c], row[c].size());
  std::printf("    parameters:\n");
  for (const auto& row : rows) {
    std::string line = "      ";
    for (int c = 0; c < 4; ++c) {
      line += row[c];
      line += std::string(widths[c] - row[c].size() + 2, ' ');
    }
    line += row[4];
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::printf("%s\n", line.c_str());
  }
}

void run_plugins(const PluginsOptions& options) {
  std::vector<PluginKind> kinds;
  if (!options.kind.empty()) {
    PluginKind kind;
    if (!parse_plugin_kind(options.kind, &kind)) {
      std::string names;
      for (int i = 0; i < kNumPluginKinds; ++i)
        names += std::string(i ? ", " : "") + plugin_kind_name(static_cast<PluginKind>(i));
      throw CommandError("unknown plugin kind '" + options.kind + "'; expected one of: " + names);
    }
    kinds.push_back(kind);
  } else {
    for (int i = 0; i < kNumPluginKinds; ++i) kinds.push_back(static_cast<PluginKind>(i));
  }

  PluginRegistry registry;
  std::vector<std::filesystem::path> extra(options.plugin_paths.begin(), options.plugin_paths.end());
  registry.scan_default_paths(extra);

  if (options.json) {
    nlohmann::json out;
    out["plugin_dirs"] = registry.scanned_dirs();
    nlohmann::json kinds_json = nlohmann::json::array();
    nlohmann::json plugins = nlohmann::json::array();
    for (PluginKind kind : kinds) {
      kinds_json.push_back(plugin_kind_name(kind));
      for (const PluginInfo* info : registry.list(kind)) plugins.push_back(plugin_json(*info));
    }
    out["kinds"] = kinds_json;
    out["plugins"] = plugins;
    nlohmann::json errors = nlohmann::json::array();
    for (const auto& e : registry.load_errors())
      errors.push_back({{"library", e.library_path}, {"plugin", e.plugin_name}, {"message", e.message}});
    out["load_errors"] = errors;
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }

  const auto& dirs = registry.scanned_dirs();
  if (dirs.empty()) {
    std::printf("plugin folders: none found (set TESSERA_PLUGIN_PATH or pass --plugin-path)\n");
  } else {
    std::printf("plugin folders:\n");
    for (const auto& d : dirs) std::printf("  %s\n", d.c_str());
  }
  for (PluginKind kind : kinds) {
    std::printf("\n%s\n", plugin_kind_name(kind));
    auto plugins = registry.list(kind);
    if (plugins.empty()) std::printf("  (none)\n");
    for (const PluginInfo* info : plugins) print_plugin(*info);
  }
  if (!registry.load_errors().empty()) {
    std::printf("\nload errors (these libraries were refused):\n");
    for (const auto& e : registry.load_errors())
      std::printf("  %s\n    %s\n", e.library_path.c_str(), e.message.c_str());
  }
}

}  // namespace

void add_plugins_command(CLI::App& app) {
  // CLI11 writes into these during parse and the callback runs afterwards, so they must
  // outlive this function.
  auto options = std::make_shared<PluginsOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plugins", "List plugins on the plugin path with their parameters, and refused libraries");
  cmd->add_option("--kind", options->kind,
                  "Only plugins of this kind (scheduler, kv_cache, attention, quantizer, sampler, "
                  "cache_layer, router, drafter, backend)");
  cmd->add_flag("--json", options->json, "Print JSON instead of text");
  cmd->add_option("--plugin-path", options->plugin_paths,
                  "Another folder to scan for libtessera-*.so (repeatable; also "
                  "TESSERA_PLUGIN_PATH)");
  cmd->callback([options] { run_plugins(*options); });
}

}  // namespace tessera::cli
