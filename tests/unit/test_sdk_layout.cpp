// The SDK's layout lock: what a minor ABI version may change in the structs that cross the
// plugin seam, checked against the layouts recorded in sdk/abi.layout.
//
// sdk_abi_lock (sdk/cmake/abi_lock.cmake) fails when a header changes without a version
// change; this test decides whether the version change was big enough. A plugin of ABI 2.m
// runs in a host of 2.n for every m <= n, so within one major version:
//   - "frozen" structs keep their size and alignment. They are stored in containers, spans,
//     optionals or other structs, returned by value, or built by the plugin and read by the
//     host, so a host and a plugin that disagree on their size corrupt memory.
//   - "append" structs may grow at their end: each recorded field keeps its offset, alignment
//     stays. They go singly, by reference, from the host to the plugin (an older plugin reads
//     the prefix it knows), or carry their own size where the plugin builds them
//     (PluginManifest: header.manifest_size; ParamSpec: PluginManifest::param_spec_size).
//   - "local" structs never cross the seam (a header-only helper's own state): not checked.
// A new struct in a public header must be listed below (the test scans the headers for them).
// Changing a frozen struct, or inserting into an append struct, needs TESSERA_SDK_ABI_MAJOR.
//
// After a version bump: `cmake --build build --target tessera-sdk-layout` runs this test with
// TESSERA_SDK_LAYOUT_WRITE=1, which checks the change against the record first and then
// rewrites sdk/abi.layout (a record of an older major is replaced without checks).
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_env.h"
#include "tessera/sdk.h"
#include "tessera/sdk/host_model_drafter.h"

// offsetof on structs with std::string members is conditionally supported; GCC and Clang give
// the member's offset, which is exactly what is recorded.
#pragma GCC diagnostic ignored "-Winvalid-offsetof"

namespace {

using namespace tessera;

struct FieldLayout {
  std::string name;
  size_t offset = 0;
};

struct StructLayout {
  std::string name;
  std::string rule;  // frozen | append | local
  size_t size = 0;
  size_t align = 0;
  std::vector<FieldLayout> fields;  // append structs only
};

#define FROZEN(T) StructLayout{#T, "frozen", sizeof(T), alignof(T), {}}
#define LOCAL(T) StructLayout{#T, "local", sizeof(T), alignof(T), {}}
#define FIELD(T, f) FieldLayout{#f, offsetof(T, f)}
#define APPEND(T, ...) StructLayout{#T, "append", sizeof(T), alignof(T), {__VA_ARGS__}}

// Every struct of the public headers outside tessera/sdk/kernels (whose structs are linked into
// the plugin and never cross the seam; kernels/version.h versions them apart).
std::vector<StructLayout> current_layouts() {
  return {
      // append: host -> plugin, singly, by const reference.
      APPEND(AttentionShape, FIELD(AttentionShape, num_heads), FIELD(AttentionShape, num_kv_heads),
             FIELD(AttentionShape, head_dim), FIELD(AttentionShape, scale),
             FIELD(AttentionShape, block_size), FIELD(AttentionShape, k_dtype),
             FIELD(AttentionShape, v_dtype), FIELD(AttentionShape, sliding_window)),
      APPEND(KvModelShape, FIELD(KvModelShape, num_layers), FIELD(KvModelShape, num_kv_heads),
             FIELD(KvModelShape, head_dim), FIELD(KvModelShape, max_context),
             FIELD(KvModelShape, max_num_seqs)),
      APPEND(RouteRequest, FIELD(RouteRequest, request_id), FIELD(RouteRequest, prompt),
             FIELD(RouteRequest, tokens), FIELD(RouteRequest, user), FIELD(RouteRequest, embedding),
             FIELD(RouteRequest, candidates)),
      APPEND(CacheKey, FIELD(CacheKey, model), FIELD(CacheKey, prompt), FIELD(CacheKey, params),
             FIELD(CacheKey, reproducible), FIELD(CacheKey, embedding), FIELD(CacheKey, tenant)),
      APPEND(SamplingInput, FIELD(SamplingInput, params), FIELD(SamplingInput, history)),
      APPEND(RemotePrefillRequest, FIELD(RemotePrefillRequest, request_id),
             FIELD(RemotePrefillRequest, prompt), FIELD(RemotePrefillRequest, params),
             FIELD(RemotePrefillRequest, want_kv), FIELD(RemotePrefillRequest, fingerprint),
             FIELD(RemotePrefillRequest, timeout_seconds)),
      APPEND(RemoteGenerateRequest, FIELD(RemoteGenerateRequest, request_id),
             FIELD(RemoteGenerateRequest, prompt), FIELD(RemoteGenerateRequest, params),
             FIELD(RemoteGenerateRequest, n), FIELD(RemoteGenerateRequest, prompt_logprobs),
             FIELD(RemoteGenerateRequest, fingerprint), FIELD(RemoteGenerateRequest, timeout_seconds)),
      APPEND(ForwardModelView, FIELD(ForwardModelView, vocab_size),
             FIELD(ForwardModelView, embedding_dim), FIELD(ForwardModelView, num_layers),
             FIELD(ForwardModelView, num_heads), FIELD(ForwardModelView, num_kv_heads),
             FIELD(ForwardModelView, head_dim), FIELD(ForwardModelView, ffn_dim),
             FIELD(ForwardModelView, rms_eps), FIELD(ForwardModelView, rope),
             FIELD(ForwardModelView, token_embd), FIELD(ForwardModelView, output),
             FIELD(ForwardModelView, output_norm), FIELD(ForwardModelView, layers)),
      APPEND(PluginContext, FIELD(PluginContext, logger), FIELD(PluginContext, config_file),
             FIELD(PluginContext, models)),
      // append, with their own size: built by the plugin, read by the host.
      APPEND(PluginManifest, FIELD(PluginManifest, header), FIELD(PluginManifest, kind),
             FIELD(PluginManifest, name), FIELD(PluginManifest, version),
             FIELD(PluginManifest, description), FIELD(PluginManifest, status),
             FIELD(PluginManifest, params), FIELD(PluginManifest, num_params),
             FIELD(PluginManifest, create), FIELD(PluginManifest, destroy),
             FIELD(PluginManifest, capabilities), FIELD(PluginManifest, needs),
             FIELD(PluginManifest, param_spec_size)),
      APPEND(ParamSpec, FIELD(ParamSpec, name), FIELD(ParamSpec, type),
             FIELD(ParamSpec, default_value), FIELD(ParamSpec, description),
             FIELD(ParamSpec, min_value), FIELD(ParamSpec, max_value), FIELD(ParamSpec, choices),
             FIELD(ParamSpec, optional)),
      // frozen: the manifest header is read before the version is known.
      FROZEN(PluginManifestHeader),
      // frozen: in containers, spans or optionals, members of other structs, returned by value,
      // or built by the plugin for the host.
      FROZEN(AttentionSequence), FROZEN(AttentionBatch), FROZEN(RopeParams),
      FROZEN(CachedResponse), FROZEN(CacheMetric), FROZEN(ConstraintVocabulary),
      FROZEN(ConstraintSpec), FROZEN(Draft), FROZEN(DraftRequest), FROZEN(ForwardSequence),
      FROZEN(ForwardModelView::Layer), FROZEN(KvLayout), FROZEN(KvDtypes), FROZEN(BlockCopy),
      FROZEN(KvStats), FROZEN(PrefillResult), FROZEN(RemoteEvent), FROZEN(RouteCandidate), FROZEN(HostModelRequest),
      FROZEN(TargetLayersRequest), FROZEN(WeightView), FROZEN(MatmulTarget), FROZEN(RouterMetric),
      FROZEN(SamplerState), FROZEN(TokenLogprob), FROZEN(SampledToken), FROZEN(DraftView),
      FROZEN(ScheduledSequence), FROZEN(RejectedSequence), FROZEN(SchedulePlan),
      FROZEN(SamplingParams), FROZEN(SequenceInfo), FROZEN(KvBlockQ8_0),
      // local: HostModelDrafter's own state, compiled into the drafter plugin that uses it.
      LOCAL(HostModelDraftSequence), LOCAL(HostModelDraftJob),
  };
}

std::string version_text() {
  return std::to_string(kSdkAbiMajor) + "." + std::to_string(kSdkAbiMinor);
}

std::string format_line(const StructLayout& s) {
  std::ostringstream out;
  out << "struct " << s.name << " " << s.rule << " " << s.size << " " << s.align;
  for (const FieldLayout& f : s.fields) out << " " << f.name << "@" << f.offset;
  return out.str();
}

struct Record {
  uint32_t major = 0, minor = 0;
  std::map<std::string, StructLayout> structs;
};

Record read_record(const std::filesystem::path& path) {
  Record record;
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot read " << path.string());
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream words(line);
    std::string tag;
    words >> tag;
    if (tag == "version") {
      char dot = 0;
      words >> record.major >> dot >> record.minor;
    } else if (tag == "struct") {
      StructLayout s;
      words >> s.name >> s.rule >> s.size >> s.align;
      for (std::string field; words >> field;) {
        const size_t at = field.find('@');
        REQUIRE_MESSAGE(at != std::string::npos, "bad field '" << field << "' in " << path.string());
        s.fields.push_back({field.substr(0, at), std::stoul(field.substr(at + 1))});
      }
      record.structs[s.name] = s;
    }
  }
  return record;
}

// Struct definitions in the public headers outside kernels/, by their own (unqualified) name.
std::set<std::string> structs_in_headers() {
  const std::filesystem::path dir = test::source_dir() / "sdk/include/tessera";
  const std::regex definition(R"(^\s*struct\s+(\w+)\s*(final\s*)?(:[^{;]*)?\{)");
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (entry.path().extension() != ".h") continue;
    if (entry.path().string().find("/sdk/kernels/") != std::string::npos) continue;
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (std::regex_search(line, m, definition)) names.insert(m[1]);
    }
  }
  return names;
}

std::string unqualified(const std::string& name) {
  const size_t colon = name.rfind("::");
  return colon == std::string::npos ? name : name.substr(colon + 2);
}

// What changed from `old` to `now` that a minor version may not change; empty when allowed.
std::vector<std::string> minor_violations(const StructLayout& old, const StructLayout& now) {
  std::vector<std::string> out;
  if (old.rule == "local" || now.rule == "local") return out;
  if (now.rule != old.rule)
    out.push_back(now.name + ": rule changed from " + old.rule + " to " + now.rule);
  if (now.align != old.align)
    out.push_back(now.name + ": alignment " + std::to_string(old.align) + " -> " + std::to_string(now.align));
  if (old.rule == "frozen" && now.size != old.size)
    out.push_back(now.name + " is frozen (passed by value or in containers across the seam): size " +
                  std::to_string(old.size) + " -> " + std::to_string(now.size));
  if (old.rule == "append") {
    if (now.size < old.size)
      out.push_back(now.name + " shrank: size " + std::to_string(old.size) + " -> " + std::to_string(now.size));
    for (const FieldLayout& f : old.fields) {
      bool found = false;
      for (const FieldLayout& g : now.fields) {
        if (g.name != f.name) continue;
        found = true;
        if (g.offset != f.offset)
          out.push_back(now.name + "::" + f.name + " moved from offset " + std::to_string(f.offset) +
                        " to " + std::to_string(g.offset) + " (fields may only be appended)");
      }
      if (!found) out.push_back(now.name + "::" + f.name + " was removed or renamed");
    }
  }
  return out;
}

}  // namespace

TEST_CASE("every struct of the public SDK headers has a layout rule") {
  std::set<std::string> listed;
  for (const StructLayout& s : current_layouts()) listed.insert(unqualified(s.name));
  for (const std::string& name : structs_in_headers())
    CHECK_MESSAGE(listed.count(name) == 1,
                  "struct " << name << " is in sdk/include but not in tests/unit/test_sdk_layout.cpp: "
                            "list it as FROZEN, APPEND (with its fields) or LOCAL");
}

TEST_CASE("sdk/abi.layout: within a major version, frozen structs keep their layout and append structs only grow") {
  const std::filesystem::path path = test::source_dir() / "sdk/abi.layout";
  const Record record = read_record(path);
  const std::vector<StructLayout> now = current_layouts();
  const bool write = std::getenv("TESSERA_SDK_LAYOUT_WRITE") != nullptr;
  INFO("recorded ABI " << record.major << "." << record.minor << ", headers at " << version_text());

  REQUIRE_MESSAGE(!(record.major > kSdkAbiMajor ||
                    (record.major == kSdkAbiMajor && record.minor > kSdkAbiMinor)),
                  "sdk/abi.layout records a newer ABI than sdk/include/tessera/sdk/abi.h");

  std::vector<std::string> violations;
  if (record.major == kSdkAbiMajor) {
    for (const StructLayout& s : now) {
      auto it = record.structs.find(s.name);
      if (it == record.structs.end()) continue;  // new in this version
      if (record.minor == kSdkAbiMinor) {
        if (format_line(it->second) != format_line(s))
          violations.push_back(s.name + " changed without a version change: recorded '" +
                               format_line(it->second) + "', now '" + format_line(s) + "'");
      } else {
        for (std::string& v : minor_violations(it->second, s)) violations.push_back(std::move(v));
      }
    }
    for (const auto& [name, old] : record.structs) {
      bool present = false;
      for (const StructLayout& s : now) present = present || s.name == name;
      if (!present && old.rule != "local")
        violations.push_back(name + " was removed (recorded as " + old.rule + ")");
    }
  }
  for (const std::string& v : violations)
    FAIL_CHECK(v << " -- this needs TESSERA_SDK_ABI_MAJOR bumped (a minor version only appends)");
  if (!violations.empty()) return;

  if (write) {
    std::ofstream out(path, std::ios::trunc);
    out << "# Layouts of the SDK's structs at this ABI version (tests/unit/test_sdk_layout.cpp; rewritten by\n"
           "# the tessera-sdk-layout target). struct <name> <frozen|append|local> <sizeof> <alignof> [field@offset...]\n";
    out << "version " << version_text() << "\n";
    for (const StructLayout& s : now) out << format_line(s) << "\n";
    REQUIRE(out.good());
    MESSAGE("wrote " << path.string() << " for ABI " << version_text());
    return;
  }
  // A compatible change under a newer version still has to be recorded, so that the next
  // version is checked against this one and new structs have a baseline.
  const bool recorded_current = record.major == kSdkAbiMajor && record.minor == kSdkAbiMinor;
  CHECK_MESSAGE(recorded_current,
                "the layout change is compatible with ABI " << version_text()
                    << "; record it: cmake --build build --target tessera-sdk-layout");
  for (const StructLayout& s : now)
    CHECK_MESSAGE(record.structs.count(s.name) == 1,
                  s.name << " has no recorded layout; record it: cmake --build build --target tessera-sdk-layout");
}

TEST_CASE("minor_violations: an inserted field, a grown frozen struct and a shrunk append struct are refused") {
  const StructLayout old_append{"S", "append", 16, 8, {{"a", 0}, {"b", 8}}};
  StructLayout appended = old_append;
  appended.size = 24;
  appended.fields.push_back({"c", 16});
  CHECK(minor_violations(old_append, appended).empty());

  StructLayout inserted{"S", "append", 24, 8, {{"a", 0}, {"c", 8}, {"b", 16}}};
  auto v = minor_violations(old_append, inserted);
  REQUIRE(v.size() == 1);
  CHECK(v[0] == "S::b moved from offset 8 to 16 (fields may only be appended)");

  StructLayout shrunk{"S", "append", 8, 8, {{"a", 0}}};
  v = minor_violations(old_append, shrunk);
  REQUIRE(v.size() == 2);
  CHECK(v[0] == "S shrank: size 16 -> 8");
  CHECK(v[1] == "S::b was removed or renamed");

  const StructLayout frozen{"F", "frozen", 48, 8, {}};
  StructLayout grown = frozen;
  grown.size = 56;
  v = minor_violations(frozen, grown);
  REQUIRE(v.size() == 1);
  CHECK(v[0] == "F is frozen (passed by value or in containers across the seam): size 48 -> 56");

  const StructLayout local{"L", "local", 8, 8, {}};
  StructLayout local_grown = local;
  local_grown.size = 64;
  CHECK(minor_violations(local, local_grown).empty());
}
