// kv_connector.grpc: moves a prefill's first token and KV rows between engine processes over
// gRPC (Debian libgrpc++), one bidirectional stream per request (kv_transfer.proto); and, for
// replicas, whole requests from a gateway to an engine process, one server stream each.
#include <zlib.h>

#include <grpc/support/time.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kv_transfer.grpc.pb.h"
#include "tessera/sdk.h"
#include "tessera/sdk/kv_connector.h"

namespace tessera {
namespace {

namespace pb = ::tessera::kv::v1;

const ParamSpec kParams[] = {
    {"max_message_bytes", ParamType::kBytes, "256MiB",
     "largest message either side accepts: one layer's K and V rows of the longest prompt "
     "(SmolLM2-135M: 768 B per token and layer in f16)",
     1 << 20, 2.0 * (1u << 30)},
    {"connect_timeout", ParamType::kDuration, "2s",
     "how long a call waits for the prefill engine's connection before it counts as unavailable", 0.01, 60},
    {"keepalive", ParamType::kDuration, "1s",
     "how often a caller pings an engine it has calls open with; a peer that does not answer "
     "within the same time fails those calls (kUnavailable), so a cut link or a host that "
     "vanished without closing its connections is noticed in about twice this (0: no pings, "
     "such calls wait for their deadline)",
     0, 3600},
    {"fault_corrupt_layer", ParamType::kInt, "-1",
     "fault injection for tests: the prefill side flips one byte of this layer's K payload after "
     "computing its checksum, so the decode side must detect it (-1: off)",
     -1, 1 << 20},
};

uint32_t crc32_of(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  // zlib takes uInt lengths: feed large payloads in pieces.
  const auto* p = reinterpret_cast<const Bytef*>(bytes.data());
  size_t left = bytes.size();
  while (left > 0) {
    const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    left -= n;
  }
  return static_cast<uint32_t>(crc);
}

Status from_grpc(const grpc::Status& st, const std::string& address) {
  const std::string where = "engine " + address + ": ";
  switch (st.error_code()) {
    case grpc::StatusCode::OK: return Status::ok();
    case grpc::StatusCode::UNAVAILABLE: return unavailable(where + st.error_message());
    case grpc::StatusCode::DEADLINE_EXCEEDED: return deadline_exceeded(where + "deadline exceeded");
    case grpc::StatusCode::CANCELLED: return Status(StatusCode::kCancelled, where + "cancelled");
    case grpc::StatusCode::FAILED_PRECONDITION: return failed_precondition(where + st.error_message());
    case grpc::StatusCode::DATA_LOSS: return data_loss(where + st.error_message());
    case grpc::StatusCode::INVALID_ARGUMENT: return invalid_argument(st.error_message());
    case grpc::StatusCode::OUT_OF_RANGE: return out_of_range(st.error_message());
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return resource_exhausted(where + st.error_message());
    default: return internal_error(where + st.error_message());
  }
}

grpc::Status to_grpc(const Status& st) {
  switch (st.code()) {
    case StatusCode::kOk: return grpc::Status::OK;
    case StatusCode::kInvalidArgument: return {grpc::StatusCode::INVALID_ARGUMENT, st.message()};
    case StatusCode::kOutOfRange: return {grpc::StatusCode::OUT_OF_RANGE, st.message()};
    case StatusCode::kResourceExhausted: return {grpc::StatusCode::RESOURCE_EXHAUSTED, st.message()};
    case StatusCode::kCancelled: return {grpc::StatusCode::CANCELLED, st.message()};
    case StatusCode::kUnavailable: return {grpc::StatusCode::UNAVAILABLE, st.message()};
    case StatusCode::kDeadlineExceeded: return {grpc::StatusCode::DEADLINE_EXCEEDED, st.message()};
    case StatusCode::kDataLoss: return {grpc::StatusCode::DATA_LOSS, st.message()};
    case StatusCode::kFailedPrecondition: return {grpc::StatusCode::FAILED_PRECONDITION, st.message()};
    default: return {grpc::StatusCode::INTERNAL, st.message()};
  }
}

void to_proto(const SamplingParams& p, pb::Sampling* out) {
  out->set_temperature(p.temperature);
  out->set_top_k(p.top_k);
  out->set_top_p(p.top_p);
  out->set_min_p(p.min_p);
  out->set_repetition_penalty(p.repetition_penalty);
  out->set_presence_penalty(p.presence_penalty);
  out->set_frequency_penalty(p.frequency_penalty);
  out->set_penalty_last_n(p.penalty_last_n);
  out->set_seed(p.seed);
  out->set_has_seed(p.has_seed);
  out->set_num_logprobs(p.num_logprobs);
  out->set_ignore_eos(p.ignore_eos);
  for (TokenId t : p.stop_token_ids) out->add_stop_token_ids(t);
}

SamplingParams from_proto(const pb::Sampling& s) {
  SamplingParams p;
  p.temperature = s.temperature();
  p.top_k = s.top_k();
  p.top_p = s.top_p();
  p.min_p = s.min_p();
  p.repetition_penalty = s.repetition_penalty();
  p.presence_penalty = s.presence_penalty();
  p.frequency_penalty = s.frequency_penalty();
  p.penalty_last_n = s.penalty_last_n();
  p.seed = s.seed();
  p.has_seed = s.has_seed();
  p.num_logprobs = s.num_logprobs();
  p.ignore_eos = s.ignore_eos();
  p.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  p.max_tokens = 1;
  return p;
}

void to_proto(const SampledToken& t, pb::Token* pt) {
  pt->set_id(t.token);
  pt->set_logprob(t.logprob);
  for (const TokenLogprob& alt : t.top) {
    pt->add_top_ids(alt.token);
    pt->add_top_logprobs(alt.logprob);
  }
}

SampledToken from_proto(const pb::Token& pt) {
  SampledToken t;
  t.token = pt.id();
  t.logprob = pt.logprob();
  for (int i = 0; i < pt.top_ids_size() && i < pt.top_logprobs_size(); ++i)
    t.top.push_back({pt.top_ids(i), pt.top_logprobs(i)});
  return t;
}

void to_proto(const PrefillResult& r, pb::Prefilled* out) {
  for (const SampledToken& t : r.tokens) to_proto(t, out->add_tokens());
  out->set_finish(r.finish == FinishReason::kNone   ? pb::Prefilled::NONE
                  : r.finish == FinishReason::kStop ? pb::Prefilled::STOP
                                                    : pb::Prefilled::ERROR);
  out->set_error(r.error.message());
  out->set_rng_state(r.rng_state);
  out->set_num_kv_tokens(r.num_kv_tokens);
  out->set_num_layers(r.num_layers);
  out->set_num_cached_tokens(r.num_cached_tokens);
  out->set_prefill_seconds(r.prefill_seconds);
}

PrefillResult from_proto(const pb::Prefilled& p) {
  PrefillResult r;
  for (const pb::Token& pt : p.tokens()) r.tokens.push_back(from_proto(pt));
  r.finish = p.finish() == pb::Prefilled::NONE   ? FinishReason::kNone
             : p.finish() == pb::Prefilled::STOP ? FinishReason::kStop
                                                 : FinishReason::kError;
  if (r.finish == FinishReason::kError) r.error = internal_error(p.error());
  r.rng_state = p.rng_state();
  r.num_kv_tokens = p.num_kv_tokens();
  r.num_layers = p.num_layers();
  r.num_cached_tokens = p.num_cached_tokens();
  r.prefill_seconds = p.prefill_seconds();
  return r;
}

void to_proto(const RemoteEvent& e, pb::GenerateEvent* out) {
  out->set_choice(e.choice);
  for (const SampledToken& t : e.tokens) to_proto(t, out->add_tokens());
  out->set_finished(e.finished);
  out->set_finish_reason(static_cast<int32_t>(e.finish_reason));
  out->set_error_code(static_cast<int32_t>(e.error.code()));
  out->set_error(e.error.message());
  out->set_num_prompt_tokens(e.num_prompt_tokens);
  out->set_num_cached_prompt_tokens(e.num_cached_prompt_tokens);
  out->set_num_draft_tokens(e.num_draft_tokens);
  out->set_num_accepted_draft_tokens(e.num_accepted_draft_tokens);
  for (const SampledToken& t : e.prompt_logprobs) to_proto(t, out->add_prompt_logprobs());
}

RemoteEvent from_proto(const pb::GenerateEvent& p) {
  RemoteEvent e;
  e.choice = p.choice();
  for (const pb::Token& pt : p.tokens()) e.tokens.push_back(from_proto(pt));
  e.finished = p.finished();
  const int32_t reason = p.finish_reason();
  e.finish_reason = reason >= 0 && reason <= static_cast<int32_t>(FinishReason::kError) ? static_cast<FinishReason>(reason)
                                                                                        : FinishReason::kError;
  if (e.finish_reason == FinishReason::kError)
    e.error = Status(p.error_code() == 0 ? StatusCode::kInternal : static_cast<StatusCode>(p.error_code()), p.error());
  e.num_prompt_tokens = p.num_prompt_tokens();
  e.num_cached_prompt_tokens = p.num_cached_prompt_tokens();
  e.num_draft_tokens = p.num_draft_tokens();
  e.num_accepted_draft_tokens = p.num_accepted_draft_tokens();
  for (const pb::Token& pt : p.prompt_logprobs()) e.prompt_logprobs.push_back(from_proto(pt));
  return e;
}

void set_timeout(grpc::ClientContext* ctx, double seconds) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6)));
}

// The seconds left until the caller's deadline: the decode engine's transfer_timeout or the
// gateway's request limit, which the caller sets on every call (see set_timeout). The host
// gives up when its caller does (gRPC rounds a deadline up, by at most ~1 %) and no sooner;
// a call without a deadline keeps `fallback` (the SDK's default).
double seconds_left(const grpc::ServerContext& ctx, double fallback) {
  if (gpr_time_cmp(ctx.raw_deadline(), gpr_inf_future(ctx.raw_deadline().clock_type)) == 0) return fallback;
  const double left = std::chrono::duration<double>(ctx.deadline() - std::chrono::system_clock::now()).count();
  return std::max(0.0, left);
}

const grpc::Status kDraining{grpc::StatusCode::UNAVAILABLE, "the engine is draining (shutting down): it takes no new requests"};

// The prefill side: one handler thread per call (gRPC's synchronous server).
class TransferService final : public pb::KvTransfer::Service {
 public:
  TransferService(KvPrefillHost* host, int32_t corrupt_layer) : host_(host), corrupt_layer_(corrupt_layer) {}

  grpc::Status Info(grpc::ServerContext*, const pb::InfoRequest*, pb::InfoReply* reply) override {
    if (host_->draining()) return kDraining;  // health probes steer callers elsewhere
    reply->set_fingerprint(host_->fingerprint());
    return grpc::Status::OK;
  }

  grpc::Status Generate(grpc::ServerContext* ctx, const pb::GenerateCall* call,
                        grpc::ServerWriter<pb::GenerateEvent>* writer) override {
    if (host_->draining()) return kDraining;
    const std::string mine = host_->fingerprint();
    if (call->fingerprint() != mine)
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "model or KV layout mismatch: this engine serves '" + mine + "', the gateway has '" +
                  call->fingerprint() + "'"};
    RemoteGenerateRequest request;
    request.request_id = call->request_id();
    request.prompt.assign(call->prompt().begin(), call->prompt().end());
    request.params = from_proto(call->sampling());
    request.params.max_tokens = call->max_tokens();
    request.n = call->n();
    request.prompt_logprobs = call->prompt_logprobs();
    request.fingerprint = call->fingerprint();
    request.timeout_seconds = seconds_left(*ctx, request.timeout_seconds);
    Status st = host_->generate(
        request, [ctx] { return ctx->IsCancelled(); },
        [writer](const RemoteEvent& event) {
          pb::GenerateEvent msg;
          to_proto(event, &msg);
          return writer->Write(msg);
        });
    return to_grpc(st);
  }

  grpc::Status Prefill(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<pb::ServerMessage, pb::ClientMessage>* stream) override {
    pb::ClientMessage first;
    if (!stream->Read(&first) || !first.has_call())
      return {grpc::StatusCode::INVALID_ARGUMENT, "the first message of a Prefill call must be a PrefillCall"};
    if (host_->draining()) return kDraining;
    const pb::PrefillCall& call = first.call();
    const std::string mine = host_->fingerprint();
    if (call.fingerprint() != mine)
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "model or KV layout mismatch: the prefill engine serves '" + mine + "', the decode engine has '" +
                  call.fingerprint() + "'"};
    RemotePrefillRequest request;
    request.request_id = call.request_id();
    request.prompt.assign(call.prompt().begin(), call.prompt().end());
    request.params = from_proto(call.sampling());
    request.want_kv = call.want_kv();
    request.fingerprint = call.fingerprint();
    // Without this the host's limit was the SDK default (30 s), whatever transfer_timeout
    // the decode engine set: a prefill longer than 30 s always failed.
    request.timeout_seconds = seconds_left(*ctx, request.timeout_seconds);
    std::unique_ptr<KvExportHandle> handle;
    Status st = host_->prefill(request, [ctx] { return ctx->IsCancelled(); }, &handle);
    if (!st.is_ok()) return to_grpc(st);
    const PrefillResult& result = handle->result();
    pb::ServerMessage header;
    to_proto(result, header.mutable_prefilled());
    if (!stream->Write(header)) return {grpc::StatusCode::CANCELLED, "the decode engine went away"};
    if (result.finish != FinishReason::kNone || !request.want_kv) return grpc::Status::OK;

    std::vector<uint8_t> k, v;
    for (int32_t layer = 0; layer < result.num_layers; ++layer) {
      if (ctx->IsCancelled()) return {grpc::StatusCode::CANCELLED, "the decode engine cancelled the transfer"};
      if (Status rs = handle->read_layer(layer, &k, &v); !rs.is_ok()) return to_grpc(rs);
      pb::ServerMessage msg;
      pb::LayerChunk* chunk = msg.mutable_layer();
      chunk->set_layer(layer);
      chunk->set_k(k.data(), k.size());
      chunk->set_v(v.data(), v.size());
      chunk->set_k_crc32(crc32_of(chunk->k()));
      chunk->set_v_crc32(crc32_of(chunk->v()));
      if (layer == corrupt_layer_ && !chunk->k().empty()) (*chunk->mutable_k())[0] ^= 0x5a;
      if (!stream->Write(msg)) return {grpc::StatusCode::CANCELLED, "the decode engine went away mid-transfer"};
    }
    // Hold the blocks until the decode side says every layer landed (or goes away).
    pb::ClientMessage ack;
    if (!stream->Read(&ack) || !ack.has_ack())
      return {grpc::StatusCode::CANCELLED, "the decode engine closed without acknowledging"};
    return grpc::Status::OK;  // `handle` goes now: the prefill engine frees the blocks
  }

 private:
  KvPrefillHost* host_;
  int32_t corrupt_layer_;
};

class GrpcConnector final : public KvConnector {
 public:
  GrpcConnector(int64_t max_message_bytes, double connect_timeout, double keepalive, int32_t corrupt_layer)
      : max_message_bytes_(static_cast<int>(std::min<int64_t>(max_message_bytes, INT32_MAX))),
        connect_timeout_(connect_timeout),
        keepalive_ms_(static_cast<int>(keepalive * 1000)),
        corrupt_layer_(corrupt_layer) {}
  ~GrpcConnector() override { shutdown(); }

  static Status create(const PluginConfig& config, const PluginContext&, std::unique_ptr<KvConnector>* out) {
    *out = std::make_unique<GrpcConnector>(config.get_int("max_message_bytes", 256 << 20),
                                           config.get_float("connect_timeout", 2.0),
                                           config.get_float("keepalive", 1.0),
                                           static_cast<int32_t>(config.get_int("fault_corrupt_layer", -1)));
    return Status::ok();
  }

  Status serve(const std::string& address, KvPrefillHost* host, std::string* bound) override {
    std::lock_guard<std::mutex> lock(server_mutex_);
    if (server_) return invalid_argument("kv_connector.grpc: already serving");
    service_ = std::make_unique<TransferService>(host, corrupt_layer_);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(max_message_bytes_);
    builder.SetMaxSendMessageSize(max_message_bytes_);
    builder.RegisterService(service_.get());
    // Callers ping while their calls are open (keepalive): accept pings that often, without
    // counting them as abuse (the default answers a second ping within 5 min with GOAWAY).
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 100);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    server_ = builder.BuildAndStart();
    if (!server_ || port == 0) {
      server_.reset();
      service_.reset();
      return unavailable("kv_connector.grpc: cannot listen on " + address + " (in use, or not a local address)");
    }
    const auto colon = address.rfind(':');
    *bound = address.substr(0, colon) + ":" + std::to_string(port);
    return Status::ok();
  }

  void shutdown() override {
    std::lock_guard<std::mutex> lock(server_mutex_);
    if (!server_) return;
    // In-flight calls are cancelled after a short grace period; their handles release.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server_.reset();
    service_.reset();
  }

  Status remote_prefill(const std::string& address, const RemotePrefillRequest& request,
                        KvImportSink* sink) override {
    std::shared_ptr<pb::KvTransfer::Stub> stub = stub_for(address);
    // The sink's cancel function may run after this call returned (a client that goes away
    // races the return), so it shares the context instead of pointing at this frame's.
    auto context = std::make_shared<grpc::ClientContext>();
    grpc::ClientContext& ctx = *context;
    set_timeout(&ctx, request.timeout_seconds);
    sink->on_cancel_available([context] { context->TryCancel(); });
    if (Status st = wait_connected(address); !st.is_ok()) return st;
    auto stream = stub->Prefill(&ctx);
    auto fail = [&](Status st) {
      ctx.TryCancel();
      stream->Finish();
      return st;
    };
    pb::ClientMessage call_msg;
    pb::PrefillCall* call = call_msg.mutable_call();
    call->set_request_id(request.request_id);
    for (TokenId t : request.prompt) call->add_prompt(t);
    to_proto(request.params, call->mutable_sampling());
    call->set_want_kv(request.want_kv);
    call->set_fingerprint(request.fingerprint);
    if (!stream->Write(call_msg)) return from_grpc(stream->Finish(), address);

    pb::ServerMessage msg;
    if (!stream->Read(&msg)) return from_grpc(stream->Finish(), address);
    if (!msg.has_prefilled()) return fail(data_loss("prefill engine " + address + ": expected the prefill header"));
    const PrefillResult result = from_proto(msg.prefilled());
    if (Status st = sink->on_prefilled(result); !st.is_ok()) return fail(st);
    if (result.finish != FinishReason::kNone || !request.want_kv) {
      stream->WritesDone();
      return from_grpc(stream->Finish(), address);
    }
    for (int32_t layer = 0; layer < result.num_layers; ++layer) {
      if (!stream->Read(&msg)) {
        Status st = from_grpc(stream->Finish(), address);
        if (st.is_ok()) st = unavailable("prefill engine " + address + ": the stream ended at layer " + std::to_string(layer));
        return st;
      }
      if (!msg.has_layer() || msg.layer().layer() != layer)
        return fail(data_loss("prefill engine " + address + ": expected KV layer " + std::to_string(layer)));
      const pb::LayerChunk& chunk = msg.layer();
      const uint32_t k_crc = crc32_of(chunk.k()), v_crc = crc32_of(chunk.v());
      if (k_crc != chunk.k_crc32() || v_crc != chunk.v_crc32())
        return fail(data_loss("prefill engine " + address + ": KV layer " + std::to_string(layer) +
                              " failed its checksum (K crc32 " + std::to_string(k_crc) + ", sent " +
                              std::to_string(chunk.k_crc32()) + "; V " + std::to_string(v_crc) + ", sent " +
                              std::to_string(chunk.v_crc32()) + ")"));
      const auto* k = reinterpret_cast<const uint8_t*>(chunk.k().data());
      const auto* v = reinterpret_cast<const uint8_t*>(chunk.v().data());
      if (Status st = sink->on_layer(layer, {k, chunk.k().size()}, {v, chunk.v().size()}); !st.is_ok())
        return fail(st);
    }
    pb::ClientMessage ack;
    ack.mutable_ack();
    stream->Write(ack);
    stream->WritesDone();
    return from_grpc(stream->Finish(), address);
  }

  Status remote_generate(const std::string& address, const RemoteGenerateRequest& request,
                         RemoteEventSink* sink) override {
    std::shared_ptr<pb::KvTransfer::Stub> stub = stub_for(address);
    auto context = std::make_shared<grpc::ClientContext>();  // as in remote_prefill
    grpc::ClientContext& ctx = *context;
    set_timeout(&ctx, request.timeout_seconds);
    sink->on_cancel_available([context] { context->TryCancel(); });
    if (Status st = wait_connected(address); !st.is_ok()) return st;
    pb::GenerateCall call;
    call.set_request_id(request.request_id);
    for (TokenId t : request.prompt) call.add_prompt(t);
    to_proto(request.params, call.mutable_sampling());
    call.set_max_tokens(request.params.max_tokens);
    call.set_n(request.n);
    call.set_prompt_logprobs(request.prompt_logprobs);
    call.set_fingerprint(request.fingerprint);
    std::unique_ptr<grpc::ClientReader<pb::GenerateEvent>> reader = stub->Generate(&ctx, call);
    pb::GenerateEvent msg;
    int32_t finished = 0;
    while (reader->Read(&msg)) {
      const RemoteEvent event = from_proto(msg);
      if (event.finished) ++finished;
      if (Status st = sink->on_event(event); !st.is_ok()) {
        ctx.TryCancel();
        reader->Finish();
        return st;
      }
    }
    Status st = from_grpc(reader->Finish(), address);
    if (st.is_ok() && finished < std::max(1, request.n))
      st = unavailable("engine " + address + ": the stream ended before every sample finished");
    return st;
  }

  Status probe(const std::string& address, std::string* fingerprint) override {
    if (Status st = wait_connected(address); !st.is_ok()) return st;
    grpc::ClientContext ctx;
    set_timeout(&ctx, connect_timeout_);
    pb::InfoRequest req;
    pb::InfoReply reply;
    grpc::Status st = stub_for(address)->Info(&ctx, req, &reply);
    if (!st.ok()) return from_grpc(st, address);
    *fingerprint = reply.fingerprint();
    return Status::ok();
  }

 private:
  // One channel per address, shared by every call (HTTP/2 multiplexes them).
  std::shared_ptr<pb::KvTransfer::Stub> stub_for(const std::string& address) {
    std::lock_guard<std::mutex> lock(channels_mutex_);
    auto& entry = channels_[address];
    if (!entry.stub) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(max_message_bytes_);
      args.SetMaxSendMessageSize(max_message_bytes_);
      // Reconnect quickly after a prefill engine restarts (the default backoff reaches 2 min).
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      if (keepalive_ms_ > 0) {
        // A peer behind a cut link never closes its connection: only an unanswered ping
        // ends the calls waiting on it.
        args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms_);
        args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_ms_);
        args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
      }
      entry.channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
      entry.stub = pb::KvTransfer::NewStub(entry.channel);
    }
    return entry.stub;
  }

  Status wait_connected(const std::string& address) {
    std::shared_ptr<grpc::Channel> channel;
    {
      stub_for(address);
      std::lock_guard<std::mutex> lock(channels_mutex_);
      channel = channels_[address].channel;
    }
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::microseconds(static_cast<int64_t>(connect_timeout_ * 1e6));
    if (!channel->WaitForConnected(deadline))
      return unavailable("engine " + address + ": not reachable within " +
                         std::to_string(connect_timeout_) + " s");
    return Status::ok();
  }

  struct ChannelEntry {
    std::shared_ptr<grpc::Channel> channel;
    std::shared_ptr<pb::KvTransfer::Stub> stub;
  };

  int max_message_bytes_;
  double connect_timeout_;
  int keepalive_ms_;
  int32_t corrupt_layer_;
  std::mutex server_mutex_;
  std::unique_ptr<TransferService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::mutex channels_mutex_;
  std::map<std::string, ChannelEntry> channels_;
};

}  // namespace
}  // namespace tessera

TESSERA_REGISTER_PLUGIN(tessera::GrpcConnector, tessera::KvConnector, "grpc", "0.1.0",
                        "KV transfer between prefill and decode engines over gRPC (CRC-32 per layer)",
                        tessera::kParams)
