#!/usr/bin/env bash
# Install the Debian packages kvcache needs, if any are missing.
# As root: apt-get update + install. Otherwise: print the exact command.
# A no-op (well under a second) when everything is present.
set -euo pipefail
pkgs=(build-essential pkg-config libjemalloc-dev libcmocka-dev libibverbs-dev librdmacm-dev
      libxxhash-dev clang)
missing=()
for p in "${pkgs[@]}"; do
    st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [[ "$st" == "install ok installed" ]] || missing+=("$p")
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
