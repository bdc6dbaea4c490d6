// tessera bench constrained: what structured output costs in decode throughput. `batch`
// greedy sequences decode side by side, once plain and once under a JSON Schema, a regex or a
// GBNF grammar (--kind; the engine's
// constraint plugin masks every row), in alternating rounds on one engine; only steps that
// are one pure decode batch are timed, as in `bench roofline`. The default schema asks for at
// least 1000 objects of a name (string), an age (integer) and a flag (boolean), so no
// sequence completes within the timed steps and every kind of JSON state (keys, strings,
// numbers, literals, separators) is masked.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "bench.h"
#include "commands.h"
#include "stack_loader.h"
#include "tessera/tokenizer.h"

namespace tessera::cli::bench {
namespace {

const char* kDefaultSchema = R"({"type": "array", "minItems": 1000, "items": {"type": "object",
  "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "member": {"type": "boolean"}},
  "required": ["name", "age", "member"]}})";

// Unbounded languages too: a sentence after sentence, and llama.cpp's JSON grammar with one
// object a line, for ever (the + never lets the output be complete).
const char* kDefaultRegex = "([A-Z][a-z]{0,15}(,? [a-z]{1,15}){0,12}[.!?] )+";
const char* kDefaultGrammar = R"gbnf(root   ::= (object "\n")+
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-7]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
)gbnf";

struct ConstrainedOptions {
  std::string config;
  std::string kind = "json_schema";
  std::string schema_path;
  int batch = 16;
  int steps = 48;
  int rounds = 3;
  std::string json_path;
};

struct Measurement {
  Summary step_ms;
  double tokens_per_s = 0;
  double mask_us_per_row = 0;  // constraint_seconds / num_masked_rows over the timed steps
  // The masks computed beside the forward: their time per row (off the step's path unless
  // it outlasts the forward) and the fraction of masked rows prepared that way.
  double prepare_us_per_row = 0;
  double prepared_fraction = 0;
};

Measurement measure(Engine& engine, const Tokenizer& tok, const ConstrainedOptions& opt,
                    const std::shared_ptr<const CompiledConstraint>& constraint, uint64_t seed) {
  const DecodeSteps d = time_decode_steps(engine, tok, opt.batch, opt.steps, 24, seed, constraint,
                                          "bench constrained");
  Measurement m;
  m.step_ms = summarize(d.step_ms);
  m.tokens_per_s = opt.batch / (m.step_ms.p50 / 1e3);
  m.mask_us_per_row = d.masked_rows ? d.constraint_seconds / static_cast<double>(d.masked_rows) * 1e6 : 0;
  m.prepare_us_per_row = d.prepared_masks ? d.prepare_seconds / static_cast<double>(d.prepared_masks) * 1e6 : 0;
  m.prepared_fraction = d.masked_rows ? static_cast<double>(d.prepared_masks) / static_cast<double>(d.masked_rows) : 0;
  return m;
}

void run_constrained(const ConstrainedOptions& opt) {
  std::string schema = opt.kind == "regex" ? kDefaultRegex : opt.kind == "grammar" ? kDefaultGrammar : kDefaultSchema;
  if (!opt.schema_path.empty()) {
    std::ifstream in(opt.schema_path);
    if (!in) throw CommandError("bench constrained: --spec: cannot read " + opt.schema_path);
    std::stringstream ss;
    ss << in.rdbuf();
    schema = ss.str();
  }
  LoadedStack stack = load_stack(opt.config, false);
  Engine& engine = *stack.engine;
  const Tokenizer& tok = engine.model().tokenizer();
  std::shared_ptr<const CompiledConstraint> constraint;
  Status st = engine.compile_constraint({opt.kind, schema}, &constraint);
  if (!st.is_ok()) throw CommandError("bench constrained: --spec (" + opt.kind + "): " + st.message());

  std::vector<Measurement> plain, constrained;
  for (int r = 0; r < opt.rounds; ++r) {
    // Alternate which goes first, so drift (thermal, other load) does not favour one.
    const uint64_t seed = 100 + static_cast<uint64_t>(r) * 1000;
    if (r % 2 == 0) {
      plain.push_back(measure(engine, tok, opt, nullptr, seed));
      constrained.push_back(measure(engine, tok, opt, constraint, seed));
    } else {
      constrained.push_back(measure(engine, tok, opt, constraint, seed));
      plain.push_back(measure(engine, tok, opt, nullptr, seed));
    }
    print_progress("constrained", static_cast<size_t>(r + 1), static_cast<size_t>(opt.rounds));
  }
  std::fprintf(stderr, "\n");
  std::vector<std::vector<std::string>> rows;
  std::vector<double> ratios;
  nlohmann::json rounds = nlohmann::json::array();
  for (int r = 0; r < opt.rounds; ++r) {
    const double ratio = constrained[r].tokens_per_s / plain[r].tokens_per_s;
    ratios.push_back(ratio);
    rows.push_back({std::to_string(r + 1), fmt(plain[r].step_ms.p50), fmt(constrained[r].step_ms.p50),
                    fmt(plain[r].tokens_per_s, 1), fmt(constrained[r].tokens_per_s, 1),
                    fmt((1 - ratio) * 100, 1) + "%", fmt(constrained[r].mask_us_per_row, 1),
                    fmt(constrained[r].prepare_us_per_row, 1), fmt(constrained[r].prepared_fraction * 100, 0) + "%"});
    rounds.push_back({{"plain_step_ms_p50", plain[r].step_ms.p50},
                      {"constrained_step_ms_p50", constrained[r].step_ms.p50},
                      {"plain_tokens_per_s", plain[r].tokens_per_s},
                      {"constrained_tokens_per_s", constrained[r].tokens_per_s},
                      {"mask_us_per_row", constrained[r].mask_us_per_row},
                      {"prepared_us_per_row", constrained[r].prepare_us_per_row},
                      {"prepared_fraction", constrained[r].prepared_fraction}});
  }
  // "mask us/row": the engine thread's time per masked row (applying, computing what was not
  // prepared, waiting for the preparation); "prepared us/row": computing a mask beside the
  // forward, for the "prepared" share of the rows.
  print_table({"round", "plain step ms", "constrained step ms", "plain t/s", "constrained t/s", "cost",
               "mask us/row", "prepared us/row", "prepared"},
              rows);
  const Summary ratio = summarize(ratios);
  // The masks' own share of a constrained step: less noisy than the throughput ratio on a
  // loaded machine, as it does not compare two separately timed runs.
  std::vector<double> shares;
  for (int r = 0; r < opt.rounds; ++r)
    shares.push_back(constrained[r].mask_us_per_row * opt.batch / 1e3 / constrained[r].step_ms.p50);
  const Summary share = summarize(shares);
  std::fprintf(stderr,
               "batch %d decode: constrained decoding costs %.1f%% of throughput (median of %d rounds, from "
               "%.1f%% to %.1f%%; round 1 includes the mask cache warming up); computing and applying the masks "
               "is %.2f%% of a constrained step (median; %.2f%% to %.2f%%)\n",
               opt.batch, (1 - ratio.p50) * 100, opt.rounds, (1 - ratio.max) * 100, (1 - ratio.min) * 100,
               share.p50 * 100, share.min * 100, share.max * 100);
  if (!opt.json_path.empty()) {
    nlohmann::json j = {{"command", "constrained"}, {"config", stack.config.file}, {"batch", opt.batch},
                        {"steps", opt.steps}, {"kind", opt.kind}, {"spec", schema}, {"rounds", rounds},
                        {"cost_fraction_median", 1 - ratio.p50}, {"mask_share_median", share.p50}};
    std::ofstream(opt.json_path) << j.dump(2) << "\n";
  }
}

}  // namespace

void add_constrained_subcommand(CLI::App& bench) {
  auto opt = std::make_shared<ConstrainedOptions>();
  CLI::App* c = bench.add_subcommand("constrained",
                                     "decode throughput at a batch, plain vs under a JSON Schema, regex or grammar, side by side");
  c->add_option("-c,--config", opt->config, "stack YAML (its engine.constraint slot masks the rows)");
  c->add_option("--kind", opt->kind, "constraint kind: json_schema, regex or grammar (GBNF)")
      ->capture_default_str()
      ->check(CLI::IsMember({"json_schema", "regex", "grammar"}));
  c->add_option("--spec,--schema", opt->schema_path,
                "file with the schema, regex or grammar (default: a long array of small objects; sentences; "
                "JSON objects one a line)");
  c->add_option("-b,--batch", opt->batch, "sequences decoding together")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--steps", opt->steps, "decode steps timed per measurement")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("-r,--rounds", opt->rounds, "rounds (each measures both)")->capture_default_str()->check(CLI::PositiveNumber);
  c->add_option("--json", opt->json_path, "write the results as JSON to FILE");
  c->callback([opt] { run_constrained(*opt); });
}

}  // namespace tessera::cli::bench
