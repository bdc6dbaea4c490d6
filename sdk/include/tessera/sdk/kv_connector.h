// kv_connector plugins move a prompt's KV cache between engine processes (SDK 2.9): the
// transport of prefill/decode disaggregation, the role vLLM's KV connector plays.
//
// A prefill engine computes a prompt and samples its first token; the decode engine that
// asked for it receives the first token, allocates blocks, receives the prompt's K/V one
// layer at a time and continues decoding as if it had computed the prompt itself. The host
// owns both engines' KV memory and the request's life; the connector owns only the wire:
// serving a prefill host, calling a remote one, framing, checksums, deadlines.
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
};

// The decode side of one transfer, implemented by the host.
class KvImportSink {
 public:
  virtual ~KvImportSink() = default;
  // Called once, before anything blocks, with a function that aborts the transfer from any
  // thread (the client went away): remote_prefill then returns kCancelled. The function is
  // valid until remote_prefill returns; the sink must not call it after that.
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
};

template <> struct PluginKindOf<KvConnector> {
  static constexpr PluginKind value = PluginKind::kKvConnector;
};

}  // namespace tessera
