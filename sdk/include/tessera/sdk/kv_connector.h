// kv_connector plugins move a prompt's KV cache between engine processes (SDK 2.9): the
// transport of prefill/decode disaggregation, the role vLLM's KV connector plays.
//
// A prefill engine computes a prompt and samples its first token; the decode engine that
// asked for it receives the first token, allocates blocks, receives the prompt's K/V one
// layer at a time and continues decoding as if it had computed the prompt itself. The host
// owns both engines' KV memory and the request's life; the connector owns only the wire:
// serving a prefill host, calling a remote one, framing, checksums, deadlines.
//
// Replicas (SDK 2.11) use the same transport for whole requests: a gateway in front of several
// engine processes of one deployment calls remote_generate, and each engine process's
// connector serves KvPrefillHost::generate, streaming the request's tokens back as they are
// sampled. A draining host (the process got SIGTERM) refuses new calls and fails health
// probes, while the calls it is running go on to their end.
//
// A layer's payload is token-major: for each prompt token in order, that token's K row of
// every KV head back to back in the pool's dtype (tessera/sdk/kv_rows.h), num_kv_tokens rows
// in all; V likewise. Both sides' pools may use different block sizes: rows are gathered
// and scattered through each side's own block tables.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/sdk/plugin.h"
#include "tessera/sdk/sampler.h"
#include "tessera/sdk/status.h"
#include "tessera/sdk/types.h"

namespace tessera {

struct RemotePrefillRequest {
  std::string request_id;       // the decode side's id, for both sides' logs
  std::vector<TokenId> prompt;
  // The client's sampling parameters: the prefill engine samples the first token with them
  // (max_tokens is ignored there: it samples one).
  SamplingParams params;
  bool want_kv = true;          // false: only the first token is needed (max_tokens 1)
  // The requester's model and KV layout fingerprint; a prefill host with a different one
  // refuses the request, naming both.
  std::string fingerprint;
  double timeout_seconds = 30;  // the whole call: prefill, transfer and acknowledgement
};

struct PrefillResult {
  // The first generated token; empty when it was an end token (finish is then kStop).
  std::vector<SampledToken> tokens;
  // kNone: generation goes on at the decode engine. kStop: the first token ended it, no KV
  // follows. kError: the prefill failed (error says why).
  FinishReason finish = FinishReason::kNone;
  Status error;
  // The sampler's random stream after the first token, so a seeded request continues on
  // the decode engine exactly where it would have continued on one engine.
  uint64_t rng_state = 0;
  int32_t num_kv_tokens = 0;   // prompt tokens whose K/V follow (one chunk per layer)
  int32_t num_layers = 0;
  int32_t num_cached_tokens = 0;  // of the prompt, found in the prefill engine's prefix cache
  double prefill_seconds = 0;  // queue + compute at the prefill engine
};

// Replicas (SDK 2.11): one whole request for a remote engine process.
struct RemoteGenerateRequest {
  std::string request_id;       // the gateway's id, for both sides' logs
  std::vector<TokenId> prompt;
  SamplingParams params;        // max_tokens included
  int32_t n = 1;                // independent samples (GenerationRequest::n)
  int32_t prompt_logprobs = -1; // GenerationRequest::prompt_logprobs
  // The caller's model and KV layout fingerprint; a host with a different one refuses the
  // request, naming both.
  std::string fingerprint;
  double timeout_seconds = 600; // the whole call
};

// One engine event of a remote request, as the engine's GenerationEvent has it (timings stay
// with each side: the caller keeps its own clock).
struct RemoteEvent {
  int32_t choice = 0;
  std::vector<SampledToken> tokens;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;                 // when finish_reason is kError
  int32_t num_prompt_tokens = 0;
  int32_t num_cached_prompt_tokens = 0;
  int32_t num_draft_tokens = 0;
  int32_t num_accepted_draft_tokens = 0;
  std::vector<SampledToken> prompt_logprobs;
};

// The caller's side of one remote request, implemented by the host.
class RemoteEventSink {
 public:
  virtual ~RemoteEventSink() = default;
  // As KvImportSink::on_cancel_available: a function that aborts the call from any thread
  // (remote_generate then returns kCancelled), safe to call after remote_generate returned.
  virtual void on_cancel_available(std::function<void()> cancel) = 0;
  // Each event, in order, from the calling thread of remote_generate. A non-ok return
  // cancels the remote request and remote_generate returns it.
  virtual Status on_event(const RemoteEvent& event) = 0;
};

// One finished prefill whose blocks the prefill engine holds for the transfer. Destroying
// the handle releases them (the transfer was acknowledged, or abandoned).
class KvExportHandle {
 public:
  virtual ~KvExportHandle() = default;
  virtual const PrefillResult& result() const = 0;
  // Layer `layer`'s K and V payloads (see the header comment), resized to fit. Any thread.
  virtual Status read_layer(int32_t layer, std::vector<uint8_t>* k, std::vector<uint8_t>* v) = 0;
};

// The prefill side, implemented by the host: what a connector serves.
class KvPrefillHost {
 public:
  virtual ~KvPrefillHost() = default;
  // Model and KV layout, as text both sides compare ("model=... layers=30 ... k=f16 v=f16").
  virtual std::string fingerprint() const = 0;
  // Runs the prompt on the prefill engine and blocks until its KV is ready (or it failed,
  // or needed no KV: *out's result says which). Called on a connector thread; `cancelled`
  // (polled) turns true when the caller went away, and the prefill is then abandoned.
  virtual Status prefill(const RemotePrefillRequest& request, const std::function<bool()>& cancelled,
                         std::unique_ptr<KvExportHandle>* out) = 0;
  // Replicas (SDK 2.11): runs a whole request on this engine, calling `emit` with each event
  // in order on the calling connector thread, and returns once every sample finished (ok),
  // or with the error that kept it from starting (the engine's checks; kUnavailable while
  // draining). `cancelled` (polled) turns true when the caller went away: the request is
  // cancelled. `emit` returning false means the caller is gone, likewise. The default serves
  // no replicas.
  virtual Status generate(const RemoteGenerateRequest& request, const std::function<bool()>& cancelled,
                          const std::function<bool(const RemoteEvent&)>& emit) {
    (void)request, (void)cancelled, (void)emit;
    return unimplemented("this engine host does not serve whole requests (replicas)");
  }
  // (SDK 2.11) True once the process drains: new prefills and generations are refused with
  // kUnavailable and the connector answers health probes with kUnavailable, so callers go to
  // another engine, while calls in flight run to their end.
  virtual bool draining() const { return false; }
};

// The decode side of one transfer, implemented by the host.
class KvImportSink {
 public:
  virtual ~KvImportSink() = default;
  // Called once, before anything blocks, with a function that aborts the transfer from any
  // thread (the client went away): remote_prefill then returns kCancelled. The function stays
  // safe to call after remote_prefill returned, and then does nothing: a host cannot tell a
  // client that leaves just as the call ends from one that leaves before, so a connector's
  // function must not point into remote_prefill's stack frame (share its state instead).
  virtual void on_cancel_available(std::function<void()> cancel) = 0;
  // The prefill finished. A non-ok return stops the transfer (remote_prefill returns it).
  // When the result carries no KV (finish != kNone, or want_kv was false) nothing follows.
  virtual Status on_prefilled(const PrefillResult& result) = 0;
  // One layer's payloads, in layer order, after the connector verified their checksums. A
  // non-ok return stops the transfer.
  virtual Status on_layer(int32_t layer, std::span<const uint8_t> k, std::span<const uint8_t> v) = 0;
};

class KvConnector {
 public:
  virtual ~KvConnector() = default;
  // Prefill role: serves `host` at `address` ("host:port"; port 0 picks a free one). Returns
  // once listening, with the bound address in *bound. The host outlives shutdown().
  virtual Status serve(const std::string& address, KvPrefillHost* host, std::string* bound) = 0;
  // Stops serving: in-flight transfers are cancelled, their handles released. Idempotent.
  virtual void shutdown() = 0;
  // Decode role: one remote prefill at `address`, blocking the calling thread until every
  // layer landed in `sink` (ok), or the transfer failed: kUnavailable (the prefill process
  // cannot be reached or went away), kDeadlineExceeded, kDataLoss (a checksum or size
  // mismatch, naming the layer), kFailedPrecondition (fingerprints differ, both named), or
  // what the prefill host or the sink returned. Thread-safe: many calls at once.
  virtual Status remote_prefill(const std::string& address, const RemotePrefillRequest& request,
                                KvImportSink* sink) = 0;
  // The fingerprint served at `address` (health checks; refusing a mismatch at startup).
  virtual Status probe(const std::string& address, std::string* fingerprint) = 0;
  // Replicas (SDK 2.11): one whole request at `address`, blocking the calling thread while
  // its events arrive in `sink`, until the last sample finished (ok) or the call failed:
  // kUnavailable (the engine cannot be reached, is draining, or went away mid-stream),
  // kDeadlineExceeded, kFailedPrecondition (fingerprints differ, both named), kCancelled, or
  // what the remote host or the sink returned. Thread-safe. The default has no replicas.
  virtual Status remote_generate(const std::string& address, const RemoteGenerateRequest& request,
                                 RemoteEventSink* sink) {
    (void)address, (void)request, (void)sink;
    return unimplemented("this kv_connector does not carry whole requests (replicas)");
  }
};

template <> struct PluginKindOf<KvConnector> {
  static constexpr PluginKind value = PluginKind::kKvConnector;
};

}  // namespace tessera
