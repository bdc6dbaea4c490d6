// The byte-level matcher of a Grammar: a pushdown automaton whose state is a small set of
// alternative threads (anyOf, optional keys and number ends make the grammar nondeterministic
// for a few bytes), each a stack of frames. A state is plain integers, so it can be copied,
// compared and hashed cheaply: the token mask (token_mask.h) feeds it the bytes of every
// vocabulary token from one state, and caches masks by state.
//
// Thread-safety: a ByteMatcher is immutable after construction and may be shared; States are
// values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "grammar.h"

namespace tessera::json_constraint {

// The alternatives alive after the bytes fed so far, flattened: per thread [ws, num_frames,
// frames (node, phase, a, b)...]. Empty (no threads): the bytes cannot be part of any output.
struct State {
  std::vector<int32_t> data;
  int32_t num_threads = 0;

  bool dead() const { return num_threads == 0; }
  std::string_view key() const {
    return {reinterpret_cast<const char*>(data.data()), data.size() * sizeof(int32_t)};
  }
  bool operator==(const State& o) const { return num_threads == o.num_threads && data == o.data; }
};

class ByteMatcher {
 public:
  explicit ByteMatcher(Grammar grammar);

  // The state before any output.
  State initial() const;
  // Feeds one byte; `out` (cleared first) may be dead. `in` and `out` must differ.
  void feed(const State& in, uint8_t byte, State* out) const;
  // Feeds bytes; false (and *state dead) if they cannot be part of an output.
  bool feed_all(State* state, std::string_view bytes) const;
  // The output may end here (some thread finishes without more bytes).
  bool can_end(const State& state) const;
  // No thread can take another byte: the output is complete.
  bool is_complete(const State& state) const;
  // The state is one thread inside a regex that is the whole output (a guided_regex or
  // choice constraint): nothing but the regex's own DFA decides the bytes from here on, so a
  // token mask may walk that DFA directly. Sets *dfa and its state *dfa_state.
  bool whole_output_regex(const State& state, const ByteDfa** dfa, int32_t* dfa_state) const;

  const Grammar& grammar() const { return grammar_; }

 private:
  struct Frame {
    int32_t node, phase, a, b;
  };
  static constexpr int kMaxFrames = 48;
  static constexpr int kMaxThreads = 64;
  struct Thread {
    int32_t ws = 0;
    int32_t size = 0;
    Frame frames[kMaxFrames];
    Frame& top() { return frames[size - 1]; }
  };

  void step(Thread& t, uint8_t c, State* out) const;
  void step_object(Thread& t, uint8_t c, State* out) const;
  void step_array(Thread& t, uint8_t c, State* out) const;
  void step_string(Thread& t, uint8_t c, State* out) const;
  void step_number(Thread& t, uint8_t c, State* out) const;
  // Key candidates of an object frame from property `from` on, after the opening quote.
  void spawn_keys(const Thread& t, int32_t from, State* out) const;
  bool whitespace(Thread& t, uint8_t c, State* out) const;  // consumed as JSON whitespace
  bool push(Thread& t, int32_t node) const;                 // false: too deep
  void pop(Thread& t) const;  // the top frame's value is done (and finished sequences above)
  bool endable(const Frame& f) const;
  // The rest of a sequence frame can match nothing (the sequence may end here).
  bool sequence_rest_nullable(const Frame& f) const;
  bool thread_can_end(Thread t) const;
  void emit(const Thread& t, State* out) const;
  static void load(const State& s, size_t* offset, Thread* t);
  const Node& node(int32_t id) const { return grammar_.nodes[static_cast<size_t>(id)]; }

  Grammar grammar_;
  std::vector<bool> nullable_;  // by node (grammar.h nullable_nodes)
};

}  // namespace tessera::json_constraint
