#!/usr/bin/env bash
# The kernel tests on CPUs other than this one, under QEMU's user-mode
# emulator (qemu-x86_64, TCG; Debian's qemu-user, installed by
# scripts/deps.sh):
#
#   Haswell  AVX2, FMA and F16C, no AVX-512: an EPYC before Zen 4, a Xeon
#            before Skylake-SP. The AVX2 paths chosen by the CPU, not by a
#            test knob (kv__attn_avx2_only).
#   Nehalem  SSE4.2, no AVX: the portable loops chosen by the CPU.
#
# Each binary must pass on each model: every runtime dispatch asks the CPU
# it runs on (an instruction the CPU lacks is SIGILL here), and every test's
# expectation of a dispatch follows the CPU too (tests/common/kvtest.h,
# kvt_cpu_has_*). The first run (2026-12-05) found test_attn_mla expecting
# the AVX2 MLA path on a CPU without AVX.
#
# usage: scripts/cpu-variants.sh [--quick] [BUILD]   (BUILD: default build)
#   --quick  the MLA kernels, the write/read/copy kernels, the kernels' edge
#            cases, the dtype conversions (F16C's own answers where the CPU
#            has it) and the hash (.ci/run; 22 s here for both models); without
#            it also decode, prefill and options, view copies, pack, plans
#            and the offload tier (4 min 13 s).
# The two models run at once; each prints its binaries in order, each with
# its time. Exit status 0 only if every binary passed on every model.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
quick=0
if [[ ${1:-} == --quick ]]; then
    quick=1
    shift
fi
build=${1:-build}
qemu=$(command -v qemu-x86_64 || true)
if [[ -z $qemu ]]; then
    echo "cpu-variants: qemu-x86_64 not found (Debian: qemu-user; scripts/deps.sh installs it)"
    exit 1
fi
if [[ $(uname -m) != x86_64 ]]; then
    echo "cpu-variants: x86-64 CPU models only; this host is $(uname -m): nothing to run"
    exit 0
fi
bins=(test_attn_mla test_attn_copy test_attn_edges test_convert test_xxh3)
((quick)) || bins+=(test_attn test_attn_opts test_view_copy test_pack test_plan test_offload)
for b in "${bins[@]}"; do
    [[ -x $build/tests/$b ]] || { echo "cpu-variants: $build/tests/$b is not built (make tests)"; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run_model() {
    local model=$1 log=$work/$1.log failed=0 b t0 rc out
    for b in "${bins[@]}"; do
        t0=$EPOCHREALTIME
        # KVT_NO_GRID=1: test_attn_mla leaves out its cases of the CUDA
        # bodies on the grid emulator (scalar code, the same on every CPU,
        # and the emulator's fiber switches are slowest under QEMU)
        # KVT_EMULATED_QUICK (--quick): test_attn_mla's prefill comparison
        # keeps one case per dtype and option (QEMU's AVX2 is slow: 127 s
        # of it on an Intel Xeon host against 45 s)
        out=$(OMP_WAIT_POLICY=passive KVT_NO_GRID=1 KVT_EMULATED_QUICK=$quick timeout 900 "$qemu" -cpu "$model" \
            "$build/tests/$b" 2>&1)
        rc=$?
        {
            printf '%-16s %-16s %6.1f s  ' "$model" "$b" \
                "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')"
            if [[ $rc -eq 0 ]]; then
                printf '%s\n' "$out" | grep -E '^\[  PASSED  \]' | tail -n 1
            else
                echo "FAILED (exit $rc)"
                printf '%s\n' "$out" | grep -E '^\[  (ERROR|FAILED) |^\[   LINE   \]' | head -n 20
                failed=1
            fi
        } >> "$log"
    done
    echo "$failed" > "$work/$model.rc"
}

models=(Haswell Nehalem)
echo "cpu-variants: $qemu ($("$qemu" --version | head -n 1)); models ${models[*]}; ${#bins[@]} binaries from $build"
for m in "${models[@]}"; do
    run_model "$m" &
done
wait
rc=0
for m in "${models[@]}"; do
    cat "$work/$m.log"
    [[ $(cat "$work/$m.rc" 2>/dev/null) == 0 ]] || rc=1
done
[[ $rc -eq 0 ]] && echo "cpu-variants: every binary passed on every model" ||
    echo "cpu-variants: FAILED"
exit $rc
