#!/usr/bin/env bash
# scripts/check-mutations.sh - show that the emulated-grid tests catch bugs
# in the CUDA kernel bodies (tests/unit/test_grid.c and test_grid_devidx.c,
# the device-index mode, over the *_kernels_hd.h bodies; test_grid_prefill.c
# over kv_attn_prefill_hd.h's, test_attn_mla.c over its MLA form): the code
# kv_attn_cuda.cu, kv_view_cuda.cu
# and kv_plan_cuda.cu compile.
#
#   scripts/check-mutations.sh            every mutation
#   scripts/check-mutations.sh NAME...    only those
#
# In a temporary copy of the tree (tracked and untracked, not ignored, files)
# it builds build-mut/tests/test_grid and test_grid_devidx (CUDA=0: the bodies are the same C)
# and runs it unmutated (it must pass), then for each mutation below edits
# one occurrence of a body header, rebuilds (only what includes it) and
# runs the test again: it must fail. Exit status 0 when every mutation is
# caught, 1 otherwise. 8.5 min on 2 cores for all 51 (2026-12-04 22:40 UTC).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
A=attention/kv_attn_kernels_hd.h
V=kvcache/kv_view_kernels_hd.h
P=connector/plan/kv_plan_kernels_hd.h
F=attention/kv_attn_prefill_hd.h

# name | body file | text | replacement (its first occurrence; \n: a newline)
mutations=(
"decode-head-offset|$A|h * p->lo.stride_head_bytes;|((h + 1) % H) * p->lo.stride_head_bytes;"
"decode-drop-token|$A|t < n_tok; t += p->warps|t < n_tok - 1; t += p->warps"
"decode-bounds-off-by-one|$A|d < D; d += 32)|d <= D; d += 32)"
"decode-drop-warp|$A|for (int w = 0; w < p->warps; w++)\n            M =|for (int w = 0; w < p->warps - 1; w++)\n            M ="
"decode-no-syncthreads|$A|    kv_grid_sync(c);\n    const float ks|    const float ks"
"decode-no-syncwarp|$A|            kv_grid_syncwarp(c);\n            if (lane == 0)|            if (lane == 0)"
"decode-vec-head-offset|$A|b->head_off = b->h * p->lo.stride_head_bytes|b->head_off = ((b->h + 1) % H) * p->lo.stride_head_bytes"
"decode-vec-drop-token|$A|ok[u] = t < t1;|ok[u] = t < t1 - 1;"
"decode-vec-half-row-sum|$A|for (int o = lpr / 2; o > 0; o >>= 1)|for (int o = lpr / 4; o > 0; o >>= 1)"
"decode-vec-drop-group|$A|for (int o = b->lpr; o < 32; o <<= 1) {|for (int o = b->lpr * 2; o < 32; o <<= 1) {"
"decode-pipe-drop-token|$A|        if (tu < t1) {|        if (tu < t1 - 1) {"
"decode-pipe-k-from-v|$A|            kb[u] = kn[u];|            kb[u] = vn[u];"
"decode-pipe-skip-lookahead|$A|base + 2 * step + t_off|base + 3 * step + t_off"
"decode-pipe-record-every-token|$A|{\n                if (b->h == 0 && b->q0 == 0 && b->sub == 0 && ti == 0)|{\n                if (b->h == 0 && b->q0 == 0 && b->sub == 0)"
"decode-split-chunk-overlap|$A|e = a + len;|e = a + len + 1;"
"decode-split-drop-chunk|$A|k < p->n_split; k++) {\n                const float mk|k < p->n_split - 1; k++) {\n                const float mk"
"decode-split-no-rescale|$A|const float f = kv_grid_expf(mk - M);|const float f = 1.0f;"
"decode-split-ws-entry|$A|* p->n_split + chunk) * (D + 2);|* p->n_split + chunk / 2) * (D + 2);"
"decode-split-record-every-chunk|$A|c->block / p->n_split, k == 0, &b);|c->block / p->n_split, true, &b);"
"decode-window-off-by-one|$A|return n_tok - 1 - p->window_left;|return n_tok - p->window_left;"
"move-head-offset|$A|h * m->lo.stride_head_bytes +|((h + 1) % H) * m->lo.stride_head_bytes +"
"move-drop-token|$A|const int64_t total = r.n * H * row_vecs;|const int64_t total = (r.n - 1) * H * row_vecs;"
"move-bounds-off-by-one|$A|i < total; i += c->block_dim|i <= total; i += c->block_dim"
"convert-head-offset|$A|h * t.head + d * t.dim|((h + 1) % H) * t.head + d * t.dim"
"copy-bounds-off-by-one|$A|i < vecs; i += c->block_dim|i <= vecs; i += c->block_dim"
"copy-ex-head-offset|$A|(r % p->H) * p->head|(r % p->H) * p->tok"
"view-drop-row|$V|r < a->p.rows;|r < a->p.rows - 1;"
"view-bounds-off-by-one|$V|i < a->n; i += tpr|i <= a->n; i += tpr"
"plan-wrong-pitch|$P|f.dst + y * f.dst_pitch|f.dst + y * f.src_pitch"
"plan-bounds-off-by-one|$P|k < total; k += c->block_dim|k <= total; k += c->block_dim"
"devidx-slot-bound-off-by-one|$A|s >= m->slot_limit)|s > m->slot_limit)"
"devidx-page-bound-off-by-one|$A|pid >= p->n_ids)|pid > p->n_ids)"
"devidx-indptr-past-n-pages|$A|b > n_pages)|b > n_pages + 100)"
"devidx-last-len-off-by-one|$A|ll > pt))|ll > pt + 1))"
"devidx-record-every-layer|$A|c->thread == 0 && item % m->n_layers == 0|c->thread == 0"
"devidx-copy-bound-off-by-one|$A|cp, p->n_blocks,\n                                 p->n_blocks))|cp, p->n_blocks,\n                                 p->n_blocks + 1))"
"devidx-seq-lens-off-by-one|$A|len > cols * pt)|len > cols * pt + 1)"
"devidx-read-rows-count|$A|o1 - o0 != *n_tok|o1 - o0 < *n_tok"
"devidx-read-drop-last-token|$A|r->n = left < m->rd_pt ? left : m->rd_pt;|r->n = left < m->rd_pt ? left - 1 : m->rd_pt;"
"devidx-copy-ex-dst-bound|$A|p->dlo.num_blocks))|p->dlo.num_blocks + 1))"
"devidx-scale-layer-row|$A|(int64_t)lrel * m->sc_lstride + i;|(int64_t)(lrel & 0) * m->sc_lstride + i;"
"devidx-mla-bad-page-kept|$A|                if (d == 0)\n                    okr[r] = 0.0f;|                if (d == 0)\n                    okr[r] = 1.0f;"
"devidx-plan-src-bound|$P|(s_id >= p->s_blocks|(s_id > p->s_blocks"
"prefill-causal-bound|$F|&& t <= pos)|&& t <= pos + 1)"
"prefill-drop-token|$F|for (int64_t r = 0; r < nt; r++)|for (int64_t r = 0; r + 1 < nt; r++)"
"prefill-q-head-offset|$F|qh = h * g + (r0 + rr) % g;\n        q[i]|qh = h + (r0 + rr) % g;\n        q[i]"
"prefill-kv-head-offset|$F|h * p->lo.stride_head_bytes + ch * vbytes;|((h + 1) % H) * p->lo.stride_head_bytes + ch * vbytes;"
"prefill-window-off-by-one|$F|return p - window_left;|return p - window_left + 1;"
"prefill-no-rescale|$F|kv_grid_expf(m[k] - m1);|1.0f;"
"prefill-mla-value-stride|$F|const int64_t vst = p->mla ? dp : D;|const int64_t vst = D;"
"prefill-value-dims|$F|d < Dv; d += 32)|d < Dv - 1; d += 32)"
)

cd "$root"
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$tmp"
cd "$tmp"
mkdir -p "$tmp/orig"
for f in "$A" "$V" "$P" "$F"; do cp "$f" "$tmp/orig/${f//\//_}"; done
restore() { for f in "$A" "$V" "$P" "$F"; do cp "$tmp/orig/${f//\//_}" "$f"; done; }

build() {
    make --no-print-directory -j"${JOBS:-2}" CUDA=0 RDMA=0 WERROR=1 BUILD=build-mut \
        build-mut/tests/test_grid build-mut/tests/test_grid_devidx build-mut/tests/test_grid_prefill \
        build-mut/tests/test_attn_mla \
        >"$tmp/build.log" 2>&1
}
# the emulated-grid tests (and, for the MLA prefill's mutations and the
# unmutated tree, test_attn_mla: its grid cases); the first failure's output
# in $tmp/run.log
run_tests() {
    build-mut/tests/test_grid >"$tmp/run.log" 2>&1 &&
        build-mut/tests/test_grid_devidx >"$tmp/run.log" 2>&1 &&
        build-mut/tests/test_grid_prefill >"$tmp/run.log" 2>&1 &&
        { [[ "${1:-mla}" != *mla* ]] || build-mut/tests/test_attn_mla >"$tmp/run.log" 2>&1; }
}

if ! build; then
    cat "$tmp/build.log" >&2
    echo "check-mutations: the unmutated tree does not build" >&2
    exit 1
fi
if ! run_tests; then
    cat "$tmp/run.log" >&2
    echo "check-mutations: test_grid fails unmutated" >&2
    exit 1
fi
echo "unmutated: test_grid passes"

missed=0
for m in "${mutations[@]}"; do
    IFS='|' read -r name body from to <<<"$m"
    if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then
        continue
    fi
    restore
    if ! FROM="$from" TO="$to" python3 - "$body" <<'PY'
import os, sys
p = sys.argv[1]
s = open(p).read()
f = os.environ["FROM"].replace("\\n", "\n")
t = os.environ["TO"].replace("\\n", "\n")
if f not in s:
    sys.exit(1)
open(p, "w").write(s.replace(f, t, 1))
PY
    then
        echo "$name: ERROR: '$from' not found in $body (update this script)"
        missed=1
        continue
    fi
    if ! build; then
        cat "$tmp/build.log" >&2
        echo "$name: ERROR: the mutated tree does not build"
        missed=1
        continue
    fi
    if run_tests "$name"; then
        echo "$name: MISSED (test_grid passes)"
        missed=1
    else
        test=$(grep -m1 -E '^\[ +FAILED +\] test_' "$tmp/run.log" | sed -E 's/^\[ +FAILED +\] //' || true)
        why=$(grep -m1 '^ERROR: ' "$tmp/run.log" | sed 's/^ERROR: //' | head -c 150 || true)
        echo "$name: caught by ${test:-test_grid}: $why"
    fi
done
restore
exit $missed
