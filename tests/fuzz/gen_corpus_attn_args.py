#!/usr/bin/env python3
"""Seed corpus of fuzz_attn_args (tests/fuzz/fuzz_attn_args.c).

Each seed is one call, encoded as the target decodes its input: a header
(call and CPU paths, cache shape, cache dtype, data seed), then the call's
arguments byte by byte. A zero byte is always the usual valid choice, bytes
from 0xE0 / 0xF0 the hostile ones. The seeds cover a valid decode, decode_ex
and prefill over CSR and block-table pages for every cache shape, valid
int64 and int32 writes (runs, scattered, descending, every layer, converted
and scaled), and a few invalid calls of each kind.

    tests/fuzz/gen_corpus_attn_args.py [outdir]   (default: corpus_attn_args
                                                   beside this script)

Replay one with KV_FUZZ_TRACE=1 build/fuzz/fuzz_attn_args FILE to see the
call it decodes to and its status.
"""
import os
import sys

DECODE, DECODE_EX, PREFILL, WRITE, WRITE_I32 = range(5)
PORTABLE, AVX2_ONLY, FP8_VIA_F16, NT64 = 8, 16, 32, 64
F32, F16, BF16, E4M3, E5M2 = range(5)
# cache shapes (fuzz_attn_args.c k_tmpl): L, B, N, H, D
T_NHD, T_HND, T_BLOCK_MAJOR, T_PADDED, T_D64, T_FAR, T_STRIDE, T_PACKED = range(8)


def header(call, shape, dtype, seed, paths=0):
    return bytes([call | paths, shape, dtype, seed])


def pid(k, high=False):
    """A valid page id byte: id k from the bottom, or from the top (B*r - 1 - k)."""
    assert k < 112
    return 2 * k + (1 if high else 0)


def csr(seqs, ratio=0, mutate=0, mutate_at=0):
    """CSR pages: seqs = [(page id bytes, last byte)]; last byte 0: a full last page."""
    out = [0, len(seqs), ratio]
    for ids, last in seqs:
        out += [len(ids)] + ids + [last]
    return bytes(out + [mutate, mutate_at])


def block_table(lens, cols_byte=0, ratio=0, null=0):
    """Block-table pages: lens = [(len byte, column id bytes)]; cols_byte 0: 4 columns."""
    out = [1, len(lens), ratio, cols_byte]
    for lb, ids in lens:
        out += [lb] + ids
    return bytes(out + [null])


def q_out(qdt=F32, qvar=0, hb=0, odt=F32, ovar=0, smscale=0):
    return bytes([qdt, qvar, hb, odt, ovar, smscale])


def opts(window=0, cap=0, lse=0):
    """window index (-1, 0, 1, 2, 5, 100), cap index (0, 5, 30, 0.5), lse byte (0: none)."""
    return bytes([window | cap << 3, lse])


def scales(kind=0, bad=0):
    return bytes([kind, bad])


def write_args(layer=0, t=0, n=0, mode=0, start=0, skip=0, edits=b""):
    return bytes([layer, t, n, mode, start, skip]) + edits


def conv(dtype):
    """A K or V dtype byte naming dtype explicitly (0: the cache's own dtype)."""
    return next(b for b in range(0xC0, 0xF0) if b % 5 == dtype)


def tensors(kdt=0, kvar=0, vdt=0, vvar=0):
    return bytes([kdt, kvar, vdt, vvar])


SEEDS = {
    # ---- valid attention calls, every cache shape ----
    "decode_nhd_f32_csr": header(DECODE, T_NHD, F32, 1)
    + b"\x00"
    + csr([([pid(3), pid(0, True)], 1), ([pid(5)], 0)])
    + b"\x00"
    + q_out(hb=1)
    + scales(),
    "decode_ex_hnd_f16_bt_window_cap_lse": header(DECODE_EX, T_HND, F16, 2)
    + b"\x00"
    + block_table([(3, [pid(1), pid(2), pid(0, True), pid(4)]), (20, [pid(7)] * 4), (0, [pid(9)] * 4)])
    + b"\x00"
    + q_out(qdt=F16, qvar=1, ovar=2)
    + opts(window=3, cap=1, lse=2)
    + scales(),
    "prefill_block_major_bf16_csr": header(PREFILL, T_BLOCK_MAJOR, BF16, 3)
    + b"\x01"
    + csr([([pid(0), pid(8)], 1), ([pid(2, True)], 2)])
    + bytes([2, 0, 0, 0])
    + q_out(qdt=BF16, odt=BF16, ovar=1)
    + opts()
    + scales(),
    "decode_padded_f32_bt": header(DECODE, T_PADDED, F32, 4, PORTABLE)
    + b"\x01"
    + block_table([(1, [pid(6), pid(1, True), 0, 0]), (0, [pid(2), pid(3), pid(4), pid(5)])], cols_byte=0)
    + b"\x00"
    + q_out(hb=1, qvar=3, ovar=4)
    + scales(),
    "decode_ex_d64_e4m3_scales": header(DECODE_EX, T_D64, E4M3, 5)
    + b"\x01"
    + csr([([pid(1), pid(2), pid(3)], 3), ([pid(7)], 0), ([], 0)])
    + b"\x00"
    + q_out(qdt=BF16, hb=1, odt=F32)
    + opts(lse=1)
    + scales(kind=3),
    "decode_ex_d64_e4m3_f16c": header(DECODE_EX, T_D64, E4M3, 6, FP8_VIA_F16 | AVX2_ONLY)
    + b"\x00"
    + csr([([pid(4), pid(4, True)], 0)])
    + b"\x00"
    + q_out(qdt=BF16, odt=F16)
    + opts(window=2)
    + scales(kind=1),
    "prefill_far_ids_f32": header(PREFILL, T_FAR, F32, 7)
    + b"\x00"
    + csr([([pid(0, True), pid(1, True), pid(50, True)], 0), ([pid(90, True)], 1)], ratio=0)
    + bytes([0, 1, 0, 0])
    + q_out(qvar=2)
    + opts(cap=2, lse=3)
    + scales(),
    "decode_stride_padded_bf16_ratio2": header(DECODE, T_STRIDE, BF16, 8)
    + b"\x00"
    + csr([([pid(1), pid(10), pid(2, True)], 5), ([pid(3)], 0)], ratio=2)
    + b"\x00"
    + q_out(qdt=F32, hb=1, odt=E4M3)
    + scales(),
    "prefill_packed_f16_bt": header(PREFILL, T_PACKED, F16, 9)
    + b"\x01"
    + block_table([(5, [pid(1), pid(2), pid(3), pid(4)]), (9, [pid(0, True), pid(6), 0, 0])])
    + bytes([0, 3, 0, 0])
    + q_out(qdt=F16, hb=1)
    + opts(window=4, lse=2)
    + scales(kind=2),
    "decode_d64_e5m2": header(DECODE, T_D64, E5M2, 10)
    + b"\x00"
    + block_table([(0, [pid(5)] * 4), (40, [pid(1), pid(2), pid(3), pid(4)])])
    + b"\x00"
    + q_out(qdt=E5M2, odt=BF16, smscale=9)
    + scales(kind=4),
    # ---- valid writes ----
    "write_nhd_f32_run": header(WRITE, T_NHD, F32, 11) + write_args() + scales() + tensors(),
    "write_i32_far_scattered": header(WRITE_I32, T_FAR, F32, 12)
    + write_args(mode=1, skip=3)
    + scales()
    + tensors(kvar=1, vvar=2),
    "write_d64_e4m3_f32_in_scaled": header(WRITE, T_D64, E4M3, 13, NT64)
    + write_args(layer=1, mode=2)
    + scales(kind=2)
    + tensors(kdt=conv(F32), vdt=conv(BF16)),
    "write_all_layers_bf16_descending": header(WRITE, T_BLOCK_MAJOR, BF16, 14)
    + write_args(layer=2, mode=2, start=7)
    + scales()
    + tensors(kvar=3, vvar=4),
    "write_i32_stride_f16_skips": header(WRITE_I32, T_STRIDE, F16, 15, NT64)
    + write_args(t=3, n=2, mode=3, skip=1)
    + scales()
    + tensors(kdt=conv(F32), vdt=conv(E5M2)),
    "write_packed_f16": header(WRITE, T_PACKED, F16, 16) + write_args(mode=1) + scales() + tensors(),
    # ---- invalid calls ----
    "bad_decode_indptr_decreasing": header(DECODE, T_NHD, F32, 17)
    + b"\x00"
    + csr([([pid(1)], 0), ([pid(2), pid(3)], 0)], mutate=0xF8, mutate_at=1)
    + b"\x00"
    + q_out()
    + scales(),
    "bad_decode_page_past_pool": header(DECODE, T_HND, F16, 18)
    + b"\x00"
    + csr([([pid(1), 0xE1], 0)])
    + b"\x00"
    + q_out()
    + scales(),
    "bad_decode_ex_seq_lens_negative": header(DECODE_EX, T_PADDED, F32, 19)
    + b"\x00"
    + block_table([(0xF0, [pid(1)] * 4), (0, [pid(2)] * 4)])
    + b"\x00"
    + q_out()
    + opts()
    + scales(),
    "bad_prefill_q_len_past_len": header(PREFILL, T_BLOCK_MAJOR, BF16, 20)
    + b"\x00"
    + csr([([pid(1)], 1), ([pid(2)], 0)])
    + bytes([0, 0, 0xF8, 0])
    + q_out()
    + opts()
    + scales(),
    "bad_decode_ex_cap_nan_lse_stride": header(DECODE_EX, T_D64, E4M3, 21)
    + b"\x00"
    + csr([([pid(1)], 0)])
    + b"\x00"
    + q_out(hb=1)
    + opts(cap=5, lse=3)
    + scales(bad=0xF2),
    "bad_write_duplicate_slot": header(WRITE, T_NHD, F32, 22)
    + write_args(skip=0xF0, edits=bytes([3, 4]))
    + scales()
    + tensors(),
    "bad_write_i32_slot_min": header(WRITE_I32, T_FAR, BF16, 23)
    + write_args(mode=1, skip=0xF1, edits=bytes([0, 3, 5, 1]))
    + scales()
    + tensors(),
}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "corpus_attn_args")
    os.makedirs(outdir, exist_ok=True)
    for name, data in sorted(SEEDS.items()):
        with open(os.path.join(outdir, name), "wb") as f:
            f.write(data)
    print(f"{len(SEEDS)} seeds in {outdir}")


if __name__ == "__main__":
    main()
