// Stack configuration: YAML loading with `extends:`, merging, and validation of every key
// against the plugin schemas, gathering all problems before reporting them.
//
// The files are first turned into a small tree of our own (Tree) that remembers, for every
// key and value, the file and line:col it came from; merging `extends:` chains works on that
// tree, so a message about a key set in a base file still points into the base file.
#include "text_util.h"
#include "tessera/config.h"
#include "tessera/thread_pool.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <set>
#include <sstream>
#include <system_error>
#include <tuple>

namespace tessera {

namespace fs = std::filesystem;

// --- ConfigIssue / ConfigError ------------------------------------------------------------

std::string ConfigIssue::to_string() const {
  std::string out;
  if (!file.empty()) {
    out += file;
    if (line > 0) out += ":" + std::to_string(line) + ":" + std::to_string(column);
    out += ": ";
  }
  if (!key_path.empty()) out += key_path + ": ";
  out += message;
  return out;
}

namespace {
std::string join_issues(const std::vector<ConfigIssue>& issues) {
  std::string out;
  for (size_t i = 0; i < issues.size(); ++i) {
    if (i) out += "\n";
    out += issues[i].to_string();
  }
  return out;
}
}  // namespace

ConfigError::ConfigError(std::vector<ConfigIssue> issues)
    : std::runtime_error(join_issues(issues)), issues_(std::move(issues)) {}

const char* default_engine_plugin(PluginKind kind) {
  switch (kind) {
    case PluginKind::kBackend: return "cpu";
    case PluginKind::kScheduler: return "static";
    case PluginKind::kKvCache: return "contiguous";
    case PluginKind::kAttention: return "naive";
    case PluginKind::kQuantizer: return "gguf";
    case PluginKind::kSampler: return "standard";
    case PluginKind::kDrafter: return nullptr;
    case PluginKind::kConstraint: return "json-schema";
    case PluginKind::kCacheLayer:
    case PluginKind::kRouter:
    case PluginKind::kKvConnector: return nullptr;
  }
  return nullptr;
}

namespace {

// --- small text helpers -------------------------------------------------------------------

using detail::join;

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string format_number(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<int64_t>(v));
  std::ostringstream os;
  os.precision(10);
  os << v;
  return os.str();
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// "unknown key 'x'; did you mean 'y'? expected one of: a, b"
std::string unknown_key_message(const std::string& key, const std::vector<std::string>& allowed) {
  std::string message = "unknown key '" + key + "'";
  std::string best;
  size_t best_distance = 3;  // suggest only close typos
  for (const auto& candidate : allowed) {
    size_t d = edit_distance(key, candidate);
    if (d < best_distance) best_distance = d, best = candidate;
  }
  if (!best.empty()) message += "; did you mean '" + best + "'?";
  if (allowed.empty()) return message + "; no keys are accepted here";
  return message + (best.empty() ? "; expected one of: " : " expected one of: ") +
         join(allowed, ", ");
}

// --- sizes and durations ------------------------------------------------------------------

struct Unit {
  const char* name;
  double factor;
};
constexpr Unit kSizeUnits[] = {
    {"B", 1},          {"KB", 1e3},          {"kB", 1e3},          {"MB", 1e6},
    {"GB", 1e9},       {"TB", 1e12},         {"KiB", 1024.0},      {"MiB", 1048576.0},
    {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
};
constexpr Unit kDurationUnits[] = {
    {"ns", 1e-9}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1}, {"m", 60}, {"min", 60},
    {"h", 3600},  {"d", 86400},
};

// Splits "256MiB" / "1.5 GiB" / "4096" into number and unit. False when there is no number.
bool split_number_unit(std::string_view text, double* number, std::string* unit) {
  std::string s = trim(text);
  size_t i = 0;
  if (i < s.size() && s[i] == '+') ++i;
  size_t start = i;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == start) return false;
  auto [ptr, ec] = std::from_chars(s.data() + start, s.data() + i, *number);
  if (ec != std::errc() || ptr != s.data() + i) return false;
  *unit = trim(std::string_view(s).substr(i));
  return true;
}

// Bytes from "256MiB", "1GB", "4096"; sets *error on failure.
std::optional<int64_t> parse_bytes(std::string_view text, std::string* error) {
  double number = 0;
  std::string unit;
  if (!split_number_unit(text, &number, &unit)) return std::nullopt;
  double factor = 0;
  if (unit.empty()) {
    factor = 1;
  } else {
    for (const auto& u : kSizeUnits)
      if (unit == u.name) factor = u.factor;
  }
  if (factor == 0) {
    *error = "unknown size unit '" + unit + "'; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB";
    return std::nullopt;
  }
  double bytes = number * factor;
  if (bytes != std::floor(bytes) && (unit.empty() || unit == "B")) return std::nullopt;
  if (bytes > 9.2e18) {
    *error = "size is too large";
    return std::nullopt;
  }
  return static_cast<int64_t>(std::llround(bytes));
}

std::optional<double> parse_duration(std::string_view text, std::string* error) {
  double number = 0;
  std::string unit;
  if (!split_number_unit(text, &number, &unit)) return std::nullopt;
  if (unit.empty()) return number;  // plain number: seconds
  for (const auto& u : kDurationUnits)
    if (unit == u.name) return number * u.factor;
  *error = "unknown duration unit '" + unit + "'; use ms, s, m, h or d (a plain number is seconds)";
  return std::nullopt;
}

std::string format_bytes(double bytes) {
  static constexpr Unit kPretty[] = {{"TiB", 1099511627776.0}, {"GiB", 1073741824.0},
                                     {"MiB", 1048576.0}, {"KiB", 1024.0}};
  if (std::isinf(bytes)) return format_number(bytes);
  for (const auto& u : kPretty)
    if (bytes >= u.factor && std::fmod(bytes, u.factor) == 0)
      return format_number(bytes / u.factor) + u.name;
  return format_number(bytes);
}

std::string format_duration(double seconds) {
  if (std::isinf(seconds)) return format_number(seconds);
  if (seconds != 0 && seconds < 1) return format_number(seconds * 1000) + "ms";
  if (seconds >= 3600 && std::fmod(seconds, 3600) == 0) return format_number(seconds / 3600) + "h";
  if (seconds >= 60 && std::fmod(seconds, 60) == 0) return format_number(seconds / 60) + "m";
  return format_number(seconds) + "s";
}

// --- the source-tracking tree -------------------------------------------------------------

struct TreeEntry;

// A YAML value with where it came from. Maps and sequences are converted recursively so that
// merging keeps each key's origin; scalars keep their YAML node.
struct Tree {
  enum class Type { kNull, kScalar, kSequence, kMap };
  Type type = Type::kNull;
  // Scalars: their text, and whether it was quoted. (No YAML::Node is kept: assigning one
  // rebinds shared node data, which breaks moving trees around while merging.)
  std::string text;
  bool quoted = false;
  std::string file;
  YAML::Mark mark;
  std::vector<TreeEntry> entries;  // kMap, in file order
  std::vector<Tree> items;         // kSequence

  bool is_map() const { return type == Type::kMap; }
  bool is_sequence() const { return type == Type::kSequence; }
  bool is_scalar() const { return type == Type::kScalar; }
  bool is_null() const { return type == Type::kNull; }
  const std::string& scalar() const { return text; }
  bool is_quoted() const { return is_scalar() && quoted; }

  const TreeEntry* find(std::string_view key) const;
  TreeEntry* find(std::string_view key);
};

struct TreeEntry {
  std::string key;
  std::string key_file;
  YAML::Mark key_mark;
  Tree value;
};

const TreeEntry* Tree::find(std::string_view key) const {
  for (const auto& e : entries)
    if (e.key == key) return &e;
  return nullptr;
}
TreeEntry* Tree::find(std::string_view key) {
  for (auto& e : entries)
    if (e.key == key) return &e;
  return nullptr;
}

// How a value reads in "got ..." messages: quoted text for strings, as written for numbers.
std::string describe_got(const Tree& t) {
  switch (t.type) {
    case Tree::Type::kNull: return "nothing";
    case Tree::Type::kMap: return "a mapping";
    case Tree::Type::kSequence: return "a list";
    case Tree::Type::kScalar: break;
  }
  const std::string& s = t.scalar();
  double d;
  auto [ptr, ec] = std::from_chars(s.data() + (!s.empty() && s[0] == '+'),
                                   s.data() + s.size(), d);
  bool numeric = !s.empty() && ec == std::errc() && ptr == s.data() + s.size();
  if (numeric && !t.is_quoted()) return s;
  return "\"" + s + "\"";
}

// Where an issue points.
struct Position {
  std::string file;
  YAML::Mark mark;
};

class IssueList {
 public:
  void add(const Position& where, const std::string& key_path, std::string message) {
    ConfigIssue issue;
    issue.file = where.file;
    if (where.mark.line >= 0 && !where.mark.is_null()) {
      issue.line = where.mark.line + 1;
      issue.column = where.mark.column + 1;
    }
    issue.key_path = key_path;
    issue.message = std::move(message);
    issues_.push_back(std::move(issue));
  }
  void add(const Tree& t, const std::string& key_path, std::string message) {
    add(Position{t.file, t.mark}, key_path, std::move(message));
  }
  void add_at_key(const TreeEntry& e, const std::string& key_path, std::string message) {
    add(Position{e.key_file, e.key_mark}, key_path, std::move(message));
  }
  // Groups issues by file (in order of first appearance), then by position, so they read
  // top to bottom whatever order the checks ran in.
  void sort() {
    std::vector<std::string> files;
    for (const auto& i : issues_)
      if (std::find(files.begin(), files.end(), i.file) == files.end()) files.push_back(i.file);
    auto rank = [&](const ConfigIssue& i) {
      auto file = std::find(files.begin(), files.end(), i.file) - files.begin();
      // Issues without a position (line 0) go after the positioned ones of their file.
      return std::make_tuple(file, i.line == 0 ? INT32_MAX : i.line, i.column);
    };
    std::stable_sort(issues_.begin(), issues_.end(),
                     [&](const ConfigIssue& a, const ConfigIssue& b) { return rank(a) < rank(b); });
  }
  bool empty() const { return issues_.empty(); }
  size_t size() const { return issues_.size(); }
  std::vector<ConfigIssue>& issues() { return issues_; }

 private:
  std::vector<ConfigIssue> issues_;
};

// Bounds on what one config document may expand to. YAML aliases share nodes in yaml-cpp's
// graph but are copied into the Tree, so 9 levels of 9 aliases ("billion laughs") would copy
// 9^9 nodes; real stacks have a few hundred nodes and a nesting depth under 10.
constexpr size_t kMaxConfigNodes = 100000;
constexpr int kMaxConfigDepth = 64;
// Config files larger than this are refused before parsing (a stack is a few KiB).
constexpr uintmax_t kMaxConfigBytes = 1u << 20;

// Thrown inside to_tree when a document exceeds the bounds above; parse_yaml turns it into
// one issue.
struct TreeLimitExceeded {
  YAML::Mark mark;
  std::string message;
};

struct TreeBudget {
  size_t nodes_left = kMaxConfigNodes;
};

Tree to_tree(const YAML::Node& node, const std::string& file, IssueList& issues,
             TreeBudget& budget, int depth) {
  if (budget.nodes_left == 0)
    throw TreeLimitExceeded{node.Mark(), "the document expands to more than " +
                                             std::to_string(kMaxConfigNodes) +
                                             " nodes (nested YAML aliases?)"};
  --budget.nodes_left;
  if (depth > kMaxConfigDepth)
    throw TreeLimitExceeded{node.Mark(), "nesting deeper than " +
                                             std::to_string(kMaxConfigDepth) + " levels"};
  Tree t;
  t.file = file;
  t.mark = node.Mark();
  switch (node.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      t.type = Tree::Type::kNull;
      break;
    case YAML::NodeType::Scalar:
      t.type = Tree::Type::kScalar;
      t.text = node.Scalar();
      // Quoted scalars are strings to YAML ("!" tag); plain ones may be numbers or booleans.
      t.quoted = node.Tag() == "!";
      // A NUL (YAML's "\0" escape) would silently cut a path or name short where it reaches
      // a C API.
      if (t.text.find('\0') != std::string::npos) {
        issues.add(Position{file, node.Mark()}, "", "a value contains a NUL character");
        t.text.resize(t.text.find('\0'));
      }
      break;
    case YAML::NodeType::Sequence:
      t.type = Tree::Type::kSequence;
      for (const auto& item : node)
        t.items.push_back(to_tree(item, file, issues, budget, depth + 1));
      break;
    case YAML::NodeType::Map:
      t.type = Tree::Type::kMap;
      for (const auto& kv : node) {
        if (!kv.first.IsScalar()) {
          issues.add(Position{file, kv.first.Mark()}, "", "keys must be plain strings");
          continue;
        }
        const std::string& key = kv.first.Scalar();
        if (const TreeEntry* first = t.find(key)) {
          issues.add(Position{file, kv.first.Mark()}, "",
                     "duplicate key '" + key + "' (first set at line " +
                         std::to_string(first->key_mark.line + 1) + ")");
          continue;
        }
        t.entries.push_back(
            {key, file, kv.first.Mark(), to_tree(kv.second, file, issues, budget, depth + 1)});
      }
      break;
  }
  return t;
}

// Merges `child` over `base`: maps merge key by key, anything else replaces. A plugin slot
// whose child names a different plugin replaces the base's slot entirely, because the base's
// parameters belong to the other plugin's schema.
void merge_into(Tree& base, Tree&& child) {
  for (auto& entry : child.entries) {
    TreeEntry* existing = base.find(entry.key);
    if (!existing) {
      base.entries.push_back(std::move(entry));
      continue;
    }
    Tree& old_value = existing->value;
    bool both_maps = old_value.is_map() && entry.value.is_map();
    if (both_maps) {
      const TreeEntry* old_plugin = old_value.find("plugin");
      const TreeEntry* new_plugin = entry.value.find("plugin");
      bool plugin_changed = old_plugin && new_plugin && old_plugin->value.is_scalar() &&
                            new_plugin->value.is_scalar() &&
                            old_plugin->value.scalar() != new_plugin->value.scalar();
      if (!plugin_changed) {
        merge_into(old_value, std::move(entry.value));
        continue;
      }
    }
    existing->key_file = entry.key_file;
    existing->key_mark = entry.key_mark;
    existing->value = std::move(entry.value);
  }
}

std::string display_path(const fs::path& p) { return p.lexically_normal().string(); }

std::optional<std::string> read_text_file(const fs::path& path, std::string* error) {
  // stat first: opening a FIFO blocks until a writer comes, and a device (/dev/zero) never
  // ends, so only regular files are read, and only up to the size bound.
  std::error_code ec;
  fs::file_status status = fs::status(path, ec);
  if (ec) {
    *error = "cannot open file: " + ec.message();
    return std::nullopt;
  }
  if (fs::is_directory(status)) {
    *error = "is a directory, not a YAML file";
    return std::nullopt;
  }
  if (!fs::is_regular_file(status)) {
    *error = "is not a regular file (a device, FIFO or socket); configs are read from files";
    return std::nullopt;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = std::string("cannot open file: ") + std::strerror(errno);
    return std::nullopt;
  }
  // Read one byte past the bound, so a file that grew after the stat is still refused.
  std::string text(static_cast<size_t>(kMaxConfigBytes) + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxConfigBytes) {
    *error = "is larger than " + format_bytes(static_cast<double>(kMaxConfigBytes)) +
             ", the most a config file may be";
    return std::nullopt;
  }
  return text;
}

// Parses YAML text into a Tree; syntax errors become issues (with their line:col).
std::optional<Tree> parse_yaml(const std::string& text, const std::string& file,
                               IssueList& issues) {
  try {
    YAML::Node root = YAML::Load(text);
    TreeBudget budget;
    return to_tree(root, file, issues, budget, 0);
  } catch (const TreeLimitExceeded& e) {
    issues.add(Position{file, e.mark}, "", "config too large: " + e.message);
    return std::nullopt;
  } catch (const YAML::DeepRecursion& e) {
    // yaml-cpp's own guard says only "bad file".
    issues.add(Position{file, e.mark}, "",
               "config too large: nesting deeper than " + std::to_string(kMaxConfigDepth) +
                   " levels");
    return std::nullopt;
  } catch (const YAML::Exception& e) {
    issues.add(Position{file, e.mark}, "", "YAML syntax error: " + e.msg);
    return std::nullopt;
  }
}

// Removes `extends:` from a mapping. Returns false on a malformed value (reported under
// `key_path`); otherwise *base is the base file (relative paths resolved against the file that
// wrote them), empty when there is none, and *from where it was written.
bool take_extends(Tree& tree, const std::string& key_path, IssueList& issues, fs::path* base, Position* from) {
  base->clear();
  auto it = std::find_if(tree.entries.begin(), tree.entries.end(),
                         [](const TreeEntry& e) { return e.key == "extends"; });
  if (it == tree.entries.end()) return true;
  TreeEntry extends = std::move(*it);
  tree.entries.erase(it);
  if (!extends.value.is_scalar() || extends.value.scalar().empty()) {
    issues.add(extends.value, key_path, "expected the path of a base config file, got " + describe_got(extends.value));
    return false;
  }
  *base = fs::path(extends.value.scalar());
  if (base->is_relative()) *base = fs::path(extends.value.file).parent_path() / *base;
  *from = Position{extends.value.file, extends.value.mark};
  return true;
}

// Loads `path` and, recursively, what it extends. `chain` holds the canonical paths of the
// files currently being loaded, to detect cycles. `from` is where `path` was named (the
// extends: value), used when the file cannot be read.
std::optional<Tree> load_tree(const fs::path& path, const std::optional<Position>& from,
                              std::vector<std::pair<std::string, std::string>>& chain,
                              IssueList& issues) {
  const std::string shown = display_path(path);
  std::error_code ec;
  fs::path canonical = fs::weakly_canonical(path, ec);
  if (ec) canonical = fs::absolute(path, ec);
  for (const auto& [canon, _] : chain) {
    if (canon == canonical.string()) {
      std::vector<std::string> names;
      for (const auto& [c, name] : chain) names.push_back(name);
      names.push_back(shown);
      issues.add(from.value_or(Position{shown, YAML::Mark::null_mark()}), "extends",
                 "extends cycle: " + join(names, " -> "));
      return std::nullopt;
    }
  }
  std::string error;
  auto text = read_text_file(path, &error);
  if (!text) {
    if (from) {
      issues.add(*from, "extends", "cannot read '" + shown + "': " + error);
    } else {
      issues.add(Position{shown, YAML::Mark::null_mark()}, "", error);
    }
    return std::nullopt;
  }
  auto tree = parse_yaml(*text, shown, issues);
  if (!tree) return std::nullopt;
  if (tree->is_null()) {  // an empty file is an empty mapping
    tree->type = Tree::Type::kMap;
    tree->mark = YAML::Mark();
  }
  if (!tree->is_map()) {
    issues.add(*tree, "", "the top level of a config file must be a mapping, got " +
                              describe_got(*tree));
    return std::nullopt;
  }
  fs::path base_path;
  Position extends_at{shown, YAML::Mark::null_mark()};
  if (!take_extends(*tree, "extends", issues, &base_path, &extends_at)) return std::nullopt;
  if (base_path.empty()) return tree;
  chain.emplace_back(canonical.string(), shown);
  auto base = load_tree(base_path, extends_at, chain, issues);
  chain.pop_back();
  if (!base) return std::nullopt;
  merge_into(*base, std::move(*tree));
  return base;
}

// --- parameter conversion -----------------------------------------------------------------

bool has_min(const ParamSpec& s) { return std::isfinite(s.min_value); }
bool has_max(const ParamSpec& s) { return std::isfinite(s.max_value); }

std::vector<std::string> enum_choices(const ParamSpec& spec) {
  std::vector<std::string> out;
  std::string_view rest = spec.choices ? spec.choices : "";
  while (true) {
    size_t bar = rest.find('|');
    out.push_back(trim(rest.substr(0, bar)));
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  return out;
}

std::string format_bound(const ParamSpec& spec, double v) {
  if (spec.type == ParamType::kBytes) return format_bytes(v);
  if (spec.type == ParamType::kDuration) return format_duration(v);
  return format_number(v);
}

std::optional<bool> parse_bool(const std::string& text) {
  std::string s = lower(trim(text));
  if (s == "true" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "no" || s == "off") return false;
  return std::nullopt;
}

std::optional<int64_t> parse_int(const std::string& text) {
  std::string s = trim(text);
  const char* b = s.data() + (!s.empty() && s[0] == '+');
  int64_t v;
  auto [ptr, ec] = std::from_chars(b, s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size()) return std::nullopt;
  return v;
}

std::optional<double> parse_float(const std::string& text) {
  std::string s = trim(text);
  const char* b = s.data() + (!s.empty() && s[0] == '+');
  double v;
  auto [ptr, ec] = std::from_chars(b, s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(v))
    return std::nullopt;
  return v;
}

bool in_range(const ParamSpec& spec, double v) {
  return !(v < spec.min_value) && !(v > spec.max_value);
}

// Converts one value to the spec's type. On failure returns nullopt with *error set to the
// message (without key path).
std::optional<ParamValue> convert_param(const ParamSpec& spec, const Tree& t, std::string* error) {
  const std::string expected = "expected " + describe_param_expectation(spec);
  auto fail = [&](std::string detail = {}) -> std::optional<ParamValue> {
    *error = detail.empty() ? expected + ", got " + describe_got(t)
                            : detail + " (" + expected.substr(std::strlen("expected ")) + ")";
    return std::nullopt;
  };
  switch (spec.type) {
    case ParamType::kBool: {
      if (!t.is_scalar()) return fail();
      auto v = parse_bool(t.scalar());
      if (!v) return fail();
      return ParamValue(*v);
    }
    case ParamType::kInt: {
      if (!t.is_scalar()) return fail();
      auto v = parse_int(t.scalar());
      if (!v || !in_range(spec, static_cast<double>(*v))) return fail();
      return ParamValue(*v);
    }
    case ParamType::kFloat: {
      if (!t.is_scalar()) return fail();
      auto v = parse_float(t.scalar());
      if (!v || !in_range(spec, *v)) return fail();
      return ParamValue(*v);
    }
    case ParamType::kString: {
      if (!t.is_scalar()) return fail();
      return ParamValue(t.scalar());
    }
    case ParamType::kEnum: {
      if (!t.is_scalar()) return fail();
      for (const auto& c : enum_choices(spec))
        if (c == t.scalar()) return ParamValue(c);
      return fail();
    }
    case ParamType::kBytes: {
      if (!t.is_scalar()) return fail();
      std::string unit_error;
      auto v = parse_bytes(t.scalar(), &unit_error);
      if (!unit_error.empty()) return fail(unit_error + " in " + describe_got(t));
      if (!v || !in_range(spec, static_cast<double>(*v))) return fail();
      return ParamValue(*v);
    }
    case ParamType::kDuration: {
      if (!t.is_scalar()) return fail();
      std::string unit_error;
      auto v = parse_duration(t.scalar(), &unit_error);
      if (!unit_error.empty()) return fail(unit_error + " in " + describe_got(t));
      if (!v || !in_range(spec, *v)) return fail();
      return ParamValue(*v);
    }
    case ParamType::kStringList: {
      if (!t.is_sequence()) return fail();
      std::vector<std::string> out;
      for (size_t i = 0; i < t.items.size(); ++i) {
        if (!t.items[i].is_scalar())
          return fail("element " + std::to_string(i) + " is " + describe_got(t.items[i]));
        out.push_back(t.items[i].scalar());
      }
      return ParamValue(std::move(out));
    }
    case ParamType::kStringMap: {
      if (!t.is_map()) return fail();
      std::map<std::string, std::string> out;
      for (const auto& e : t.entries) {
        if (!e.value.is_scalar())
          return fail("value of '" + e.key + "' is " + describe_got(e.value));
        out[e.key] = e.value.scalar();
      }
      return ParamValue(std::move(out));
    }
  }
  return fail();
}

// Validates the parameters in `slot` (a map; `plugin:` is skipped when `is_slot`) against
// `manifest`'s schema. Returns the values with defaults filled in.
// Problems with absent keys are reported at `owner` (the key that holds the slot).
std::map<std::string, ParamValue> validate_params(const PluginManifest& manifest, const Tree& slot,
                                                  const std::string& key_path, bool is_slot,
                                                  const Position& owner, IssueList& issues) {
  std::map<std::string, ParamValue> values;
  std::vector<std::string> allowed;
  if (is_slot) allowed.push_back("plugin");
  for (size_t i = 0; i < manifest.num_params; ++i) allowed.push_back(manifest_param(manifest, i).name);

  for (const auto& entry : slot.entries) {
    if (is_slot && entry.key == "plugin") continue;
    bool known = false;
    for (size_t i = 0; i < manifest.num_params; ++i)
      if (entry.key == manifest_param(manifest, i).name) known = true;
    if (known) continue;
    std::string message = unknown_key_message(entry.key, allowed);
    if (manifest.num_params == 0)
      message = "unknown key '" + entry.key + "'; plugin '" + manifest.name +
                "' takes no parameters";
    issues.add_at_key(entry, key_path, message);
  }

  for (size_t i = 0; i < manifest.num_params; ++i) {
    const ParamSpec spec = manifest_param(manifest, i);
    const std::string param_path = key_path.empty() ? spec.name : key_path + "." + spec.name;
    if (const TreeEntry* entry = slot.find(spec.name)) {
      std::string error;
      auto value = convert_param(spec, entry->value, &error);
      if (value) {
        values[spec.name] = std::move(*value);
      } else {
        // A missing value (`key:`) has no mark of its own; point at the key then.
        if (entry->value.is_null())
          issues.add_at_key(*entry, param_path, error);
        else
          issues.add(entry->value, param_path, error);
      }
      continue;
    }
    if (spec.default_value) {
      IssueList default_issues;
      std::string error;
      auto tree = parse_yaml(spec.default_value, "<default>", default_issues);
      std::optional<ParamValue> value;
      // An empty default text means the empty value of the type.
      if (tree && tree->is_null() && spec.type == ParamType::kString) value = std::string();
      else if (tree && tree->is_null() && spec.type == ParamType::kStringList)
        value = std::vector<std::string>();
      else if (tree && tree->is_null() && spec.type == ParamType::kStringMap)
        value = std::map<std::string, std::string>();
      else if (tree) value = convert_param(spec, *tree, &error);
      if (value) {
        values[spec.name] = std::move(*value);
      } else {
        issues.add(owner, param_path,
                   "plugin '" + std::string(manifest.name) + "' has an invalid default for '" +
                       spec.name + "' (" + spec.default_value + "): " + error);
      }
      continue;
    }
    if (!spec.optional) {
      issues.add(owner, key_path,
                 "missing required parameter '" + std::string(spec.name) + "' (" +
                     describe_param_expectation(spec) + ")");
    }
  }
  return values;
}

// --- the stack ----------------------------------------------------------------------------

constexpr PluginKind kEngineKinds[] = {
    PluginKind::kBackend,   PluginKind::kScheduler, PluginKind::kKvCache, PluginKind::kAttention,
    PluginKind::kQuantizer, PluginKind::kSampler,   PluginKind::kDrafter, PluginKind::kConstraint,
};

// Slots a stack runs without: `plugin: none` switches them off, and a missing default plugin
// leaves them off rather than failing the file.
bool engine_slot_is_optional(PluginKind kind) {
  return kind == PluginKind::kDrafter || kind == PluginKind::kConstraint;
}

class StackValidator {
 public:
  StackValidator(PluginRegistry& registry, IssueList& issues, std::string top_file)
      : registry_(registry), issues_(issues), top_file_(std::move(top_file)) {}

  StackConfig validate(const Tree& root) {
    StackConfig config;
    config.file = top_file_;
    check_keys(root, "", {"extends", "plugin_paths", "model", "engine", "deployments", "gateway", "embedding",
                          "server", "disaggregation", "replicas"});
    // Plugin folders first: the slots below may name plugins that live there.
    if (const TreeEntry* e = root.find("plugin_paths")) validate_plugin_paths(*e, &config);
    if (const TreeEntry* d = root.find("deployments")) {
      for (const char* key : {"model", "engine", "disaggregation", "replicas"})
        if (const TreeEntry* e = root.find(key))
          issues_.add_at_key(*e, key,
                             "with 'deployments:' each deployment has its own model and engine; move "
                             "this section into one of them");
      validate_deployments(*d, &config);
      if (!config.deployments.empty()) {
        config.model = config.deployments.front().model;
        config.engine = config.deployments.front().engine;
      }
    } else {
      if (const TreeEntry* e = root.find("model")) {
        validate_model(*e, "model", &config.model);
      } else {
        issues_.add(Position{root.file, root.mark}, "",
                    "missing required key 'model' (at least {path: MODEL}), or 'deployments'");
      }
      validate_engine(root, "engine", &config.engine);
      config.deployments.push_back(DeploymentConfig{config.model.name, config.model, config.engine, {}});
      if (const TreeEntry* e = root.find("disaggregation"))
        validate_disaggregation(*e, "disaggregation", &config.deployments.back().disaggregation);
      if (const TreeEntry* e = root.find("replicas"))
        validate_replicas(*e, "replicas", &config.deployments.back());
    }
    if (const TreeEntry* e = root.find("gateway")) validate_gateway(*e, &config);
    if (const TreeEntry* e = root.find("embedding")) validate_embedding(*e, &config);
    if (const TreeEntry* e = root.find("server")) validate_server(*e, &config.server);
    return config;
  }

 private:
  // Reports keys of `map` not in `allowed`; returns false when `map` is not a mapping.
  bool check_keys(const Tree& map, const std::string& path,
                  std::initializer_list<const char*> allowed) {
    // `engine:` with every slot commented out is an empty mapping, not a mistake.
    if (map.is_null()) return true;
    if (!map.is_map()) {
      issues_.add(map, path, "expected a mapping, got " + describe_got(map));
      return false;
    }
    std::vector<std::string> names(allowed.begin(), allowed.end());
    for (const auto& entry : map.entries) {
      if (std::find(names.begin(), names.end(), entry.key) == names.end())
        issues_.add_at_key(entry, path, unknown_key_message(entry.key, names));
    }
    return true;
  }

  // Converts a fixed (non-plugin) field with the same rules as plugin parameters.
  template <class T>
  void field(const TreeEntry& owner, const std::string& path, const ParamSpec& spec, T* out) {
    const TreeEntry* entry = owner.value.find(spec.name);
    const std::string key_path = path + "." + spec.name;
    if (!entry) {
      if (!spec.default_value && !spec.optional)
        issues_.add_at_key(owner, path, "missing required key '" + std::string(spec.name) + "' (" +
                                   describe_param_expectation(spec) + ")");
      return;
    }
    std::string error;
    auto value = convert_param(spec, entry->value, &error);
    if (!value) {
      if (entry->value.is_null())
        issues_.add_at_key(*entry, key_path, error);
      else
        issues_.add(entry->value, key_path, error);
      return;
    }
    if constexpr (std::is_same_v<T, int>) {
      *out = static_cast<int>(std::get<int64_t>(*value));
    } else {
      *out = std::get<T>(*value);
    }
  }

  void validate_plugin_paths(const TreeEntry& entry, StackConfig* config) {
    const Tree& list = entry.value;
    if (!list.is_sequence()) {
      issues_.add(list, "plugin_paths",
                  "expected a list of plugin folders, got " + describe_got(list));
      return;
    }
    for (size_t i = 0; i < list.items.size(); ++i) {
      const Tree& item = list.items[i];
      const std::string path = "plugin_paths[" + std::to_string(i) + "]";
      if (!item.is_scalar() || item.scalar().empty()) {
        issues_.add(item, path, "expected a folder path, got " + describe_got(item));
        continue;
      }
      // Relative to the file that wrote it, so a stack works from any working directory.
      fs::path dir = item.scalar();
      if (dir.is_relative()) dir = fs::path(item.file).parent_path() / dir;
      dir = dir.lexically_normal();
      std::error_code ec;
      if (!fs::is_directory(dir, ec)) {
        issues_.add(item, path, "plugin folder '" + dir.string() + "' does not exist");
        continue;
      }
      registry_.scan_directory(dir);
      config->plugin_paths.push_back(dir.string());
    }
  }

  void validate_model(const TreeEntry& entry, const std::string& path, ModelConfig* model) {
    const Tree& map = entry.value;
    if (!check_keys(map, path, {"path", "name", "threads", "context_length"})) return;
    static const ParamSpec kPath{"path", ParamType::kString, nullptr,
                                 "a model name from the cache or a .gguf file path"};
    static const ParamSpec kName{"name", ParamType::kString, "", "served model id"};
    static const ParamSpec kThreads{"threads", ParamType::kInt, "0", "", 0, kMaxThreadPoolThreads};
    static const ParamSpec kContext{"context_length", ParamType::kInt, "0", "", 0, 1 << 30};
    field(entry, path, kPath, &model->path);
    field(entry, path, kName, &model->name);
    field(entry, path, kThreads, &model->threads);
    field(entry, path, kContext, &model->context_length);
    if (const TreeEntry* path_entry = map.find("path");
        path_entry && !model->path.empty() && fs::path(model->path).is_relative()) {
      // A relative file path means relative to the file that set it.
      fs::path candidate = fs::path(path_entry->value.file).parent_path() / model->path;
      std::error_code ec;
      if (fs::is_regular_file(candidate, ec)) model->path = candidate.lexically_normal().string();
    }
    if (model->name.empty() && !model->path.empty()) {
      std::string stem = fs::path(model->path).filename().string();
      if (stem.size() > 5 && stem.ends_with(".gguf")) stem.resize(stem.size() - 5);
      model->name = stem;
    }
  }

  // Validates one `{plugin: NAME, ...}` slot. Returns nullopt on error or when the slot is
  // switched off with `plugin: none` (*off is set then).
  // `owner` is where the slot is named (its key, or the list item), for absent keys.
  std::optional<PluginSlot> validate_slot(const Tree& t, const Position& owner, PluginKind kind,
                                          const std::string& path, bool may_be_off,
                                          bool* off = nullptr) {
    const char* kind_name = plugin_kind_name(kind);
    if (!t.is_map()) {
      issues_.add(t, path, std::string("expected a plugin slot {plugin: NAME, ...parameters}, got ") +
                               describe_got(t));
      return std::nullopt;
    }
    const TreeEntry* plugin = t.find("plugin");
    if (!plugin) {
      std::string names = registry_.names_of(kind);
      issues_.add(owner, path,
                  std::string("missing key 'plugin' (the ") + kind_name + " plugin's name" +
                      (names.empty() ? std::string(")") : "; registered: " + names + ")"));
      return std::nullopt;
    }
    if (!plugin->value.is_scalar() || plugin->value.scalar().empty()) {
      issues_.add(plugin->value, path + ".plugin",
                  "expected a plugin name, got " + describe_got(plugin->value));
      return std::nullopt;
    }
    const std::string& name = plugin->value.scalar();
    if (may_be_off && name == "none") {
      for (const auto& e : t.entries)
        if (e.key != "plugin")
          issues_.add_at_key(e, path, "'plugin: none' switches the slot off and takes no parameters");
      if (off) *off = true;
      return std::nullopt;
    }
    const PluginInfo* info = registry_.find(kind, name);
    if (!info) {
      issues_.add(plugin->value, path, registry_.describe_missing(kind, name));
      return std::nullopt;
    }
    size_t before = issues_.size();
    auto values = validate_params(*info->manifest, t, path, /*is_slot=*/true, owner, issues_);
    if (issues_.size() != before) return std::nullopt;
    PluginSlot slot;
    slot.plugin = name;
    slot.file = plugin->value.file;
    slot.config = PluginConfig(name, path, std::move(values));
    return slot;
  }

  // `prefix`: "engine", or "deployments.NAME.engine".
  void validate_engine(const Tree& root, const std::string& prefix, std::map<PluginKind, PluginSlot>* slots) {
    const TreeEntry* engine = root.find("engine");
    if (engine && !check_keys(engine->value, prefix,
                              {"backend", "scheduler", "kv_cache", "attention", "quantizer",
                               "sampler", "drafter", "constraint", "requires"}))
      return;
    std::map<PluginKind, Position> slot_positions;  // where each slot was set, for need errors
    for (PluginKind kind : kEngineKinds) {
      const std::string path = prefix + "." + plugin_kind_name(kind);
      const TreeEntry* entry = engine ? engine->value.find(plugin_kind_name(kind)) : nullptr;
      if (entry) {
        bool off = false;
        auto slot = validate_slot(entry->value, Position{entry->key_file, entry->key_mark}, kind,
                                  path, engine_slot_is_optional(kind), &off);
        slot_positions[kind] = Position{entry->value.file, entry->value.mark};
        if (slot) (*slots)[kind] = std::move(*slot);
        continue;
      }
      const char* default_name = default_engine_plugin(kind);
      if (!default_name) continue;  // off unless configured
      const PluginInfo* info = registry_.find(kind, default_name);
      Position where = engine ? Position{engine->key_file, engine->key_mark}
                              : Position{top_file_, YAML::Mark::null_mark()};
      if (!info && engine_slot_is_optional(kind)) continue;
      if (!info) {
        // The stack cannot run without it, so say so now rather than at startup.
        issues_.add(where, path,
                    std::string("not set, and the default ") + plugin_kind_name(kind) +
                        " plugin is not available: " +
                        registry_.describe_missing(kind, default_name));
        continue;
      }
      Tree empty;
      empty.type = Tree::Type::kMap;
      empty.file = where.file;
      empty.mark = where.mark;
      size_t before = issues_.size();
      auto values = validate_params(*info->manifest, empty, path, true, where, issues_);
      if (issues_.size() != before) continue;
      PluginSlot slot;
      slot.plugin = default_name;
      slot.file = top_file_;
      slot.config = PluginConfig(default_name, path, std::move(values));
      slot_positions[kind] = where;
      (*slots)[kind] = std::move(slot);
    }
    check_capabilities(engine, prefix, *slots, slot_positions);
  }

  // Capabilities (SDK 2.6), before anything is created: each slot's plugin's `needs` and each
  // `engine.requires` entry ("<kind>.<capability>") must be offered by the plugin in that
  // kind's slot, or the stack would fail (or silently run another path) only once the model
  // is loaded.
  void check_capabilities(const TreeEntry* engine, const std::string& prefix,
                          const std::map<PluginKind, PluginSlot>& slots,
                          const std::map<PluginKind, Position>& positions) {
    // Why `kind`'s slot does not offer `capability`, or "" when it does.
    auto missing = [&](PluginKind kind, const std::string& capability) -> std::string {
      const char* kind_name = plugin_kind_name(kind);
      auto it = slots.find(kind);
      if (it == slots.end())
        return std::string("but no ") + kind_name + " is configured (" + prefix + "." + kind_name + ")";
      const PluginInfo* info = registry_.find(kind, it->second.plugin);
      if (!info || info->has_capability(capability)) return "";
      std::string offered;
      for (const std::string& c : info->capabilities()) offered += (offered.empty() ? "" : ", ") + c;
      return std::string("which ") + kind_name + " plugin '" + it->second.plugin + "' does not offer (it offers: " +
             (offered.empty() ? "none" : offered) + ")";
    };
    for (const auto& [kind, slot] : slots) {
      const PluginInfo* info = registry_.find(kind, slot.plugin);
      if (!info) continue;
      for (const std::string& need : info->needs()) {
        size_t dot = need.find('.');
        PluginKind needed_kind;
        if (!parse_plugin_kind(need.substr(0, dot), &needed_kind)) continue;  // refused at load
        const std::string capability = need.substr(dot + 1);
        std::string why = missing(needed_kind, capability);
        if (why.empty()) continue;
        auto pos = positions.find(kind);
        issues_.add(pos != positions.end() ? pos->second : Position{top_file_, YAML::Mark::null_mark()},
                    prefix + "." + plugin_kind_name(kind),
                    std::string(plugin_kind_name(kind)) + " plugin '" + slot.plugin + "' needs capability '" +
                        capability + "' of the " + plugin_kind_name(needed_kind) + ", " + why);
      }
    }
    const TreeEntry* requires_entry = engine ? engine->value.find("requires") : nullptr;
    if (!requires_entry) return;
    const Tree& list = requires_entry->value;
    const std::string list_path = prefix + ".requires";
    if (!list.is_sequence()) {
      issues_.add(list, list_path,
                  "expected a list of <kind>.<capability>, e.g. [quantizer.grouped_matmul], got " +
                      describe_got(list));
      return;
    }
    for (size_t i = 0; i < list.items.size(); ++i) {
      const Tree& item = list.items[i];
      const std::string path = list_path + "[" + std::to_string(i) + "]";
      const std::string text = item.is_scalar() ? item.scalar() : "";
      size_t dot = text.find('.');
      PluginKind kind;
      if (dot == std::string::npos || dot + 1 == text.size() ||
          !parse_plugin_kind(text.substr(0, dot), &kind) ||
          std::find(std::begin(kEngineKinds), std::end(kEngineKinds), kind) == std::end(kEngineKinds)) {
        issues_.add(item, path,
                    "expected <kind>.<capability> with an engine kind (backend, scheduler, kv_cache, attention, "
                    "quantizer, sampler, drafter, constraint), e.g. quantizer.grouped_matmul, got " +
                        describe_got(item));
        continue;
      }
      const std::string capability = text.substr(dot + 1);
      std::string why = missing(kind, capability);
      if (!why.empty())
        issues_.add(item, path,
                    "the stack requires capability '" + capability + "' of the " + plugin_kind_name(kind) + ", " + why);
    }
  }

  // `deployments: {NAME: {extends: FILE?, model: {...}, engine: {...}}, ...}`. A deployment
  // that extends a file takes that file's model and engine (its other sections belong to a
  // whole stack and are ignored) and merges its own keys over them.
  void validate_deployments(const TreeEntry& entry, StackConfig* config) {
    const Tree& map = entry.value;
    if (!map.is_map() || map.entries.empty()) {
      issues_.add(map, "deployments",
                  "expected a mapping of deployment names to stacks {model: ..., engine: ...}, got " +
                      describe_got(map));
      return;
    }
    for (const TreeEntry& d : map.entries) {
      const std::string path = "deployments." + d.key;
      Tree tree = d.value;
      if (!tree.is_map()) {
        issues_.add(tree, path, "expected a deployment {extends: FILE, model: ..., engine: ...}, got " +
                                    describe_got(tree));
        continue;
      }
      if (!resolve_deployment_extends(path, &tree)) continue;
      if (!check_keys(tree, path, {"model", "engine", "disaggregation", "replicas"})) continue;
      DeploymentConfig dc;
      dc.name = d.key;
      if (const TreeEntry* m = tree.find("model")) {
        if (const TreeEntry* n = m->value.find("name"))
          issues_.add_at_key(*n, path + ".model.name",
                             "a deployment is served under its key '" + d.key + "'; remove 'name'");
        validate_model(*m, path + ".model", &dc.model);
      } else {
        issues_.add_at_key(d, path, "missing required key 'model' (at least {path: MODEL})");
      }
      dc.model.name = d.key;
      validate_engine(tree, path + ".engine", &dc.engine);
      if (const TreeEntry* e = tree.find("disaggregation"))
        validate_disaggregation(*e, path + ".disaggregation", &dc.disaggregation);
      if (const TreeEntry* e = tree.find("replicas")) validate_replicas(*e, path + ".replicas", &dc);
      config->deployments.push_back(std::move(dc));
    }
  }

  bool resolve_deployment_extends(const std::string& path, Tree* tree) {
    fs::path base_path;
    Position extends_at{top_file_, YAML::Mark::null_mark()};
    if (!take_extends(*tree, path + ".extends", issues_, &base_path, &extends_at)) return false;
    if (base_path.empty()) return true;
    std::vector<std::pair<std::string, std::string>> chain;
    auto base = load_tree(base_path, extends_at, chain, issues_);
    if (!base) return false;
    Tree kept;
    kept.type = Tree::Type::kMap;
    kept.file = base->file;
    kept.mark = base->mark;
    for (auto& e : base->entries)
      if (e.key == "model" || e.key == "engine") kept.entries.push_back(std::move(e));
    merge_into(kept, std::move(*tree));
    *tree = std::move(kept);
    return true;
  }

  void validate_gateway(const TreeEntry& entry, StackConfig* config) {
    const Tree& map = entry.value;
    if (!check_keys(map, "gateway", {"cache", "router"})) return;
    if (const TreeEntry* cache = map.find("cache")) {
      if (!cache->value.is_sequence()) {
        issues_.add(cache->value, "gateway.cache",
                    "expected a list of cache layer slots, got " + describe_got(cache->value));
      } else {
        for (size_t i = 0; i < cache->value.items.size(); ++i) {
          const Tree& item = cache->value.items[i];
          auto slot = validate_slot(item, Position{item.file, item.mark}, PluginKind::kCacheLayer,
                                    "gateway.cache[" + std::to_string(i) + "]", false);
          if (slot) config->cache_layers.push_back(std::move(*slot));
        }
      }
    }
    if (const TreeEntry* router = map.find("router")) {
      // `name` belongs to the gateway, not to the plugin: the model id that picks the router.
      Tree slot_tree = router->value;
      std::string name;
      if (slot_tree.is_map()) {
        auto it = std::find_if(slot_tree.entries.begin(), slot_tree.entries.end(),
                               [](const TreeEntry& e) { return e.key == "name"; });
        if (it != slot_tree.entries.end()) {
          if (!it->value.is_scalar() || it->value.scalar().empty())
            issues_.add(it->value, "gateway.router.name",
                        "expected the model id clients send to reach the router, got " + describe_got(it->value));
          else
            name = it->value.scalar();
          slot_tree.entries.erase(it);
        }
      }
      auto slot = validate_slot(slot_tree, Position{router->key_file, router->key_mark},
                                PluginKind::kRouter, "gateway.router", true);
      if (slot) {
        config->router_name = name.empty() ? slot->plugin : name;
        for (const auto& d : config->deployments)
          if (d.name == config->router_name)
            issues_.add_at_key(*router, "gateway.router.name",
                               "'" + config->router_name + "' is also a deployment's name; give the router another");
        config->router = std::move(*slot);
      }
    }
  }

  // `disaggregation: {role: both|prefill|decode, connector: {plugin: NAME, ...}, listen:
  // HOST:PORT, prefill: [HOST:PORT, ...], transfer_timeout: DURATION, pipelined_start: BOOL,
  // layer_wait: DURATION}`.
  void validate_disaggregation(const TreeEntry& entry, const std::string& path, DisaggregationConfig* out) {
    if (!check_keys(entry.value, path,
                    {"role", "connector", "listen", "prefill", "transfer_timeout", "pipelined_start", "layer_wait"}))
      return;
    static const ParamSpec kRole{"role", ParamType::kEnum, "both", "", -INFINITY, INFINITY, "both|prefill|decode"};
    static const ParamSpec kListen{"listen", ParamType::kString, "", ""};
    static const ParamSpec kPrefill{"prefill", ParamType::kStringList, "[]", ""};
    static const ParamSpec kTimeout{"transfer_timeout", ParamType::kDuration, "30s", "", 0.1, 3600};
    static const ParamSpec kPipelined{"pipelined_start", ParamType::kBool, "true", ""};
    static const ParamSpec kLayerWait{"layer_wait", ParamType::kDuration, "2s", "", 0.001, 3600};
    field(entry, path, kRole, &out->role);
    field(entry, path, kListen, &out->listen);
    field(entry, path, kPrefill, &out->prefill);
    field(entry, path, kTimeout, &out->transfer_timeout);
    field(entry, path, kPipelined, &out->pipelined_start);
    field(entry, path, kLayerWait, &out->layer_wait);
    const TreeEntry* connector = entry.value.find("connector");
    if (connector) {
      out->connector = validate_slot(connector->value, Position{connector->key_file, connector->key_mark},
                                     PluginKind::kKvConnector, path + ".connector", false);
    }
    if (out->role == "both") {
      if (connector || !out->listen.empty() || !out->prefill.empty())
        issues_.add_at_key(entry, path + ".role",
                           "role 'both' (the default) serves prefill and decode here; set role: prefill or "
                           "role: decode to use connector, listen or prefill");
      return;
    }
    if (!connector)
      issues_.add_at_key(entry, path, "role '" + out->role + "' needs a connector (e.g. connector: {plugin: grpc})");
    if (out->role == "prefill") {
      if (out->listen.empty())
        issues_.add_at_key(entry, path, "role 'prefill' needs 'listen' (HOST:PORT the decode engines call)");
      else
        check_address(out->listen, path, "listen", *entry.value.find("listen"));
      if (!out->prefill.empty())
        issues_.add_at_key(*entry.value.find("prefill"), path + ".prefill", "only a decode engine has prefill engines");
    } else {
      if (out->prefill.empty())
        issues_.add_at_key(entry, path, "role 'decode' needs 'prefill': the list of prefill engines' HOST:PORT");
      for (const std::string& a : out->prefill) check_address(a, path, "prefill", *entry.value.find("prefill"));
      if (!out->listen.empty())
        issues_.add_at_key(*entry.value.find("listen"), path + ".listen", "only a prefill engine listens");
    }
  }

  // `replicas: {connector: {plugin: NAME}, listen: HOST:PORT, endpoints: [HOST:PORT, ...],
  // local: BOOL, router: {plugin: NAME, ...}, health_interval: DURATION, timeout: DURATION,
  // max_concurrent: N}`.
  void validate_replicas(const TreeEntry& entry, const std::string& path, DeploymentConfig* dc) {
    ReplicasConfig* out = &dc->replicas;
    if (!check_keys(entry.value, path,
                    {"connector", "listen", "endpoints", "local", "router", "health_interval", "timeout",
                     "max_concurrent"}))
      return;
    static const ParamSpec kListen{"listen", ParamType::kString, "", ""};
    static const ParamSpec kEndpoints{"endpoints", ParamType::kStringList, "[]", ""};
    static const ParamSpec kLocal{"local", ParamType::kBool, "true", ""};
    static const ParamSpec kHealth{"health_interval", ParamType::kDuration, "1s", "", 0.05, 3600};
    static const ParamSpec kTimeout{"timeout", ParamType::kDuration, "600s", "", 0.1, 86400};
    static const ParamSpec kConcurrent{"max_concurrent", ParamType::kInt, "64", "", 1, 4096};
    field(entry, path, kListen, &out->listen);
    field(entry, path, kEndpoints, &out->endpoints);
    field(entry, path, kLocal, &out->local);
    field(entry, path, kHealth, &out->health_interval);
    field(entry, path, kTimeout, &out->timeout);
    field(entry, path, kConcurrent, &out->max_concurrent);
    if (const TreeEntry* c = entry.value.find("connector"))
      out->connector = validate_slot(c->value, Position{c->key_file, c->key_mark}, PluginKind::kKvConnector,
                                     path + ".connector", false);
    else
      issues_.add_at_key(entry, path, "missing required key 'connector' (the transport, e.g. {plugin: grpc})");
    if (const TreeEntry* r = entry.value.find("router")) {
      out->router = validate_slot(r->value, Position{r->key_file, r->key_mark}, PluginKind::kRouter,
                                  path + ".router", false);
    } else if (!out->endpoints.empty()) {
      Tree slot;
      slot.type = Tree::Type::kMap;
      slot.file = entry.value.file;
      slot.mark = entry.value.mark;
      Tree name;
      name.type = Tree::Type::kScalar;
      name.text = "prefix-affinity";
      name.file = entry.value.file;
      name.mark = entry.value.mark;
      slot.entries.push_back(TreeEntry{"plugin", entry.key_file, entry.key_mark, std::move(name)});
      out->router = validate_slot(slot, Position{entry.key_file, entry.key_mark}, PluginKind::kRouter,
                                  path + ".router", false);
    }
    if (out->listen.empty() && out->endpoints.empty())
      issues_.add_at_key(entry, path,
                         "give 'listen' (this process serves its engine to gateways) and/or 'endpoints' (this "
                         "gateway spreads requests over those engine processes)");
    if (!out->listen.empty()) check_address(out->listen, path, "listen", *entry.value.find("listen"));
    for (const std::string& a : out->endpoints) check_address(a, path, "endpoints", *entry.value.find("endpoints"));
    if (out->endpoints.empty() && entry.value.find("local"))
      issues_.add_at_key(*entry.value.find("local"), path + ".local", "only a gateway with 'endpoints' routes to its own engine or not");
    if (dc->disaggregation.role != "both" && !out->endpoints.empty())
      issues_.add_at_key(entry, path + ".endpoints",
                         "a deployment is either disaggregated (role " + dc->disaggregation.role +
                             ") or replicated over endpoints, not both; list the decode processes as endpoints instead");
  }

  void check_address(const std::string& address, const std::string& path, const std::string& key, const TreeEntry& at) {
    const auto colon = address.rfind(':');
    bool ok = colon != std::string::npos && colon > 0 && colon + 1 < address.size();
    if (ok) {
      for (size_t i = colon + 1; i < address.size(); ++i) ok = ok && std::isdigit(static_cast<unsigned char>(address[i]));
      ok = ok && address.size() - colon - 1 <= 5 && std::stol(address.substr(colon + 1)) <= 65535;
    }
    if (!ok) issues_.add_at_key(at, path + "." + key, "expected HOST:PORT (port 0..65535), got \"" + address + "\"");
  }

  // `embedding: {model: {path: DIR_OR_NAME, threads: N}, max_inputs: N}`.
  void validate_embedding(const TreeEntry& entry, StackConfig* config) {
    if (!check_keys(entry.value, "embedding", {"model", "max_inputs"})) return;
    EmbeddingConfig embedding;
    const TreeEntry* m = entry.value.find("model");
    if (!m) {
      issues_.add_at_key(entry, "embedding", "missing required key 'model' ({path: all-MiniLM-L6-v2})");
      return;
    }
    validate_model(*m, "embedding.model", &embedding.model);
    static const ParamSpec kMaxInputs{"max_inputs", ParamType::kInt, "256", "", 1, 1 << 16};
    field(entry, "embedding", kMaxInputs, &embedding.max_inputs);
    if (const TreeEntry* p = m->value.find("path"); p && !embedding.model.path.empty()) {
      try {
        embedding.model.path =
            resolve_model_dir(embedding.model.path, fs::path(p->value.file).parent_path().string());
      } catch (const std::exception& e) {
        issues_.add(p->value, "embedding.model.path", e.what());
      }
    }
    config->embedding = std::move(embedding);
  }

  void validate_server(const TreeEntry& entry, ServerConfig* server) {
    const Tree& map = entry.value;
    if (!check_keys(map, "server",
                    {"host", "port", "api_keys", "max_body_size", "max_header_size", "header_timeout",
                     "read_timeout", "idle_timeout", "write_timeout", "max_queued_requests",
                     "shutdown_timeout", "shutdown_grace", "defaults"}))
      return;
    static const ParamSpec kHost{"host", ParamType::kString, "127.0.0.1", ""};
    static const ParamSpec kPort{"port", ParamType::kInt, "8080", "", 0, 65535};
    static const ParamSpec kKeys{"api_keys", ParamType::kStringList, "[]", ""};
    static const ParamSpec kMaxBody{"max_body_size", ParamType::kBytes, "1MiB", "", 1024, 1 << 30};
    static const ParamSpec kMaxHeader{"max_header_size", ParamType::kBytes, "16KiB", "", 1024, 1 << 20};
    static const ParamSpec kHeaderTimeout{"header_timeout", ParamType::kDuration, "10s", "", 0.01, 3600};
    static const ParamSpec kReadTimeout{"read_timeout", ParamType::kDuration, "30s", "", 0.01, 3600};
    static const ParamSpec kIdleTimeout{"idle_timeout", ParamType::kDuration, "60s", "", 0.01, 86400};
    static const ParamSpec kWriteTimeout{"write_timeout", ParamType::kDuration, "30s", "", 0.01, 3600};
    static const ParamSpec kMaxQueued{"max_queued_requests", ParamType::kInt, "256", "", 1, 1 << 20};
    static const ParamSpec kShutdown{"shutdown_timeout", ParamType::kDuration, "10s", "", 0, 3600};
    static const ParamSpec kShutdownGrace{"shutdown_grace", ParamType::kDuration, "10s", "", 0, 3600};
    field(entry, "server", kHost, &server->host);
    field(entry, "server", kPort, &server->port);
    field(entry, "server", kKeys, &server->api_keys);
    field(entry, "server", kMaxBody, &server->max_body_bytes);
    field(entry, "server", kMaxHeader, &server->max_header_bytes);
    field(entry, "server", kHeaderTimeout, &server->header_timeout);
    field(entry, "server", kReadTimeout, &server->read_timeout);
    field(entry, "server", kIdleTimeout, &server->idle_timeout);
    field(entry, "server", kWriteTimeout, &server->write_timeout);
    field(entry, "server", kMaxQueued, &server->max_queued_requests);
    field(entry, "server", kShutdown, &server->shutdown_timeout);
    field(entry, "server", kShutdownGrace, &server->shutdown_grace);
    for (const std::string& key : server->api_keys)
      if (key.empty()) issues_.add(entry.value.find("api_keys")->value, "server.api_keys", "an API key must not be empty");
    if (const TreeEntry* d = entry.value.find("defaults")) validate_request_defaults(*d, &server->defaults);
  }

  // server.defaults: the request fields' own names and ranges (docs/server.md).
  void validate_request_defaults(const TreeEntry& entry, RequestDefaults* d) {
    const std::string path = "server.defaults";
    if (!check_keys(entry.value, path,
                    {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "max_tokens"}))
      return;
    auto spec = [](const char* name, ParamType type, double lo, double hi) {
      ParamSpec s{name, type, nullptr, "", lo, hi};
      s.optional = true;
      return s;
    };
    optional_field(entry, path, spec("temperature", ParamType::kFloat, 0, 2), &d->temperature);
    optional_field(entry, path, spec("top_p", ParamType::kFloat, 1e-9, 1), &d->top_p);
    optional_field(entry, path, spec("top_k", ParamType::kInt, -1, 1 << 20), &d->top_k);
    optional_field(entry, path, spec("min_p", ParamType::kFloat, 0, 1), &d->min_p);
    optional_field(entry, path, spec("presence_penalty", ParamType::kFloat, -2, 2), &d->presence_penalty);
    optional_field(entry, path, spec("frequency_penalty", ParamType::kFloat, -2, 2), &d->frequency_penalty);
    optional_field(entry, path, spec("repetition_penalty", ParamType::kFloat, 0.01, 10), &d->repetition_penalty);
    optional_field(entry, path, spec("max_tokens", ParamType::kInt, 1, 1 << 24), &d->max_tokens);
  }

  template <class T>
  void optional_field(const TreeEntry& owner, const std::string& path, const ParamSpec& spec, std::optional<T>* out) {
    if (!owner.value.find(spec.name)) return;
    T value{};
    field(owner, path, spec, &value);
    *out = value;
  }

  PluginRegistry& registry_;
  IssueList& issues_;
  std::string top_file_;
};

}  // namespace

std::string describe_param_expectation(const ParamSpec& spec) {
  std::string noun;
  switch (spec.type) {
    case ParamType::kBool: return "a boolean (true or false)";
    case ParamType::kInt: noun = "an integer"; break;
    case ParamType::kFloat: noun = "a number"; break;
    case ParamType::kString: return "a string";
    case ParamType::kEnum: return "one of: " + join(enum_choices(spec), ", ");
    case ParamType::kBytes: noun = "a size"; break;
    case ParamType::kDuration: noun = "a duration"; break;
    case ParamType::kStringList: return "a list of strings";
    case ParamType::kStringMap: return "a mapping of strings to strings";
  }
  if (has_min(spec) && has_max(spec))
    noun += " in [" + format_bound(spec, spec.min_value) + ", " + format_bound(spec, spec.max_value) + "]";
  else if (has_min(spec))
    noun += " >= " + format_bound(spec, spec.min_value);
  else if (has_max(spec))
    noun += " <= " + format_bound(spec, spec.max_value);
  if (spec.type == ParamType::kBytes) noun += " (e.g. 4096, 512KiB, 256MiB, 1GB)";
  if (spec.type == ParamType::kDuration) noun += " (e.g. 250ms, 10s, 10m, 1h)";
  return noun;
}

std::string format_param_value(const ParamSpec& spec, const ParamValue& value) {
  return std::visit(
      [&](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) {
          return v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (spec.type == ParamType::kBytes) return format_bytes(static_cast<double>(v));
          return std::to_string(v);
        } else if constexpr (std::is_same_v<T, double>) {
          if (spec.type == ParamType::kDuration) return format_duration(v);
          return format_number(v);
        } else if constexpr (std::is_same_v<T, std::string>) {
          return v;
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          return "[" + join(v, ", ") + "]";
        } else {
          std::vector<std::string> parts;
          for (const auto& [k, s] : v) parts.push_back(k + ": " + s);
          return "{" + join(parts, ", ") + "}";
        }
      },
      value);
}

StackConfig deployment_stack(const StackConfig& config, size_t index) {
  StackConfig out = config;
  out.model = config.deployments.at(index).model;
  out.engine = config.deployments.at(index).engine;
  return out;
}

StackConfig load_stack_config(const std::string& path, PluginRegistry& registry) {
  IssueList issues;
  std::vector<std::pair<std::string, std::string>> chain;
  auto tree = load_tree(fs::path(path), std::nullopt, chain, issues);
  // Unreadable files and syntax errors stop here: validating half a stack would only add
  // misleading "missing key" reports.
  if (!tree) throw ConfigError(std::move(issues.issues()));
  StackValidator validator(registry, issues, display_path(path));
  StackConfig config = validator.validate(*tree);
  if (!issues.empty()) {
    issues.sort();
    throw ConfigError(std::move(issues.issues()));
  }
  return config;
}

PluginConfig validate_plugin_params(const PluginManifest& manifest, const std::string& key_path,
                                    const std::string& yaml_text) {
  IssueList issues;
  auto tree = parse_yaml(yaml_text, "<params>", issues);
  if (!tree) throw ConfigError(std::move(issues.issues()));
  if (tree->is_null()) tree->type = Tree::Type::kMap;
  if (!tree->is_map()) {
    issues.add(*tree, key_path, "expected a mapping of parameters, got " + describe_got(*tree));
    throw ConfigError(std::move(issues.issues()));
  }
  auto values = validate_params(manifest, *tree, key_path, /*is_slot=*/false,
                                Position{"<params>", YAML::Mark()}, issues);
  if (!issues.empty()) {
    issues.sort();
    throw ConfigError(std::move(issues.issues()));
  }
  return PluginConfig(manifest.name, key_path, std::move(values));
}

// --- models -------------------------------------------------------------------------------

std::string model_cache_dir() {
  if (const char* dir = std::getenv("TESSERA_MODEL_DIR"); dir && *dir) return dir;
  const char* home = std::getenv("HOME");
  return (fs::path(home && *home ? home : ".") / ".cache" / "tessera" / "models").string();
}

namespace {
// Short names for the models scripts/fetch-models.sh downloads, mapped to their file names.
const std::map<std::string, std::string>& model_aliases() {
  static const std::map<std::string, std::string> aliases = {
      {"smollm2-135m-instruct-q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf"},
      {"gemma3-270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf"},
  };
  return aliases;
}
}  // namespace

namespace {

// Where a model named in a config is: an absolute path as is; a relative one relative to the
// config file's folder, then the working directory; then the model cache by `names` (exact,
// then case-insensitive). `is_model` says what counts (a regular file, a directory).
std::optional<std::string> find_model(const std::string& path_or_name, const std::string& config_dir,
                                      const std::vector<std::string>& names,
                                      bool (*is_model)(const fs::path&), std::vector<std::string>* looked) {
  auto try_path = [&](const fs::path& p) {
    looked->push_back(p.lexically_normal().string());
    return is_model(p);
  };
  fs::path given(path_or_name);
  if (given.is_absolute()) {
    if (try_path(given)) return given.string();
  } else {
    if (!config_dir.empty() && try_path(fs::path(config_dir) / given))
      return (fs::path(config_dir) / given).lexically_normal().string();
    if (try_path(given)) return given.string();
  }
  // A bare name: look in the model cache.
  fs::path cache = model_cache_dir();
  for (const auto& name : names)
    if (try_path(cache / name)) return (cache / name).string();
  // Names are case-insensitive within the cache ("smollm2-135m-instruct.q4_1").
  std::error_code ec;
  if (fs::is_directory(cache, ec)) {
    for (const auto& entry : fs::directory_iterator(cache, ec)) {
      std::string file = entry.path().filename().string();
      for (const auto& name : names)
        if (lower(file) == lower(name) && is_model(entry.path())) return entry.path().string();
    }
  }
  return std::nullopt;
}

std::string unique_join(const std::vector<std::string>& looked) {
  std::vector<std::string> unique;
  for (const auto& l : looked)
    if (std::find(unique.begin(), unique.end(), l) == unique.end()) unique.push_back(l);
  return join(unique, ", ");
}

}  // namespace

std::string resolve_model_path(const std::string& path_or_name, const std::string& config_dir) {
  std::vector<std::string> names = {path_or_name, path_or_name + ".gguf"};
  if (auto it = model_aliases().find(lower(path_or_name)); it != model_aliases().end())
    names.push_back(it->second);
  std::vector<std::string> looked;
  auto is_file = [](const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec);
  };
  if (auto found = find_model(path_or_name, config_dir, names, is_file, &looked)) return *found;
  throw std::runtime_error("model '" + path_or_name + "' not found (looked in " + unique_join(looked) +
                           "); run scripts/fetch-models.sh to download it");
}

std::string resolve_model_path(const std::string& path_or_name) {
  return resolve_model_path(path_or_name, std::string());
}

std::string resolve_model_dir(const std::string& path_or_name, const std::string& config_dir) {
  std::vector<std::string> looked;
  auto is_dir = [](const fs::path& p) {
    std::error_code ec;
    return fs::is_directory(p, ec);
  };
  if (auto found = find_model(path_or_name, config_dir, {path_or_name}, is_dir, &looked)) return *found;
  throw std::runtime_error("embedding model '" + path_or_name + "' not found (looked in " + unique_join(looked) +
                           "); run scripts/fetch-models.sh to download all-MiniLM-L6-v2");
}

}  // namespace tessera
