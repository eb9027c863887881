#!/usr/bin/env bash
# shellcheck disable=SC2086 # lists of pids are split on purpose
# kvdemo's parent never waits forever, and its roles never outlive it:
# - a role stopped (SIGSTOP) held the parent forever: with --timeout 1 the
#   parent kills both roles and fails, naming the limit;
# - a parent killed (SIGKILL) left its roles running out their own 30 s
#   waits: they die with it (PR_SET_PDEATHSIG).
# Usage: tests/cli/test_watchdog.sh BUILD_DIR
set -uo pipefail
build=${1:-build}
d=$build/kvdemo
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() {
    printf 'FAIL: %s\n' "$*"
    fails=$((fails + 1))
}
# the roles of parent $1 (its children), space-separated
roles_of() { pgrep -P "$1" | tr '\n' ' '; }
wait_roles() { # until parent $1 has $2 children (5 s at most)
    [ -n "$1" ] || return 1
    for _ in $(seq 500); do
        [ "$(pgrep -P "$1" | wc -l)" -ge "$2" ] && return 0
        sleep 0.01
    done
    return 1
}
gone() { # until every pid in $1 has exited (5 s at most)
    for _ in $(seq 500); do
        local alive=0
        for p in $1; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && return 0
        sleep 0.01
    done
    return 1
}

# 1. decode stopped as soon as it exists (a run long enough not to end
#    first): the parent gives up after 1 s
timeout 20 "$d" --requests 256 --timeout 1 >"$tmp/1.out" 2>"$tmp/1.err" &
tpid=$!
ppid_=
for _ in $(seq 500); do
    ppid_=$(pgrep -P $tpid)
    [ -n "$ppid_" ] && break
    kill -0 $tpid 2>/dev/null || break
    sleep 0.01
done
if wait_roles "$ppid_" 1; then
    dec=$(roles_of "$ppid_")
    kill -STOP $dec
    t0=$(date +%s%N)
    wait $tpid
    rc=$?
    ms=$((($(date +%s%N) - t0) / 1000000))
    [ "$rc" = 1 ] || fail "stopped decode: parent exit $rc (want 1; 124 = it hung): $(tail -2 "$tmp/1.err")"
    grep -q "did not finish within 1 s (--timeout): its processes were killed" "$tmp/1.err" ||
        fail "stopped decode: the limit not named: $(tail -2 "$tmp/1.err")"
    gone "$dec" || { fail "stopped decode: still there after the parent ended"; kill -9 $dec 2>/dev/null; }
    [ "$ms" -lt 10000 ] || fail "stopped decode: the parent took $ms ms"
else
    fail "kvdemo started no role"
    wait $tpid
fi

# 2. the parent killed while both roles run: they die with it
"$d" --requests 256 >"$tmp/2.out" 2>"$tmp/2.err" &
ppid_=$!
if wait_roles $ppid_ 2; then
    both=$(roles_of $ppid_)
    kill -9 $ppid_
    wait $ppid_ 2>/dev/null
    gone "$both" || { fail "parent killed: its roles ($both) still run"; kill -9 $both 2>/dev/null; }
else
    fail "kvdemo did not start both roles: $(tail -2 "$tmp/2.err")"
    kill -9 $ppid_ 2>/dev/null
fi
[ "$fails" = 0 ] && echo "tests/cli/test_watchdog.sh: 2 of 2 as expected" || echo "tests/cli/test_watchdog.sh: $fails check(s) failed"
[ "$fails" = 0 ]
