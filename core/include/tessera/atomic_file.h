// Whole-file writes that never leave a half-written file behind: the bytes go to a temporary
// file in the destination's directory (so rename(2) cannot cross a file system; mkstemp makes
// its name unique, so concurrent writers do not collide), are flushed to disk, and replace the
// destination only when everything was written. On any failure (a full disk, a file size
// limit, no permission, an exception from the producer) the temporary file is removed and the
// destination is left as it was. Used for quantized models, reports and workloads.
#pragma once

#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tessera {

class FileWriteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using WriteFn = std::function<void(const void* data, size_t num_bytes)>;

// `produce` streams the file's bytes through `put`. Throws FileWriteError("cannot write PATH:
// reason"); an exception from `produce` itself propagates unchanged. A destination that exists
// and is not a regular file (a FIFO, /dev/stdout) is written in place: it cannot be renamed
// over, and holds no file to leave half-written.
void write_file_atomically(const std::string& path, const std::function<void(const WriteFn& put)>& produce);
void write_file_atomically(const std::string& path, std::string_view contents);

}  // namespace tessera
