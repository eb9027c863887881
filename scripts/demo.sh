#!/usr/bin/env bash
# A short tour of kvcache through its command-line tool (make demo).
set -euo pipefail
kv=${1:-build/kvcache}
step() { printf '\n== %s\n$ %s\n' "$1" "${*:2}"; "${@:2}" || true; }

"$kv" version
step "A bf16 KV page [N=4 tokens][H=2 heads][D=8] viewed as HND: a permute is metadata only" \
    "$kv" view --dtype bf16 --shape 4,2,8 --op "permute 1,0,2"
step "Flattening that HND view cannot be a view: reshape copies (and says so), view refuses" \
    "$kv" view --dtype bf16 --shape 4,2,8 --op "permute 1,0,2" --op "reshape 2,32" --op "permute 1,0" --op "view 64"
step "Slicing every other token and selecting head 1: strides tell where the bytes are" \
    "$kv" view --dtype f16 --shape 16,2,8 --op "slice 0 0 16 2" --op "select 1 1" --print
step "as_strided is bounds-checked against the storage (the refusal names the last byte)" \
    "$kv" view --dtype f32 --shape 8 --op "as_strided 4,4 2,1 2"
step "A sliding window of 3 tokens over 6 (overlapping view, no copy)" \
    "$kv" view --dtype i32 --shape 6 --op "window 0 3" --print
step "expand broadcasts with stride 0; diagonal walks stride sum" \
    "$kv" view --dtype f32 --shape 3,1 --op "expand 2,3,4" --op "diagonal 0 1 2"
step "A model's KV cache (4 layers, 1024 blocks of 16 tokens, 8 KV heads x 128, bf16): three prompts (the third repeats the first and reuses its cached blocks), a fork with copy-on-write, and the block table / slot mapping / CSR a kernel takes" \
    "$kv" cache --seqs 37,70,37
step "The same cache block-major, HND, padded blocks, 2 kernel pages per block" \
    "$kv" cache --arrange block --order hnd --pad 64 --page-ratio 2 --seqs 20,3
printf '\nMore: %s view --help, docs/layout.md, docs/api.md\n' "$kv"
