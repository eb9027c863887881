#!/usr/bin/env bash
# Run every test binary given, print each cmocka summary, then one closing
# line "N passed, N failed". Exit non-zero if any test failed or crashed.
set -uo pipefail
passed=0; failed=0; bad_bins=()
for t in "$@"; do
    [[ -x "$t" ]] || { echo "missing test binary: $t"; failed=$((failed + 1)); continue; }
    # Output to a file, not a pipe: a child a failed test left behind must
    # not hold the run open. timeout leads its own process group; whatever
    # of that group outlives the test is killed.
    log=$(mktemp)
    timeout "${KV_TEST_TIMEOUT:-600}" "$t" > "$log" 2>&1 & tpid=$!
    wait "$tpid"; rc=$?
    kill -KILL -- "-$tpid" 2>/dev/null || true
    out=$(cat "$log"); rm -f "$log"
    printf '%s\n' "$out"
    p=$(printf '%s\n' "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | awk '{s+=$1} END {print s+0}')
    f=$(printf '%s\n' "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' | awk '{s+=$1} END {print s+0}')
    passed=$((passed + p)); failed=$((failed + f))
    if [[ $rc -ne 0 && $f -eq 0 ]]; then
        echo "$t exited with status $rc"; failed=$((failed + 1))
    fi
    [[ $rc -ne 0 ]] && bad_bins+=("$(basename "$t")")
done
echo
[[ ${#bad_bins[@]} -gt 0 ]] && echo "failing binaries: ${bad_bins[*]}"
echo "tests: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
