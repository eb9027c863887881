#!/usr/bin/env bash
# Install the Debian packages kvcache needs, if any are missing.
# As root: apt-get update + install. Otherwise: print the exact command.
# A no-op (well under a second: one dpkg-query) when everything is present.
set -euo pipefail
# Build and tests: build-essential (gcc, g++, make, binutils), pkg-config, the
# libraries. .ci/run also: python3 (gen-api-doc.py), cppcheck, and clang with
# its sanitizer/libFuzzer runtime (bookworm's clang is clang-14; without
# libclang-rt-14-dev, -fsanitize=fuzzer cannot link). DLPack interop: the
# libdlpack-dev header. The Python package and its tests (make test):
# python3-pytest, python3-numpy (python3-torch is optional: the tests that
# need it are skipped without it, and scripts/bench_peers.py installs it).
# iproute2: the transport test between two network namespaces over a veth
# pair (`ip netns`, `ip link`). qemu-user: scripts/cpu-variants.sh, the
# kernel tests on emulated CPUs without AVX-512 and without AVX (.ci/run).
pkgs=(build-essential pkg-config libjemalloc-dev libcmocka-dev libibverbs-dev librdmacm-dev
      libxxhash-dev clang libclang-rt-14-dev python3 cppcheck libdlpack-dev python3-pytest
      python3-numpy iproute2 qemu-user)
declare -A have=()
while read -r p; do have[$p]=1; done < <(
    dpkg-query -W -f='${Package} ${Status}\n' "${pkgs[@]}" 2>/dev/null |
        awk '/ install ok installed$/ { print $1 }' || true)
missing=()
for p in "${pkgs[@]}"; do
    [[ -n ${have[$p]:-} ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [[ $(id -u) -ne 0 ]]; then
    echo "kvcache: missing packages: ${missing[*]}" >&2
    echo "run as root:  apt-get update && $cmd" >&2
    exit 1
fi
echo "kvcache: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
$cmd -qq
