#!/usr/bin/env bash
# Bad command-line values are refused before anything runs: exit 2 and a
# message naming the option and the value (tools/kvdemo, tools/kvcache,
# tools/bench's environment).
# Usage: tests/cli/test_args.sh BUILD_DIR
set -uo pipefail
build=${1:-build}
fails=0 n=0
# expect CODE NEEDLE -- COMMAND...: COMMAND exits CODE, its stderr holds NEEDLE
expect() {
    local code=$1 needle=$2
    shift 3
    local err rc
    err=$("$@" 2>&1 >/dev/null)
    rc=$?
    n=$((n + 1))
    if [ "$rc" != "$code" ] || [[ "$err" != *"$needle"* ]]; then
        printf 'FAIL: %s -> exit %s (want %s), stderr: %s (want it to hold: %s)\n' \
            "$*" "$rc" "$code" "$err" "$needle"
        fails=$((fails + 1))
    fi
}
d=$build/kvdemo
# strtoull alone skips blanks, takes a sign and reads 010 as octal
expect 2 "--seed needs an unsigned integer" -- "$d" --local --seed ' -1'
expect 2 "got ' +3'" -- "$d" --local --requests ' +3'
expect 2 "got '0x'" -- "$d" --local --seed 0x
expect 2 "got '1e3'" -- "$d" --local --seed 1e3
expect 2 "got '257'" -- "$d" --local --requests 257
expect 2 "got '0'" -- "$d" --local --requests 0
expect 2 "got '18446744073709551616'" -- "$d" --local --seed 18446744073709551616
expect 2 "tcp, rdma, shm or auto, got 'foo'" -- "$d" --transport foo
expect 2 ">= 3, got '1'" -- "$d" --report-fd 1
expect 2 "got '99999'" -- "$d" --port-fd 99999
expect 2 "got '65536'" -- "$d" --port 65536
# a descriptor the role writes to must be open for writing (a read-only one
# lost the report, and the role's failed checks with it: it exited 0)
# shellcheck disable=SC2016 # $0: expanded by that sh
expect 2 "--report-fd needs a file descriptor open for writing, >= 3, got '3'" -- \
    sh -c 'exec "$0" decode --port 0 --report-fd 3 3</dev/null' "$d"
# shellcheck disable=SC2016
expect 2 "--port-fd needs a file descriptor open for writing, >= 3, got '3'" -- \
    sh -c 'exec "$0" decode --port 0 --port-fd 3 3</dev/null' "$d"
expect 2 "--requests needs 1..256, got '(nothing)'" -- "$d" --requests
expect 2 "unknown option '--nope'" -- "$d" --nope
expect 2 "unexpected argument 'extra'" -- "$d" --local extra
c=$build/kvcache
expect 2 "--blocks '-1' is not a number in range" -- "$c" cache --blocks -1
expect 2 "' 4'" -- "$c" cache --blocks ' 4'
expect 2 "0x10" -- "$c" cache --blocks 0x10
# kvbench where it is built (.ci/run runs this again after building it):
# its KVB_* numbers are checked before the first case
b=$build/kvbench
if [ -x "$b" ]; then
    expect 2 "KVB_RUNS='abc' is not a decimal integer" -- env KVB_RUNS=abc "$b" --list
    expect 2 "KVB_RUNS='0'" -- env KVB_RUNS=0 "$b" --list
    expect 2 "KVB_THREADS=' 4'" -- env "KVB_THREADS= 4" "$b" --list
    expect 2 "KVB_SETTLE_MS='-1'" -- env KVB_SETTLE_MS=-1 "$b" --list
    expect 2 "KVB_GATHER_BELOW='0x10'" -- env KVB_GATHER_BELOW=0x10 "$b" --list
    expect 2 "KVB_GATHER_BELOW='4294967296'" -- env KVB_GATHER_BELOW=4294967296 "$b" --list
fi
echo "tests/cli/test_args.sh: $((n - fails)) of $n refusals as expected"
[ "$fails" = 0 ]
