#include "tessera/gateway/gateway.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include "tessera/embedding/encoder_model.h"
#include "tessera/stack.h"

namespace tessera {
namespace {

std::string escape_label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}


// One sample of a plugin's metric, HELP/TYPE written the first time its family appears.
template <class Metric>
void render_plugin_metric(const Metric& m, const std::string& owner_label, std::vector<std::string>* seen,
                          std::string* out) {
  if (std::find(seen->begin(), seen->end(), m.name) == seen->end()) {
    seen->push_back(m.name);
    *out += "# HELP " + m.name + " " + m.help + "\n# TYPE " + m.name + " " + (m.is_counter ? "counter" : "gauge") +
            "\n";
  }
  std::string labels = owner_label;
  for (const auto& [k, v] : m.labels) labels += "," + k + "=\"" + escape_label(v) + "\"";
  char value[40];
  std::snprintf(value, sizeof value, "%.9g", m.value);
  *out += m.name + "{" + labels + "} " + value + "\n";
}

}  // namespace

std::unique_ptr<Gateway> Gateway::build(const StackConfig& config, PluginRegistry& registry,
                                        const ProgressFn& progress) {
  std::unique_ptr<Gateway> g(new Gateway());
  std::vector<std::string> names;
  for (size_t i = 0; i < config.deployments.size(); ++i) {
    const std::string& name = config.deployments[i].name;
    Model::ProgressFn p;
    if (progress) p = [&progress, &name](size_t done, size_t total) { progress(name, done, total); };
    g->engines_.push_back(build_engine(deployment_stack(config, i), registry, p));
    names.push_back(name);
  }
  if (config.embedding) {
    const std::string dir = resolve_model_dir(config.embedding->model.path, "");
    g->embedding_ = EncoderModel::load(dir, config.embedding->model.threads);
    g->embed_worker_ = std::make_unique<CacheWorkers>(1);
  }
  for (size_t i = 0; i < config.cache_layers.size(); ++i) {
    const PluginSlot& slot = config.cache_layers[i];
    PluginContext context{&host_logger(), slot.file};
    g->cache_layers_.push_back({slot.plugin, registry.create<CacheLayer>(slot.plugin, slot.config, context)});
    if (g->cache_layers_.back().layer->needs_embedding() && !g->embedding_)
      throw std::runtime_error("gateway.cache[" + std::to_string(i) + "] (" + slot.plugin +
                               "): needs an embedding model; add `embedding: {model: {path: all-MiniLM-L6-v2}}` "
                               "(scripts/fetch-models.sh fetches it)");
  }
  if (config.router) {
    PluginContext context{&host_logger(), config.router->file};
    g->router_ = registry.create<Router>(config.router->plugin, config.router->config, context);
    g->router_name_ = config.router_name;
    if (Status st = g->router_->configure(names); !st.is_ok())
      throw std::runtime_error("gateway.router: " + st.message());
    if (g->router_->needs_embedding() && !g->embedding_)
      throw std::runtime_error("gateway.router (" + config.router->plugin +
                               "): needs an embedding model; add `embedding: {model: {path: all-MiniLM-L6-v2}}` "
                               "(scripts/fetch-models.sh fetches it)");
  }
  std::vector<std::shared_ptr<Deployment>> bases(names.size());
  for (size_t i = 0; i < config.deployments.size(); ++i) {
    const DisaggregationConfig& dis = config.deployments[i].disaggregation;
    if (dis.role == "both" || !dis.connector) continue;
    const std::string where = "deployments." + names[i] + ".disaggregation";
    PluginContext context{&host_logger(), dis.connector->file};
    std::shared_ptr<KvConnector> connector =
        registry.create<KvConnector>(dis.connector->plugin, dis.connector->config, context);
    g->connectors_.push_back(connector);
    if (dis.role == "prefill") {
      g->prefill_hosts_.push_back(std::make_unique<EnginePrefillHost>(*g->engines_[i]));
      std::string bound;
      if (Status st = connector->serve(dis.listen, g->prefill_hosts_.back().get(), &bound); !st.is_ok())
        throw std::runtime_error(where + ".listen: " + st.message());
      g->prefill_endpoints_.push_back(names[i] + " " + bound);
    } else {
      auto d = std::make_shared<DisaggregatedDeployment>(
          names[i], *g->engines_[i], connector, dis.prefill, dis.transfer_timeout,
          KvImport::Options{dis.pipelined_start, dis.layer_wait});
      std::vector<std::string> warnings;
      if (Status st = d->check_prefill_engines(&warnings); !st.is_ok()) throw std::runtime_error(where + ": " + st.message());
      for (const std::string& w : warnings)
        host_logger().log(LogLevel::kWarn, where + ": " + w + " (requests fall back to the next prefill engine, "
                                                      "then to this engine, until it answers)");
      g->decode_deployments_.push_back(d);
      bases[i] = d;
    }
  }
  for (size_t i = 0; i < config.deployments.size(); ++i) {
    const ReplicasConfig& rep = config.deployments[i].replicas;
    if (!rep.enabled()) continue;
    const std::string where = "deployments." + names[i] + ".replicas";
    PluginContext context{&host_logger(), rep.connector->file};
    if (!rep.listen.empty()) {
      // Gateways get the engine (or the disaggregated decode deployment) itself: their own
      // cache layers and router already ran.
      std::shared_ptr<Deployment> served = bases[i] ? bases[i] : std::make_shared<EngineDeployment>(names[i], *g->engines_[i]);
      if (!bases[i]) bases[i] = served;
      std::shared_ptr<KvConnector> connector =
          registry.create<KvConnector>(rep.connector->plugin, rep.connector->config, context);
      g->connectors_.push_back(connector);
      g->replica_hosts_.push_back(std::make_unique<DeploymentReplicaHost>(served, g->engines_[i]->kv_fingerprint()));
      std::string bound;
      if (Status st = connector->serve(rep.listen, g->replica_hosts_.back().get(), &bound); !st.is_ok())
        throw std::runtime_error(where + ".listen: " + st.message());
      g->replica_endpoints_.push_back(names[i] + " " + bound);
    }
    if (!rep.endpoints.empty()) {
      std::shared_ptr<KvConnector> connector =
          registry.create<KvConnector>(rep.connector->plugin, rep.connector->config, context);
      g->connectors_.push_back(connector);
      PluginContext router_context{&host_logger(), rep.router->file};
      std::shared_ptr<Router> router = registry.create<Router>(rep.router->plugin, rep.router->config, router_context);
      ReplicationOptions options;
      options.endpoints = rep.endpoints;
      options.local = rep.local;
      options.health_interval = rep.health_interval;
      options.timeout = rep.timeout;
      options.max_concurrent = rep.max_concurrent;
      auto d = std::make_shared<ReplicatedDeployment>(names[i], *g->engines_[i], connector, router,
                                                      rep.router->plugin, std::move(options));
      std::vector<std::string> warnings;
      if (Status st = d->check_replicas(&warnings); !st.is_ok()) throw std::runtime_error(where + ": " + st.message());
      for (const std::string& w : warnings)
        host_logger().log(LogLevel::kWarn, where + ": " + w + " (unhealthy until a health probe answers)");
      g->replicated_deployments_.push_back(d);
      bases[i] = d;
    }
  }
  g->wrap_deployments(names, std::move(bases));
  return g;
}

ReplicatedDeployment* Gateway::replicated(const std::string& name) {
  for (auto& d : replicated_deployments_)
    if (d->name() == name) return d.get();
  return nullptr;
}

void Gateway::begin_drain() {
  for (auto& h : replica_hosts_) h->begin_drain();
  for (auto& h : prefill_hosts_) h->begin_drain();
}

int32_t Gateway::served_remote_in_flight() const {
  int32_t n = 0;
  for (const auto& h : replica_hosts_) n += h->in_flight();
  for (const auto& h : prefill_hosts_) n += h->in_flight();
  return n;
}

void Gateway::stop_serving_remote() {
  for (auto& c : connectors_) c->shutdown();
}

void Gateway::render_replica_metrics(std::string* out) const {
  if (replicated_deployments_.empty() && replica_hosts_.empty()) return;
  auto family = [out](const char* name, const char* type, const char* help) {
    *out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  auto sample = [out](const char* name, const std::string& labels, double value) {
    char v[40];
    std::snprintf(v, sizeof v, "%.9g", value);
    *out += std::string(name) + "{" + labels + "} " + v + "\n";
  };
  auto labels = [](const std::string& deployment, const std::string& replica) {
    return "deployment=\"" + escape_label(deployment) + "\",replica=\"" + escape_label(replica) + "\"";
  };
  if (!replicated_deployments_.empty()) {
    struct Family {
      const char* name;
      const char* type;
      const char* help;
      double (*get)(const ReplicaStatus&);
    };
    static const Family kPerReplica[] = {
        {"tessera_replica_healthy", "gauge", "1 when the replica's last health probe (or call) succeeded",
         [](const ReplicaStatus& r) { return r.healthy ? 1.0 : 0.0; }},
        {"tessera_replica_in_flight", "gauge", "requests this gateway has in flight at the replica",
         [](const ReplicaStatus& r) { return double(r.in_flight); }},
        {"tessera_replica_requests_total", "counter", "requests (and resumptions) sent to the replica",
         [](const ReplicaStatus& r) { return double(r.requests); }},
        {"tessera_replica_failures_total", "counter", "calls that failed because of the replica",
         [](const ReplicaStatus& r) { return double(r.failures); }},
    };
    for (const Family& f : kPerReplica) {
      family(f.name, f.type, f.help);
      for (const auto& d : replicated_deployments_)
        for (const ReplicaStatus& r : d->replicas()) sample(f.name, labels(d->name(), r.name), f.get(r));
    }
    struct DeploymentFamily {
      const char* name;
      const char* help;
      uint64_t ReplicationStats::*field;
    };
    static const DeploymentFamily kPerDeployment[] = {
        {"tessera_replica_failovers_total", "requests moved to another replica before their first token",
         &ReplicationStats::failovers},
        {"tessera_replica_resumed_total", "greedy requests continued on another replica after a mid-stream failure",
         &ReplicationStats::resumed},
        {"tessera_replica_midstream_errors_total", "requests ended with an error: their replica failed mid-stream",
         &ReplicationStats::midstream_errors},
        {"tessera_replica_unavailable_total", "requests refused or ended because no replica could serve them",
         &ReplicationStats::unavailable},
    };
    for (const DeploymentFamily& f : kPerDeployment) {
      family(f.name, "counter", f.help);
      for (const auto& d : replicated_deployments_)
        sample(f.name, "deployment=\"" + escape_label(d->name()) + "\"", double(d->stats().*f.field));
    }
    std::vector<std::string> seen;
    for (const auto& d : replicated_deployments_) {
      std::vector<RouterMetric> metrics;
      d->router().metrics(&metrics);
      for (const RouterMetric& m : metrics)
        render_plugin_metric(m, "deployment=\"" + escape_label(d->name()) + "\",router=\"" + escape_label(d->router_plugin()) + "\"",
                             &seen, out);
    }
  }
  if (!replica_hosts_.empty()) {
    family("tessera_replica_served_in_flight", "gauge", "requests this engine process runs for gateways now");
    for (const auto& h : replica_hosts_)
      sample("tessera_replica_served_in_flight", "deployment=\"" + escape_label(h->deployment_name()) + "\"", h->in_flight());
    family("tessera_replica_draining", "gauge", "1 while this engine process drains (refuses new requests)");
    for (const auto& h : replica_hosts_)
      sample("tessera_replica_draining", "deployment=\"" + escape_label(h->deployment_name()) + "\"", h->draining() ? 1 : 0);
  }
}

DisaggregatedDeployment* Gateway::disaggregated(const std::string& name) {
  for (auto& d : decode_deployments_)
    if (d->name() == name) return d.get();
  return nullptr;
}

void Gateway::render_disaggregation_metrics(std::string* out) const {
  if (decode_deployments_.empty() && prefill_hosts_.empty()) return;
  auto line = [out](const char* name, const char* type, const char* help) {
    *out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  auto sample = [out](const char* name, const std::string& deployment, double value) {
    char v[40];
    std::snprintf(v, sizeof v, "%.9g", value);
    *out += std::string(name) + "{deployment=\"" + escape_label(deployment) + "\"} " + v + "\n";
  };
  struct Family {
    const char* name;
    const char* type;
    const char* help;
    double (*get)(const DisaggregationStats&);
  };
  static const Family kFamilies[] = {
      {"tessera_disagg_remote_prefills_total", "counter", "requests prefilled by a prefill engine",
       [](const DisaggregationStats& s) { return double(s.remote_prefills); }},
      {"tessera_disagg_prefill_failovers_total", "counter", "prefill engines that failed before the first token",
       [](const DisaggregationStats& s) { return double(s.prefill_failovers); }},
      {"tessera_disagg_local_prefills_total", "counter", "requests computed on the decode engine: no prefill engine answered",
       [](const DisaggregationStats& s) { return double(s.local_prefills); }},
      {"tessera_disagg_transfer_failures_total", "counter", "KV transfers that failed after the first token (prompt recomputed)",
       [](const DisaggregationStats& s) { return double(s.transfer_failures); }},
      {"tessera_disagg_kv_bytes_total", "counter", "KV payload bytes received from prefill engines",
       [](const DisaggregationStats& s) { return double(s.kv_bytes); }},
      {"tessera_disagg_prefill_seconds_total", "counter", "remote call start to first token, summed",
       [](const DisaggregationStats& s) { return s.prefill_seconds; }},
      {"tessera_disagg_transfer_seconds_total", "counter", "first token to last KV layer landed, summed",
       [](const DisaggregationStats& s) { return s.transfer_seconds; }},
  };
  if (!decode_deployments_.empty()) {
    for (const Family& f : kFamilies) {
      line(f.name, f.type, f.help);
      for (const auto& d : decode_deployments_) sample(f.name, d->name(), f.get(d->stats()));
    }
  }
  line("tessera_kv_transfer_held_exports", "gauge", "finished prefills whose blocks are held for a transfer");
  for (size_t i = 0; i < engines_.size(); ++i) sample("tessera_kv_transfer_held_exports", deployments_[i]->name(),
                                                      engines_[i]->stats().num_held_exports);
  line("tessera_kv_transfer_waiting_sequences", "gauge", "sequences waiting for their KV to land");
  for (size_t i = 0; i < engines_.size(); ++i) sample("tessera_kv_transfer_waiting_sequences", deployments_[i]->name(),
                                                      engines_[i]->stats().num_waiting_for_kv);
  line("tessera_kv_transfer_import_fallbacks_total", "counter", "imports whose prompt the decode engine computed itself");
  for (size_t i = 0; i < engines_.size(); ++i) sample("tessera_kv_transfer_import_fallbacks_total", deployments_[i]->name(),
                                                      double(engines_[i]->stats().num_kv_import_fallbacks));
  line("tessera_kv_transfer_pipelined_starts_total", "counter",
       "decode steps that began before the sequence's last KV layer landed");
  for (size_t i = 0; i < engines_.size(); ++i) sample("tessera_kv_transfer_pipelined_starts_total", deployments_[i]->name(),
                                                      double(engines_[i]->stats().num_kv_pipelined_starts));
  line("tessera_kv_transfer_layer_wait_seconds_total", "counter",
       "time pipelined decode steps waited inside the forward for KV layers to land");
  for (size_t i = 0; i < engines_.size(); ++i) sample("tessera_kv_transfer_layer_wait_seconds_total", deployments_[i]->name(),
                                                      engines_[i]->stats().kv_layer_wait_seconds);
}

Gateway::Gateway(std::vector<std::string> names, std::vector<std::unique_ptr<Engine>> engines,
                 std::vector<NamedCacheLayer> cache_layers)
    : engines_(std::move(engines)), cache_layers_(std::move(cache_layers)) {
  if (names.size() != engines_.size()) throw std::invalid_argument("Gateway: one name per engine");
  wrap_deployments(names);
}

void Gateway::wrap_deployments(const std::vector<std::string>& names,
                               std::vector<std::shared_ptr<Deployment>> bases) {
  if (!cache_layers_.empty()) workers_ = std::make_unique<CacheWorkers>(2);
  CachedDeployment::Embedder embed;
  if (embedding_) {
    std::shared_ptr<EncoderModel> model = embedding_;
    embed = [model](const std::string& text) { return std::move(model->embed({model->encode(text)})[0]); };
  }
  for (size_t i = 0; i < engines_.size(); ++i) {
    std::shared_ptr<Deployment> d = i < bases.size() && bases[i] ? bases[i]
                                                                 : std::make_shared<EngineDeployment>(names[i], *engines_[i]);
    if (!cache_layers_.empty()) d = std::make_shared<CachedDeployment>(d, cache_layers_, *workers_,
                                                                       CachedDeployment::Decoder{}, embed);
    deployments_.push_back(std::move(d));
  }
}

Gateway::~Gateway() {
  // Remote prefills and replica calls first: their handlers wait on engines that are about
  // to stop.
  for (auto& c : connectors_) c->shutdown();
  for (auto& d : decode_deployments_) d->shutdown();
  for (auto& d : replicated_deployments_) d->shutdown();
  stop();
  // Queued lookups and stores finish before the deployments and layers they use go away.
  workers_.reset();
  embed_worker_.reset();
}

void Gateway::post_embedding_job(std::function<void(EncoderModel&)> job) {
  std::shared_ptr<EncoderModel> model = embedding_;
  embed_worker_->post([model, job = std::move(job)] { job(*model); });
}

Deployment* Gateway::find(const std::string& name) {
  for (auto& d : deployments_)
    if (d->name() == name) return d.get();
  return nullptr;
}

Status Gateway::route(const RouteRequest& request, Deployment** out) {
  if (!router_) return internal_error("no router is configured");
  std::string chosen;
  if (Status st = router_->route(request, &chosen); !st.is_ok()) return st;
  *out = find(chosen);
  if (!*out) return internal_error("router '" + router_name_ + "' chose '" + chosen + "', which is not a deployment");
  return Status::ok();
}


void Gateway::render_cache_metrics(std::string* out) const {
  std::vector<std::string> seen;  // HELP/TYPE once per family
  for (const auto& l : cache_layers_) {
    std::vector<CacheMetric> metrics;
    l.layer->metrics(&metrics);
    for (const CacheMetric& m : metrics) render_plugin_metric(m, "layer=\"" + escape_label(l.name) + "\"", &seen, out);
  }
}

void Gateway::render_router_metrics(std::string* out) const {
  if (!router_) return;
  std::vector<RouterMetric> metrics;
  router_->metrics(&metrics);
  std::vector<std::string> seen;
  for (const RouterMetric& m : metrics)
    render_plugin_metric(m, "router=\"" + escape_label(router_name_) + "\"", &seen, out);
}

void Gateway::collect_plugin_metrics(std::vector<CacheMetric>* out) const {
  for (const auto& l : cache_layers_) {
    const size_t first = out->size();
    l.layer->metrics(out);
    for (size_t i = first; i < out->size(); ++i) (*out)[i].labels.insert((*out)[i].labels.begin(), {"layer", l.name});
  }
  if (!router_) return;
  std::vector<RouterMetric> metrics;
  router_->metrics(&metrics);
  for (RouterMetric& m : metrics) {
    m.labels.insert(m.labels.begin(), {"router", router_name_});
    out->push_back({std::move(m.name), std::move(m.help), m.is_counter, std::move(m.labels), m.value});
  }
}

void Gateway::start() {
  for (auto& e : engines_) e->start();
}

void Gateway::stop() {
  for (auto& e : engines_) e->stop();
}

}  // namespace tessera
