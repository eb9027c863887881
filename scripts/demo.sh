#!/usr/bin/env bash
# A short tour of kvcache through its command-line tool (make demo).
#
# Each step prints its command, quoted so it can be pasted back into a shell,
# then runs it. `step` commands must succeed. `refusal` commands demonstrate a
# refusal: they must exit 1 (the tool's "operation refused" status, with the
# reason on the refused line). Anything else -- a failing step, a usage error
# (exit 2), a crash, or a refusal step that unexpectedly succeeds -- stops the
# tour with a non-zero exit status.
set -euo pipefail
kv=${1:-build/kvcache}

# One shell word for $1: as is when it is plain, else single-quoted.
quote() {
    if [[ $1 =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

# show TITLE CMD ARGS...: the title and the command line.
show() {
    printf '\n== %s\n$' "$1"
    for arg in "${@:2}"; do
        printf ' %s' "$(quote "$arg")"
    done
    printf '\n'
}

# step TITLE CMD ARGS...: must succeed (set -e stops the tour otherwise).
step() {
    show "$@"
    "${@:2}"
}

# refusal TITLE CMD ARGS...: must be refused, i.e. exit exactly 1.
refusal() {
    local rc=0
    show "$@"
    "${@:2}" || rc=$?
    if [[ $rc -ne 1 ]]; then
        printf 'demo: expected this command to be refused (exit 1), it exited %d\n' "$rc" >&2
        exit 1
    fi
    printf '(refused, as expected: exit 1)\n'
}

step "The library" "$kv" version
step "A bf16 KV page [N=4 tokens][H=2 heads][D=8] viewed as HND: a permute is metadata only" \
    "$kv" view --dtype bf16 --shape 4,2,8 --op "permute 1,0,2"
refusal "Flattening that HND view cannot be a view: reshape copies (and says so), view refuses" \
    "$kv" view --dtype bf16 --shape 4,2,8 --op "permute 1,0,2" --op "reshape 2,32" \
    --op "permute 1,0" --op "view 64"
step "Slicing every other token and selecting head 1: strides tell where the bytes are" \
    "$kv" view --dtype f16 --shape 16,2,8 --op "slice 0 0 16 2" --op "select 1 1" --print
refusal "as_strided is bounds-checked against the storage (the refusal names the last byte)" \
    "$kv" view --dtype f32 --shape 8 --op "as_strided 4,4 2,1 2"
step "A sliding window of 3 tokens over 6 (overlapping view, no copy)" \
    "$kv" view --dtype i32 --shape 6 --op "window 0 3" --print
step "expand broadcasts with stride 0; diagonal walks stride sum" \
    "$kv" view --dtype f32 --shape 3,1 --op "expand 2,3,4" --op "diagonal 0 1 2"
step "A model's KV cache (4 layers, 1024 blocks of 16 tokens, 8 KV heads x 128, bf16): three \
prompts with their own token ids, except the third, which has the first one's prompt and so \
reuses its 2 full cached blocks; a fork with copy-on-write; and the block table / slot \
mapping / CSR a kernel takes" \
    "$kv" cache --seqs 37,70,37
step "The same cache block-major, HND, padded blocks, 2 kernel pages per block" \
    "$kv" cache --arrange block --order hnd --pad 64 --page-ratio 2 --seqs 20,3
printf '\nMore: %s --help, docs/layout.md, docs/api.md\n' "$(quote "$kv")"
