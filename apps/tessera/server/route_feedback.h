// Live misroutes: which router arm answered each recent routed response, so that a client (an
// evaluation harness, a rating UI, a human reviewer) can later say which deployment should
// have answered it (POST /v1/route_feedback). The server cannot tell a misroute by itself:
// only someone who judged the answer can. Runs on the io thread, like OpenAiService.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>

namespace tessera::server {

class RouteLedger {
 public:
  struct Entry {
    std::string router;
    std::string arm;                // the deployment the router chose
    std::string feedback;           // the deployment feedback named; empty until then
  };

  explicit RouteLedger(size_t capacity = 65536) : capacity_(capacity) {}

  // Remembers that `arm` of `router` answered response `id`; the oldest entry goes when full.
  void record(const std::string& id, const std::string& router, const std::string& arm);
  // The entry of response `id`, or nullptr when it was not routed or is older than the last
  // `capacity` routed responses.
  Entry* find(const std::string& id);
  size_t size() const { return entries_.size(); }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  std::unordered_map<std::string, Entry> entries_;
  std::deque<std::string> order_;  // ids, oldest first
};

}  // namespace tessera::server
