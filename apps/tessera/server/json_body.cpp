#include "json_body.h"

#include <vector>

namespace tessera::server {

using nlohmann::json;

namespace {

constexpr size_t kMaxKeyInPath = 40;
constexpr size_t kMaxPath = 200;
constexpr size_t kMaxMessage = 300;

std::string clip(std::string s, size_t n) {
  if (s.size() > n) {
    s.resize(n);
    s += "...";
  }
  return s;
}

// nlohmann's SAX interface, building the value with an explicit stack (as the library's own
// DOM builder does) and refusing to open a container deeper than the limit. Errors are
// recorded, not thrown: returning false ends the parse.
class BoundedBuilder {
 public:
  explicit BoundedBuilder(int max_depth) : max_depth_(static_cast<size_t>(max_depth)) {}

  bool null() { return add(nullptr); }
  bool boolean(bool v) { return add(v); }
  bool number_integer(json::number_integer_t v) { return add(v); }
  bool number_unsigned(json::number_unsigned_t v) { return add(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return add(v); }
  bool string(json::string_t& v) { return add(std::move(v)); }
  bool binary(json::binary_t& v) { return add(json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool key(json::string_t& k) {
    frames_.back().key = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool parse_error(std::size_t /*position*/, const std::string& last_token, const json::exception& ex) {
    const std::string where = path();
    if (ex.id == 406) {  // out_of_range.406: a number that overflows a double
      const std::string what = "the number " + clip(last_token, 40) + " is out of range (it does not fit a double)";
      error_.param = where;
      error_.message = where.empty() ? what + " in the request body" : where + ": " + what;
    } else {
      error_.message = clip(std::string("the request body is not valid JSON: ") + ex.what(), kMaxMessage);
    }
    return false;
  }

  json& result() { return root_; }
  const JsonBodyError& error() const { return error_; }
  bool failed() const { return !error_.message.empty(); }

 private:
  struct Frame {
    json* value;
    std::string key;  // objects: the last key read
  };

  // Where the value being parsed now sits: "messages[2].content".
  std::string path() const {
    std::string p;
    for (size_t i = 0; i < frames_.size() && p.size() < kMaxPath; ++i) {
      const Frame& f = frames_[i];
      if (f.value->is_array()) {
        // Inner frames hold their open child as the last element; the innermost one is
        // about to append.
        const size_t index = f.value->size() - (i + 1 < frames_.size() ? 1 : 0);
        p += '[';
        p += std::to_string(index);
        p += ']';
      } else {
        if (!p.empty()) p += ".";
        p += clip(f.key, kMaxKeyInPath);
      }
    }
    return clip(std::move(p), kMaxPath);
  }

  // Returns where the value was stored.
  json* place(json&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& parent = *frames_.back().value;
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    json& slot = parent[frames_.back().key];  // a repeated key: the last one wins
    slot = std::move(v);
    return &slot;
  }

  bool add(json&& v) {
    place(std::move(v));
    return true;
  }

  bool open(json&& container) {
    if (frames_.size() >= max_depth_) {
      // The top-level field it happened under, if the body is an object.
      std::string field;
      if (!frames_.empty() && frames_[0].value->is_object()) field = clip(frames_[0].key, kMaxKeyInPath);
      const std::string what = "nested deeper than " + std::to_string(max_depth_) + " levels of arrays and objects";
      error_.param = field;
      error_.message = field.empty() ? "the request body is " + what : field + ": " + what;
      return false;
    }
    // A parent's storage does not move while a child is open: only the innermost container
    // is appended to.
    frames_.push_back({place(std::move(container)), {}});
    return true;
  }

  bool close() {
    frames_.pop_back();
    return true;
  }

  size_t max_depth_;
  json root_;
  std::vector<Frame> frames_;
  JsonBodyError error_;
};

}  // namespace

std::optional<json> parse_json_body(std::string_view body, JsonBodyError* error, int max_depth) {
  BoundedBuilder builder(max_depth);
  bool ok = false;
  try {
    ok = json::sax_parse(body.begin(), body.end(), &builder);
  } catch (const json::exception& e) {
    // The SAX parser reports through parse_error(); this is for anything it throws anyway.
    error->param.clear();
    error->message = clip(std::string("the request body is not valid JSON: ") + e.what(), kMaxMessage);
    return std::nullopt;
  }
  if (!ok || builder.failed()) {
    *error = builder.error();
    if (error->message.empty()) error->message = "the request body is not valid JSON";
    return std::nullopt;
  }
  return std::move(builder.result());
}

std::string describe_json(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number (" + v.dump() + ")";
    case json::value_t::binary: return "binary data";
    case json::value_t::discarded: return "nothing";
    default: return "an integer (" + v.dump() + ")";
  }
}

}  // namespace tessera::server
