#!/usr/bin/env bash
# `tessera eval` on the real default model, over a text every Debian system ships (the GPL
# version 3 in /usr/share/common-licenses, package base-files), with a small context so it
# runs in seconds:
#  - perplexity is finite and in a sane range;
#  - a stack against itself (evaluated in the same run, or through saved log-probabilities)
#    has KLD exactly 0, top-1 agreement 100 % and identical greedy continuations;
#  - a lower-precision stack (f16 and q8_0 KV caches against the f32 one) has KLD > 0;
#  - on F32 weights the q8_0 cache (rows stored Hadamard-rotated) is within mean KLD 0.0005 of
#    the f16 one;
#  - bad input (missing corpus, a corpus shorter than one chunk, a reference file made with
#    another context or from another text, a file that is no reference) is one error line and
#    exit status 1.
# Exit 77 (skipped) without the model or the corpus. Ends with "N passed, N failed".
set -uo pipefail

bin="$TESSERA_BUILD_DIR/bin/tessera"
model_dir="${TESSERA_MODEL_DIR:-$HOME/.cache/tessera/models}"
model="${TESSERA_MODEL_PATH:-$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf}"
corpus=/usr/share/common-licenses/GPL-3
if [[ ! -f "$model" || ! -f "$corpus" ]]; then
  echo "skipped: needs $model and $corpus"
  exit 77
fi
scratch="$TESSERA_BUILD_DIR/test-scratch/eval"
rm -rf "$scratch" && mkdir -p "$scratch"
cd "$scratch" || exit 1
source "$TESSERA_SOURCE_DIR/tests/support/expect_error.sh"

# check NAME JSON_FILE PYTHON_EXPRESSION (over the parsed report `r`)
check() {
  local name=$1 file=$2 expr=$3
  if python3 -c "import json,math,sys; r=json.load(open('$file')); sys.exit(0 if ($expr) else 1)"; then
    pass "$name"
  else
    fail "$name: $expr is false for $(python3 -c "import json; r=json.load(open('$file')); print({k: r.get(k) for k in ('ppl','kld','top1_agreement','reference')})")"
  fi
}

# expect_error NAME EXPECTED_SUBSTRING COMMAND... (one "error: " line on stderr), and the
# exit status must be 1.
expect_error_1() {
  expect_error "$@"
  if [[ $last_rc -ne 1 ]]; then fail "$1: exit status $last_rc, expected 1"; fi
}

src="$TESSERA_SOURCE_DIR/configs"
cat >f16.yaml <<YAML
extends: $src/smollm2-cpu.yaml
model: {path: $model}
YAML
cat >f32.yaml <<YAML
extends: $src/smollm2-cpu-f32kv.yaml
model: {path: $model}
YAML
cat >q8.yaml <<YAML
extends: $src/smollm2-cpu.yaml
model: {path: $model}
engine:
  kv_cache: {plugin: paged, block_size: 16, memory: 512MiB, dtype: q8_0, prefix_caching: true}
YAML
eval_args=(eval --corpus "$corpus" --ctx 128 --chunks 3)

# --- perplexity, a stack against itself -----------------------------------------------------
if "$bin" "${eval_args[@]}" --config f16.yaml --reference-config f16.yaml --json self.json --html self.html \
    --save-logits f16.logp --greedy 8 >self.out 2>self.err; then
  check "perplexity is finite and sane" self.json "math.isfinite(r['ppl']) and 2 < r['ppl'] < 200 and r['scored_tokens'] == 3 * 63"
  check "a stack against itself: KLD exactly 0, top-1 100 %" self.json \
    "r['kld']['mean'] == 0 and r['kld']['max'] == 0 and r['top1_agreement'] == 1 and r['delta_p']['rms'] == 0 and r['reference']['ppl'] == r['ppl']"
  check "a stack against itself: greedy continuations identical" self.json \
    "r['greedy']['identical'] == 3 and r['greedy']['mean_agreeing_prefix'] == 1"
  if grep -q "KLD 99.9%" self.err && grep -q "same top-1" self.err && grep -q "<svg" self.html; then
    pass "terminal table and HTML report"
  else
    fail "terminal table and HTML report"
  fi
else
  fail "tessera eval f16 vs f16: $(tail -3 self.err)"
fi

# --- the saved reference reused -------------------------------------------------------------
if "$bin" "${eval_args[@]}" --config f16.yaml --reference-logits f16.logp --json reuse.json -q 2>reuse.err; then
  check "saved log-probabilities of the same stack: KLD exactly 0" reuse.json \
    "r['kld']['max'] == 0 and r['top1_agreement'] == 1"
  check "saved reference reports the same perplexity" reuse.json \
    "r['reference']['ppl'] == json.load(open('self.json'))['ppl']"
else
  fail "tessera eval --reference-logits: $(tail -3 reuse.err)"
fi

# --- llama-perplexity's own base file -------------------------------------------------------
# tests/fixtures/eval/smollm2-q4_1.gpl3.c16.kld: llama-perplexity (llama-cpp-python 0.3.36,
# AVX2 build) -m SmolLM2-135M-Instruct.Q4_1.gguf -f GPL-3 -c 16 -b 16 --chunks 2 -ctk f32
# -ctv f32 -fa off -t 2 --kl-divergence-base FILE: its log-probabilities, coded in 16 bits,
# read as the reference of the stack that computes llama.cpp's logits bit for bit.
llama_base="$TESSERA_SOURCE_DIR/tests/fixtures/eval/smollm2-q4_1.gpl3.c16.kld"
if "$bin" eval --corpus "$corpus" --ctx 16 --chunks 2 --config f32.yaml --reference-logits "$llama_base" \
    --json llama.json -q 2>llama.err; then
  check "llama-perplexity's base file: the perplexity it printed (8.4612) read back" llama.json \
    "abs(r['reference']['ppl'] - 8.4612) < 2e-3"
  check "llama-perplexity's base file: the reference stack agrees with it" llama.json \
    "r['kld']['mean'] < 1e-4 and r['top1_agreement'] == 1 and abs(r['ppl'] / r['reference']['ppl'] - 1) < 2e-3"
else
  fail "tessera eval --reference-logits (llama-perplexity's file): $(tail -3 llama.err)"
fi
head -c 100000 "$llama_base" >llama-truncated.kld
expect_error_1 "llama-perplexity file, truncated" "truncated or corrupt" \
  "$bin" eval -q --config f32.yaml --corpus "$corpus" --ctx 16 --chunks 2 --reference-logits llama-truncated.kld
expect_error_1 "llama-perplexity file made with another context" "llama-perplexity -c 16" \
  "$bin" eval -q --config f32.yaml --corpus "$corpus" --ctx 32 --chunks 2 --reference-logits "$llama_base"
expect_error_1 "llama-perplexity file with fewer chunks than asked for" "holds 2 chunks" \
  "$bin" eval -q --config f32.yaml --corpus "$corpus" --ctx 16 --chunks 3 --reference-logits "$llama_base"

# --- lower precision has a cost -------------------------------------------------------------
for low in f16 q8; do
  if "$bin" "${eval_args[@]}" --config $low.yaml --reference-config f32.yaml --json $low-vs-f32.json -q --greedy 8 \
      2>$low.err; then
    check "$low KV cache vs f32 KV cache: KLD > 0" $low-vs-f32.json \
      "r['kld']['mean'] > 0 and r['kld']['max'] >= r['kld']['p99_9'] >= r['kld']['p99'] >= r['kld']['median'] >= 0 and 0.5 < r['top1_agreement'] <= 1 and 0 <= r['greedy']['mean_agreeing_prefix'] <= 1"
  else
    fail "tessera eval $low vs f32: $(tail -3 $low.err)"
  fi
done

# --- the q8_0 cache's own error, on F32 weights -------------------------------------------
# The Q4_1 matmuls re-quantize their inputs to 8 bits, which turns any change into KLD ~0.004;
# F32 weights (the default model dequantized by tessera quantize) multiply in f32, so there the
# q8_0 cache's rounding shows alone. Its rows are stored Hadamard-rotated (tessera/kv_rotation.h):
# mean KLD against the f16 cache ~0.00026 over these 3 chunks, ~0.0009 before the rotation (and
# a V rotation not undone on the output would be far worse). Issue 14's bound is 0.002.
if "$bin" quantize "$model" f32-weights.gguf --type F32 >quantize.out 2>quantize.err; then
  cat >f16w.yaml <<YAML
extends: $src/smollm2-cpu.yaml
model: {path: $scratch/f32-weights.gguf}
YAML
  cat >q8w.yaml <<YAML
extends: $src/smollm2-cpu-q8kv.yaml
model: {path: $scratch/f32-weights.gguf}
YAML
  if "$bin" eval --corpus "$corpus" --ctx 512 --chunks 3 --config q8w.yaml --reference-config f16w.yaml \
      --json q8w.json -q 2>q8w.err; then
    check "q8_0 KV cache vs f16 on F32 weights: mean KLD < 0.0005" q8w.json \
      "0 < r['kld']['mean'] < 5e-4 and r['top1_agreement'] > 0.97"
  else
    fail "tessera eval q8_0 vs f16 on F32 weights: $(tail -3 q8w.err)"
  fi
  rm -f f32-weights.gguf
else
  fail "tessera quantize --type F32: $(tail -3 quantize.err)"
fi

# --- bad input ------------------------------------------------------------------------------
expect_error_1 "missing corpus" "no-such.txt" "$bin" eval -q --config f16.yaml --corpus no-such.txt
printf 'Only a few words.\n' >short.txt
expect_error_1 "corpus shorter than one chunk" "shorter than one chunk" "$bin" eval -q --config f16.yaml --corpus short.txt --ctx 128
: >empty.txt
expect_error_1 "empty corpus" "empty" "$bin" eval -q --config f16.yaml --corpus empty.txt
expect_error_1 "reference made with another context" "--ctx 128" \
  "$bin" eval -q --config f16.yaml --corpus "$corpus" --ctx 64 --chunks 3 --reference-logits f16.logp
head -c 20000 /usr/share/common-licenses/Apache-2.0 >other.txt
expect_error_1 "reference made from another text" "different text" \
  "$bin" eval -q --config f16.yaml --corpus other.txt --ctx 128 --chunks 3 --reference-logits f16.logp
expect_error_1 "llama-perplexity file of another text" "different text" \
  "$bin" eval -q --config f32.yaml --corpus other.txt --ctx 16 --chunks 2 --reference-logits "$llama_base"
expect_error_1 "reference with more chunks than saved" "holds 3 chunks" \
  "$bin" eval -q --config f16.yaml --corpus "$corpus" --ctx 128 --chunks 4 --reference-logits f16.logp
expect_error_1 "not a reference file" "neither a file written by tessera eval" \
  "$bin" eval -q --config f16.yaml --corpus "$corpus" --ctx 128 --reference-logits "$corpus"
expect_error_1 "greedy continuations need a reference stack" "--greedy needs --reference-config" \
  "$bin" eval -q --config f16.yaml --corpus "$corpus" --ctx 128 --greedy 8 --reference-logits f16.logp
expect_error_1 "missing reference file" "cannot open" \
  "$bin" eval -q --config f16.yaml --corpus "$corpus" --ctx 128 --reference-logits no-such.logp

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
