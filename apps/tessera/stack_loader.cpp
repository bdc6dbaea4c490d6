#include "stack_loader.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "commands.h"
#include "tessera/stack.h"

namespace tessera::cli {

std::string default_config_path() {
  namespace fs = std::filesystem;
  // Next to the source tree the binary was built from, then the install prefix's share dir.
  for (const fs::path& p : {fs::path(TESSERA_SOURCE_DIR) / "configs/smollm2-cpu.yaml",
                            fs::path(TESSERA_INSTALL_DATA_DIR) / "configs/smollm2-cpu.yaml"})
    if (fs::exists(p)) return p.string();
  throw CommandError("the default stack configs/smollm2-cpu.yaml was not found; pass --config FILE");
}

std::string read_text_file(const std::string& path, const char* option) {
  const std::string what = std::string(option) + " '" + path + "': ";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw CommandError(what + "no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CommandError(what + "cannot read the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.empty()) throw CommandError(what + "the file is empty");
  return text;
}

void print_progress(const char* label, size_t done, size_t total) {
  constexpr int kWidth = 30;
  const int filled = total ? static_cast<int>(kWidth * done / total) : kWidth;
  const bool tty = isatty(STDERR_FILENO);
  // On a terminal redraw one line; in logs print only the start and the end.
  if (!tty && done != total && done != 1) return;
  std::fprintf(stderr, "%s%s [", tty ? "\r" : "", label);
  for (int i = 0; i < kWidth; ++i) std::fputc(i < filled ? '#' : ' ', stderr);
  std::fprintf(stderr, "] %zu/%zu%s", done, total, (done == total || !tty) ? "\n" : "");
  std::fflush(stderr);
}

LoadedStack load_stack(const std::string& config_path, bool quiet) {
  LoadedStack s;
  s.registry = std::make_unique<PluginRegistry>();
  s.registry->scan_default_paths();
  const std::string path = config_path.empty() ? default_config_path() : config_path;
  s.config = load_stack_config(path, *s.registry);
  const auto start = std::chrono::steady_clock::now();
  Model::ProgressFn progress;
  if (!quiet) progress = [](size_t done, size_t total) { print_progress("loading model", done, total); };
  s.engine = build_engine(s.config, *s.registry, progress);
  if (!quiet) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const Model& m = s.engine->model();
    std::fprintf(stderr, "loaded %s (%s, %d layers, %.1f MiB of weights) in %.2f s; context %d\n",
                 m.name().c_str(), m.hparams().architecture.c_str(), m.hparams().num_layers,
                 m.weight_bytes() / 1048576.0, secs, s.engine->max_context());
  }
  return s;
}

LoadedGateway load_gateway(const std::string& config_path, bool quiet) {
  LoadedGateway g;
  g.registry = std::make_unique<PluginRegistry>();
  g.registry->scan_default_paths();
  const std::string path = config_path.empty() ? default_config_path() : config_path;
  g.config = load_stack_config(path, *g.registry);
  Gateway::ProgressFn progress;
  std::string label;
  if (!quiet)
    progress = [&label](const std::string& deployment, size_t done, size_t total) {
      label = "loading " + deployment;
      print_progress(label.c_str(), done, total);
    };
  g.gateway = Gateway::build(g.config, *g.registry, progress);
  if (!quiet) {
    for (size_t i = 0; i < g.gateway->num_deployments(); ++i) {
      const Engine& e = g.gateway->engine(i);
      const Model& m = e.model();
      std::fprintf(stderr, "deployment \"%s\": %s (%s, %d layers, %.1f MiB of weights), context %d\n",
                   g.gateway->deployment(i).name().c_str(), m.name().c_str(), m.hparams().architecture.c_str(),
                   m.hparams().num_layers, m.weight_bytes() / 1048576.0, e.max_context());
    }
  }
  return g;
}

}  // namespace tessera::cli
