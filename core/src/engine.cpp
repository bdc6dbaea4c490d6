#include "tessera/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "kernels/logit_mask.h"
#include "tessera/token_logprobs.h"

namespace tessera {

double RequestTimings::tpot() const {
  if (token_times.size() < 2 || first_token < 0) return 0;
  return (token_times.back() - first_token) / static_cast<double>(token_times.size() - 1);
}

std::vector<double> RequestTimings::inter_token_latencies() const {
  std::vector<double> out;
  for (size_t i = 1; i < token_times.size(); ++i) out.push_back(token_times[i] - token_times[i - 1]);
  return out;
}

struct Engine::Request {
  uint64_t id = 0;
  GenerationRequest spec;
  int32_t num_open = 0;  // samples not yet finished
};

struct Engine::Sequence {
  SequenceInfo info;
  std::vector<TokenId> tokens;  // capacity reserved up front: info.tokens never dangles
  std::shared_ptr<Request> request;
  int32_t choice = 0;
  int32_t pending_forks = 0;    // children to fork when the prompt is done (n > 1)
  int32_t num_cached_prompt_tokens = 0;
  SamplerState sampler_state;
  std::unique_ptr<ConstraintMatcher> matcher;  // structured output; null: unconstrained
  // This step's mask, prepared while the forward ran (index into prepared_masks_), or -1.
  int32_t prepared_mask = -1;
  Draft draft;                   // the pending drafts (tokens also at the end of `tokens`)
  AcceptanceEstimate acceptance;  // of this sequence's drafts, for adaptive drafting
  // Tokens of this sequence the drafter has taken in: all committed ones at its last
  // propose() for the sequence, plus the drafts of that call that were accepted. A drafter
  // that runs a model catches up on the rest first (a whole prompt the first time, the
  // output of steps without drafts later), which the control prices (catch_up_pays).
  int32_t drafter_known_tokens = 0;
  // Tokens beyond the one new token of a step that follows a verification.
  int32_t drafter_catch_up_tokens() const { return std::max(0, info.num_tokens() - drafter_known_tokens - 1); }
  int32_t num_draft_tokens_fed = 0;      // for GenerationEvent
  int32_t num_draft_tokens_accepted = 0;
  RequestTimings timings;
  // A disaggregated import scheduled before all its KV layers landed (layer-pipelined decode
  // start): the sequence is in the scheduler and still in awaiting_kv_.
  bool kv_pipelined = false;
  bool finished = false;
  bool finish_reported = false;  // the finished event has been delivered
  // Requests with prompt_logprobs: entry i is prompt token i + 1 (filled chunk by chunk).
  std::vector<SampledToken> prompt_logprobs;
  bool prompt_logprobs_sent = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status finish_error;

  bool wants_prompt_logprobs() const { return request->spec.prompt_logprobs >= 0 && choice == 0; }
  // Prompt tokens whose logprobs are still to be computed (token 0 has none).
  bool prompt_logprobs_pending() const {
    return wants_prompt_logprobs() && static_cast<int32_t>(prompt_logprobs.size()) + 1 < info.num_prompt_tokens;
  }
  void sync_view() { info.tokens = std::span<const TokenId>(tokens.data(), tokens.size()); }
  // Takes the last `n` drafts off the token vector (they stay in `draft` until cleared).
  void drop_drafts(int32_t n) {
    tokens.resize(tokens.size() - n);
    info.num_draft_tokens -= n;
    sync_view();
  }
};

namespace {
double monotonic_seconds() {
  using clock = std::chrono::steady_clock;
  static const clock::time_point start = clock::now();
  return std::chrono::duration<double>(clock::now() - start).count();
}
// Per-sample seeds: sample i of a seeded request uses seed + i, so n > 1 differs per sample.
uint64_t seed_for(const SamplingParams& p, uint64_t request_id, int32_t choice) {
  const uint64_t base = p.has_seed ? p.seed : (0x5DEECE66Dull * request_id) ^
                                                  static_cast<uint64_t>(monotonic_seconds() * 1e9);
  return base + static_cast<uint64_t>(choice) * 0x9E3779B97F4A7C15ull;
}
}  // namespace

double Engine::now() const { return monotonic_seconds(); }

// The KV cache as the scheduler sees it: the configured plugin, except that a sequence whose
// prompt logprobs are requested gets no prefix-cache hit (a cached prefix has no logits; its
// prompt is computed in full, and its blocks are still published for others to reuse).
class Engine::PromptLogprobsKvView final : public KvCacheManager {
 public:
  PromptLogprobsKvView(Engine& engine, KvCacheManager& kv) : engine_(engine), kv_(kv) {}
  Status configure(const KvModelShape& shape, KvLayout* layout) override { return kv_.configure(shape, layout); }
  int32_t attach_cached_prefix(const SequenceInfo& seq) override {
    const Sequence* s = engine_.find_sequence(seq.id);
    if (s && s->request->spec.prompt_logprobs >= 0) return 0;
    return kv_.attach_cached_prefix(seq);
  }
  bool allocate_slots(const SequenceInfo& seq, int32_t n) override { return kv_.allocate_slots(seq, n); }
  void mark_computed(const SequenceInfo& seq, int32_t n) override { kv_.mark_computed(seq, n); }
  void truncate(const SequenceInfo& seq, int32_t n) override { kv_.truncate(seq, n); }
  void free(SeqId seq) override { kv_.free(seq); }
  Status fork(SeqId parent, SeqId child) override { return kv_.fork(parent, child); }
  std::span<const int32_t> block_table(SeqId seq) const override { return kv_.block_table(seq); }
  void take_block_copies(std::vector<BlockCopy>* copies) override { kv_.take_block_copies(copies); }
  int32_t num_free_blocks() const override { return kv_.num_free_blocks(); }
  KvStats stats() const override { return kv_.stats(); }

 private:
  Engine& engine_;
  KvCacheManager& kv_;
};

Engine::Engine(EngineComponents components) : components_(std::move(components)) {
  auto& c = components_;
  if (!c.model || !c.backend || !c.quantizer || !c.scheduler || !c.kv_cache || !c.attention || !c.sampler)
    throw std::runtime_error("engine: every component except the drafter is required");
  if (c.drafter && (c.num_draft_tokens < 0 || c.num_draft_tokens > kMaxDraftTokens))
    throw std::runtime_error("engine.drafter.num_draft_tokens: must be in 0.." +
                             std::to_string(kMaxDraftTokens) + ", got " + std::to_string(c.num_draft_tokens));
  const ModelHparams& hp = c.model->hparams();
  max_context_ = c.max_context > 0 ? c.max_context : std::min(hp.context_length, 4096);
  KvModelShape shape{hp.num_layers, hp.num_kv_heads, hp.head_dim, max_context_,
                     c.scheduler->max_num_seqs()};
  Status st = c.kv_cache->configure(shape, &kv_layout_);
  if (!st.is_ok()) throw std::runtime_error(st.message());
  scheduler_kv_ = std::make_unique<PromptLogprobsKvView>(*this, *c.kv_cache);
  kv_token_bytes_k_ = KvLayout::pool_block_bytes(shape, 1, kv_layout_.k_dtype);
  kv_token_bytes_v_ = KvLayout::pool_block_bytes(shape, 1, kv_layout_.v_dtype);
  // A device backend may run the whole forward itself (tessera/sdk/forward.h); otherwise the
  // core runner drives the backend's kernels and the quantizer's matmuls.
  if (auto* provider = dynamic_cast<ForwardRunnerProvider*>(c.backend.get())) {
    st = provider->create_forward_runner(c.model->forward_view(), kv_layout_,
                                         c.scheduler->max_batch_tokens(), max_context_,
                                         *c.attention, &runner_);
    if (!st.is_ok() && st.code() != StatusCode::kUnimplemented)
      throw std::runtime_error("engine.backend: " + st.message());
  }
  if (!runner_)
    runner_ = std::make_unique<ModelRunner>(*c.model, *c.backend, *c.quantizer, *c.attention,
                                            kv_layout_, c.scheduler->max_batch_tokens());
  gated_runner_ = dynamic_cast<LayerGatedForward*>(runner_.get());
  // Per-step scratch at its largest up front: steady-state steps do not allocate.
  const size_t max_seqs = static_cast<size_t>(c.scheduler->max_num_seqs());
  import_failed_.reserve(max_seqs);
  runner_batch_.reserve(max_seqs);
  batch_sequences_.reserve(max_seqs);
  sampled_.reserve(kMaxDraftTokens + 1);
  emitted_.reserve(kMaxDraftTokens + 1);
  verify_rows_.reserve(kMaxDraftTokens + 1);
  draft_requests_.reserve(max_seqs);
  draft_sequences_.reserve(max_seqs);
  if (c.constraint) {
    // The constraint sees each token as the bytes it adds to the output.
    const Tokenizer& tok = c.model->tokenizer();
    std::vector<std::string> bytes(static_cast<size_t>(runner_->vocab_size()));
    for (int32_t t = 0; t < tok.vocab_size() && t < runner_->vocab_size(); ++t)
      bytes[static_cast<size_t>(t)] = tok.token_to_piece(t, /*render_special=*/false);
    std::vector<TokenId> ends(tok.end_of_generation_ids().begin(), tok.end_of_generation_ids().end());
    std::sort(ends.begin(), ends.end());
    st = c.constraint->set_vocabulary(ConstraintVocabulary{bytes, ends});
    if (!st.is_ok()) throw std::runtime_error("engine.constraint: " + st.message());
    mask_words_.resize((static_cast<size_t>(runner_->vocab_size()) + 31) / 32);
  }
}

Status Engine::compile_constraint(const ConstraintSpec& spec,
                                  std::shared_ptr<const CompiledConstraint>* out) const {
  if (!components_.constraint)
    return unimplemented("this engine has no constraint plugin (engine.constraint is off)");
  try {
    Status st = components_.constraint->compile(spec, out);
    if (st.is_ok() && !*out) return internal_error("constraint: compile returned no object");
    return st;
  } catch (const std::exception& e) {
    return internal_error(std::string("constraint: ") + e.what());
  }
}

Engine::~Engine() {
  stop();
  detach_transfers();
}

Status Engine::check(const GenerationRequest& request) const {
  const int32_t vocab = components_.model->hparams().vocab_size;
  const auto prompt_len = static_cast<int64_t>(request.prompt.size());
  if (request.prompt.empty()) return invalid_argument("prompt: must contain at least one token");
  if (request.constraint && !components_.constraint)
    return unimplemented("this engine has no constraint plugin (engine.constraint is off)");
  for (TokenId t : request.prompt)
    if (t < 0 || t >= vocab)
      return invalid_argument("prompt: token id " + std::to_string(t) + " is outside the vocabulary (0.." +
                              std::to_string(vocab - 1) + ")");
  if (request.prompt_logprobs < -1 || request.prompt_logprobs > vocab)
    return invalid_argument("prompt_logprobs: must be -1 (none) or 0.." + std::to_string(vocab) + ", got " +
                            std::to_string(request.prompt_logprobs));
  // max_tokens 0 only evaluates the prompt: meaningful with prompt logprobs alone.
  const int32_t min_tokens = request.prompt_logprobs >= 0 ? 0 : 1;
  if (request.params.max_tokens < min_tokens)
    return invalid_argument("max_tokens: must be at least " + std::to_string(min_tokens) + ", got " +
                            std::to_string(request.params.max_tokens));
  if (request.n < 1) return invalid_argument("n: must be at least 1, got " + std::to_string(request.n));
  if (request.kv_export || request.kv_import) {
    // One sample, no prompt logits, no matcher state: what a transfer carries.
    if (request.n != 1 || request.prompt_logprobs >= 0 || request.constraint)
      return invalid_argument("disaggregation: a transferred request has n 1, no prompt_logprobs and no constraint");
    if (request.kv_export && request.kv_import)
      return invalid_argument("disaggregation: a request is either exported or imported");
    if (request.kv_import &&
        request.kv_import->prefilled().num_kv_tokens != static_cast<int32_t>(request.prompt.size()))
      return invalid_argument("disaggregation: the transfer carries " +
                              std::to_string(request.kv_import->prefilled().num_kv_tokens) +
                              " tokens of KV, the prompt has " + std::to_string(request.prompt.size()));
  }
  if (request.n > components_.scheduler->max_num_seqs())
    return invalid_argument("n: " + std::to_string(request.n) + " exceeds the scheduler's max_num_seqs (" +
                            std::to_string(components_.scheduler->max_num_seqs()) + ")");
  if (prompt_len >= max_context_)
    return out_of_range("prompt: " + std::to_string(prompt_len) + " tokens do not fit the context of " +
                        std::to_string(max_context_) + " tokens");
  if (prompt_len + request.params.max_tokens > max_context_)
    return out_of_range("max_tokens: prompt (" + std::to_string(prompt_len) + " tokens) + max_tokens (" +
                        std::to_string(request.params.max_tokens) + ") exceeds the context of " +
                        std::to_string(max_context_) + " tokens");
  return Status::ok();
}

Status Engine::submit(GenerationRequest request, uint64_t* request_id) {
  if (Status st = check(request); !st.is_ok()) return st;
  const auto prompt_len = request.prompt.size();
  try {
    auto r = std::make_shared<Request>();
    r->spec = std::move(request);
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    inbox_requests_.reserve(inbox_requests_.size() + 1);  // the only step that can throw
    r->id = next_request_id_++;
    *request_id = r->id;
    inbox_requests_.push_back(std::move(r));
  } catch (const std::bad_alloc&) {
    return resource_exhausted("admission: out of memory while queueing the request (" +
                              std::to_string(prompt_len) + " prompt tokens)");
  }
  inbox_ready_.notify_one();
  return Status::ok();
}

void Engine::cancel(uint64_t request_id) {
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    inbox_cancels_.push_back(request_id);
  }
  inbox_ready_.notify_one();
}

void Engine::drain_inbox() {
  std::vector<std::shared_ptr<Request>> incoming;
  std::vector<uint64_t> cancels;
  std::vector<std::pair<SeqId, Status>> landed;
  std::vector<SeqId> started;
  std::vector<SeqId> released;
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);
    incoming.swap(inbox_requests_);
    cancels.swap(inbox_cancels_);
    landed.swap(inbox_kv_landed_);
    started.swap(inbox_kv_started_);
    released.swap(inbox_export_releases_);
  }
  for (SeqId id : released) release_export(id);
  for (SeqId id : started) {
    try {
      kv_started(id);
    } catch (const std::exception& e) {
      if (Sequence* seq = find_sequence(id)) finish(*seq, FinishReason::kError, internal_error(e.what()));
    }
  }
  for (const auto& [id, status] : landed) {
    try {
      kv_landed(id, status);
    } catch (const std::exception& e) {
      if (Sequence* seq = find_sequence(id)) finish(*seq, FinishReason::kError, internal_error(e.what()));
    }
  }
  const double t = now();
  for (auto& r : incoming) {
    // An allocation failure (or a throwing scheduler) while admitting fails this request
    // alone; the ones admitted before and after it are untouched.
    try {
      admit(r, t);
    } catch (const std::bad_alloc&) {
      reject_admission(*r, resource_exhausted("admission: out of memory while admitting the request (" +
                                              std::to_string(r->spec.prompt.size()) + " prompt tokens, max_tokens " +
                                              std::to_string(r->spec.params.max_tokens) + ")"));
    } catch (const std::exception& e) {
      reject_admission(*r, internal_error(std::string("admission: ") + e.what()));
    }
  }
  for (uint64_t id : cancels) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    for (auto& [sid, seq] : sequences_)
      if (seq->info.request_id == id && !seq->finished) finish(*seq, FinishReason::kCancelled);
  }
}

void Engine::admit(const std::shared_ptr<Request>& r, double t) {
  auto seq = std::make_unique<Sequence>();
  seq->request = r;
  seq->info.id = next_seq_id_++;
  seq->info.request_id = r->id;
  seq->info.priority = r->spec.priority;
  seq->info.arrival_time = t;
  seq->info.num_prompt_tokens = static_cast<int32_t>(r->spec.prompt.size());
  seq->info.max_new_tokens = r->spec.params.max_tokens;
  seq->tokens.reserve(r->spec.prompt.size() + r->spec.params.max_tokens +
                      components_.num_draft_tokens + 1);
  seq->tokens = r->spec.prompt;
  seq->sync_view();
  seq->pending_forks = r->spec.n - 1;
  if (r->spec.prompt_logprobs >= 0) seq->prompt_logprobs.reserve(r->spec.prompt.size());
  seq->sampler_state.rng = seed_for(r->spec.params, r->id, 0);
  Status matcher_status;
  if (r->spec.constraint) matcher_status = r->spec.constraint->new_matcher(&seq->matcher);
  seq->draft.tokens.reserve(components_.num_draft_tokens);
  seq->timings.arrival = t;
  // One time stamp per generated token; reserved so decode steps never grow it.
  seq->timings.token_times.reserve(r->spec.params.max_tokens + components_.num_draft_tokens + 1);
  r->num_open = r->spec.n;
  // Everything above only allocated; from here each insertion is undone if a later one
  // throws, so a failed admission leaves no trace in the maps or the scheduler.
  Sequence& admitted = *seq;
  const SeqId id = admitted.info.id;
  requests_[r->id] = r;
  try {
    sequences_.emplace(id, std::move(seq));
    if (!r->spec.kv_import) components_.scheduler->add(&admitted.info);
  } catch (...) {
    try {
      components_.scheduler->remove(id);
    } catch (...) {
    }
    sequences_.erase(id);
    requests_.erase(r->id);
    throw;
  }
  if (!matcher_status.is_ok())
    finish(admitted, FinishReason::kError, Status(matcher_status.code(), "constraint: " + matcher_status.message()));
  else if (r->spec.kv_import)
    admit_imported(admitted);
}

void Engine::admit_imported(Sequence& seq) {
  KvImport& import = *seq.request->spec.kv_import;
  const PrefillResult& prefilled = import.prefilled();
  seq.sampler_state.rng = prefilled.rng_state;
  seq.num_cached_prompt_tokens = prefilled.num_cached_tokens;
  seq.timings.first_scheduled = seq.timings.arrival;
  // The first token, sampled by the prefill engine, is output now: that is the TTFT.
  emitted_.clear();
  for (const SampledToken& t : prefilled.tokens) {
    append_token(seq, t, &emitted_);
    if (seq.finished) break;
  }
  emit(seq, emitted_);
  if (seq.finished) {
    import.refuse(Status(StatusCode::kCancelled, "the first token ended the request"));
    return;
  }
  bool allocated = false;
  try {
    allocated = components_.kv_cache->allocate_slots(seq.info, seq.info.num_prompt_tokens);
  } catch (...) {
  }
  if (!allocated) {
    // No room now: compute the prompt here when the scheduler can, like a preempted sequence.
    ++stats_.num_kv_import_fallbacks;
    import.refuse(resource_exhausted("decode engine: no free KV blocks for the " +
                                     std::to_string(seq.info.num_prompt_tokens) +
                                     " prompt tokens; it computes the prompt itself"));
    components_.scheduler->add(&seq.info);
    return;
  }
  const std::span<const int32_t> table = components_.kv_cache->block_table(seq.info.id);
  const SeqId id = seq.info.id;
  awaiting_kv_[id] = seq.request->spec.kv_import;
  // Layer-pipelined start needs a runner that asks before reading each layer.
  std::function<void()> on_first_layer;
  if (import.options().pipelined_start && gated_runner_)
    on_first_layer = [this, id] {
      {
        std::lock_guard<std::mutex> lock(inbox_mutex_);
        inbox_kv_started_.push_back(id);
      }
      inbox_ready_.notify_one();
    };
  import.set_target(runner_.get(), std::vector<int32_t>(table.begin(), table.end()), kv_token_bytes_k_,
                    kv_token_bytes_v_, [this, id](const Status& st) {
                      {
                        std::lock_guard<std::mutex> lock(inbox_mutex_);
                        inbox_kv_landed_.emplace_back(id, st);
                      }
                      inbox_ready_.notify_one();
                    },
                    std::move(on_first_layer));
}

void Engine::kv_started(SeqId id) {
  if (!awaiting_kv_.count(id)) return;  // landed, failed or cancelled meanwhile
  Sequence* seq = find_sequence(id);
  if (!seq || seq->finished || seq->kv_pipelined) return;
  // Scheduled as computed (its decode step feeds the first token); the step's forward waits
  // for each layer before reading it. Its blocks are published to the prefix cache only
  // once every layer is in place (kv_landed or the first step's commit).
  seq->kv_pipelined = true;
  seq->info.num_computed_tokens = seq->info.num_prompt_tokens;
  seq->info.status = SequenceStatus::kRunning;
  components_.scheduler->add(&seq->info);
}

void Engine::count_import(const KvImport& import) {
  ++stats_.num_kv_imports;
  stats_.kv_import_bytes += static_cast<uint64_t>(import.bytes_written());
}

void Engine::recompute_after_import(Sequence& seq) {
  seq.kv_pipelined = false;
  components_.scheduler->remove(seq.info.id);
  components_.kv_cache->free(seq.info.id);
  discard_drafts(seq, seq.info.num_draft_tokens);
  seq.info.num_computed_tokens = 0;
  seq.info.status = SequenceStatus::kWaiting;
  ++stats_.num_kv_import_fallbacks;
  components_.scheduler->add(&seq.info);
}

void Engine::kv_landed(SeqId id, const Status& status) {
  auto it = awaiting_kv_.find(id);
  if (it == awaiting_kv_.end()) return;  // cancelled meanwhile: release_finished detached it
  std::shared_ptr<KvImport> import = std::move(it->second);
  awaiting_kv_.erase(it);
  import->detach();  // nothing writes into the blocks from here on
  Sequence* seq = find_sequence(id);
  if (!seq || seq->finished) return;
  if (seq->kv_pipelined) {
    // Already scheduled, and not yet stepped with every layer in place.
    if (status.is_ok() || import->all_layers_landed()) {
      seq->kv_pipelined = false;
      components_.kv_cache->mark_computed(seq->info, seq->info.num_computed_tokens);
      count_import(*import);
    } else {
      recompute_after_import(*seq);
    }
    return;
  }
  if (status.is_ok()) {
    seq->info.num_computed_tokens = seq->info.num_prompt_tokens;
    seq->info.status = SequenceStatus::kRunning;
    components_.kv_cache->mark_computed(seq->info, seq->info.num_computed_tokens);
    count_import(*import);
  } else {
    // The transfer failed (the prefill process went away, a checksum): the rows written so
    // far are worthless; compute the prompt here, the first token already out.
    components_.kv_cache->free(id);
    ++stats_.num_kv_import_fallbacks;
  }
  // Arriving computed, it runs at once (as a forked child does); otherwise it waits.
  components_.scheduler->add(&seq->info);
}

// After a step that fed a pipelined import's sequence: true when every layer was in place for
// it (the import is finished here and the step's result stands), false when the transfer
// failed or stalled (the result is discarded and the prompt computed here).
bool Engine::settle_pipelined_import(Sequence& seq, bool failed) {
  auto it = awaiting_kv_.find(seq.info.id);
  std::shared_ptr<KvImport> import;
  if (it != awaiting_kv_.end()) {
    import = std::move(it->second);
    awaiting_kv_.erase(it);
    import->detach();
  }
  if (failed || !import || !import->all_layers_landed()) {
    recompute_after_import(seq);
    return false;
  }
  seq.kv_pipelined = false;
  count_import(*import);
  return true;
}

bool Engine::hold_for_export(Sequence& seq) {
  KvExport& exp = *seq.request->spec.kv_export;
  PrefillResult result;
  result.num_layers = components_.model->hparams().num_layers;
  result.num_cached_tokens = seq.num_cached_prompt_tokens;
  result.prefill_seconds = now() - seq.timings.arrival;
  result.rng_state = seq.sampler_state.rng;
  const bool prompt_done = seq.info.num_computed_tokens >= seq.info.num_prompt_tokens;
  if (seq.finish_reason != FinishReason::kLength || !prompt_done) {
    result.finish = seq.finish_reason == FinishReason::kStop ? FinishReason::kStop : FinishReason::kError;
    if (result.finish == FinishReason::kError)
      result.error = seq.finish_error.is_ok() ? Status(StatusCode::kCancelled, "the prefill was cancelled")
                                              : seq.finish_error;
    exp.set_failed(std::move(result));
    return false;
  }
  result.finish = FinishReason::kNone;
  result.num_kv_tokens = seq.info.num_prompt_tokens;
  const std::span<const int32_t> table = components_.kv_cache->block_table(seq.info.id);
  const SeqId id = seq.info.id;
  held_exports_[id] = seq.request->spec.kv_export;
  const bool held = exp.set_ready(std::move(result), runner_.get(), std::vector<int32_t>(table.begin(), table.end()),
                                  kv_token_bytes_k_, kv_token_bytes_v_, [this, id] {
                                    {
                                      std::lock_guard<std::mutex> lock(inbox_mutex_);
                                      inbox_export_releases_.push_back(id);
                                    }
                                    inbox_ready_.notify_one();
                                  });
  if (!held) held_exports_.erase(id);  // abandoned meanwhile: the caller frees the blocks
  return held;
}

void Engine::release_export(SeqId id) {
  auto it = held_exports_.find(id);
  if (it == held_exports_.end()) return;
  held_exports_.erase(it);
  try {
    components_.kv_cache->free(id);
  } catch (...) {
  }
}

void Engine::detach_transfers() {
  for (auto& [id, import] : awaiting_kv_) import->detach();
  awaiting_kv_.clear();
  for (auto& [id, exp] : held_exports_) exp->detach();
  held_exports_.clear();
  // Prefills still queued or running will never finish: their waiters hear so now.
  for (auto& [id, seq] : sequences_)
    if (seq->request->spec.kv_export) seq->request->spec.kv_export->detach();
  std::lock_guard<std::mutex> lock(inbox_mutex_);
  for (auto& r : inbox_requests_) {
    if (r->spec.kv_export) r->spec.kv_export->detach();
    if (r->spec.kv_import) r->spec.kv_import->refuse(Status(StatusCode::kUnavailable, "the decode engine stopped"));
  }
}

void Engine::reject_admission(const Request& r, const Status& error) {
  if (!r.spec.on_event) return;
  try {
    for (int32_t c = 0; c < std::max(1, r.spec.n); ++c) {
      GenerationEvent ev;
      ev.request_id = r.id;
      ev.choice = c;
      ev.finished = true;
      ev.finish_reason = FinishReason::kError;
      ev.error = error;
      ev.num_prompt_tokens = static_cast<int32_t>(r.spec.prompt.size());
      r.spec.on_event(ev);
    }
  } catch (...) {
    // Out of memory even for the error event: the request's sink never hears back, but the
    // engine and every other request go on.
  }
}

Engine::Sequence* Engine::find_sequence(SeqId id) {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

void Engine::emit(Sequence& seq, std::vector<SampledToken>& tokens) {
  const bool report_finish = seq.finished && !seq.finish_reported;
  if (tokens.empty() && !report_finish) return;
  if (report_finish) seq.finish_reported = true;
  if (!seq.request->spec.on_event) {
    tokens.clear();
    return;
  }
  GenerationEvent ev;
  ev.request_id = seq.info.request_id;
  ev.choice = seq.choice;
  // The caller's buffer travels in the event and comes back, capacity kept.
  ev.tokens = std::move(tokens);
  ev.finished = report_finish;
  ev.finish_reason = report_finish ? seq.finish_reason : FinishReason::kNone;
  if (report_finish) ev.error = seq.finish_error;
  ev.num_prompt_tokens = seq.info.num_prompt_tokens;
  ev.num_cached_prompt_tokens = seq.num_cached_prompt_tokens;
  ev.num_draft_tokens = seq.num_draft_tokens_fed;
  ev.num_accepted_draft_tokens = seq.num_draft_tokens_accepted;
  ev.timings = &seq.timings;
  if (seq.wants_prompt_logprobs() && !seq.prompt_logprobs_sent && !seq.prompt_logprobs_pending()) {
    seq.prompt_logprobs_sent = true;
    ev.prompt_logprobs = std::move(seq.prompt_logprobs);
  }
  seq.request->spec.on_event(ev);
  tokens = std::move(ev.tokens);
  tokens.clear();
}

void Engine::finish(Sequence& seq, FinishReason reason, Status error, bool report_now) {
  if (seq.finished) return;
  seq.finished = true;
  seq.finish_reason = reason;
  seq.finish_error = std::move(error);
  seq.info.status = SequenceStatus::kFinished;
  seq.timings.finished = now();
  // Children not yet forked will never exist: they finish with the parent.
  if (seq.pending_forks > 0) seq.request->num_open -= seq.pending_forks;
  seq.pending_forks = 0;
  finished_.push_back(seq.info.id);
  if (report_now) {
    std::vector<SampledToken> no_tokens;
    emit(seq, no_tokens);
  }
}

void Engine::append_token(Sequence& seq, const SampledToken& token, std::vector<SampledToken>* emitted) {
  const SamplingParams& p = seq.request->spec.params;
  const double t = now();
  if (seq.timings.first_token < 0) seq.timings.first_token = t;
  seq.timings.token_times.push_back(t);
  const bool is_stop_token =
      (!p.ignore_eos && components_.model->tokenizer().is_end_of_generation(token.token)) ||
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token.token) != p.stop_token_ids.end();
  if (is_stop_token) {
    finish(seq, FinishReason::kStop, {}, /*report_now=*/false);
    return;
  }
  seq.tokens.push_back(token.token);
  seq.sync_view();
  emitted->push_back(token);
  if (tokens_left(seq) <= 0) finish(seq, FinishReason::kLength, {}, /*report_now=*/false);
}

int32_t Engine::tokens_left(const Sequence& seq) const {
  return std::min(seq.info.max_new_tokens - seq.info.num_generated(), max_context_ - seq.info.num_tokens());
}

void Engine::fork_children(Sequence& parent) {
  for (int32_t c = 1; c <= parent.pending_forks; ++c) {
    auto child = std::make_unique<Sequence>();
    child->request = parent.request;
    child->choice = c;
    child->info = parent.info;
    child->info.id = next_seq_id_++;
    child->tokens.reserve(parent.tokens.capacity());
    child->tokens = parent.tokens;
    child->sync_view();
    child->num_cached_prompt_tokens = parent.num_cached_prompt_tokens;
    child->sampler_state.rng = seed_for(parent.request->spec.params, parent.info.request_id, c);
    // Forks happen before the first token is sampled: the parent's matcher is at its start.
    if (parent.matcher) child->matcher = parent.matcher->clone();
    child->draft.tokens.reserve(components_.num_draft_tokens);
    child->timings = parent.timings;
    child->timings.token_times.reserve(parent.timings.token_times.capacity());
    Status st = components_.kv_cache->fork(parent.info.id, child->info.id);
    Sequence& ref = *child;
    sequences_[child->info.id] = std::move(child);
    if (!st.is_ok()) {
      finish(ref, FinishReason::kError, st);
      continue;
    }
    // The scheduler sees the child as a running sequence with its prompt computed.
    components_.scheduler->add(&ref.info);
  }
  parent.pending_forks = 0;
}

// One step: drain → schedule → apply the plan → build the batch → forward → sample or
// verify, commit → draft → release. A plugin error (a non-OK status from the scheduler, an
// exception from any plugin or the runner) ends that step's requests with kError and the
// message; the engine thread goes on serving.
bool Engine::step() {
  drain_inbox();
  bool did_work = true;
  try {
    did_work = run_phases();
  } catch (const std::exception& e) {
    fail_step(internal_error(std::string("engine step: ") + e.what()));
  } catch (...) {
    fail_step(internal_error("engine step: unknown exception"));
  }
  release_finished();
  publish_stats();
  return did_work;
}

bool Engine::run_phases() {
  runner_batch_.clear();
  batch_sequences_.clear();
  Status st = schedule();
  if (!st.is_ok()) {
    fail_step(st);
    return true;
  }
  apply_plan();
  build_batch();
  const bool did_work = !runner_batch_.empty() || !plan_.rejected.empty() || !finished_.empty();
  if (!runner_batch_.empty()) {
    const double t0 = now();
    prepare_masks();
    {
      // Joined however the forward ends: the helper uses this step's sequences.
      struct JoinMasks {
        Engine* engine;
        ~JoinMasks() { engine->wait_for_masks(); }
      } join{this};
      st = forward();
    }
    if (st.is_ok()) sample_batch();
    else
      for (Sequence* seq : batch_sequences_) finish(*seq, FinishReason::kError, st);
    const double seconds = now() - t0;
    if (batch_has_drafts_) stats_.verify_seconds += seconds;
    step_times_.record(stats_.last_batch_tokens, seconds);
    if (!batch_has_drafts_) plain_step_times_.record(stats_.last_batch_tokens, seconds);
  }
  if (components_.drafter && components_.num_draft_tokens > 0) propose_drafts();
  return did_work;
}

Status Engine::schedule() {
  plan_.clear();
  Status st = components_.scheduler->schedule(*scheduler_kv_, now(), &plan_);
  if (!st.is_ok()) return Status(st.code(), "scheduler: " + st.message());
  return st;
}

void Engine::apply_plan() {
  for (const RejectedSequence& r : plan_.rejected)
    if (Sequence* s = find_sequence(r.id)) finish(*s, FinishReason::kError, r.reason);
  for (SeqId id : plan_.preempted) {
    Sequence* s = find_sequence(id);
    if (!s) continue;
    if (s->kv_pipelined) {
      // Its blocks went back with the preemption: stop the transfer writing into them before
      // anything computes over them this step.
      s->kv_pipelined = false;
      if (auto a = awaiting_kv_.find(id); a != awaiting_kv_.end()) {
        a->second->detach();
        awaiting_kv_.erase(a);
      }
      ++stats_.num_kv_import_fallbacks;
    }
    // Recompute on resume: the prompt and everything generated so far is fed again.
    discard_drafts(*s, s->info.num_draft_tokens);
    s->info.num_computed_tokens = 0;
    s->info.status = SequenceStatus::kWaiting;
    ++s->info.num_preemptions;
    ++stats_.num_preemptions;
  }
  // Copy-on-write after forks, before anything is written this step.
  block_copies_.clear();
  components_.kv_cache->take_block_copies(&block_copies_);
  if (!block_copies_.empty()) runner_->copy_blocks(block_copies_);
}

void Engine::build_batch() {
  batch_has_drafts_ = false;
  const double t = now();
  for (const ScheduledSequence& s : plan_.scheduled) {
    Sequence* seq = find_sequence(s.id);
    if (!seq || seq->finished || s.num_new_tokens <= 0) continue;
    // Prefix-cache hits need no computation.
    seq->info.num_computed_tokens += s.num_cached_tokens;
    if (seq->timings.first_scheduled < 0) {
      seq->timings.first_scheduled = t;
      seq->num_cached_prompt_tokens = s.num_cached_tokens;
    }
    seq->info.status = SequenceStatus::kRunning;
    const int32_t start = seq->info.num_computed_tokens;
    // Drafts the scheduler did not fit into this step are dropped: verification needs every
    // draft of the sequence fed in one step.
    const int32_t unfed = seq->info.num_tokens() - (start + s.num_new_tokens);
    if (unfed > 0 && seq->info.num_draft_tokens > 0)
      discard_drafts(*seq, std::min(unfed, seq->info.num_draft_tokens));
    const bool reaches_end = start + s.num_new_tokens == seq->info.num_tokens();
    RunnerSequence rs;
    rs.tokens = seq->tokens.data() + start;
    rs.num_tokens = s.num_new_tokens;
    rs.start_position = start;
    rs.block_table = components_.kv_cache->block_table(seq->info.id);
    // Only rows that will be sampled get logits: 1 + k for a sequence verifying k drafts.
    rs.num_logit_rows = reaches_end ? 1 + seq->info.num_draft_tokens : 0;
    // Prompt logprobs: every row from the first position whose next prompt token is still
    // to be scored (position p predicts token p + 1).
    if (seq->prompt_logprobs_pending()) {
      const int32_t first = std::max(start, static_cast<int32_t>(seq->prompt_logprobs.size()));
      if (first < start + s.num_new_tokens)
        rs.num_logit_rows = std::max(rs.num_logit_rows, start + s.num_new_tokens - first);
    }
    batch_has_drafts_ |= reaches_end && seq->info.num_draft_tokens > 0;
    runner_batch_.push_back(rs);
    batch_sequences_.push_back(seq);
  }
}

Status Engine::forward() {
  int32_t batch_tokens = 0;
  for (const RunnerSequence& rs : runner_batch_) batch_tokens += rs.num_tokens;
  ++stats_.num_steps;
  stats_.num_batch_tokens += batch_tokens;
  stats_.last_batch_size = static_cast<int32_t>(runner_batch_.size());
  stats_.last_batch_tokens = batch_tokens;
  import_failed_.assign(batch_sequences_.size(), 0);
  bool pipelined = false;
  for (const Sequence* seq : batch_sequences_) pipelined |= seq->kv_pipelined;
  if (!pipelined) return runner_->forward(runner_batch_, &logits_);

  // Some sequences' KV layers are still arriving: the runner asks before each layer.
  class ImportGate final : public ForwardLayerGate {
   public:
    explicit ImportGate(Engine& engine) : engine_(engine) {}
    void before_layer(int32_t layer) override {
      for (size_t i = 0; i < engine_.batch_sequences_.size(); ++i) {
        Sequence* seq = engine_.batch_sequences_[i];
        if (!seq->kv_pipelined || engine_.import_failed_[i]) continue;
        auto it = engine_.awaiting_kv_.find(seq->info.id);
        if (it == engine_.awaiting_kv_.end()) {
          engine_.import_failed_[i] = 1;
          continue;
        }
        KvImport& import = *it->second;
        const double t0 = engine_.now();
        if (import.wait_layer(layer, import.options().layer_wait_seconds) != KvImport::LayerState::kLanded)
          engine_.import_failed_[i] = 1;  // no row lands any more; this result is discarded
        engine_.stats_.kv_layer_wait_seconds += engine_.now() - t0;
      }
    }

   private:
    Engine& engine_;
  } gate(*this);
  for (const Sequence* seq : batch_sequences_)
    if (seq->kv_pipelined) {
      auto it = awaiting_kv_.find(seq->info.id);
      if (it != awaiting_kv_.end() && !it->second->all_layers_landed()) ++stats_.num_kv_pipelined_starts;
    }
  return gated_runner_->forward_gated(runner_batch_, &logits_, gate);
}

void Engine::sample_batch() {
  const size_t vocab = static_cast<size_t>(runner_->vocab_size());
  size_t row = 0;
  for (size_t i = 0; i < batch_sequences_.size(); ++i) {
    Sequence& seq = *batch_sequences_[i];
    const RunnerSequence& rs = runner_batch_[i];
    float* first_row = logits_.data() + row * vocab;
    row += rs.num_logit_rows;
    if (seq.finished) continue;  // ended earlier this step (cancelled, rejected)
    if (seq.kv_pipelined && !settle_pipelined_import(seq, import_failed_[i] != 0)) continue;
    // Before sampling: the sampler may modify its row in place.
    if (seq.prompt_logprobs_pending()) record_prompt_logprobs(seq, rs, first_row);
    if (rs.start_position + rs.num_tokens < seq.info.num_tokens()) {
      // A prompt chunk short of the prompt's end: nothing to sample.
      seq.info.num_computed_tokens += rs.num_tokens;
      components_.kv_cache->mark_computed(seq.info, seq.info.num_computed_tokens);
      continue;
    }
    // The sampled rows are the last 1 + drafts of the sequence's rows.
    const int32_t num_sampled_rows = 1 + seq.info.num_draft_tokens;
    sample_sequence(seq, rs.num_tokens, first_row + static_cast<size_t>(rs.num_logit_rows - num_sampled_rows) * vocab);
  }
}

void Engine::record_prompt_logprobs(Sequence& seq, const RunnerSequence& rs, const float* first_row) {
  const size_t vocab = static_cast<size_t>(runner_->vocab_size());
  const int32_t first_position = rs.start_position + rs.num_tokens - rs.num_logit_rows;
  for (int32_t r = 0; r < rs.num_logit_rows && seq.prompt_logprobs_pending(); ++r) {
    const int32_t target = first_position + r + 1;  // the prompt token this row predicts
    if (target != static_cast<int32_t>(seq.prompt_logprobs.size()) + 1) continue;
    SampledToken t;
    t.token = seq.tokens[static_cast<size_t>(target)];
    fill_token_logprobs(std::span<const float>(first_row + static_cast<size_t>(r) * vocab, vocab),
                        seq.request->spec.prompt_logprobs, &t, &logprob_index_);
    seq.prompt_logprobs.push_back(std::move(t));
  }
}

void Engine::sample_sequence(Sequence& seq, int32_t num_fed, float* first_row) {
  if (seq.info.max_new_tokens == 0) {
    // Prompt logprobs only (max_tokens 0): the prompt is computed, nothing is generated; the
    // n samples are n equal (empty) choices.
    seq.info.num_computed_tokens += num_fed;
    components_.kv_cache->mark_computed(seq.info, seq.info.num_computed_tokens);
    const int32_t forks = seq.pending_forks;
    const SeqId first_child = next_seq_id_;
    fork_children(seq);
    finish(seq, FinishReason::kLength);
    for (int32_t k = 0; k < forks; ++k)
      if (Sequence* child = find_sequence(first_child + k)) finish(*child, FinishReason::kLength);
    return;
  }
  if (seq.pending_forks > 0) {
    // The prompt is done: children share its KV and sample from copies of this row.
    seq.info.num_computed_tokens += num_fed;
    components_.kv_cache->mark_computed(seq.info, seq.info.num_computed_tokens);
    num_fed = 0;
    const size_t vocab = static_cast<size_t>(runner_->vocab_size());
    const int32_t forks = seq.pending_forks;
    const SeqId first_child = next_seq_id_;
    fork_children(seq);
    for (int32_t k = 0; k < forks; ++k) {
      Sequence* child = find_sequence(first_child + k);
      if (!child || child->finished) continue;
      fork_row_.assign(first_row, first_row + vocab);
      sampled_.clear();
      const Status st = guarded_pick(*child, fork_row_.data());
      commit(*child, 0, st, sampled_);
    }
  }
  const int32_t num_drafts = seq.info.num_draft_tokens;
  sampled_.clear();
  const Status st = guarded_pick(seq, first_row);
  // K/V is valid for the fed tokens up to the last one plus the accepted drafts only.
  const int32_t accepted = num_drafts > 0 ? static_cast<int32_t>(sampled_.size()) - 1 : 0;
  commit(seq, num_fed - num_drafts + std::max(0, accepted), st, sampled_);
  // Roll the rejected drafts' slots back.
  if (num_drafts > 0 && !seq.finished) components_.kv_cache->truncate(seq.info, seq.info.num_tokens());
}

// A sampler (or drafter) exception fails this sequence only, like an error status.
Status Engine::guarded_pick(Sequence& seq, float* first_row) {
  try {
    return pick_tokens(seq, first_row, &sampled_);
  } catch (const std::exception& e) {
    return internal_error(std::string("sampler: ") + e.what());
  }
}

Status Engine::pick_tokens(Sequence& seq, float* first_row, std::vector<SampledToken>* out) {
  const SamplingParams& p = seq.request->spec.params;
  const int32_t vocab = runner_->vocab_size();
  const int32_t num_drafts = seq.info.num_draft_tokens;
  if (num_drafts == 0) {
    out->emplace_back();
    if (seq.matcher && seq.prepared_mask >= 0) {
      const PreparedMask& m = prepared_masks_[static_cast<size_t>(seq.prepared_mask)];
      seq.prepared_mask = -1;
      if (!m.status.is_ok()) return Status(m.status.code(), "constraint: " + m.status.message());
      const double t0 = now();
      Status st = apply_mask(m.words, first_row);
      stats_.constraint_seconds += now() - t0;
      if (!st.is_ok()) return st;
    } else if (seq.matcher) {
      Status st = mask_row(*seq.matcher, first_row);
      if (!st.is_ok()) return st;
    }
    SamplingInput in{&p, seq.info.tokens};
    Status st = components_.sampler->sample(std::span<float>(first_row, vocab), in, &seq.sampler_state,
                                            &out->back());
    if (st.is_ok() && seq.matcher && !seq.matcher->accept(out->back().token))
      st = internal_error("constraint: the sampler picked token " + std::to_string(out->back().token) +
                          ", which the mask excludes");
    return st;
  }
  seq.drop_drafts(num_drafts);
  verify_rows_.clear();
  for (int32_t k = 0; k <= num_drafts; ++k)
    verify_rows_.emplace_back(first_row + static_cast<size_t>(k) * vocab, vocab);
  const DraftView drafts{seq.draft.tokens, seq.draft.q};
  SamplingInput in{&p, seq.info.tokens};
  Status st = seq.matcher ? mask_verify_rows(seq) : Status::ok();
  if (st.is_ok()) st = components_.sampler->verify(verify_rows_, drafts, in, &seq.sampler_state, out);
  if (st.is_ok() && (out->empty() || out->size() > static_cast<size_t>(num_drafts) + 1))
    st = internal_error("sampler: verify of " + std::to_string(num_drafts) + " drafts returned " +
                        std::to_string(out->size()) + " tokens (expected 1.." +
                        std::to_string(num_drafts + 1) + ")");
  if (st.is_ok() && seq.matcher)
    for (const SampledToken& t : *out)
      if (!seq.matcher->accept(t.token)) {
        st = internal_error("constraint: verification kept token " + std::to_string(t.token) +
                            ", which the mask excludes");
        break;
      }
  const int32_t accepted = st.is_ok() ? static_cast<int32_t>(out->size()) - 1 : 0;
  ++stats_.num_drafts;
  stats_.num_draft_tokens += num_drafts;
  stats_.num_accepted_draft_tokens += accepted;
  for (int32_t i = 0; i < accepted; ++i) ++stats_.num_accepted_tokens_per_pos[i];
  seq.acceptance.record(num_drafts, accepted);
  acceptance_.record(num_drafts, accepted);
  seq.num_draft_tokens_fed += num_drafts;
  seq.num_draft_tokens_accepted += accepted;
  seq.drafter_known_tokens += accepted;
  components_.drafter->on_drafts_settled(seq.info.id, num_drafts, accepted);
  seq.draft.clear();
  return st;
}

void Engine::commit(Sequence& seq, int32_t num_newly_computed, const Status& status,
                    std::vector<SampledToken>& tokens) {
  seq.info.num_computed_tokens += num_newly_computed;
  if (!status.is_ok()) {
    finish(seq, FinishReason::kError, status);
    return;
  }
  emitted_.clear();
  for (const SampledToken& tok : tokens) {
    append_token(seq, tok, &emitted_);
    if (seq.finished) break;  // EOS, a stop token or a limit inside accepted drafts
  }
  // The constraint allows nothing but the end now: the output is complete.
  if (!seq.finished && seq.matcher && seq.matcher->is_complete())
    finish(seq, FinishReason::kStop, {}, /*report_now=*/false);
  // Accepted drafts after an end are not part of the sequence: their K/V does not count.
  seq.info.num_computed_tokens = std::min(seq.info.num_computed_tokens, seq.info.num_tokens());
  components_.kv_cache->mark_computed(seq.info, seq.info.num_computed_tokens);
  // Tokens and, when the sequence ended, its finish reason in one event.
  emit(seq, emitted_);
}

void Engine::discard_drafts(Sequence& seq, int32_t num_to_drop) {
  if (num_to_drop <= 0) return;
  const int32_t proposed = seq.info.num_draft_tokens;
  seq.drop_drafts(num_to_drop);
  if (seq.info.num_draft_tokens == 0) {
    seq.draft.clear();
    components_.drafter->on_drafts_settled(seq.info.id, proposed, 0);
  } else {
    // The fed prefix of the drafts stays to be verified; q rows past it go.
    seq.draft.tokens.resize(seq.info.num_draft_tokens);
    if (!seq.draft.q.empty())
      seq.draft.q.resize(static_cast<size_t>(seq.info.num_draft_tokens) * runner_->vocab_size());
  }
}

void Engine::fail_step(const Status& error) {
  ++stats_.num_step_errors;
  if (!batch_sequences_.empty()) {
    for (Sequence* seq : batch_sequences_) finish(*seq, FinishReason::kError, error);
    return;
  }
  for (auto& [id, seq] : sequences_) finish(*seq, FinishReason::kError, error);
}

void Engine::propose_drafts() {
  const int32_t vocab = runner_->vocab_size();
  draft_requests_.clear();
  draft_sequences_.clear();
  for (Sequence* seq : batch_sequences_) {
    if (seq->finished || seq->kv_pipelined || seq->info.is_prefill() || seq->info.num_draft_tokens > 0) continue;
    // The target's token after the drafts needs room too.
    const int32_t room = std::min(components_.num_draft_tokens, tokens_left(*seq) - 1);
    if (room <= 0) continue;
    seq->draft.clear();
    draft_requests_.push_back({&seq->info, room, &seq->draft});
    draft_sequences_.push_back(seq);
  }
  if (components_.adaptive_drafts) adapt_draft_lengths();
  if (draft_requests_.empty()) return;
  int32_t catch_up_tokens = 0;
  for (const Sequence* seq : draft_sequences_) catch_up_tokens += seq->drafter_catch_up_tokens();
  const double t0 = now();
  Status st;
  try {
    st = components_.drafter->propose(draft_requests_);
  } catch (const std::exception& e) {
    st = internal_error(std::string("drafter: ") + e.what());
  }
  const double draft_seconds = now() - t0;
  stats_.draft_seconds += draft_seconds;
  if (!st.is_ok()) ++stats_.num_drafter_errors;
  size_t proposed = 0;  // drafts the call produced, whether or not they are kept below
  for (size_t i = 0; i < draft_requests_.size(); ++i) {
    Sequence& seq = *draft_sequences_[i];
    Draft& d = seq.draft;
    if (d.tokens.size() > static_cast<size_t>(draft_requests_[i].max_drafts))
      d.tokens.resize(draft_requests_[i].max_drafts);
    proposed += d.tokens.size();
    seq.drafter_known_tokens = seq.info.num_tokens();
    // A failed call, or q rows that do not match the tokens: no drafts for this sequence.
    const bool bad_q = !d.q.empty() && d.q.size() < d.tokens.size() * static_cast<size_t>(vocab);
    bool bad_token = false;
    for (TokenId t : d.tokens) bad_token |= t < 0 || t >= vocab;
    if (!st.is_ok() || bad_q || bad_token || d.tokens.empty()) {
      if (!d.tokens.empty()) components_.drafter->on_drafts_settled(seq.info.id, static_cast<int32_t>(d.tokens.size()), 0);
      d.clear();
      continue;
    }
    if (seq.matcher) {
      // Drafts the constraint would mask can never be accepted: verify only the allowed run.
      const size_t keep = allowed_draft_prefix(seq, d.tokens);
      if (keep < d.tokens.size()) {
        ++stats_.num_constraint_draft_cuts;
        if (keep == 0) {
          components_.drafter->on_drafts_settled(seq.info.id, static_cast<int32_t>(d.tokens.size()), 0);
          d.clear();
          continue;
        }
        d.tokens.resize(keep);
      }
    }
    if (!d.q.empty()) d.q.resize(d.tokens.size() * static_cast<size_t>(vocab));
    seq.tokens.insert(seq.tokens.end(), d.tokens.begin(), d.tokens.end());
    seq.info.num_draft_tokens = static_cast<int32_t>(d.tokens.size());
    seq.sync_view();
  }
  draft_cost_.record(static_cast<int32_t>(proposed), draft_seconds, catch_up_tokens);
}

void Engine::prepare_masks() {
  num_prepared_masks_ = 0;
  if (!components_.prepare_masks) {
    for (Sequence* seq : batch_sequences_) seq->prepared_mask = -1;
    return;
  }
  for (size_t i = 0; i < batch_sequences_.size(); ++i) {
    Sequence& seq = *batch_sequences_[i];
    const RunnerSequence& rs = runner_batch_[i];
    seq.prepared_mask = -1;
    // Rows that sample one token from the matcher's current state: a decode step or a
    // prompt's last chunk, without drafts (verification walks the drafts) or forks (each
    // child samples under its own matcher).
    const bool samples_one = seq.matcher && !seq.finished && rs.num_logit_rows > 0 &&
                             rs.start_position + rs.num_tokens == seq.info.num_tokens() &&
                             seq.info.num_draft_tokens == 0 && seq.pending_forks == 0 &&
                             seq.info.max_new_tokens != 0;
    if (!samples_one) continue;
    if (prepared_masks_.size() <= num_prepared_masks_) prepared_masks_.emplace_back();
    PreparedMask& m = prepared_masks_[num_prepared_masks_];
    m.seq = &seq;
    m.words.assign(mask_words_.size(), 0u);
    m.status = Status::ok();
    seq.prepared_mask = static_cast<int32_t>(num_prepared_masks_++);
  }
  if (num_prepared_masks_ == 0) return;
  // The helper touches only the prepared entries and their matchers, and writes its time to
  // mask_prepare_seconds_; the engine thread reads them after the join.
  mask_worker_ = std::thread([this] {
    const double t0 = now();
    for (size_t k = 0; k < num_prepared_masks_; ++k) {
      PreparedMask& m = prepared_masks_[k];
      try {
        m.status = m.seq->matcher->fill_mask(m.words);
      } catch (const std::exception& e) {
        m.status = internal_error(std::string("fill_mask threw: ") + e.what());
      }
    }
    mask_prepare_seconds_ = now() - t0;
  });
}

void Engine::wait_for_masks() {
  if (!mask_worker_.joinable()) return;
  const double t0 = now();
  mask_worker_.join();
  stats_.constraint_seconds += now() - t0;
  stats_.constraint_prepare_seconds += mask_prepare_seconds_;
  stats_.num_prepared_masks += num_prepared_masks_;
}

Status Engine::mask_row(ConstraintMatcher& matcher, float* row) {
  const double t0 = now();
  std::fill(mask_words_.begin(), mask_words_.end(), 0u);
  Status st = matcher.fill_mask(mask_words_);
  if (!st.is_ok()) return Status(st.code(), "constraint: " + st.message());
  st = apply_mask(mask_words_, row);
  stats_.constraint_seconds += now() - t0;
  return st;
}

Status Engine::apply_mask(std::span<const uint32_t> allowed, float* row) {
  const bool any = kernels::apply_logit_mask(allowed.data(), row, runner_->vocab_size());
  ++stats_.num_masked_rows;
  if (!any) return invalid_argument("constraint: no token of the vocabulary can continue the output");
  return Status::ok();
}

Status Engine::mask_verify_rows(Sequence& seq) {
  std::unique_ptr<ConstraintMatcher> walker = seq.matcher->clone();
  for (size_t k = 0; k < verify_rows_.size(); ++k) {
    Status st = mask_row(*walker, verify_rows_[k].data());
    if (!st.is_ok()) return st;
    if (k < seq.draft.tokens.size() && !walker->accept(seq.draft.tokens[k]))
      return internal_error("constraint: draft token " + std::to_string(seq.draft.tokens[k]) +
                            " was fed although the constraint excludes it");
  }
  return Status::ok();
}

size_t Engine::allowed_draft_prefix(const Sequence& seq, std::span<const TokenId> drafts) const {
  std::unique_ptr<ConstraintMatcher> walker = seq.matcher->clone();
  size_t n = 0;
  while (n < drafts.size() && walker->accept(drafts[n])) ++n;
  return n;
}

// Each candidate's max_drafts becomes what pays for it (tessera/speculation_control.h), in a
// step of as many decode rows as there are candidates; those given none are left out, and so
// are those whose drafter would first have to catch up on more than the drafts can save.
void Engine::adapt_draft_lengths() {
  const size_t num_candidates = draft_requests_.size();
  if (num_candidates == 0 || !step_times_.has_data()) return;
  const auto rows = static_cast<int32_t>(num_candidates);
  // A token's worth is what it costs in a step without drafts. While every sequence drafts,
  // each step feeds 1 + k rows per sequence, and a line through those times puts the plain
  // step too high (the step time is concave in the rows: 1, 2 and 5 rows of SmolLM2 Q4_1 at
  // batch 1 took ~3.6, ~5.3 and ~6.4 ms), which kept layer-skip's drafts on when each cost
  // more than a plain step. So the value is also read off steps that had no drafts, and the
  // lower of the two is taken: drafts must pay by either measure.
  double step_seconds = step_times_.seconds_for(rows);
  if (plain_step_times_.has_data()) step_seconds = std::min(step_seconds, plain_step_times_.seconds_for(rows));
  const double row_seconds = step_times_.seconds_per_extra_token();
  const double draft_token_seconds = draft_cost_.seconds_per_token();
  const double catch_up_token_seconds = draft_cost_.seconds_per_catch_up_token();
  size_t kept = 0;
  for (size_t i = 0; i < num_candidates; ++i) {
    Sequence* seq = draft_sequences_[i];
    // A seeded sampled request keeps its drafts: how many there are decides how its random
    // stream is consumed, and a count that followed step times would make it irreproducible.
    const SamplingParams& p = seq->request->spec.params;
    if (p.has_seed && !p.is_greedy()) {
      draft_requests_[kept] = draft_requests_[i];
      draft_sequences_[kept++] = seq;
      continue;
    }
    const double alpha = seq->acceptance.alpha(acceptance_.alpha());
    int32_t k = choose_num_drafts(alpha, draft_requests_[i].max_drafts, rows, step_seconds, row_seconds,
                                  draft_token_seconds);
    if (const int32_t behind = seq->drafter_catch_up_tokens(); k > 0 && behind > 0) {
      if (!catch_up_pays(alpha, k, tokens_left(*seq), step_seconds / rows, row_seconds, draft_token_seconds,
                         catch_up_token_seconds * behind))
        k = 0;
    }
    if (k == 0) {
      seq->acceptance.age();  // so that it is tried again later
      ++stats_.num_draft_skips;
      continue;
    }
    draft_requests_[kept] = draft_requests_[i];
    draft_requests_[kept].max_drafts = k;
    draft_sequences_[kept] = seq;
    ++kept;
  }
  stats_.speculation_off = kept == 0;
  if (kept == 0) draft_cost_.age();
  draft_requests_.resize(kept);
  draft_sequences_.resize(kept);
}

void Engine::release_finished() {
  // Each release is guarded: a plugin that throws here must not keep the others' blocks.
  auto guarded = [](auto&& fn) {
    try {
      fn();
    } catch (...) {
    }
  };
  for (SeqId id : finished_) {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;
    guarded([&] { components_.scheduler->remove(id); });
    if (auto a = awaiting_kv_.find(id); a != awaiting_kv_.end()) {
      a->second->detach();  // before the blocks go back: no late write lands in them
      awaiting_kv_.erase(a);
    }
    bool held = false;
    if (it->second->request->spec.kv_export) guarded([&] { held = hold_for_export(*it->second); });
    if (!held) guarded([&] { components_.kv_cache->free(id); });
    if (components_.drafter) guarded([&] { components_.drafter->forget(id); });
    ++stats_.num_finished;
    auto req = it->second->request;
    sequences_.erase(it);
    if (--req->num_open <= 0) requests_.erase(req->id);
  }
  finished_.clear();
}

void Engine::publish_stats() {
  auto& c = components_;
  std::lock_guard<std::mutex> lock(stats_mutex_);
  stats_.num_running = c.scheduler->num_running();
  stats_.num_waiting = c.scheduler->num_waiting();
  stats_.kv = c.kv_cache->stats();
  stats_.num_held_exports = static_cast<int32_t>(held_exports_.size());
  stats_.num_waiting_for_kv = static_cast<int32_t>(awaiting_kv_.size());
  published_stats_ = stats_;
}

void Engine::run_until_idle() {
  for (;;) {
    const bool worked = step();
    bool empty;
    {
      std::lock_guard<std::mutex> lock(inbox_mutex_);
      empty = inbox_requests_.empty() && inbox_cancels_.empty();
    }
    if (!worked && empty && sequences_.empty()) return;
  }
}

void Engine::start() {
  if (running_.exchange(true)) return;
  loop_ = std::thread([this] {
    while (running_) {
      const bool worked = step();
      // Idle, or only sequences whose KV is in flight: nothing changes until the inbox does.
      if (!worked && sequences_.size() == awaiting_kv_.size()) {
        std::unique_lock<std::mutex> lock(inbox_mutex_);
        inbox_ready_.wait_for(lock, std::chrono::milliseconds(50), [this] {
          return !running_ || !inbox_requests_.empty() || !inbox_cancels_.empty() ||
                 !inbox_kv_landed_.empty() || !inbox_kv_started_.empty() || !inbox_export_releases_.empty();
        });
      }
    }
  });
}

void Engine::stop() {
  if (!running_.exchange(false)) return;
  inbox_ready_.notify_all();
  if (loop_.joinable()) loop_.join();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return published_stats_;
}

}  // namespace tessera

namespace tessera {

std::string Engine::kv_fingerprint() const {
  // FNV-1a over the tensor table and a sample of every tensor's bytes: two files with the
  // same shapes but other weights (another quantization, another fine-tune) differ.
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  for (const gguf::TensorInfo& t : components_.model->file().tensors()) {
    mix(t.name.data(), t.name.size());
    mix(&t.type, sizeof t.type);
    mix(t.dims.data(), t.dims.size() * sizeof(int64_t));
    const size_t n = std::min<size_t>(t.num_bytes, 256);
    if (t.data) {
      mix(t.data, n);
      mix(t.data + t.num_bytes - n, n);
    }
  }
  const ModelHparams& hp = components_.model->hparams();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return "model=" + components_.model->name() + " weights=" + hex + " layers=" + std::to_string(hp.num_layers) +
         " kv_heads=" + std::to_string(hp.num_kv_heads) + " head_dim=" + std::to_string(hp.head_dim) +
         " k=" + kv_dtype_name(kv_layout_.k_dtype) + " v=" + kv_dtype_name(kv_layout_.v_dtype);
}

}  // namespace tessera
