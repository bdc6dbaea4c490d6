// Stack configuration: one YAML file (optionally `extends:` a base file) describing the model,
// the engine's plugin slots, the gateway and the server. Every key is validated against the
// plugin schemas before anything runs; all errors are gathered and reported together as
// `file:line:col: key.path: message`.
#pragma once

#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tessera/plugin_registry.h"
#include "tessera/sdk/params.h"
#include "tessera/sdk/plugin.h"

namespace tessera {

struct ConfigIssue {
  std::string file;
  int line = 0;    // 1-based; 0 when unknown
  int column = 0;  // 1-based
  std::string key_path;  // e.g. "engine.scheduler.max_num_seqs"
  std::string message;   // e.g. "expected a positive integer, got \"abc\""
  std::string to_string() const;  // "file:line:col: key_path: message"
};

class ConfigError : public std::runtime_error {
 public:
  explicit ConfigError(std::vector<ConfigIssue> issues);
  const std::vector<ConfigIssue>& issues() const { return issues_; }

 private:
  std::vector<ConfigIssue> issues_;
};

// One plugin slot: `{plugin: NAME, ...params}` validated against NAME's schema.
struct PluginSlot {
  std::string plugin;
  PluginConfig config;      // typed values with defaults filled in
  std::string file;         // the YAML file that set the slot (for messages)
};

struct ModelConfig {
  std::string path;         // a model name from the model cache or a .gguf file path
  std::string name;         // served model id; defaults to the file stem
  int threads = 0;          // 0: all hardware threads
  int context_length = 0;   // 0: the model's, capped at 4096
};

// `server.defaults`: sampling parameters a request gets when it omits them (each unset key
// keeps the OpenAI default). Same ranges and meaning as the request fields (docs/server.md).
struct RequestDefaults {
  std::optional<double> temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty;
  std::optional<int> top_k, max_tokens;
};

// The `server:` section (`tessera serve`). Sizes in bytes, durations in seconds.
struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8080;                       // 0: any free port (the bound one is printed)
  std::vector<std::string> api_keys;     // empty: no authentication
  int64_t max_body_bytes = 1 << 20;      // larger request bodies get 413
  int64_t max_header_bytes = 16 << 10;   // larger request headers get 431
  double header_timeout = 10;            // a request's headers must arrive within this
  double read_timeout = 30;              // the body must arrive within this
  double idle_timeout = 60;              // a keep-alive connection may wait this long
  double write_timeout = 30;             // a client must accept each write within this
  int max_queued_requests = 256;         // requests held at once (running + waiting); more get 429
  // After shutdown_timeout, cancelled requests get this long to end by themselves (a request
  // ends at its engine step's end); responses still open then are ended as aborted.
  double shutdown_grace = 10;
  double shutdown_timeout = 10;          // on SIGTERM/SIGINT, in-flight requests get this long
  RequestDefaults defaults;              // server.defaults
};

// `disaggregation:` — prefill/decode disaggregation (docs/disaggregation.md). A `prefill`
// engine serves remote prefills over its kv_connector at `listen`; a `decode` deployment
// prefills each request at one of `prefill` (tried in order, then on itself) and receives
// the prompt's KV before decoding; `both` (the default) is an ordinary colocated engine.
struct DisaggregationConfig {
  std::string role = "both";           // both | prefill | decode
  std::optional<PluginSlot> connector; // required for prefill and decode
  std::string listen;                  // prefill: host:port (port 0: any free one)
  std::vector<std::string> prefill;    // decode: the prefill engines' host:port
  double transfer_timeout = 30;        // decode: a remote prefill and its transfer, at most
  bool pipelined_start = true;         // decode: start decoding before the last KV layer lands
  double layer_wait = 2;               // decode: a pipelined step waits this long per layer
};

// `replicas:` — several engine processes serve one deployment (docs/replicas.md). An engine
// process serves its engine to gateways at `listen`; a gateway spreads the deployment's
// requests over `endpoints` (and its own engine when `local`), chosen by `router`.
struct ReplicasConfig {
  std::optional<PluginSlot> connector;  // the transport (a kv_connector plugin); required
  std::string listen;                   // engine process: HOST:PORT (port 0: any free one)
  std::vector<std::string> endpoints;   // gateway: the other engine processes' HOST:PORT
  bool local = true;                    // gateway: this process's engine serves requests too
  std::optional<PluginSlot> router;     // gateway: picks a replica (default prefix-affinity)
  double health_interval = 1.0;         // gateway: seconds between health probes of a replica
  double timeout = 600;                 // gateway: one remote request at most
  int max_concurrent = 64;              // gateway: remote requests in flight (a thread each)
  bool enabled() const { return connector.has_value(); }
};

// One deployment: a model and its engine plugins, served under `name` (the `model` field
// clients send).
struct DeploymentConfig {
  std::string name;
  ModelConfig model;                                // model.name == name
  std::map<PluginKind, PluginSlot> engine;          // every engine kind present, defaults filled
  DisaggregationConfig disaggregation;
  ReplicasConfig replicas;
};

// `embedding:` — the sentence-embedding model the gateway runs itself (POST /v1/embeddings,
// the semantic cache layer). A model directory (safetensors + tokenizer.json), not a GGUF.
struct EmbeddingConfig {
  ModelConfig model;        // path: a directory or a name in the model cache ("all-MiniLM-L6-v2")
  int max_inputs = 256;     // most inputs one /v1/embeddings request may carry
};

struct StackConfig {
  std::string file;                                 // the file loaded (after extends)
  std::vector<std::string> plugin_paths;
  // The first (default) deployment's model and engine: what the single-model commands
  // (generate, chat, bench, eval) run. Equal to deployments[0] after loading.
  ModelConfig model;
  std::map<PluginKind, PluginSlot> engine;
  // Every deployment, in file order: the one of `model:`/`engine:`, or those of `deployments:`.
  std::vector<DeploymentConfig> deployments;
  std::vector<PluginSlot> cache_layers;             // gateway.cache, in order
  std::optional<PluginSlot> router;                 // gateway.router
  std::string router_name;                          // gateway.router.name: the model id clients send
  std::optional<EmbeddingConfig> embedding;         // `embedding:`; absent: no embedding model
  ServerConfig server;
};

// `config` with its model and engine replaced by deployment `index`'s (for build_engine).
StackConfig deployment_stack(const StackConfig& config, size_t index);

// The plugin each engine slot uses when the file does not name one.
// nullptr: slot off by default (drafter). The constraint slot defaults to json-schema when
// that plugin is installed and is off otherwise.
const char* default_engine_plugin(PluginKind kind);

// Loads, merges `extends:` chains (a child's maps merge into the base's, other values
// replace), scans `plugin_paths:` into the registry, and validates everything. Throws
// ConfigError listing every problem found.
StackConfig load_stack_config(const std::string& path, PluginRegistry& registry);

// Validates params of one plugin from a YAML mapping text (tests, CLI overrides).
PluginConfig validate_plugin_params(const PluginManifest& manifest, const std::string& key_path,
                                    const std::string& yaml_text);

// What a parameter accepts, as used in messages and `tessera plugins`: "an integer >= 1",
// "a size in [1MiB, 1GiB] (e.g. ...)", "one of: f16, f32".
std::string describe_param_expectation(const ParamSpec& spec);
// A validated value as text in the parameter's own syntax (sizes as 256MiB, durations as 10s).
std::string format_param_value(const ParamSpec& spec, const ParamValue& value);

// Where models are cached: $TESSERA_MODEL_DIR or ~/.cache/tessera/models.
std::string model_cache_dir();
// Resolves a ModelConfig::path: an existing file as is, else <cache>/<name> or
// <cache>/<name>.gguf, or a known alias (e.g. "smollm2-135m-instruct-q4_1"). Throws
// std::runtime_error saying how to fetch the model when not found.
std::string resolve_model_path(const std::string& path_or_name);
// Same, but a relative file path is tried relative to `config_dir` (the directory of the
// config file that named it) before the working directory.
std::string resolve_model_path(const std::string& path_or_name, const std::string& config_dir);
// The same for a model that is a directory (the embedding model): an existing directory as
// is, else <cache>/<name> (case-insensitive). Throws naming the places looked in.
std::string resolve_model_dir(const std::string& path_or_name, const std::string& config_dir);

}  // namespace tessera
