#!/usr/bin/env bash
# Run every test binary given, print each cmocka summary, then one closing
# line "N passed, N failed". Exit non-zero if any test failed or crashed.
#
# KV_TEST_JOBS=n runs up to n binaries at once (default 1); the output is
# still printed binary by binary, in the order given. The tests assert no
# timing, so they may share the machine (.ci/run uses one per core).
# KV_TEST_TIMEOUT (seconds, default 600) bounds each binary. Each binary's
# summary ends with its wall time, "(test_x: 12.3 s)": where CI's time goes.
set -uo pipefail
jobs=${KV_TEST_JOBS:-1}
# OpenMP workers sleep when a parallel region ends instead of spinning for
# the next: with binaries sharing the cores, a spinning worker only takes
# CPU from the other binary (2-3 s of a CI stage's wall time here).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "run-tests.sh: KV_TEST_JOBS=$jobs is not a positive integer"; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0; failed=0; bad_bins=()

# Output to a file, not a pipe: a child a failed test left behind must not
# hold the run open. timeout leads its own process group; whatever of that
# group outlives the test is killed.
run_one() {
    local i=$1 t=$2 tpid rc t0=$EPOCHREALTIME
    timeout "${KV_TEST_TIMEOUT:-600}" "$t" > "$work/$i.log" 2>&1 & tpid=$!
    wait "$tpid"; rc=$?
    kill -KILL -- "-$tpid" 2>/dev/null || true
    awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f\n", b - a }' > "$work/$i.secs"
    echo "$rc" > "$work/$i.rc"
}

report() {
    local i=$1 t=$2 out rc p f
    out=$(cat "$work/$i.log"); rc=$(cat "$work/$i.rc")
    printf '%s\n' "$out"
    echo "($(basename "$t"): $(cat "$work/$i.secs") s)"
    p=$(printf '%s\n' "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | awk '{s+=$1} END {print s+0}')
    f=$(printf '%s\n' "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' | awk '{s+=$1} END {print s+0}')
    passed=$((passed + p)); failed=$((failed + f))
    if [[ $rc -ne 0 && $f -eq 0 ]]; then
        echo "$t exited with status $rc"; failed=$((failed + 1))
    fi
    [[ $rc -ne 0 ]] && bad_bins+=("$(basename "$t")")
}

tests=("$@")
n=${#tests[@]}
next=0 # the next binary to print
running=0
flush() { # print every binary, in order, that has finished
    while [[ $next -lt $n && ( -e "$work/$next.rc" || -e "$work/$next.missing" ) ]]; do
        if [[ -e "$work/$next.missing" ]]; then
            echo "missing test binary: ${tests[$next]}"; failed=$((failed + 1))
        else
            report "$next" "${tests[$next]}"
        fi
        next=$((next + 1))
    done
}
for ((i = 0; i < n; i++)); do
    t=${tests[$i]}
    if [[ ! -x "$t" ]]; then
        : > "$work/$i.missing"
        flush
        continue
    fi
    while [[ $running -ge $jobs ]]; do
        wait -n 2>/dev/null || true
        running=$(jobs -rp | wc -l)
        flush
    done
    run_one "$i" "$t" &
    running=$((running + 1))
    [[ $jobs -eq 1 ]] && { wait; running=0; flush; }
done
wait
flush
echo
[[ ${#bad_bins[@]} -gt 0 ]] && echo "failing binaries: ${bad_bins[*]}"
echo "tests: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
