#!/usr/bin/env bash
# Check the README's claim on a fresh, minimal Debian 12 (bookworm): in a
# `debootstrap --variant=minbase` chroot, with only the committed source
# tree, run what the README tells a new user to run and time each step:
#
#   apt-get update && apt-get install -y make      (the one prerequisite)
#   make demo                                      (runs scripts/deps.sh itself)
#   make test
#   bash .ci/run                                   (with --ci)
#
# Before that, scripts/deps.sh is run once as an unprivileged user in the bare
# chroot: it must fail and print the apt-get line. After, it must be a fast
# no-op (as root and as that user).
#
# Usage (as root, on a Debian/Ubuntu host with debootstrap installed):
#   scripts/fresh-check.sh [--ci] [--rev REV] [--dir DIR] [--mirror URL]
#                          [--rebootstrap] [--keep]
#
#   --ci           also run `bash .ci/run` in the chroot (adds ~10 minutes)
#   --rev REV      the commit to check (default HEAD); uncommitted changes are
#                  never part of the check
#   --dir DIR      work directory (default /var/tmp/kvcache-fresh). It holds
#                  base/ (the debootstrapped minbase, made once and reused),
#                  root/ (a fresh copy of base/ for each run) and logs/.
#   --mirror URL   Debian mirror (default: the first bookworm URI of this
#                  machine's apt sources)
#   --rebootstrap  make base/ again instead of reusing it
#   --keep         leave root/ in place after the run (it is replaced by the
#                  next run anyway); without it root/ is removed on success
#
# The chroot gets this host's apt source list and Acquire:: settings (so it
# reaches the same mirror the same way), /etc/hosts and /etc/resolv.conf, and
# nothing else from the host: no CUDA toolkit (builds are CUDA=0), no pyenv.
# The mounts (/proc, /sys, /dev, /dev/pts, /dev/shm) are made in a private
# mount namespace and unmounted by a trap on exit; even if this script is
# killed, they vanish with the namespace. Removal only ever touches DIR/root
# and DIR/base, never across a mount point (rm --one-file-system).
#
# Not part of .ci/run: it takes minutes and needs root and a Debian mirror.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=/var/tmp/kvcache-fresh
rev=HEAD
mirror=
ci=0
rebootstrap=0
keep=0
suite=bookworm

args=("$@")
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --ci) ci=1 ;;
        --rev) rev=${2:?--rev needs a value}; shift ;;
        --dir) dir=${2:?--dir needs a value}; shift ;;
        --mirror) mirror=${2:?--mirror needs a value}; shift ;;
        --rebootstrap) rebootstrap=1 ;;
        --keep) keep=1 ;;
        -h|--help) usage 0 ;;
        *) echo "fresh-check: unknown argument: $1" >&2; usage 2 >&2 ;;
    esac
    shift
done

die() { echo "fresh-check: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, chroot, mounts)"
command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install -y debootstrap"
command -v unshare >/dev/null || die "unshare (util-linux) is missing"
case $dir in
    /*) ;;
    *) die "--dir must be an absolute path" ;;
esac
dir=$(realpath -m "$dir")
case $dir in
    /|/bin|/boot|/dev|/etc|/home|/lib*|/opt|/proc|/root|/run|/sbin|/srv|/sys|/tmp|/usr|/usr/*|/var|/var/tmp|/work|/work/*)
        die "refusing to use $dir as the work directory" ;;
esac
base=$dir/base
root=$dir/root
logs=$dir/logs

# Everything below the re-exec runs in a private mount namespace: mounts made
# there are invisible to the host and disappear when the last process exits.
if [[ -z ${KV_FRESH_NS:-} ]]; then
    export KV_FRESH_NS=1
    exec unshare --mount --propagation private -- "$0" ${args[@]+"${args[@]}"}
fi

sha=$(git -C "$repo" rev-parse --verify "$rev^{commit}") || die "no such commit: $rev"
if [[ -n $(git -C "$repo" status --porcelain --untracked-files=no) ]]; then
    echo "fresh-check: note: the working tree has uncommitted changes; checking commit $sha only" >&2
fi

# The mirror: this machine's first bookworm (not -security) URI.
if [[ -z $mirror ]]; then
    mirror=$(awk '
        /^[ \t]*$/ { if (uri != "" && suite) { print uri; exit } uri = ""; suite = 0; next }
        $1 == "URIs:" { uri = $2 }
        $1 == "Suites:" { for (i = 2; i <= NF; i++) if ($i == "bookworm") suite = 1 }
        END { if (uri != "" && suite) print uri }' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
fi
if [[ -z $mirror && -f /etc/apt/sources.list ]]; then
    mirror=$(awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' /etc/apt/sources.list)
fi
mirror=${mirror:-http://deb.debian.org/debian}

mkdir -p "$dir" "$logs"
log=$logs/run-$(date -u +%Y%m%dT%H%M%SZ).log
exec > >(tee -a "$log") 2>&1
echo "fresh-check: commit $sha, $suite minbase from $mirror, work dir $dir"
echo "fresh-check: log $log"

mounted=()
cleanup() {
    local rc=$? i
    for (( i=${#mounted[@]}-1; i>=0; i-- )); do
        umount "${mounted[i]}" 2>/dev/null || umount -l "${mounted[i]}" 2>/dev/null || true
    done
    mounted=()
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Unmount anything still mounted under a directory (left by an older run in
# the host namespace, say), deepest first.
unmount_under() {
    local d=$1 m
    while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m"
    done < <(awk -v d="$d" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r)
}
remove_tree() {
    local d=$1
    [[ -e $d ]] || return 0
    case $d in "$dir"/base|"$dir"/root|"$dir"/base.tmp) ;; *) die "internal: will not remove $d" ;; esac
    unmount_under "$d"
    rm -rf --one-file-system "$d"
}

# 1. The base system, made once.
if [[ $rebootstrap -eq 1 ]]; then remove_tree "$base"; fi
if [[ ! -f $base/.kv-fresh-base-ok ]]; then
    remove_tree "$base"
    remove_tree "$dir/base.tmp"
    echo "fresh-check: debootstrap --variant=minbase $suite (once; reused by later runs)"
    t=$SECONDS
    debootstrap --variant=minbase "$suite" "$dir/base.tmp" "$mirror"
    echo "$sha $(date -u +%FT%TZ) $mirror" > "$dir/base.tmp/.kv-fresh-base-ok"
    mv "$dir/base.tmp" "$base"
    echo "fresh-check: debootstrap took $((SECONDS - t)) s"
else
    echo "fresh-check: reusing $base (made $(cut -d' ' -f2 "$base/.kv-fresh-base-ok"))"
fi

# 2. A fresh copy of it for this run.
remove_tree "$root"
t=$SECONDS
cp -a "$base" "$root"
rm -f "$root/.kv-fresh-base-ok"
echo "fresh-check: fresh root copied in $((SECONDS - t)) s"

# This host's way to the mirror: its Debian source list (in place of the one
# debootstrap wrote), its Acquire:: settings (e.g. no Valid-Until check for a
# snapshot mirror), name resolution.
shopt -s nullglob
srcs=(/etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list)
shopt -u nullglob
copied=0
for f in "${srcs[@]}"; do
    if grep -Eq "^(URIs:|deb)[[:space:]]+.*${mirror%/}/?([[:space:]]|$)" "$f" ||
       grep -Eq 'debian-security' "$f"; then
        cp "$f" "$root/etc/apt/sources.list.d/"
        copied=1
    fi
done
[[ $copied -eq 1 ]] && : > "$root/etc/apt/sources.list"
for f in /etc/apt/apt.conf.d/*; do
    [[ -f $f ]] && grep -q '^[[:space:]]*Acquire::' "$f" && cp "$f" "$root/etc/apt/apt.conf.d/"
done
cp /etc/hosts "$root/etc/hosts"
cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
echo "fresh-check: chroot apt sources: $(cd "$root/etc/apt" && ls sources.list.d) (+ sources.list: $(grep -c . sources.list 2>/dev/null || echo 0) lines)"

# 3. The source tree at the commit (as a release tarball or a clone has it),
# owned by an unprivileged user so deps.sh can be tried without root too.
mkdir -p "$root/home/kv/kvcache"
git -C "$repo" archive --format=tar "$sha" | tar -x -C "$root/home/kv/kvcache"
chroot "$root" /usr/sbin/useradd -M -d /home/kv -s /bin/bash kv 2>/dev/null || true
chroot "$root" /bin/chown -R kv:kv /home/kv

# 4. Mounts.
mnt() { mkdir -p "$root$2"; mount "${@:3}" "$1" "$root$2"; mounted+=("$root$2"); }
mnt proc /proc -t proc
mnt sysfs /sys -t sysfs -o ro || mnt /sys /sys --bind
mnt /dev /dev --bind
mnt devpts /dev/pts -t devpts -o newinstance,ptmxmode=0666 || mnt /dev/pts /dev/pts --bind
mnt tmpfs /dev/shm -t tmpfs -o mode=1777

# 5. The user's steps, each timed, in a clean environment.
in_chroot() {   # in_chroot USER COMMAND
    local user=$1 cmd=$2
    env -i HOME="$([[ $user == root ]] && echo /root || echo /home/kv)" TERM=dumb LANG=C.UTF-8 \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        chroot --userspec="$user:$user" "$root" /bin/bash -c "cd /home/kv/kvcache && $cmd"
}
results=()
step() {        # step NAME USER COMMAND
    local name=$1 t rc=0
    printf '\n===== fresh-check: %s\n$ %s\n' "$name" "$3"
    t=$(date +%s.%N)
    in_chroot "$2" "$3" || rc=$?
    t=$(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    results+=("$(printf '%-44s %8s s  %s' "$name" "$t" "$([[ $rc -eq 0 ]] && echo ok || echo "FAILED (exit $rc)")")")
    printf '===== fresh-check: %s: %s s, exit %d\n' "$name" "$t" "$rc"
    return "$rc"
}
summary() {
    printf '\n===== fresh-check summary (commit %s, %s minbase, %s)\n' "${sha:0:12}" "$suite" "$(date -u +%F)"
    printf '%s\n' "${results[@]}"
}
fail() { summary; echo "fresh-check: FAILED at: $1"; exit 1; }

out=$(in_chroot kv 'scripts/deps.sh' 2>&1) && fail "deps.sh as non-root in the bare chroot exited 0"
printf '\n===== fresh-check: deps.sh as a user, bare chroot (must refuse and print the apt line)\n%s\n' "$out"
grep -q '^run as root:  apt-get update && apt-get install -y ' <<<"$out" ||
    fail "deps.sh as non-root did not print the apt-get line"
results+=("$(printf '%-44s %8s    %s' "deps.sh as a user, bare: prints apt line" - ok)")

step "prerequisite: apt-get install -y make" root \
    'apt-get update && apt-get install -y make' || fail "installing make"
step "make demo" root 'make demo' || fail "make demo"
step "make test" root 'make test' || fail "make test"
step "deps.sh no-op (root)" root 'scripts/deps.sh' || fail "deps.sh no-op as root"
step "deps.sh no-op (user)" kv 'scripts/deps.sh' || fail "deps.sh no-op as non-root"
if [[ $ci -eq 1 ]]; then
    # .ci/run starts from a fresh clone: a clean tree.
    step "clean tree (rm -rf build*)" root 'rm -rf build build-*' || fail "cleaning"
    step "bash .ci/run" root 'bash .ci/run' || fail ".ci/run"
fi
summary
echo "fresh-check: PASSED"
if [[ $keep -eq 0 ]]; then
    for (( i=${#mounted[@]}-1; i>=0; i-- )); do umount "${mounted[i]}"; done
    mounted=()
    remove_tree "$root"
fi
