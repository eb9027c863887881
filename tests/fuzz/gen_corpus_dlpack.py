#!/usr/bin/env python3
"""Seeds for tests/fuzz/fuzz_dlpack.c (run from the repo root; writes
tests/fuzz/corpus_dlpack/). Each seed is one DLManagedTensor in the
harness's byte format (its decode()): api, device type, device id, dtype,
lanes, ndim, one size per dim, a strides mode and its bytes, byte_offset,
then how data is made (a buffer of the tensor's extent, shorter or longer,
misaligned; NULL; an address without memory) and one argument byte."""
import os
import struct

# dtype bytes: kvcache's eight, then the near misses (0xC0 + index of g_near)
DT = dict(f32=0, f16=1, bf16=2, f64=3, i8=4, i32=5, i64=6, u8=7)
NEAR = dict(bool8=0, fp8_e4m3_code8=1, fp8_e4m3fn=2, fp8_e5m2=3, float8=4, i16=5, u16=6,
            bf32=7, complex64=8, handle=9, float0=10, u1=11, u4=12, float12=13)
CPU, CUDA, CUDAHOST = 0, 1, 2  # device bytes (b % 3)
# other device types: 0xE0..0xEF pick g_devices[b % 12]
OTHER_DEVICES = [0, 4, 7, 8, 9, 10, 11, 12, 13, 14, 5, -1]


def other_device(code):
    i = OTHER_DEVICES.index(code)
    return bytes([next(b for b in range(0xE0, 0xF0) if b % 12 == i)])


def wild(v):
    """rd_wild bytes for v: 2^k, -2^k, or 8 raw bytes."""
    if 0 < v < 1 << 63 and v & (v - 1) == 0:
        return bytes([0x00, v.bit_length() - 1])
    if -(1 << 62) <= v < 0 and (-v) & (-v - 1) == 0:
        return bytes([0x60, (-v).bit_length() - 1])
    return bytes([0xE0, 0]) + struct.pack("<Q", v % (1 << 64))


def size(v):
    return bytes([v]) if 0 <= v <= 16 else b"\xe0" + wild(v)


def i32(v):
    return struct.pack("<i", v)


def seed(shape, dtype="f32", strides=b"\x00", offset=b"\x00", data=0, arg=0, api=0,
         device=CPU, dev_id=0, lanes=b"\x00", ndim=None):
    """shape: sizes; strides: the mode byte and its bytes; offset: the byte_offset
    bytes; data: the data byte (mode | size mode << 3 | misalignment << 5)."""
    out = bytes([api])
    out += bytes([device]) if isinstance(device, int) else device
    out += bytes([dev_id]) if isinstance(dev_id, int) else dev_id
    out += bytes([DT[dtype]]) if isinstance(dtype, str) else dtype
    out += lanes
    out += bytes([len(shape) if ndim is None else ndim])
    out += b"".join(size(s) for s in shape)
    return out + strides + offset + bytes([data, arg])


def per_dim(*v):
    """strides mode 5: each dim small (< 32) or hostile."""
    return b"\x05" + b"".join(bytes([x]) if 0 <= x < 32 else b"\xc0" + wild(x) for x in v)


COMPACT = b"\x02"
OFF_ELEMS = lambda k: bytes([k])          # byte_offset = k elements (k < 8)
OFF_BYTES = lambda k: bytes([0x80 + k])   # byte_offset = k bytes (k < 32)
EXACT, SHORT, MORE, RAW = 0, 1 << 3, 2 << 3, 3 << 3
NULL_DATA, FAKE = 5, 6
MIS1 = 4 << 5  # data 1 byte into the buffer

seeds = {
    # accepted
    "f32_1d": seed([8]),
    "f16_2d_compact": seed([4, 6], "f16", COMPACT),
    "bf16_3d_nhd": seed([16, 4, 8], "bf16", COMPACT, OFF_ELEMS(2), MORE, 7),
    # [blocks][N][H][D] with HND memory order: dims 0, 2, 1, 3
    "bf16_4d_hnd": seed([2, 16, 4, 8], "bf16", b"\x03" + bytes([3, 1, 1])),
    "f32_4d_padded": seed([2, 4, 3, 5], "f32", b"\x04" + bytes([1, 2, 0, 3])),
    "u8_fp8_bytes": seed([16, 32], "u8", COMPACT, OFF_BYTES(16)),
    "f64_0d": seed([], "f64", b"\x00", OFF_ELEMS(1)),
    "i8_broadcast": seed([5, 7], "i8", per_dim(0, 1)),
    "i32_strided": seed([3, 4], "i32", per_dim(9, 2), OFF_ELEMS(3)),
    "i64_cuda_id1": seed([6], "i64", device=CUDA, dev_id=1),
    "f16_cudahost": seed([2, 128], "f16", device=CUDAHOST),
    "f32_head128": seed([2, 8, 128], "f32", COMPACT),
    "empty_null_data": seed([3, 0, 5], "f32", data=NULL_DATA),
    "empty_huge_null_strides": seed([4, 1 << 61, 0], "f32", data=EXACT),
    "short_buffer": seed([4, 6], "f32", COMPACT, data=SHORT, arg=3),
    "fake_address": seed([4, 4], "f16", data=FAKE, arg=9),
    "negative_device_id": seed([4], "f32", dev_id=b"\xf0" + i32(-1)),
    # refused
    "lanes4": seed([4], "f32", lanes=b"\xf4"),
    "fp8_e4m3fn": seed([4, 4], bytes([0xC0 + NEAR["fp8_e4m3fn"]])),
    "complex64": seed([4], bytes([0xC0 + NEAR["complex64"]])),
    "bits0_raw": seed([4], b"\xe0\x02\x00"),
    "ndim9": seed([1] * 8, ndim=0xF1),
    "ndim_negative": seed([1], ndim=0xF0),
    "negative_size": seed([4, -3], "f32", COMPACT),
    "negative_stride": seed([4, 3], "f32", per_dim(3, -1)),
    "offset_unaligned": seed([4], "f32", offset=OFF_BYTES(6)),
    "offset_far": seed([4], "f32", offset=b"\xe0" + wild(1 << 62)),
    "offset_huge": seed([4], "f32", offset=b"\xe0" + wild(1 << 63)),
    "data_misaligned": seed([4], "f16", data=MIS1),
    "data_null": seed([4], "f32", data=NULL_DATA),
    "device_rocm": seed([4], device=other_device(10)),
    "t_null": seed([4], api=0xF0),
    "out_null": seed([4], api=0xF1),
    "shape_null": seed([4, 4], api=0xF3),
    "numel_overflow": seed([1 << 40, 1 << 40], "f32", COMPACT),
    "stride_overflow": seed([4, 2], "f32", b"\x07\x00" + wild(1 << 62)),
    "compact_overflow": seed([0, 1 << 62, 4], "f32"),
}

out_dir = "tests/fuzz/corpus_dlpack"
os.makedirs(out_dir, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(data)
print(f"{len(seeds)} seeds in {out_dir}")
