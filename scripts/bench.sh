#!/usr/bin/env bash
# Run the kvbench binary given as $1 with the remaining arguments, after
# printing a machine line (cores, CPU model, date) to stderr so a saved log
# says where its numbers came from.
#
#   scripts/bench.sh build/kvbench --bench view.materialize --case bf16
set -euo pipefail
if [[ $# -lt 1 || ! -x "$1" ]]; then
    echo "usage: $0 path/to/kvbench [kvbench args...]" >&2
    exit 2
fi
bin=$1; shift
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n1)
[[ -n "$cpu" ]] || cpu=$(uname -m)
echo "machine: nproc=$(nproc) cpu=\"$cpu\" kernel=$(uname -r) date=$(date -u +%Y-%m-%dT%H:%M:%SZ)" >&2
exec "$bin" "$@"
