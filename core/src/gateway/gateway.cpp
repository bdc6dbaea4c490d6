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
  g->wrap_deployments(names);
  return g;
}

Gateway::Gateway(std::vector<std::string> names, std::vector<std::unique_ptr<Engine>> engines,
                 std::vector<NamedCacheLayer> cache_layers)
    : engines_(std::move(engines)), cache_layers_(std::move(cache_layers)) {
  if (names.size() != engines_.size()) throw std::invalid_argument("Gateway: one name per engine");
  wrap_deployments(names);
}

void Gateway::wrap_deployments(const std::vector<std::string>& names) {
  if (!cache_layers_.empty()) workers_ = std::make_unique<CacheWorkers>(2);
  CachedDeployment::Embedder embed;
  if (embedding_) {
    std::shared_ptr<EncoderModel> model = embedding_;
    embed = [model](const std::string& text) { return std::move(model->embed({model->encode(text)})[0]); };
  }
  for (size_t i = 0; i < engines_.size(); ++i) {
    std::shared_ptr<Deployment> d = std::make_shared<EngineDeployment>(names[i], *engines_[i]);
    if (!cache_layers_.empty()) d = std::make_shared<CachedDeployment>(d, cache_layers_, *workers_,
                                                                       CachedDeployment::Decoder{}, embed);
    deployments_.push_back(std::move(d));
  }
}

Gateway::~Gateway() {
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

namespace {

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
