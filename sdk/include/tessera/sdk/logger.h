// The host's logger as plugins see it. The host passes one Logger to every plugin it creates
// (so plugins need not link spdlog and all output goes through one sink).
#pragma once

#include <string_view>

namespace tessera {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError };

class Logger {
 public:
  virtual ~Logger() = default;
  // Thread-safe; may be called from any thread.
  virtual void log(LogLevel level, std::string_view message) = 0;
  virtual bool enabled(LogLevel level) const = 0;
};

}  // namespace tessera
