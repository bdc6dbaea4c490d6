// tessera bench: statistics, this machine's limits, and the report writers.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "bench.h"
#include "commands.h"
#include "tessera/atomic_file.h"

namespace tessera::cli::bench {

// ---- statistics -------------------------------------------------------------------------

double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

Summary summarize(std::vector<double> v) {
  Summary s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  double ss = 0;
  for (double x : v) ss += (x - s.mean) * (x - s.mean);
  s.stdev = v.size() > 1 ? std::sqrt(ss / static_cast<double>(v.size() - 1)) : 0;
  s.min = v.front();
  s.max = v.back();
  s.p50 = percentile(v, 0.50);
  s.p90 = percentile(v, 0.90);
  s.p99 = percentile(v, 0.99);
  return s;
}

nlohmann::json summary_json(const Summary& s) {
  return {{"n", s.n}, {"mean", s.mean}, {"stdev", s.stdev}, {"min", s.min}, {"max", s.max},
          {"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}};
}

double mann_whitney_p(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t n = a.size(), m = b.size();
  if (n == 0 || m == 0) return 1;
  // U = pairs (x in a, y in b) with x > y, ties counting one half; doubled to stay integral.
  long u2 = 0;
  for (double x : a)
    for (double y : b) u2 += x > y ? 2 : (x == y ? 1 : 0);
  // Exact null distribution of U (no ties) by the recurrence over the last element:
  // count(n, m, u) = count(n-1, m, u-m) + count(n, m-1, u).
  const long max_u = static_cast<long>(n * m);
  std::vector<std::vector<std::vector<double>>> count(
      n + 1, std::vector<std::vector<double>>(m + 1, std::vector<double>(max_u + 1, 0)));
  for (size_t i = 0; i <= n; ++i)
    for (size_t j = 0; j <= m; ++j)
      for (long u = 0; u <= max_u; ++u) {
        if (i == 0 || j == 0) { count[i][j][u] = u == 0 ? 1 : 0; continue; }
        double c = count[i][j - 1][u];
        if (u >= static_cast<long>(j)) c += count[i - 1][j][u - static_cast<long>(j)];
        count[i][j][u] = c;
      }
  double total = 0;
  for (long u = 0; u <= max_u; ++u) total += count[n][m][u];
  // Two-sided: the probability of a U at least as far from the mean n*m/2 as the observed.
  const double dist = std::fabs(u2 / 2.0 - max_u / 2.0);
  double tail = 0;
  for (long u = 0; u <= max_u; ++u)
    if (std::fabs(u - max_u / 2.0) >= dist - 1e-9) tail += count[n][m][u];
  return std::min(1.0, tail / total);
}

// ---- machine limits ---------------------------------------------------------------------

namespace {

// Sums a slice with AVX loads: four independent accumulators keep the loop bound by the
// loads, not by the add latency.
__attribute__((target("avx2"))) float sum_slice(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

// Twelve independent FMA chains: enough to cover the FMA latency (4-5 cycles) on two FMA
// ports, so the loop runs at the core's FMA throughput with everything in registers. Each
// chain converges to y / (1 - x) = seed: `seed` must be a normal, non-zero float, or the
// chains decay into denormals, which run ~100x slower where FTZ/DAZ are off (thread 0 passed
// 0 once and the "peak" came out at 1 GFLOP/s).
__attribute__((target("avx2,fma"))) float fma_loop(long iterations, float seed) {
  __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(seed * 1e-3f);
  __m256 a[12];
  for (int k = 0; k < 12; ++k) a[k] = _mm256_set1_ps(static_cast<float>(k) * 1e-3f);
  for (long i = 0; i < iterations; ++i) {
    for (int k = 0; k < 12; ++k) a[k] = _mm256_fmadd_ps(a[k], x, y);
  }
  __m256 s = a[0];
  for (int k = 1; k < 12; ++k) s = _mm256_add_ps(s, a[k]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[7];
}

// Runs fn(thread_index) on `threads` threads started together; returns the wall seconds.
template <typename Fn>
double run_parallel(int threads, Fn fn) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      fn(t);
    });
  while (ready.load() < threads) std::this_thread::yield();
  const auto start = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

MachineLimits measure_machine_limits(int threads) {
  MachineLimits m;
  m.threads = std::max(1, threads);
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (!avx2) throw CommandError("bench: measuring the machine limits needs AVX2 and FMA");
  // 512 MiB: far beyond any last-level cache here, so every pass streams from DRAM.
  m.bandwidth_buffer_bytes = 512ull << 20;
  const size_t n = m.bandwidth_buffer_bytes / sizeof(float);
  float* buf = static_cast<float*>(std::aligned_alloc(64, m.bandwidth_buffer_bytes));
  if (!buf) throw CommandError("bench: cannot allocate the bandwidth buffer");
  std::unique_ptr<float, decltype(&std::free)> owner(buf, &std::free);
  const size_t slice = (n / m.threads) & ~size_t{31};
  // First touch from the threads that will read, so pages land near them.
  run_parallel(m.threads, [&](int t) {
    float* p = buf + t * slice;
    for (size_t i = 0; i < slice; ++i) p[i] = 1.0f;
  });
  std::vector<float> sink(m.threads);
  double best = 0;
  for (int pass = 0; pass < 5; ++pass) {
    const double secs = run_parallel(m.threads, [&](int t) { sink[t] += sum_slice(buf + t * slice, slice); });
    best = std::max(best, static_cast<double>(slice * m.threads * sizeof(float)) / secs);
  }
  m.read_bandwidth_bytes_s = best;

  constexpr long kIterations = 20'000'000;  // ~0.1-0.3 s per pass on a modern core
  double best_flops = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const double secs =
        run_parallel(m.threads, [&](int t) { sink[t] += fma_loop(kIterations, static_cast<float>(t + 1)); });
    // 12 chains x 8 lanes x 2 flop per iteration per thread.
    best_flops = std::max(best_flops, 12.0 * 8 * 2 * kIterations * m.threads / secs);
  }
  m.fma_peak_flop_s = best_flops;
  // Keep the sums observable so the loops cannot be optimized away.
  volatile float keep = 0;
  for (float s : sink) keep = keep + s;
  return m;
}

nlohmann::json limits_json(const MachineLimits& m) {
  return {{"threads", m.threads},
          {"read_bandwidth_gb_s", m.read_bandwidth_bytes_s / 1e9},
          {"fma_peak_gflop_s", m.fma_peak_flop_s / 1e9},
          {"bandwidth_buffer_mib", m.bandwidth_buffer_bytes / 1048576.0}};
}

ModelCost model_cost(const Model& model) {
  ModelCost c;
  auto add = [&c](const PreparedWeight* w) {
    if (!w) return;
    c.weight_bytes_per_token += static_cast<double>(w->num_bytes());
    c.matmul_params += static_cast<double>(w->rows()) * static_cast<double>(w->cols());
  };
  for (const LayerWeights& l : model.layers()) {
    for (const auto* w : {l.wq.get(), l.wk.get(), l.wv.get(), l.wo.get(), l.w_gate.get(),
                          l.w_up.get(), l.w_down.get()})
      add(w);
    c.weight_bytes_per_token += 4.0 * static_cast<double>(l.attn_norm.size() + l.ffn_norm.size());
  }
  add(&model.output());  // the output projection reads the whole (possibly tied) matrix
  return c;
}

// ---- reports ----------------------------------------------------------------------------

std::string fmt(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", precision, v);
  return buf;
}

void print_table(const std::vector<std::string>& header,
                 const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size(), 0);
  for (size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  for (const auto& r : rows)
    for (size_t c = 0; c < r.size() && c < width.size(); ++c) width[c] = std::max(width[c], r[c].size());
  auto line = [&](const std::vector<std::string>& r) {
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < r.size() ? r[c] : "";
      // Names left-aligned, numbers right-aligned.
      if (c == 0) std::fprintf(stderr, "%-*s", static_cast<int>(width[c]), cell.c_str());
      else std::fprintf(stderr, "  %*s", static_cast<int>(width[c]), cell.c_str());
    }
    std::fputc('\n', stderr);
  };
  line(header);
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  std::fprintf(stderr, "%s\n", std::string(total - 2, '-').c_str());
  for (const auto& r : rows) line(r);
  std::fflush(stderr);
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

namespace {

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
constexpr double kW = 640, kH = 360, kLeft = 70, kRight = 20, kTop = 40, kBottom = 50;

// A "nice" upper bound for an axis (1, 2, 5 x 10^k).
double nice_ceiling(double v) {
  if (v <= 0) return 1;
  const double e = std::pow(10.0, std::floor(std::log10(v)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (v <= m * e) return m * e;
  return 10 * e;
}

std::string svg_open(const std::string& title) {
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << kW << "' height='" << kH
    << "' font-family='sans-serif' font-size='12'>"
    << "<rect width='100%' height='100%' fill='white'/>"
    << "<text x='" << kW / 2 << "' y='20' text-anchor='middle' font-size='14'>" << html_escape(title)
    << "</text>";
  return o.str();
}

}  // namespace

std::string svg_line_chart(const std::string& title, const std::string& x_label,
                           const std::string& y_label, const std::vector<Series>& series,
                           bool log2_x) {
  double x_min = 1e300, x_max = -1e300, y_max = 0;
  auto tx = [&](double x) { return log2_x ? std::log2(std::max(x, 1e-9)) : x; };
  for (const auto& s : series)
    for (size_t i = 0; i < s.x.size(); ++i) {
      x_min = std::min(x_min, tx(s.x[i]));
      x_max = std::max(x_max, tx(s.x[i]));
      y_max = std::max(y_max, s.y[i]);
    }
  if (x_min > x_max) { x_min = 0; x_max = 1; }
  if (!log2_x) x_min = std::min(0.0, x_min);
  if (x_max == x_min) x_max = x_min + 1;
  y_max = nice_ceiling(y_max * 1.05);
  const double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (tx(x) - x_min) / (x_max - x_min) * pw; };
  auto py = [&](double y) { return kTop + ph - y / y_max * ph; };
  std::ostringstream o;
  o << svg_open(title);
  o << "<line x1='" << kLeft << "' y1='" << kTop + ph << "' x2='" << kLeft + pw << "' y2='" << kTop + ph
    << "' stroke='black'/><line x1='" << kLeft << "' y1='" << kTop << "' x2='" << kLeft << "' y2='"
    << kTop + ph << "' stroke='black'/>";
  for (int k = 0; k <= 5; ++k) {  // y ticks
    const double y = y_max * k / 5;
    o << "<text x='" << kLeft - 5 << "' y='" << py(y) + 4 << "' text-anchor='end'>" << fmt(y, y_max < 10 ? 2 : 0)
      << "</text><line x1='" << kLeft << "' y1='" << py(y) << "' x2='" << kLeft + pw << "' y2='" << py(y)
      << "' stroke='#eee'/>";
  }
  for (int k = 0; k <= 5; ++k) {  // x ticks
    const double t = x_min + (x_max - x_min) * k / 5;
    const double x = log2_x ? std::pow(2.0, t) : t;
    o << "<text x='" << kLeft + pw * k / 5 << "' y='" << kTop + ph + 16 << "' text-anchor='middle'>"
      << fmt(x, (log2_x || x_max > 10) ? 0 : 2) << "</text>";
  }
  o << "<text x='" << kLeft + pw / 2 << "' y='" << kH - 10 << "' text-anchor='middle'>" << html_escape(x_label)
    << "</text><text transform='translate(15," << kTop + ph / 2 << ") rotate(-90)' text-anchor='middle'>"
    << html_escape(y_label) << "</text>";
  for (size_t si = 0; si < series.size(); ++si) {
    const auto& s = series[si];
    const char* color = kColors[si % 6];
    o << "<polyline fill='none' stroke='" << color << "' stroke-width='2' points='";
    for (size_t i = 0; i < s.x.size(); ++i) o << px(s.x[i]) << "," << py(s.y[i]) << " ";
    o << "'/>";
    for (size_t i = 0; i < s.x.size(); ++i)
      o << "<circle cx='" << px(s.x[i]) << "' cy='" << py(s.y[i]) << "' r='3' fill='" << color << "'/>";
    o << "<text x='" << kLeft + 10 << "' y='" << kTop + 14 + 15 * si << "' fill='" << color << "'>"
      << html_escape(s.name) << "</text>";
  }
  o << "</svg>";
  return o.str();
}

std::string svg_bar_chart(const std::string& title, const std::string& y_label,
                          const std::vector<Bar>& bars, double reference_line) {
  double y_max = reference_line;
  for (const auto& b : bars) y_max = std::max({y_max, b.value, b.high});
  y_max = nice_ceiling(y_max * 1.05);
  const double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom - 40;
  auto py = [&](double y) { return kTop + ph - y / y_max * ph; };
  std::ostringstream o;
  o << svg_open(title);
  o << "<line x1='" << kLeft << "' y1='" << kTop + ph << "' x2='" << kLeft + pw << "' y2='" << kTop + ph
    << "' stroke='black'/>";
  for (int k = 0; k <= 5; ++k) {
    const double y = y_max * k / 5;
    o << "<text x='" << kLeft - 5 << "' y='" << py(y) + 4 << "' text-anchor='end'>" << fmt(y, 2) << "</text>";
  }
  o << "<text transform='translate(15," << kTop + ph / 2 << ") rotate(-90)' text-anchor='middle'>"
    << html_escape(y_label) << "</text>";
  const double slot = bars.empty() ? pw : pw / static_cast<double>(bars.size());
  for (size_t i = 0; i < bars.size(); ++i) {
    const auto& b = bars[i];
    const double x = kLeft + slot * i + slot * 0.15, w = slot * 0.7;
    o << "<rect x='" << x << "' y='" << py(b.value) << "' width='" << w << "' height='"
      << kTop + ph - py(b.value) << "' fill='" << kColors[i % 6] << "' opacity='0.8'/>";
    if (b.high > b.low)
      o << "<line x1='" << x + w / 2 << "' y1='" << py(b.low) << "' x2='" << x + w / 2 << "' y2='" << py(b.high)
        << "' stroke='black' stroke-width='2'/>";
    o << "<text x='" << x + w / 2 << "' y='" << kTop + ph + 14 << "' text-anchor='end' font-size='10' "
      << "transform='rotate(-30 " << x + w / 2 << " " << kTop + ph + 14 << ")'>" << html_escape(b.label) << "</text>";
  }
  if (reference_line > 0)
    o << "<line x1='" << kLeft << "' y1='" << py(reference_line) << "' x2='" << kLeft + pw << "' y2='"
      << py(reference_line) << "' stroke='black' stroke-dasharray='4 3'/>";
  o << "</svg>";
  return o.str();
}

std::string html_table(const std::vector<std::string>& header,
                       const std::vector<std::vector<std::string>>& rows) {
  std::ostringstream o;
  o << "<table><tr>";
  for (const auto& h : header) o << "<th>" << html_escape(h) << "</th>";
  o << "</tr>";
  for (const auto& r : rows) {
    o << "<tr>";
    for (const auto& c : r) o << "<td>" << html_escape(c) << "</td>";
    o << "</tr>";
  }
  o << "</table>";
  return o.str();
}

void write_html(const std::string& path, const std::string& title,
                const std::vector<std::string>& sections) {
  std::ostringstream out;
  out << "<!DOCTYPE html><html><head><meta charset='utf-8'><title>" << html_escape(title)
      << "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
         "margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
         "td:first-child,th:first-child{text-align:left}</style></head><body><h1>"
      << html_escape(title) << "</h1>\n";
  for (const auto& s : sections) out << s << "\n";
  out << "</body></html>\n";
  write_report_file(path, out.str());
}

void write_json(const std::string& path, const nlohmann::json& j) { write_report_file(path, j.dump(2) + "\n"); }

void write_report_file(const std::string& path, const std::string& contents) {
  try {
    write_file_atomically(path, contents);
  } catch (const FileWriteError& e) {
    throw CommandError(e.what());
  }
}

}  // namespace tessera::cli::bench
