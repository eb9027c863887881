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
#  4. the same test over the software device, for comparison.
# It prints the parameters the transport chose on the real device (device,
# port, link layer, LID, GID index/type/address, active MTU; per peer the
# path MTU, GRH or not, the peer's LID and GID: kv_xport_info_format's
# line) and, where ibv_devinfo exists, each port as the device reports it.
# KV_RDMA_DEVICE, KV_RDMA_PORT, KV_RDMA_GID_INDEX (environment) choose them
# instead (the transport's config fields rdma_device, rdma_port,
# rdma_gid_index); unset: automatic. KV_RDMA_DEVICES=mlx5_0,mlx5_1 runs it
# over those rails (rdma_devices; the test's data on rail 0) and the line
# then shows each rail's choices and path.
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

echo "== test_xport_rdma on the software device"
timeout 120 build-rdma/tests/test_xport_rdma

echo "== test_xport_rdma_rails on the software device (its per-rail choices)"
make -j"$(nproc)" RDMA=1 BUILD=build-rdma build-rdma/tests/test_xport_rdma_rails
timeout 60 build-rdma/tests/test_xport_rdma_rails | tee "$log"
grep -m1 "rails:" "$log" | sed 's/^ *rails: /rdma-check:   soft rails: /' || true

echo "rdma-check: PASSED"
