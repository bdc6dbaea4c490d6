#include "grammar.h"

#include <cmath>
#include <map>
#include <optional>
#include <set>

namespace tessera::json_constraint {
namespace {

using ojson = nlohmann::ordered_json;

constexpr size_t kMaxNodes = 1 << 16;
constexpr size_t kMaxProperties = 256;

std::string describe(const ojson& v) {
  switch (v.type()) {
    case ojson::value_t::object: return "an object";
    case ojson::value_t::array: return "a list";
    case ojson::value_t::string: return "a string";
    case ojson::value_t::boolean: return "a boolean";
    case ojson::value_t::null: return "null";
    default: return "a number";
  }
}

std::string join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

Status fail(const std::string& path, const std::string& message) {
  return invalid_argument((path.empty() ? std::string("schema") : path) + ": " + message);
}

// Adds the nodes every grammar has; returns nothing (cannot fail).
void add_builtins(Grammar* g) {
  auto add = [&](Node n) {
    g->nodes.push_back(std::move(n));
    return static_cast<int32_t>(g->nodes.size() - 1);
  };
  Node any;
  any.kind = NodeKind::kAny;
  g->any_node = add(any);
  Node str;
  str.kind = NodeKind::kString;
  g->string_node = add(str);
  Node num;
  num.kind = NodeKind::kNumber;
  g->number_node = add(num);
  Node kw;
  kw.kind = NodeKind::kLiterals;
  kw.literals = {"true", "false", "null"};
  g->keyword_node = add(kw);
  Node obj;
  obj.kind = NodeKind::kObject;
  obj.generic = true;
  g->generic_object_node = add(obj);
  Node arr;
  arr.kind = NodeKind::kArray;
  g->generic_array_node = add(arr);
}

// One schema document: $ref paths resolve against its root.
class SchemaCompiler {
 public:
  SchemaCompiler(const ojson& root, Grammar* g) : root_(root), g_(g) {}

  Status compile(const ojson& schema, const std::string& path, int32_t* out) {
    if (++depth_ > 64) return fail(path, "nested more than 64 levels deep");
    Status st = compile_inner(schema, path, out);
    --depth_;
    return st;
  }

 private:
  int32_t add(Node n) {
    g_->nodes.push_back(std::move(n));
    return static_cast<int32_t>(g_->nodes.size() - 1);
  }

  Status check_size(const std::string& path) {
    return g_->nodes.size() > kMaxNodes ? fail(path, "the schema is too large") : Status::ok();
  }

  Status literals(const std::vector<std::string>& lits, int32_t* out) {
    Node n;
    n.kind = NodeKind::kLiterals;
    n.literals = lits;
    *out = add(std::move(n));
    return Status::ok();
  }

  Status resolve_ref(const ojson& ref, const std::string& path, int32_t* out) {
    if (!ref.is_string()) return fail(join(path, "$ref"), "expected a string, got " + describe(ref));
    const std::string target = ref.get<std::string>();
    if (auto it = refs_.find(target); it != refs_.end()) {
      *out = it->second;
      return Status::ok();
    }
    if (target.empty() || target[0] != '#')
      return fail(join(path, "$ref"), "only references inside the schema (\"#/$defs/...\") are supported, got \"" +
                                          target + "\"");
    const ojson* doc = &root_;
    try {
      if (target.size() > 1) doc = &root_.at(ojson::json_pointer(target.substr(1)));
    } catch (const std::exception&) {
      return fail(join(path, "$ref"), "\"" + target + "\" does not name a part of the schema");
    }
    // Reserve the node first, so a recursive reference finds it.
    const int32_t alias = add(Node{});
    refs_[target] = alias;
    int32_t body = -1;
    Status st = compile(*doc, target.substr(1), &body);
    if (!st.is_ok()) return st;
    Node& n = g_->nodes[static_cast<size_t>(alias)];
    n.kind = NodeKind::kAnyOf;
    n.alternatives = {body};
    *out = alias;
    return Status::ok();
  }

  Status compile_inner(const ojson& schema, const std::string& path, int32_t* out) {
    Status st = check_size(path);
    if (!st.is_ok()) return st;
    if (schema.is_boolean()) {
      if (!schema.get<bool>()) return fail(path, "the schema false allows no value");
      *out = g_->any_node;
      return Status::ok();
    }
    if (!schema.is_object()) return fail(path, "expected a schema object, got " + describe(schema));
    if (auto ref = schema.find("$ref"); ref != schema.end()) return resolve_ref(*ref, path, out);
    if (auto c = schema.find("const"); c != schema.end()) return literals({c->dump()}, out);
    if (auto e = schema.find("enum"); e != schema.end()) {
      if (!e->is_array() || e->empty())
        return fail(join(path, "enum"), "expected a non-empty list, got " + describe(*e));
      std::vector<std::string> lits;
      for (const auto& v : *e) lits.push_back(v.dump());
      return literals(lits, out);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      auto alts = schema.find(key);
      if (alts == schema.end()) continue;
      if (!alts->is_array() || alts->empty())
        return fail(join(path, key), "expected a non-empty list of schemas, got " + describe(*alts));
      Node n;
      n.kind = NodeKind::kAnyOf;
      for (size_t i = 0; i < alts->size(); ++i) {
        int32_t alt = -1;
        st = compile((*alts)[i], join(path, key) + "[" + std::to_string(i) + "]", &alt);
        if (!st.is_ok()) return st;
        n.alternatives.push_back(alt);
      }
      *out = add(std::move(n));
      return Status::ok();
    }
    if (auto all = schema.find("allOf"); all != schema.end()) {
      if (!all->is_array() || all->size() != 1)
        return fail(join(path, "allOf"), "only a list of one schema is supported");
      return compile((*all)[0], join(path, "allOf") + "[0]", out);
    }
    const bool nullable = schema.value("nullable", false);
    std::vector<std::string> types;
    if (auto t = schema.find("type"); t != schema.end()) {
      if (t->is_string()) {
        types.push_back(t->get<std::string>());
      } else if (t->is_array() && !t->empty()) {
        for (const auto& item : *t) {
          if (!item.is_string()) return fail(join(path, "type"), "expected type names, got " + describe(item));
          types.push_back(item.get<std::string>());
        }
      } else {
        return fail(join(path, "type"), "expected a type name or a list of them, got " + describe(*t));
      }
    } else if (schema.contains("properties") || schema.contains("required") ||
               schema.contains("additionalProperties")) {
      types.push_back("object");
    } else if (schema.contains("items")) {
      types.push_back("array");
    } else {
      *out = g_->any_node;
      return Status::ok();
    }
    if (nullable) types.push_back("null");
    if (types.size() == 1) return compile_type(schema, types[0], path, out);
    Node n;
    n.kind = NodeKind::kAnyOf;
    for (const auto& type : types) {
      int32_t alt = -1;
      st = compile_type(schema, type, path, &alt);
      if (!st.is_ok()) return st;
      n.alternatives.push_back(alt);
    }
    *out = add(std::move(n));
    return Status::ok();
  }

  Status count(const ojson& schema, const char* key, const std::string& path, int32_t* out) {
    auto v = schema.find(key);
    if (v == schema.end()) return Status::ok();
    if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() > (1 << 20))
      return fail(join(path, key), "expected a non-negative integer, got " + v->dump());
    *out = static_cast<int32_t>(v->get<int64_t>());
    return Status::ok();
  }

  Status compile_type(const ojson& schema, const std::string& type, const std::string& path, int32_t* out) {
    Status st;
    if (type == "string") {
      Node n;
      n.kind = NodeKind::kString;
      if (!(st = count(schema, "minLength", path, &n.min_count)).is_ok()) return st;
      if (!(st = count(schema, "maxLength", path, &n.max_count)).is_ok()) return st;
      if (n.max_count >= 0 && n.max_count < n.min_count)
        return fail(join(path, "maxLength"), "is below minLength");
      if (auto p = schema.find("pattern"); p != schema.end()) {
        if (!p->is_string()) return fail(join(path, "pattern"), "expected a regex string, got " + describe(*p));
        ByteDfa dfa;
        if (!(st = compile_regex(p->get<std::string>(), RegexMode::kSearch, RegexLimits{}, &dfa)).is_ok())
          return fail(join(path, "pattern"), st.message());
        n.dfa = static_cast<int32_t>(g_->dfas.size());
        g_->dfas.push_back(std::move(dfa));
      }
      *out = n.min_count == 0 && n.max_count < 0 && n.dfa < 0 ? g_->string_node : add(std::move(n));
      return Status::ok();
    }
    if (type == "number" || type == "integer") return compile_number(schema, type == "integer", path, out);
    if (type == "boolean") return literals({"true", "false"}, out);
    if (type == "null") return literals({"null"}, out);
    if (type == "array") return compile_array(schema, path, out);
    if (type == "object") return compile_object(schema, path, out);
    return fail(join(path, "type"), "unknown type \"" + type +
                                        "\" (expected object, array, string, number, integer, boolean or null)");
  }

  // A bound of a number schema: `key` as a number, or a draft-4 boolean exclusive flag.
  Status bound(const ojson& schema, const char* key, const std::string& path, std::optional<double>* out) {
    auto v = schema.find(key);
    if (v == schema.end() || v->is_boolean()) return Status::ok();
    if (!v->is_number()) return fail(join(path, key), "expected a number, got " + describe(*v));
    *out = v->get<double>();
    return Status::ok();
  }

  // Numbers and integers; with bounds, a regex over their digits (JSON's grammar has none).
  Status compile_number(const ojson& schema, bool integer, const std::string& path, int32_t* out) {
    std::optional<double> min, max, xmin, xmax;
    Status st;
    if (!(st = bound(schema, "minimum", path, &min)).is_ok()) return st;
    if (!(st = bound(schema, "maximum", path, &max)).is_ok()) return st;
    if (!(st = bound(schema, "exclusiveMinimum", path, &xmin)).is_ok()) return st;
    if (!(st = bound(schema, "exclusiveMaximum", path, &xmax)).is_ok()) return st;
    // Draft 4: "exclusiveMinimum": true makes minimum exclusive.
    if (schema.value("exclusiveMinimum", ojson()).is_boolean() && schema["exclusiveMinimum"].get<bool>()) std::swap(min, xmin);
    if (schema.value("exclusiveMaximum", ojson()).is_boolean() && schema["exclusiveMaximum"].get<bool>()) std::swap(max, xmax);
    if (!min && !max && !xmin && !xmax) {
      if (!integer) {
        *out = g_->number_node;
        return Status::ok();
      }
      Node n;
      n.kind = NodeKind::kNumber;
      n.integer = true;
      *out = add(std::move(n));
      return Status::ok();
    }
    const GrammarLimits& lim = g_->limits;
    // The largest magnitude the number grammar writes (max_int_digits digits).
    int64_t max_abs = 1;
    for (int32_t k = 0; k < lim.max_int_digits && k < 18; ++k) max_abs *= 10;
    max_abs -= 1;
    const double limit = static_cast<double>(max_abs);
    bool has_lo = false, has_hi = false;
    int64_t lo = -max_abs, hi = max_abs;
    std::string lo_key = "minimum", hi_key = "maximum";
    auto tighten_lo = [&](double v, bool exclusive, const char* key) {
      // The least allowed integer: ceil(v), one more when exclusive and v is whole.
      double c = std::ceil(v);
      if (exclusive && c == v) c += 1;
      if (c > limit) c = limit + 1;  // nothing fits: reported below
      if (c < -limit) return;        // below what can be written: no bound
      const auto b = static_cast<int64_t>(c);
      if (!has_lo || b > lo) {
        lo = b;
        lo_key = key;
      }
      has_lo = true;
    };
    auto tighten_hi = [&](double v, bool exclusive, const char* key) {
      double f = std::floor(v);
      if (exclusive && f == v) f -= 1;
      if (f < -limit) f = -limit - 1;
      if (f > limit) return;
      const auto b = static_cast<int64_t>(f);
      if (!has_hi || b < hi) {
        hi = b;
        hi_key = key;
      }
      has_hi = true;
    };
    if (!integer) {
      // A regex over digits holds exactly only whole, inclusive bounds on a number.
      for (const auto& [value, key] : {std::pair{xmin, "exclusiveMinimum"}, std::pair{xmax, "exclusiveMaximum"}})
        if (value)
          return fail(join(path, key), "is not enforced exactly on a number; use minimum / maximum with a whole "
                                       "number, or type integer");
      for (const auto& [value, key] : {std::pair{min, "minimum"}, std::pair{max, "maximum"}})
        if (value && (*value != std::floor(*value) || std::fabs(*value) > limit))
          return fail(join(path, key), "is enforced on a number only when it is a whole number of at most " +
                                           std::to_string(lim.max_int_digits) + " digits (got " + ojson(*value).dump() + ")");
    }
    if (min) tighten_lo(*min, false, "minimum");
    if (xmin) tighten_lo(*xmin, true, "exclusiveMinimum");
    if (max) tighten_hi(*max, false, "maximum");
    if (xmax) tighten_hi(*xmax, true, "exclusiveMaximum");
    if (has_lo && has_hi && lo > hi) return fail(join(path, hi_key), "leaves no " + std::string(integer ? "integer" : "number") + " above " + lo_key);
    if (has_lo && lo > max_abs) return fail(join(path, lo_key), "is above the largest number the grammar writes");
    if (has_hi && hi < -max_abs) return fail(join(path, hi_key), "is below the smallest number the grammar writes");
    const std::string pattern = integer ? integer_range_regex(has_lo ? lo : -max_abs, has_hi ? hi : max_abs)
                                        : number_range_regex(has_lo, lo, has_hi, hi, max_abs, lim.max_frac_digits);
    ByteDfa dfa;
    if (!(st = compile_regex(pattern, RegexMode::kFullMatch, RegexLimits{}, &dfa)).is_ok())
      return fail(path, "cannot enforce the bounds: " + st.message());
    Node n;
    n.kind = NodeKind::kRegex;
    n.dfa = static_cast<int32_t>(g_->dfas.size());
    g_->dfas.push_back(std::move(dfa));
    *out = add(std::move(n));
    return Status::ok();
  }

  Status compile_array(const ojson& schema, const std::string& path, int32_t* out) {
    if (schema.contains("prefixItems")) return fail(join(path, "prefixItems"), "is not supported");
    Node n;
    n.kind = NodeKind::kArray;
    Status st;
    if (!(st = count(schema, "minItems", path, &n.min_count)).is_ok()) return st;
    if (!(st = count(schema, "maxItems", path, &n.max_count)).is_ok()) return st;
    if (n.max_count >= 0 && n.max_count < n.min_count) return fail(join(path, "maxItems"), "is below minItems");
    if (auto items = schema.find("items"); items != schema.end()) {
      if (items->is_array()) return fail(join(path, "items"), "a list of schemas (tuple) is not supported");
      int32_t elem = -1;
      if (!(st = compile(*items, join(path, "items"), &elem)).is_ok()) return st;
      n.element = elem;
    }
    if (n.element < 0 && n.min_count == 0 && n.max_count < 0) {
      *out = g_->generic_array_node;
      return Status::ok();
    }
    *out = add(std::move(n));
    return Status::ok();
  }

  Status compile_object(const ojson& schema, const std::string& path, int32_t* out) {
    std::set<std::string> required;
    if (auto req = schema.find("required"); req != schema.end()) {
      if (!req->is_array()) return fail(join(path, "required"), "expected a list of names, got " + describe(*req));
      for (const auto& r : *req) {
        if (!r.is_string()) return fail(join(path, "required"), "expected a list of names, got " + describe(r));
        required.insert(r.get<std::string>());
      }
    }
    bool additional = true;
    const ojson* additional_schema = nullptr;
    if (auto ap = schema.find("additionalProperties"); ap != schema.end()) {
      if (ap->is_boolean()) additional = ap->get<bool>();
      else if (ap->is_object()) additional_schema = &*ap;
      else return fail(join(path, "additionalProperties"), "expected a boolean or a schema, got " + describe(*ap));
    }
    Node n;
    n.kind = NodeKind::kObject;
    Status st;
    std::set<std::string> named;
    if (auto props = schema.find("properties"); props != schema.end()) {
      if (!props->is_object()) return fail(join(path, "properties"), "expected an object, got " + describe(*props));
      if (props->size() > kMaxProperties)
        return fail(join(path, "properties"), "more than " + std::to_string(kMaxProperties) + " properties");
      for (const auto& [key, sub] : props->items()) {
        Property p;
        p.key = ojson(key).dump();
        p.required = required.count(key) > 0;
        if (!(st = compile(sub, join(join(path, "properties"), key), &p.value)).is_ok()) return st;
        n.properties.push_back(std::move(p));
        named.insert(key);
      }
    }
    for (const auto& r : required) {
      if (named.count(r)) continue;
      if (!additional) return fail(join(path, "required"), "\"" + r + "\" is required but not allowed by properties");
      // Required but not described: any value (or the additionalProperties schema's).
      Property p;
      p.key = ojson(r).dump();
      p.required = true;
      p.value = g_->any_node;
      if (additional_schema && !(st = compile(*additional_schema, join(path, "additionalProperties"), &p.value)).is_ok())
        return st;
      n.properties.push_back(std::move(p));
    }
    if (n.properties.empty() && additional) {
      // No named properties: any keys, values of the additionalProperties schema (or any).
      if (!additional_schema) {
        *out = g_->generic_object_node;
        return Status::ok();
      }
      n.generic = true;
      if (!(st = compile(*additional_schema, join(path, "additionalProperties"), &n.element)).is_ok()) return st;
    }
    *out = add(std::move(n));
    return Status::ok();
  }

  const ojson& root_;
  Grammar* g_;
  std::map<std::string, int32_t> refs_;
  int depth_ = 0;
};

}  // namespace

Status compile_json_schema(const ojson& schema, const GrammarLimits& limits, Grammar* out) {
  *out = Grammar{};
  out->limits = limits;
  add_builtins(out);
  SchemaCompiler c(schema, out);
  return c.compile(schema, "", &out->root);
}

Status compile_json_object(const GrammarLimits& limits, Grammar* out) {
  *out = Grammar{};
  out->limits = limits;
  add_builtins(out);
  out->root = out->generic_object_node;
  return Status::ok();
}

std::vector<bool> nullable_nodes(const Grammar& g) {
  std::vector<bool> nullable(g.nodes.size(), false);
  // A fixpoint: cycles (recursive rules, $ref) start from "not nullable".
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      if (nullable[i]) continue;
      const Node& n = g.nodes[i];
      bool v = false;
      switch (n.kind) {
        case NodeKind::kLiterals:
          for (const auto& l : n.literals) v = v || l.empty();
          break;
        case NodeKind::kAnyOf:
          for (int32_t a : n.alternatives) v = v || nullable[static_cast<size_t>(a)];
          break;
        case NodeKind::kSequence:
          v = true;
          for (const auto& item : n.items)
            if (item.node < 0 ? !item.literal.empty() : !nullable[static_cast<size_t>(item.node)]) v = false;
          break;
        case NodeKind::kRepeat: v = n.min_count == 0 || nullable[static_cast<size_t>(n.element)]; break;
        case NodeKind::kFreeText: v = true; break;
        case NodeKind::kRegex: v = g.dfas[static_cast<size_t>(n.dfa)].accepting(0); break;
        default: break;
      }
      if (v) nullable[i] = changed = true;
    }
  }
  return nullable;
}

Status compile_regex_output(std::string_view pattern, const GrammarLimits& limits, Grammar* out) {
  *out = Grammar{};
  out->limits = limits;
  ByteDfa dfa;
  Status st = compile_regex(pattern, RegexMode::kFullMatch, RegexLimits{}, &dfa);
  if (!st.is_ok()) return st;
  Node n;
  n.kind = NodeKind::kRegex;
  n.dfa = 0;
  out->dfas.push_back(std::move(dfa));
  out->nodes.push_back(std::move(n));
  out->root = 0;
  return Status::ok();
}

Status compile_tool_calls(const ojson& spec, const GrammarLimits& limits, Grammar* out) {
  *out = Grammar{};
  out->limits = limits;
  add_builtins(out);
  if (!spec.is_object()) return fail("", "expected an object, got " + describe(spec));
  auto text = [&](const char* key, std::string* value) {
    auto v = spec.find(key);
    if (v == spec.end() || !v->is_string()) return false;
    *value = v->get<std::string>();
    return true;
  };
  std::string begin, end, separator;
  if (!text("begin", &begin) || begin.empty()) return fail("begin", "expected a non-empty string");
  if (!text("end", &end)) return fail("end", "expected a string");
  if (!text("separator", &separator)) separator = "\n";
  auto tools = spec.find("tools");
  if (tools == spec.end() || !tools->is_array() || tools->empty()) return fail("tools", "expected a non-empty list");
  auto add = [&](Node n) {
    out->nodes.push_back(std::move(n));
    return static_cast<int32_t>(out->nodes.size() - 1);
  };
  Node calls;
  calls.kind = NodeKind::kAnyOf;
  for (size_t i = 0; i < tools->size(); ++i) {
    const ojson& tool = (*tools)[i];
    const std::string path = "tools[" + std::to_string(i) + "]";
    if (!tool.is_object() || !tool.contains("name") || !tool["name"].is_string())
      return fail(path + ".name", "expected a string");
    Node name;
    name.kind = NodeKind::kLiterals;
    name.literals = {ojson(tool["name"].get<std::string>()).dump()};
    int32_t args = out->generic_object_node;
    if (auto params = tool.find("parameters"); params != tool.end() && !params->is_null()) {
      SchemaCompiler c(*params, out);
      Status st = c.compile(*params, path + ".parameters", &args);
      if (!st.is_ok()) return st;
    }
    Node call;
    call.kind = NodeKind::kObject;
    call.properties = {{"\"name\"", add(std::move(name)), true}, {"\"arguments\"", args, true}};
    calls.alternatives.push_back(add(std::move(call)));
  }
  Node block;
  block.kind = NodeKind::kSequence;
  block.items = {{begin, -1}, {"", add(std::move(calls))}, {end, -1}};
  Node repeat;
  repeat.kind = NodeKind::kRepeat;
  repeat.element = add(std::move(block));
  repeat.min_count = 1;
  repeat.max_count = spec.value("parallel", false) ? -1 : 1;
  repeat.literal = separator;
  const int32_t calls_root = add(std::move(repeat));
  if (!spec.value("allow_text", false)) {
    out->root = calls_root;
    return Status::ok();
  }
  Node free_text;
  free_text.kind = NodeKind::kFreeText;
  free_text.literal = begin;
  Node either;
  either.kind = NodeKind::kAnyOf;
  either.alternatives = {add(std::move(free_text)), calls_root};
  out->root = add(std::move(either));
  return Status::ok();
}

}  // namespace tessera::json_constraint
