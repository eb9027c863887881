#!/usr/bin/env bash
# The RDMA transport against a REAL verbs device (a NIC, or soft-RoCE:
# `rdma link add rxe0 type rxe netdev eth0`), where one exists:
#  1. find a device (ibv_devices, else /sys/class/infiniband); none: print
#     that no RDMA device exists and exit 0 with "SKIPPED";
#  2. build with RDMA=1 (BUILD=build-rdma);
#  3. tests/unit/test_xport_rdma with KV_RDMA_REAL=1: the two-process test
#     without the software device (kv__verbs_set is skipped; the fault cases,
#     which need the soft device's injection, skip themselves): handshake,
#     MR registration, writes with a notification and the whole-region
#     compare, reads, cancel, refused token/fingerprint, the peer killed,
#     and the bandwidth case (256 writes of 20 MiB; prints GB/s);
#  4. where perftest is installed, ib_write_bw -s 1048576 on the same
#     device over loopback, against the test's 1 MiB-message writes (the
#     ratio; goal >= 0.90);
#  5. the same test over the software device, for comparison.
# It prints the parameters the transport chose on the real device (device,
# port, link layer, LID, GID index/type/address, active MTU; per peer the
# path MTU, GRH or not, the peer's LID and GID: kv_xport_info_format's
# line) and, where ibv_devinfo exists, each port as the device reports it.
# KV_RDMA_DEVICE, KV_RDMA_PORT, KV_RDMA_GID_INDEX (environment) choose them
# instead (the transport's config fields rdma_device, rdma_port,
# rdma_gid_index); unset: automatic. KV_RDMA_DEVICES=mlx5_0,mlx5_1 runs it
# over those rails (rdma_devices; the test's data on rail 0) and the line
# then shows each rail's choices and path, with its device's NUMA node and
# PCI address from sysfs ("numa 0 pci 0000:04:00.0": what a device-memory
# region's automatic rail is chosen by, docs/connector.md "Where a region
# lives").
# Exit status 0 only if every step passed (or SKIPPED).
set -euo pipefail
cd "$(dirname "$0")/.."

devices=""
if command -v ibv_devices >/dev/null 2>&1; then
    devices=$(ibv_devices 2>/dev/null | awk 'NR > 2 && NF { print $1 }' || true)
fi
if [[ -z "$devices" && -d /sys/class/infiniband ]]; then
    devices=$(ls /sys/class/infiniband 2>/dev/null || true)
fi
if [[ -z "$devices" ]]; then
    echo "rdma-check: no RDMA device exists on this host (ibv_devices lists none,"
    echo "rdma-check: /sys/class/infiniband is empty); soft-RoCE would count:"
    echo "rdma-check:   rdma link add rxe0 type rxe netdev <if>"
    echo "SKIPPED"
    exit 0
fi
echo "rdma-check: RDMA device(s): $(echo $devices)"
[[ -f /usr/include/infiniband/verbs.h ]] || {
    echo "rdma-check: a device exists but rdma-core headers are missing (libibverbs-dev)"
    exit 1
}

echo "== build (RDMA=1)"
make -j"$(nproc)" RDMA=1 BUILD=build-rdma build-rdma/tests/test_xport_rdma

if command -v ibv_devinfo >/dev/null 2>&1; then
    echo "== ports (ibv_devinfo)"
    ibv_devinfo 2>/dev/null | grep -E "hca_id|port:|state|active_mtu|link_layer|port_lid" || true
fi

echo "== test_xport_rdma on the real device (KV_RDMA_REAL=1;" \
    "device ${KV_RDMA_DEVICES:-${KV_RDMA_DEVICE:-auto}} port ${KV_RDMA_PORT:-auto}" \
    "gid index ${KV_RDMA_GID_INDEX:-auto})"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
KV_RDMA_REAL=1 timeout 300 build-rdma/tests/test_xport_rdma 2>&1 | tee "$log" || rc=$?
echo "rdma-check: parameters chosen:"
grep -m1 "rdma parameters:" "$log" | sed 's/^ *rdma parameters: /rdma-check:   /' ||
    echo "rdma-check:   (not printed: the handshake did not complete)"
[[ $rc -eq 0 ]] || { echo "rdma-check: FAILED on the real device (exit $rc)"; exit "$rc"; }

# The ib_write_bw comparison (issue goal: >= 90% of perftest's ib_write_bw
# for 1 MiB messages): perftest's server and client on this host, one
# device, loopback (the same path the test above took), against the test's
# "1MiB messages" line.
echo "== ib_write_bw (perftest) for 1 MiB messages, against kvcache's 1 MiB writes"
ours=$(sed -n 's/.*rdma write bandwidth 1MiB messages (real device):.* = \([0-9.]*\) GB\/s.*/\1/p' "$log" | head -1)
if ! command -v ib_write_bw >/dev/null 2>&1; then
    echo "rdma-check: ib_write_bw not installed (apt install perftest): comparison skipped;" \
        "kvcache 1 MiB writes: ${ours:-?} GB/s"
else
    dev=${KV_RDMA_DEVICE:-$(echo $devices | awk '{print $1}')}
    pt_args=(-d "$dev" -s 1048576 -n 5000 -F --report_gbits)
    [[ -n "${KV_RDMA_PORT:-}" ]] && pt_args+=(-i "$KV_RDMA_PORT")
    [[ -n "${KV_RDMA_GID_INDEX:-}" ]] && pt_args+=(-x "$KV_RDMA_GID_INDEX")
    srv=$(mktemp)
    timeout 120 ib_write_bw "${pt_args[@]}" > "$srv" 2>&1 &
    spid=$!
    sleep 1
    cli=$(timeout 120 ib_write_bw "${pt_args[@]}" 127.0.0.1 2>&1 || true)
    wait "$spid" || true
    rm -f "$srv"
    # the result row: "1048576  5000  <peak Gb/s>  <average Gb/s>  <Mpps>"
    pt=$(echo "$cli" | awk '$1 == 1048576 && NF >= 4 { printf "%.2f", $4 / 8; exit }')
    if [[ -z "$pt" || -z "$ours" ]]; then
        echo "rdma-check: no comparison (ib_write_bw: ${pt:-no result row}; kvcache: ${ours:-no line})"
        echo "$cli" | tail -5
    else
        ratio=$(awk -v a="$ours" -v b="$pt" 'BEGIN { printf "%.2f", a / b }')
        echo "rdma-check: 1 MiB writes: kvcache $ours GB/s, ib_write_bw $pt GB/s" \
            "(device $dev): ratio $ratio (goal >= 0.90)"
    fi
fi

echo "== test_xport_rdma on the software device"
timeout 120 build-rdma/tests/test_xport_rdma

echo "== test_xport_rdma_rails on the software device (its per-rail choices)"
make -j"$(nproc)" RDMA=1 BUILD=build-rdma build-rdma/tests/test_xport_rdma_rails
timeout 60 build-rdma/tests/test_xport_rdma_rails | tee "$log"
grep -m1 "rails:" "$log" | sed 's/^ *rails: /rdma-check:   soft rails: /' || true

echo "rdma-check: PASSED"
