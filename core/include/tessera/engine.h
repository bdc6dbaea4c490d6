// The engine: one step loop per deployment. Each step the scheduler plans a flattened batch
// (prompt chunks, decode tokens, tokens plus drafts), the KV manager provides slots, the
// runner computes logits for the rows that are sampled, the sampler picks tokens (or
// verifies drafts), and results stream back to each request's callback.
//
// Thread-safety: submit() and cancel() may be called from any thread; step() and the
// callbacks run on one engine thread (the caller of step(), or the background thread
// started by start()).
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "tessera/kv_transfer.h"
#include "tessera/model.h"
#include "tessera/model_runner.h"
#include "tessera/sdk.h"
#include "tessera/speculation_control.h"

namespace tessera {

struct EngineComponents {
  std::shared_ptr<Model> model;
  std::shared_ptr<Backend> backend;
  std::shared_ptr<Quantizer> quantizer;
  std::shared_ptr<Scheduler> scheduler;
  std::shared_ptr<KvCacheManager> kv_cache;
  std::shared_ptr<AttentionKernel> attention;
  std::shared_ptr<Sampler> sampler;
  std::shared_ptr<Drafter> drafter;  // may be null
  // Structured output (tessera/sdk/constraint.h); may be null, then constrained requests are
  // refused.
  std::shared_ptr<Constraint> constraint;
  // Compute constrained rows' masks on a helper thread while the forward runs. Worth it only
  // when the forward leaves a core free (a GPU backend, or fewer CPU threads than cores): on
  // a CPU whose cores all run the forward, the helper takes its time from the forward.
  bool prepare_masks = false;
  int32_t num_draft_tokens = 0;      // per sequence and step at most, when a drafter is set
  // Adapt each sequence's drafts to its acceptance and the measured step cost, down to none
  // when verification costs more than it saves (tessera/speculation_control.h).
  bool adaptive_drafts = false;
  int32_t max_context = 0;           // 0: the model's trained context, capped at 4096
};

// Per-request timings in seconds on the engine's monotonic clock. TTFT includes the first
// decode step (it ends when the first generated token exists).
struct RequestTimings {
  double arrival = 0;
  double first_scheduled = -1;
  double first_token = -1;
  double finished = -1;
  std::vector<double> token_times;  // when each generated token was produced

  double queue_time() const { return first_scheduled < 0 ? 0 : first_scheduled - arrival; }
  double ttft() const { return first_token < 0 ? 0 : first_token - arrival; }
  double end_to_end() const { return finished < 0 ? 0 : finished - arrival; }
  // Mean time per output token after the first: (T_total - TTFT) / (N - 1).
  double tpot() const;
  std::vector<double> inter_token_latencies() const;
};

struct GenerationEvent {
  uint64_t request_id = 0;
  int32_t choice = 0;                 // which of the n samples
  std::vector<SampledToken> tokens;   // new tokens of this step (end tokens are not included)
  // The last event of a sample has finished = true (possibly with final tokens).
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;                       // set when finish_reason == kError
  int32_t num_prompt_tokens = 0;
  int32_t num_cached_prompt_tokens = 0;  // prefix-cache hits
  // Speculative decoding, this sample so far: drafts fed for verification and, of them,
  // the ones accepted.
  int32_t num_draft_tokens = 0;
  int32_t num_accepted_draft_tokens = 0;
  const RequestTimings* timings = nullptr;  // valid during the callback
  // Requests with prompt_logprobs: entry i is prompt token i + 1 given tokens 0..i (its
  // logprob and top alternatives from the raw logits; token 0 has none). Delivered once, in
  // choice 0's first event after the prompt is computed (with its first token, or with the
  // finish when max_tokens is 0).
  std::vector<SampledToken> prompt_logprobs;
};

using EventCallback = std::function<void(const GenerationEvent&)>;

struct GenerationRequest {
  std::vector<TokenId> prompt;
  SamplingParams params;
  int32_t n = 1;          // independent samples sharing the prompt (forked after prefill)
  int32_t priority = 0;
  // vLLM's prompt_logprobs: -1 none; N >= 0 reports every prompt token's logprob (given the
  // tokens before it) with its N most likely alternatives, computed in the prefill pass
  // (logits of every prompt position are kept for this request only). Such a request skips
  // the prefix cache (a cached prefix has no logits) and may set params.max_tokens to 0:
  // the prompt is evaluated and nothing is generated.
  int32_t prompt_logprobs = -1;
  EventCallback on_event;
  // From Engine::compile_constraint; null: unconstrained. Each sample gets its own matcher:
  // its logits are masked to the tokens the constraint allows, and it ends ("stop") when the
  // constraint says the output is complete.
  std::shared_ptr<const CompiledConstraint> constraint;
  // Disaggregation (tessera/kv_transfer.h); both null on a colocated engine.
  // kv_export (prefill engine): compute the prompt, sample the first token, then hold the
  // blocks for the transfer instead of generating on (max_tokens is ignored: one token).
  std::shared_ptr<KvExport> kv_export;
  // kv_import (decode engine): the prompt was computed elsewhere; its first token (from
  // kv_import->prefilled()) is emitted at once, and decoding starts when the rows landed.
  std::shared_ptr<KvImport> kv_import;
};


// Longest draft the engine verifies per sequence and step (num_draft_tokens at most this).
inline constexpr int32_t kMaxDraftTokens = 32;

struct EngineStats {
  uint64_t num_steps = 0;
  uint64_t num_batch_tokens = 0;   // tokens fed to the model, all steps
  uint64_t num_preemptions = 0;
  uint64_t num_finished = 0;
  int32_t last_batch_size = 0;
  int32_t last_batch_tokens = 0;
  int32_t num_running = 0;
  int32_t num_waiting = 0;
  // Speculative decoding, named as vLLM's spec_decode_* counters: sequences-steps that
  // verified drafts, draft tokens verified, of them accepted, and accepted per position
  // (position i counts verifications that accepted at least i + 1 drafts).
  uint64_t num_drafts = 0;
  uint64_t num_draft_tokens = 0;
  uint64_t num_accepted_draft_tokens = 0;
  std::array<uint64_t, kMaxDraftTokens> num_accepted_tokens_per_pos{};
  uint64_t num_drafter_errors = 0;  // propose calls that failed (no drafts that step)
  // Adaptive drafts: sequence-steps the cost model gave no drafts, and whether in the last
  // step it gave none to any sequence that could have drafted (speculation auto-off).
  uint64_t num_draft_skips = 0;
  bool speculation_off = false;
  double draft_seconds = 0;         // in Drafter::propose
  double verify_seconds = 0;        // forward + sampling of steps that verified drafts
  // Steps that ended in an error from a plugin (their requests failed, the engine went on).
  uint64_t num_step_errors = 0;
  // Constrained decoding: logit rows masked, seconds spent computing and applying the masks,
  // and drafts cut because the constraint does not allow them.
  // constraint_seconds is what the engine thread spends on masks: applying them, computing
  // those it could not prepare, and waiting for the preparation to finish. The masks of rows
  // that sample one token are computed on a helper thread while the forward runs
  // (constraint_prepare_seconds, num_prepared_masks): off the step's path unless it outlasts
  // the forward.
  uint64_t num_masked_rows = 0;
  double constraint_seconds = 0;
  uint64_t num_prepared_masks = 0;
  double constraint_prepare_seconds = 0;
  uint64_t num_constraint_draft_cuts = 0;
  // Disaggregation: prefills held for a transfer (now), finished imports, imports that fell
  // back to computing the prompt here (a failed transfer, or no free blocks), KV bytes
  // written by imports, and sequences waiting for their KV (now).
  int32_t num_held_exports = 0;
  uint64_t num_kv_imports = 0;
  uint64_t num_kv_import_fallbacks = 0;
  uint64_t kv_import_bytes = 0;
  int32_t num_waiting_for_kv = 0;
  // Layer-pipelined decode start: decode steps that began before the sequence's last KV
  // layer landed, and the time such steps waited for layers inside the forward.
  uint64_t num_kv_pipelined_starts = 0;
  double kv_layer_wait_seconds = 0;
  KvStats kv;
};

class Engine {
 public:
  // Configures the KV cache, allocates its pool and the runner. Throws std::runtime_error
  // with the reason (e.g. the KV budget cannot hold one sequence).
  explicit Engine(EngineComponents components);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and enqueues. Errors (empty prompt, prompt or max_tokens past the context,
  // token outside the vocabulary) come back as a Status; nothing is enqueued then.
  Status submit(GenerationRequest request, uint64_t* request_id);
  // Compiles a structured-output spec with the engine's constraint plugin. Any thread. A bad
  // spec is kInvalidArgument naming the part of it; no constraint plugin is kUnimplemented.
  Status compile_constraint(const ConstraintSpec& spec, std::shared_ptr<const CompiledConstraint>* out) const;
  bool has_constraint() const { return components_.constraint != nullptr; }
  // The checks submit() makes, without enqueuing (any thread).
  Status check(const GenerationRequest& request) const;
  // Cancels all samples of a request; its blocks are freed on the next step. Unknown ids
  // are ignored.
  void cancel(uint64_t request_id);

  // Runs one step on the calling thread; returns false when there was nothing to do.
  bool step();
  // Steps until no request is waiting or running.
  void run_until_idle();
  // Runs the step loop on a background thread until stop().
  void start();
  void stop();

  EngineStats stats() const;
  // Model and KV layout as text: two engines exchange KV only when theirs are equal.
  std::string kv_fingerprint() const;
  const Model& model() const { return *components_.model; }
  int32_t max_context() const { return max_context_; }
  double now() const;

 private:
  struct Request;
  struct Sequence;
  class PromptLogprobsKvView;

  // The phases of step(), in order.
  void drain_inbox();
  void admit(const std::shared_ptr<Request>& r, double t);  // throws; leaves no trace then
  void reject_admission(const Request& r, const Status& error);  // its finished events
  bool run_phases();  // schedule .. draft; false when there was nothing to do
  Status schedule();
  void apply_plan();
  void build_batch();
  Status forward();
  void sample_batch();
  // Requests with prompt_logprobs: the logprobs of the prompt tokens this chunk's rows predict.
  void record_prompt_logprobs(Sequence& seq, const RunnerSequence& rs, const float* first_row);
  void propose_drafts();
  void adapt_draft_lengths();  // adaptive_drafts: cut or drop each candidate's drafts
  void release_finished();
  void publish_stats();
  // Disaggregation.
  void admit_imported(Sequence& seq);     // emits the first token, allocates, waits for KV
  void kv_landed(SeqId id, const Status& status);  // from the inbox
  void kv_started(SeqId id);  // from the inbox: a pipelined import's first layer landed
  // A pipelined import ended before the sequence's step could use it: its blocks are freed
  // and the prompt is computed here (the first token is already out).
  void recompute_after_import(Sequence& seq);
  // The import of a sequence that left awaiting_kv_ with every layer in place.
  void count_import(const KvImport& import);
  bool settle_pipelined_import(Sequence& seq, bool failed);
  // A finished kv_export sequence: true when it keeps its blocks for the transfer.
  bool hold_for_export(Sequence& seq);
  void release_export(SeqId id);          // from the inbox: the transfer is over
  void detach_transfers();                // engine shutdown

  // Ends the step's requests with `error`: the batch's when a batch was built, else every
  // live sequence (the scheduler failed, so none of them can progress).
  void fail_step(const Status& error);
  // Sampling of one batch sequence whose chunk reached its end: sample or verify, then commit.
  void sample_sequence(Sequence& seq, int32_t num_fed, float* first_row);
  Status pick_tokens(Sequence& seq, float* first_row, std::vector<SampledToken>* out);
  Status guarded_pick(Sequence& seq, float* first_row);  // pick_tokens into sampled_
  // Sets the logits `matcher` does not allow to -inf (constraint.h).
  Status mask_row(ConstraintMatcher& matcher, float* row);
  // Sets the logits outside `allowed` (one bit per token) to -inf; an error when none is left.
  Status apply_mask(std::span<const uint32_t> allowed, float* row);
  // Masks prepared while the forward runs: for each batch sequence that will sample one token
  // under a constraint, its matcher fills a mask on mask_worker_ (the engine thread does not
  // touch those matchers until wait_for_masks). Both are no-ops without constrained rows.
  void prepare_masks();
  void wait_for_masks();
  // Masks a verification's rows: row k with the state after drafts [0, k).
  Status mask_verify_rows(Sequence& seq);
  // How many of `drafts` the sequence's constraint allows in a row.
  size_t allowed_draft_prefix(const Sequence& seq, std::span<const TokenId> drafts) const;
  // Tokens the sequence may still generate: its max_tokens and the context both bound it.
  int32_t tokens_left(const Sequence& seq) const;
  // Advances the computed count, appends `tokens` (stopping where the sequence ends), tells
  // the KV cache and streams the tokens out: the one place a sampled token becomes output.
  void commit(Sequence& seq, int32_t num_newly_computed, const Status& status,
              std::vector<SampledToken>& tokens);
  // Removes pending drafts that will not be verified (the drafter hears 0 accepted).
  void discard_drafts(Sequence& seq, int32_t num_to_drop);
  // Marks a sequence finished; its blocks are freed at the end of the step. The finished
  // event goes out now, or with the step's tokens when report_now is false.
  void finish(Sequence& seq, FinishReason reason, Status error = {}, bool report_now = true);
  // Delivers `tokens` (and the finish, when due) to the request's callback; leaves `tokens`
  // empty with its capacity kept.
  void emit(Sequence& seq, std::vector<SampledToken>& tokens);
  void append_token(Sequence& seq, const SampledToken& token, std::vector<SampledToken>* emitted);
  void fork_children(Sequence& parent);
  Sequence* find_sequence(SeqId id);

  EngineComponents components_;
  int32_t max_context_ = 0;
  KvLayout kv_layout_;
  std::unique_ptr<ForwardRunner> runner_;  // the backend's, or the core ModelRunner
  LayerGatedForward* gated_runner_ = nullptr;  // runner_'s capability, when it has it
  // Per batch entry this step: 1 when the sequence's pipelined import failed during the
  // forward (its rows are worthless and its result is discarded).
  std::vector<uint8_t> import_failed_;
  // What the scheduler sees of the KV cache: the configured one, with no prefix hits for
  // sequences that need prompt logits.
  std::unique_ptr<PromptLogprobsKvView> scheduler_kv_;

  // Owned state, touched only on the engine thread.
  std::map<SeqId, std::unique_ptr<Sequence>> sequences_;
  std::map<uint64_t, std::shared_ptr<Request>> requests_;
  SeqId next_seq_id_ = 1;
  SchedulePlan plan_;
  std::vector<RunnerSequence> runner_batch_;
  std::vector<Sequence*> batch_sequences_;
  std::vector<BlockCopy> block_copies_;
  std::vector<float> logits_;
  std::vector<SeqId> finished_;
  // Per-step scratch, reused so the steady-state step does not allocate.
  std::vector<SampledToken> sampled_, emitted_;
  std::vector<TokenId> logprob_index_;
  std::vector<float> fork_row_;
  std::vector<std::span<float>> verify_rows_;
  std::vector<DraftRequest> draft_requests_;
  std::vector<Sequence*> draft_sequences_;
  std::vector<uint32_t> mask_words_;  // one bit per token, for mask_row
  struct PreparedMask {
    Sequence* seq = nullptr;
    std::vector<uint32_t> words;
    Status status;
  };
  std::vector<PreparedMask> prepared_masks_;  // [0, num_prepared_masks_) are this step's
  size_t num_prepared_masks_ = 0;
  std::thread mask_worker_;  // running between prepare_masks and wait_for_masks
  double mask_prepare_seconds_ = 0;  // the helper's time this step
  bool batch_has_drafts_ = false;
  // Disaggregation, engine thread: sequences whose KV is in flight (not in the scheduler,
  // unless Sequence::kv_pipelined),
  // and finished prefills whose blocks are held for a transfer.
  std::map<SeqId, std::shared_ptr<KvImport>> awaiting_kv_;
  std::map<SeqId, std::shared_ptr<KvExport>> held_exports_;
  size_t kv_token_bytes_k_ = 0, kv_token_bytes_v_ = 0;  // one token's K (V) rows, all KV heads
  StepTimeModel step_times_;  // forward + sampling seconds against tokens fed
  // The same over steps without drafts only: what a token costs when nothing is drafted.
  StepTimeModel plain_step_times_;
  DraftCostModel draft_cost_;  // the drafter's propose() seconds per draft token
  AcceptanceEstimate acceptance_;  // of every sequence's drafts: the prior of each sequence's
  EngineStats stats_;

  // Cross-thread inbox.
  mutable std::mutex inbox_mutex_;
  std::condition_variable inbox_ready_;
  std::vector<std::shared_ptr<Request>> inbox_requests_;
  std::vector<uint64_t> inbox_cancels_;
  std::vector<std::pair<SeqId, Status>> inbox_kv_landed_;
  std::vector<SeqId> inbox_kv_started_;
  std::vector<SeqId> inbox_export_releases_;
  std::atomic<uint64_t> next_request_id_{1};
  std::atomic<bool> running_{false};
  std::thread loop_;
  mutable std::mutex stats_mutex_;
  EngineStats published_stats_;
};

}  // namespace tessera
