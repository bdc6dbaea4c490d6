// Whole-file writes that never leave a half-written file behind: the bytes go to a temporary
// file in the destination's directory, are flushed to disk, and replace the destination by
// rename(2) only when everything was written. On any failure (a full disk, a file size limit,
// no permission) the temporary file is removed and the destination is left as it was.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace tessera {

class FileWriteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws FileWriteError("cannot write 'PATH': REASON").
void write_file_atomically(const std::string& path, std::string_view contents);

}  // namespace tessera
