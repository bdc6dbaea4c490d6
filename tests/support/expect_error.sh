# Sourced by the command-line test scripts (tests/integration/test_*.sh).
# expect_error NAME EXPECTED_SUBSTRING COMMAND...: the command must exit non-zero (and not by a
# signal) with exactly one line on stderr, starting "error: " and containing the expected
# text. Counts into $passed / $failed; the exit status is left in $last_rc.
# pass NAME / fail NAME: a check of the script's own, counted the same way.
passed=0
failed=0
pass() { echo "ok   $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }

expect_error() {
  local name=$1 expected=$2
  shift 2
  "$@" >stdout.txt 2>stderr.all.txt
  last_rc=$?
  # Model-loading progress lines are not errors.
  grep -v '^loading model \[' stderr.all.txt >stderr.txt
  local lines
  lines=$(grep -c . stderr.txt)
  if [[ $last_rc -ne 0 && $last_rc -lt 128 && $lines -eq 1 ]] && grep -q '^error: ' stderr.txt &&
     grep -qF -- "$expected" stderr.txt; then
    echo "ok   $name: $(cat stderr.txt)"
    passed=$((passed + 1))
  else
    echo "FAIL $name (exit $last_rc, $lines stderr lines, wanted '$expected'):"
    sed 's/^/     /' stderr.txt
    failed=$((failed + 1))
  fi
}
