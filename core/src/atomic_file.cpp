#include "tessera/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

namespace tessera {

namespace {
[[noreturn]] void fail(const std::string& path, int err) {
  throw FileWriteError("cannot write '" + path + "': " + std::strerror(err));
}
}  // namespace

void write_file_atomically(const std::string& path, std::string_view contents) {
  if (path.empty()) throw FileWriteError("cannot write '': empty path");
  const std::filesystem::path dest(path);
  std::error_code ec;
  // A special file (a FIFO, /dev/stdout, /dev/null) is written in place: it cannot be renamed
  // over, and there is no half-written state to avoid.
  if (std::filesystem::exists(dest, ec) && !std::filesystem::is_regular_file(dest, ec)) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail(path, errno);
    for (size_t done = 0; done < contents.size();) {
      const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        ::close(fd);
        fail(path, err);
      }
      done += static_cast<size_t>(n);
    }
    if (::close(fd) != 0) fail(path, errno);
    return;
  }
  const std::filesystem::path dir = dest.has_parent_path() ? dest.parent_path() : std::filesystem::path(".");
  std::string tmpl = (dir / ("." + dest.filename().string() + ".tmp.XXXXXX")).string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  const int fd = ::mkstemp(name.data());
  if (fd < 0) fail(path, errno);
  const std::string tmp(name.data());
  auto give_up = [&](int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(path, err);
  };
  for (size_t done = 0; done < contents.size();) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) give_up(errno);
    done += static_cast<size_t>(n);
  }
  // mkstemp creates 0600; a report is an ordinary file (0666 less the umask).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  if (::fchmod(fd, 0666 & ~mask) != 0) give_up(errno);
  if (::fsync(fd) != 0) give_up(errno);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, err);
  }
}

}  // namespace tessera
