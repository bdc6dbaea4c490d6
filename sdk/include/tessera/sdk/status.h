// Status: how plugin entry points report failure. Exceptions never cross the plugin seam;
// the host adds the plugin's name and config path to the message.
#pragma once

#include <string>
#include <utility>

namespace tessera {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // bad input from a request or a config value
  kOutOfRange,         // e.g. a prompt longer than the context
  kResourceExhausted,  // no KV blocks, queue full
  kNotFound,
  kUnimplemented,
  kCancelled,
  kInternal,
  // Appended in SDK 2.9 (kv_connector): transport outcomes.
  kUnavailable,         // a peer process cannot be reached or went away
  kDeadlineExceeded,
  kDataLoss,            // a payload failed its checksum or has the wrong size
  kFailedPrecondition,  // e.g. two engines' model/KV layout fingerprints differ
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status resource_exhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status deadline_exceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
inline Status data_loss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status failed_precondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }

inline const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kOutOfRange: return "out_of_range";
    case StatusCode::kResourceExhausted: return "resource_exhausted";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kUnimplemented: return "unimplemented";
    case StatusCode::kCancelled: return "cancelled";
    case StatusCode::kInternal: return "internal";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kDeadlineExceeded: return "deadline_exceeded";
    case StatusCode::kDataLoss: return "data_loss";
    case StatusCode::kFailedPrecondition: return "failed_precondition";
  }
  return "unknown";
}

}  // namespace tessera
