// Plugin parameter schemas and validated parameter values.
//
// A plugin declares its parameters as a table of ParamSpec. The host validates the YAML of
// the plugin's slot against that table (type, range, choices, unknown keys), fills in
// defaults, and hands the plugin an immutable PluginConfig: plugins never parse YAML.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace tessera {

enum class ParamType {
  kBool,        // true / false
  kInt,         // integer, optionally bounded by [min_value, max_value]
  kFloat,       // number, optionally bounded
  kString,
  kEnum,        // one of `choices` ("a|b|c")
  kBytes,       // integer or a size with a unit: 512KiB, 256MiB, 1GiB, 1GB (stored as bytes)
  kDuration,    // number of seconds or with a unit: 250ms, 10s, 10m, 1h (stored as seconds)
  kStringList,  // a YAML sequence of strings
  kStringMap,   // a YAML mapping of string to string
};

const char* param_type_name(ParamType type);

// One parameter a plugin accepts. Plain data with static storage: it lives in the plugin's
// manifest for as long as the library is loaded.
struct ParamSpec {
  const char* name;
  ParamType type;
  const char* default_value;  // YAML text of the default; nullptr means "required"
  const char* description;
  double min_value = -INFINITY;  // inclusive bounds for kInt, kFloat, kBytes, kDuration
  double max_value = INFINITY;
  const char* choices = nullptr;  // kEnum: values separated by '|'
  bool optional = false;          // true: no default and may be absent (has() tells)
};

using ParamValue = std::variant<bool, int64_t, double, std::string, std::vector<std::string>,
                                std::map<std::string, std::string>>;

// Validated parameters of one plugin slot. Every declared parameter with a default is present.
// Immutable after construction by the host; safe to read from any thread.
class PluginConfig {
 public:
  PluginConfig() = default;
  PluginConfig(std::string plugin_name, std::string key_path,
               std::map<std::string, ParamValue> values)
      : plugin_name_(std::move(plugin_name)), key_path_(std::move(key_path)),
        values_(std::move(values)) {}

  // The plugin name and where in the config this slot sits (e.g. "engine.sampler"), for
  // messages.
  const std::string& plugin_name() const { return plugin_name_; }
  const std::string& key_path() const { return key_path_; }

  bool has(const std::string& name) const { return values_.count(name) != 0; }
  const std::map<std::string, ParamValue>& values() const { return values_; }

  // Getters return the fallback when absent. A type mismatch cannot happen for declared
  // parameters because the host converted them to the declared type.
  bool get_bool(const std::string& name, bool fallback = false) const {
    return get<bool>(name).value_or(fallback);
  }
  int64_t get_int(const std::string& name, int64_t fallback = 0) const {
    return get<int64_t>(name).value_or(fallback);
  }
  double get_float(const std::string& name, double fallback = 0.0) const {
    if (auto v = get<double>(name)) return *v;
    if (auto v = get<int64_t>(name)) return static_cast<double>(*v);
    return fallback;
  }
  std::string get_string(const std::string& name, const std::string& fallback = {}) const {
    return get<std::string>(name).value_or(fallback);
  }
  std::vector<std::string> get_string_list(const std::string& name) const {
    return get<std::vector<std::string>>(name).value_or(std::vector<std::string>{});
  }
  std::map<std::string, std::string> get_string_map(const std::string& name) const {
    return get<std::map<std::string, std::string>>(name).value_or(
        std::map<std::string, std::string>{});
  }

 private:
  template <class T>
  std::optional<T> get(const std::string& name) const {
    auto it = values_.find(name);
    if (it == values_.end()) return std::nullopt;
    if (const T* v = std::get_if<T>(&it->second)) return *v;
    return std::nullopt;
  }
  std::string plugin_name_;
  std::string key_path_;
  std::map<std::string, ParamValue> values_;
};

inline const char* param_type_name(ParamType type) {
  switch (type) {
    case ParamType::kBool: return "a boolean";
    case ParamType::kInt: return "an integer";
    case ParamType::kFloat: return "a number";
    case ParamType::kString: return "a string";
    case ParamType::kEnum: return "one of the listed values";
    case ParamType::kBytes: return "a size (e.g. 256MiB)";
    case ParamType::kDuration: return "a duration (e.g. 10s, 5m)";
    case ParamType::kStringList: return "a list of strings";
    case ParamType::kStringMap: return "a mapping of strings";
  }
  return "a value";
}

}  // namespace tessera
