#!/usr/bin/env bash
# `tessera quantize` on the real default model (SmolLM2-135M-Instruct Q4_1, requantized):
#  - Q8_0 and Q4_0 files load in Tessera, generate greedy text, and their perplexity on the
#    evaluation text (the GPL-3) is close to the input model's (Q8_0 within 2 %, Q4_0 within
#    25 %: requantizing Q4_1 weights to Q4_0 compounds two roundings). Q8_0 continues "The
#    capital of France is" with Paris as the input model does; round-to-nearest Q4_0 does not
#    (it says "approximately 315 kilometres"; llama-quantize writes the same tensor bytes),
#    so of it only 8 tokens of text are asked;
#  - --method importance collects activation statistics on a different text (the GFDL-1.3),
#    saves them as an imatrix GGUF, and its Q4_0 file loads, says Paris and evaluates closer;
#  - --method gptq and awq (calibrated on the GFDL, from the F32 dequantization) evaluate
#    better than round-to-nearest Q4_0; AWQ's folding alone (F32 target, fixed alpha) leaves
#    the float model's logits unchanged (KLD against the unfolded model's);
#  - bad input is one error line, exit status 1 and no output file.
# Exit 77 (skipped) without the model or the texts. Ends with "N passed, N failed".
set -uo pipefail

bin="$TESSERA_BUILD_DIR/bin/tessera"
model_dir="${TESSERA_MODEL_DIR:-$HOME/.cache/tessera/models}"
model="${TESSERA_MODEL_PATH:-$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf}"
corpus=/usr/share/common-licenses/GPL-3
calibration=/usr/share/common-licenses/GFDL-1.3
if [[ ! -f "$model" || ! -f "$corpus" || ! -f "$calibration" ]]; then
  echo "skipped: needs $model, $corpus and $calibration"
  exit 77
fi
scratch="$TESSERA_BUILD_DIR/test-scratch/quantize"
rm -rf "$scratch" && mkdir -p "$scratch"
cd "$scratch" || exit 1
source "$TESSERA_SOURCE_DIR/tests/support/expect_error.sh"
expect_error_1() {
  expect_error "$@"
  if [[ $last_rc -ne 1 ]]; then fail "$1: exit status $last_rc, expected 1"; fi
}
src="$TESSERA_SOURCE_DIR/configs"
stack() {  # stack NAME MODEL: the bit-exact default stack over MODEL
  cat >"$1.yaml" <<YAML
extends: $src/smollm2-cpu-f32kv.yaml
model: {path: $2}
YAML
}
stack orig "$model"
eval_args=(eval -q --corpus "$corpus" --ctx 256 --chunks 4)
"$bin" "${eval_args[@]}" --config orig.yaml --json orig.json 2>orig.err || fail "eval of the input model: $(tail -2 orig.err)"
prompt="The capital of France is"
"$bin" generate -c orig.yaml -p "$prompt" --max-tokens 8 --temperature 0 >orig.txt 2>/dev/null

for type in Q8_0 Q4_0; do
  if "$bin" quantize -q --threads 2 "$model" "$type.gguf" --type "$type" 2>"$type.err"; then
    pass "quantize to $type"
  else
    fail "quantize to $type: $(tail -2 "$type.err")"
    continue
  fi
  stack "$type" "$PWD/$type.gguf"
  want=$([[ $type == Q8_0 ]] && echo "paris" || echo "[a-z]")
  if "$bin" generate -c "$type.yaml" -p "$prompt" --max-tokens 8 --temperature 0 >"$type.txt" 2>"$type.gen.err" && grep -qi "$want" "$type.txt"; then
    pass "$type greedy continuation ($want): $(tr '\n' ' ' <"$type.txt")"
  else
    fail "$type greedy continuation: '$(cat "$type.txt")' (input model: '$(cat orig.txt)') $(tail -2 "$type.gen.err")"
  fi
  bound=$([[ $type == Q8_0 ]] && echo 1.02 || echo 1.25)
  if "$bin" "${eval_args[@]}" --config "$type.yaml" --json "$type.json" 2>"$type.eval.err" &&
     python3 -c "import json,sys; a=json.load(open('orig.json'))['ppl']; b=json.load(open('$type.json'))['ppl']; print(f'ppl {a:.3f} -> {b:.3f}'); sys.exit(0 if b < a * $bound else 1)" >"$type.ppl"; then
    pass "$type perplexity close to the input's: $(cat "$type.ppl")"
  else
    fail "$type perplexity: $(cat "$type.ppl" 2>/dev/null) $(tail -2 "$type.eval.err")"
  fi
done

# --- importance-weighted, calibrated on another text --------------------------------------
if "$bin" quantize -q --threads 2 "$model" imp.gguf --type Q4_0 --method importance --calibration "$calibration" \
    --ctx 256 --chunks 2 --save-imatrix imp.imatrix 2>imp.err; then
  pass "quantize --method importance"
  stack imp "$PWD/imp.gguf"
  if "$bin" generate -c imp.yaml -p "$prompt" --max-tokens 8 --temperature 0 >imp.txt 2>imp.gen.err && grep -qi paris imp.txt; then
    pass "importance Q4_0 greedy continuation (paris): $(tr '\n' ' ' <imp.txt)"
  else
    fail "importance Q4_0 greedy continuation: '$(cat imp.txt)' $(tail -2 imp.gen.err)"
  fi
  if "$bin" "${eval_args[@]}" --config imp.yaml --json imp.json 2>imp.eval.err &&
     python3 -c "import json,sys; a=json.load(open('orig.json'))['ppl']; b=json.load(open('imp.json'))['ppl']; print(f'ppl {a:.3f} -> {b:.3f}'); sys.exit(0 if b < a * 1.25 else 1)" >imp.ppl; then
    pass "importance Q4_0 perplexity close to the input's: $(cat imp.ppl)"
  else
    fail "importance Q4_0 perplexity: $(cat imp.ppl 2>/dev/null) $(tail -2 imp.eval.err)"
  fi
  # The saved statistics give the same file again.
  if "$bin" quantize -q --threads 2 "$model" imp2.gguf --type Q4_0 --method importance --imatrix imp.imatrix 2>imp2.err &&
     cmp -s imp.gguf imp2.gguf; then
    pass "--imatrix with the saved statistics reproduces the file byte for byte"
  else
    fail "--imatrix reproduction: $(tail -2 imp2.err)"
  fi
else
  fail "quantize --method importance: $(tail -2 imp.err)"
fi

# --- gptq and awq, calibrated on the GFDL, against round to nearest of the same type ---------
# Both start from the model's F32 dequantization, as the benchmark does.
ppl_of() { python3 -c "import json; print(json.load(open('$1'))['ppl'])"; }
if "$bin" quantize -q --threads 2 "$model" f32.gguf --type F32 2>f32.err; then
  stack f32 "$PWD/f32.gguf"
  "$bin" "${eval_args[@]}" --config f32.yaml --json f32.json --save-logits f32.logp 2>f32.eval.err ||
    fail "eval of the F32 model: $(tail -2 f32.eval.err)"
  # AWQ's folding alone (a fixed alpha, F32 target: nothing rounded) keeps the model's function:
  # the folded file differs from the input, its logits do not (KLD against the input's).
  if "$bin" quantize -q --threads 2 f32.gguf fold.gguf --type F32 --method awq --awq-alpha 0.5 \
      --calibration "$calibration" --ctx 256 --chunks 1 2>fold.err; then
    stack fold "$PWD/fold.gguf"
    if cmp -s f32.gguf fold.gguf; then
      fail "awq folding changed no byte of the F32 model"
    elif "$bin" "${eval_args[@]}" --config fold.yaml --reference-logits f32.logp --json fold.json 2>fold.eval.err &&
         python3 -c "import json,sys; r=json.load(open('fold.json')); k=r['kld']['mean']; print(f'KLD mean {k:.2e}, top-1 {r[\"top1_agreement\"]:.4f}'); sys.exit(0 if k < 1e-5 and r['top1_agreement'] > 0.995 else 1)" >fold.kld; then
      pass "awq folding (alpha 0.5) keeps the float model's output: $(cat fold.kld)"
    else
      fail "awq folding changed the float model's output: $(cat fold.kld 2>/dev/null) $(tail -2 fold.eval.err)"
    fi
  else
    fail "awq folding: $(tail -2 fold.err)"
  fi
  # W8A8: quantizer.int8 loading the F32 file (int8 rows, int8 tokens, integer dots). The
  # rounding is real (KLD above zero) and bounded; the greedy answer survives.
  stack w8a8 "$PWD/f32.gguf"
  printf 'engine:\n  quantizer: {plugin: int8}\n' >>w8a8.yaml
  if "$bin" "${eval_args[@]}" --config w8a8.yaml --reference-logits f32.logp --json w8a8.json 2>w8a8.eval.err &&
     python3 -c "import json,sys; r=json.load(open('w8a8.json')); k=r['kld']['mean']; print(f'KLD mean {k:.4f}, top-1 {r[\"top1_agreement\"]:.4f}, ppl {r[\"ppl\"]:.3f}'); sys.exit(0 if 1e-4 < k < 0.1 and r['top1_agreement'] > 0.8 else 1)" >w8a8.kld; then
    pass "W8A8 (quantizer.int8) on the F32 model: $(cat w8a8.kld)"
  else
    fail "W8A8 against the F32 model: $(cat w8a8.kld 2>/dev/null) $(tail -2 w8a8.eval.err)"
  fi
  if "$bin" generate -c w8a8.yaml -p "$prompt" --max-tokens 8 --temperature 0 >w8a8.txt 2>w8a8.gen.err &&
     grep -qi paris w8a8.txt; then
    pass "W8A8 greedy continuation (paris): $(tr '\n' ' ' <w8a8.txt)"
  else
    fail "W8A8 greedy continuation: '$(cat w8a8.txt)' $(tail -2 w8a8.gen.err)"
  fi
  "$bin" quantize -q --threads 2 f32.gguf rtn.gguf --type Q4_0 2>rtn.err && stack rtn "$PWD/rtn.gguf" &&
    "$bin" "${eval_args[@]}" --config rtn.yaml --json rtn.json 2>>rtn.err || fail "rtn Q4_0: $(tail -2 rtn.err)"
  for method in gptq awq; do
    if "$bin" quantize -q --threads 2 f32.gguf "$method.gguf" --type Q4_0 --method "$method" \
        --calibration "$calibration" --ctx 256 --chunks 2 2>"$method.err"; then
      stack "$method" "$PWD/$method.gguf"
      if "$bin" "${eval_args[@]}" --config "$method.yaml" --json "$method.json" 2>"$method.eval.err" &&
         python3 -c "import json,sys; a=json.load(open('rtn.json'))['ppl']; b=json.load(open('$method.json'))['ppl']; print(f'ppl rtn {a:.3f}, $method {b:.3f}'); sys.exit(0 if b < a else 1)" >"$method.ppl"; then
        pass "$method Q4_0 evaluates better than rtn Q4_0: $(cat "$method.ppl")"
      else
        fail "$method Q4_0 perplexity: $(cat "$method.ppl" 2>/dev/null) $(tail -2 "$method.eval.err")"
      fi
    else
      fail "quantize --method $method: $(tail -2 "$method.err")"
    fi
  done
else
  fail "quantize to F32: $(tail -2 f32.err)"
fi

# --- bad input: one error, no output ------------------------------------------------------
expect_error_1 "unknown --type" "--type 'Q3_K': not a target type" "$bin" quantize -q "$model" bad.gguf --type Q3_K
expect_error_1 "unknown --method" "--method 'awq2'" "$bin" quantize -q "$model" bad.gguf --type Q4_0 --method awq2
expect_error_1 "int8 is a load-time layout" "engine.quantizer: {plugin: int8}" \
  "$bin" quantize -q "$model" bad.gguf --type Q8_0 --method int8
expect_error_1 "importance without calibration" "needs --calibration" "$bin" quantize -q "$model" bad.gguf --type Q4_0 --method importance
expect_error_1 "missing calibration file" "--calibration 'no-such.txt': no such file" \
  "$bin" quantize -q "$model" bad.gguf --type Q4_0 --method importance --calibration no-such.txt
: >empty.txt
expect_error_1 "empty calibration file" "--calibration 'empty.txt': the file is empty" \
  "$bin" quantize -q "$model" bad.gguf --type Q4_0 --method importance --calibration empty.txt
for method in gptq awq; do
  expect_error_1 "$method without calibration" "--method $method needs --calibration FILE" \
    "$bin" quantize -q "$model" bad.gguf --type Q4_0 --method $method
  expect_error_1 "$method with a missing calibration file" "--calibration 'no-such.txt': no such file" \
    "$bin" quantize -q "$model" bad.gguf --type Q4_0 --method $method --calibration no-such.txt
  expect_error_1 "$method with an empty calibration file" "--calibration 'empty.txt': the file is empty" \
    "$bin" quantize -q "$model" bad.gguf --type Q4_0 --method $method --calibration empty.txt
  expect_error_1 "$method with --imatrix" "not --imatrix" \
    "$bin" quantize -q "$model" bad.gguf --type Q4_0 --method $method --imatrix imp.imatrix
done
expect_error_1 "gptq into Q6_K" "gptq writes Q4_0" \
  "$bin" quantize -q "$model" bad.gguf --type Q6_K --method gptq --calibration "$calibration"
expect_error_1 "missing input" "IN 'no-such.gguf': no such file" "$bin" quantize -q no-such.gguf bad.gguf --type Q4_0
expect_error_1 "output in a missing directory" "cannot write no-dir/bad.gguf" "$bin" quantize -q "$model" no-dir/bad.gguf --type Q8_0
if [[ -e bad.gguf || -n "$(ls no-dir 2>/dev/null)" || -n "$(ls ./*.tmp.* 2>/dev/null)" ]]; then
  fail "bad input left an output or temporary file"
else
  pass "bad input left no output or temporary file"
fi

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
