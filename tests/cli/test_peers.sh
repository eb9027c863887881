#!/usr/bin/env bash
# kvdemo's decode takes only its own prefill's word: a second peer with the
# demo's token (tests/cli/kvdemo_intruder.c) connects to decode's port while
# the real prefill runs and posts DONE for a request it never wrote. Decode
# must not take it for prefill's (it did: it checked the request before its
# bytes landed and released its blocks); the run passes, decode naming what
# it ignored. Beside it, prefill's --report-fd on /dev/full: a role whose
# report (its verdict) was not written fails, naming why.
# Usage: tests/cli/test_peers.sh BUILD_DIR (needs BUILD_DIR/tests/kvdemo_intruder)
set -uo pipefail
build=${1:-build}
d=$build/kvdemo
intruder=$build/tests/kvdemo_intruder
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() {
    printf 'FAIL: %s\n' "$*"
    fails=$((fails + 1))
}
: >"$tmp/d.out"
# The timeouts only end a hang: the roles and the intruder bound their own
# waits (WAIT_MS, 3 s), and a loaded machine or a sanitizer build runs the
# roles many times slower (a 12 s run on one busy core failed "the
# intruder:" with nothing on its stderr: timeout 10's kill, most likely).
timeout 120 "$d" decode --port 0 --requests 1 >"$tmp/d.out" 2>"$tmp/d.err" &
dpid=$!
# poll until SECONDS have passed (whatever one poll costs under load)
until_s() { [ $(($(date +%s) - t0)) -lt "$1" ]; }
port="" t0=$(date +%s)
while until_s 60 && kill -0 "$dpid" 2>/dev/null; do
    port=$(sed -n 's/^decode: listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$tmp/d.out")
    [ -n "$port" ] && break
    sleep 0.01
done
[ -n "$port" ] || fail "decode did not say its port (exited, or 60 s passed)"
# prefill's report goes to a descriptor where it cannot be written
# (/dev/full): its verdict lost, it must fail, naming why (it exited 0)
timeout 120 "$d" prefill --port "${port:-1}" --requests 1 --report-fd 3 \
    >"$tmp/p.out" 2>"$tmp/p.err" 3>/dev/full &
ppid=$!
# the intruder only once decode has accepted prefill (it takes the first
# peer through its handshake: that must be prefill)
up=0 t0=$(date +%s)
while until_s 60 && kill -0 "$ppid" 2>/dev/null; do
    grep -q '^decode: accepted its peer$' "$tmp/d.out" && up=1 && break
    sleep 0.01
done
[ "$up" = 1 ] || fail "decode did not accept prefill (prefill exited, or 60 s passed)"
timeout 120 "$intruder" "${port:-1}" 1 2>"$tmp/i.err"
irc=$?
[ "$irc" = 0 ] || fail "the intruder: exit $irc: $(cat "$tmp/i.err")"
wait $dpid
drc=$?
wait $ppid
prc=$?
[ "$drc" = 0 ] || fail "decode exit $drc (want 0): $(tail -3 "$tmp/d.err")"
[ "$prc" = 1 ] || fail "prefill exit $prc (want 1, its report not written): $(tail -3 "$tmp/p.err")"
grep -q "the report to fd 3 was not written: No space left on device" "$tmp/p.err" ||
    fail "prefill did not name its unwritten report: $(tail -3 "$tmp/p.err")"
grep -q "ignored a notification (tag 2, 4 bytes) from peer" "$tmp/d.err" ||
    fail "decode did not name the notification it ignored: $(tail -3 "$tmp/d.err")"
[ "$fails" = 0 ] && echo "tests/cli/test_peers.sh: 4 of 4 as expected" || echo "tests/cli/test_peers.sh: $fails check(s) failed"
[ "$fails" = 0 ]
