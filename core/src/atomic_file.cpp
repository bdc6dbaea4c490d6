#include "tessera/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace tessera {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what, int err) {
  throw FileWriteError("cannot write " + path + ": " + what + std::strerror(err));
}

// write(2) until done; returns 0 or the errno of the failed call.
int write_all(int fd, const void* data, size_t n) {
  const auto* c = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
  return 0;
}

void write_in_place(const std::string& path, const std::function<void(const WriteFn&)>& produce) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "", errno);
  try {
    produce([&](const void* p, size_t n) {
      if (int err = write_all(fd, p, n)) fail(path, "", err);
    });
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) fail(path, "", errno);
}

}  // namespace

void write_file_atomically(const std::string& path, const std::function<void(const WriteFn& put)>& produce) {
  if (path.empty()) throw FileWriteError("cannot write an empty path");
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    return write_in_place(path, produce);

  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) fail(path, "", errno);
  bool cleaned = false;  // fd closed and the temporary removed
  auto give_up = [&](const std::string& what, int err) {
    cleaned = true;
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(path, what, err);
  };
  try {
    produce([&](const void* p, size_t n) {
      if (int err = write_all(fd, p, n)) give_up("", err);
    });
  } catch (...) {
    if (!cleaned) {
      ::close(fd);
      ::unlink(tmp.c_str());
    }
    throw;
  }
  // mkstemp creates the file 0600; give it the permissions a plain create would (0666 & ~umask).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  if (::fchmod(fd, 0666 & ~mask) != 0) give_up("", errno);
  if (::fsync(fd) != 0) give_up("fsync: ", errno);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, "", err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, "rename: ", err);
  }
}

void write_file_atomically(const std::string& path, std::string_view contents) {
  write_file_atomically(path, [&](const WriteFn& put) { put(contents.data(), contents.size()); });
}

}  // namespace tessera
