"""tests/python/test_edges.py - the Python package at its edges ("Safe at the
edges"): statuses from the library's own table, every integer crossing into C
range-checked and refused by name, every output checked for writability
whatever its type, Views keeping their cache alive, and Cache.close() against
calls in flight on other threads.

The lifetime and thread cases run in a child interpreter (run_isolated): on a
package without the fix they crash (SIGSEGV on the libc build, an ASan abort
under CI's ASan run), and a crash must fail one test, not kill pytest."""
import ctypes
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcache
from kvcache import _lib

L = _lib.lib
PKG_DIR = os.path.dirname(os.path.abspath(kvcache.__file__))


def small_layout(**kw):
    args = dict(num_layers=2, num_blocks=64, block_tokens=16, num_heads=4, head_dim=32,
                dtype="f32")
    args.update(kw)
    return kvcache.Layout(**args)


def run_isolated(code, timeout=180):
    """Run code in a fresh interpreter over the same library (and the same
    environment: under ASan the child is checked too); its output, or a
    failed test naming how it ended."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(PKG_DIR)] +
                                        [p for p in [env.get("PYTHONPATH")] if p])
    env["KVCACHE_LIBRARY"] = kvcache.library_path
    prelude = ("import gc, sys, threading, time\nimport numpy as np\nimport kvcache\n"
               "from kvcache import _lib\n")
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    how = ("killed by signal %d" % -r.returncode if r.returncode < 0
           else "exit status %d" % r.returncode)
    assert r.returncode == 0, "child %s\n--- stdout\n%s\n--- stderr\n%s" % (
        how, r.stdout[-3000:], r.stderr[-6000:])
    return r.stdout


# ---- statuses: the library's table, no numeric literals ------------------------------


def test_status_table_is_the_librarys():
    table = kvcache.errors.STATUS
    assert table["KV_OK"] == 0
    for name, code in table.items():
        assert L.kv_status_name(code).decode() == name
    # every failure status the library has maps to its own class, and back
    for name, code in table.items():
        if name == "KV_OK":
            continue
        cls = kvcache.errors.error_class(name)
        assert cls is not kvcache.KvError, name
        assert cls.status == name and cls.code == code
        e = kvcache.errors.error(name, "x")
        assert type(e) is cls and e.status == name and e.code == code


def lib_code(name):
    """The library's code for a status name, asked of kv_status_name."""
    return next(c for c in range(0, -256, -1) if L.kv_status_name(c).decode() == name)


def test_python_side_refusals_carry_the_librarys_codes():
    with kvcache.Cache(small_layout(), max_seqs=2) as c:
        s = c.seq_create()
        c.append(s, range(4))
        # ndim 9: refused in Python before C sees it - as BadDim, not InvalidArgument
        nine = np.zeros((1,) * 9, np.float32)
        with pytest.raises(kvcache.KvError) as e:
            c.write(0, nine, nine, [0])
        assert type(e.value) is kvcache.BadDim
        assert (e.value.status, e.value.code) == ("KV_ERR_BAD_DIM", lib_code("KV_ERR_BAD_DIM"))
        with pytest.raises(kvcache.KvError) as e:
            c.write(0, np.zeros((1, 4, 32), np.complex64), nine, [0])
        assert type(e.value) is kvcache.Unsupported
        assert e.value.code == lib_code("KV_ERR_UNSUPPORTED")
    with pytest.raises(kvcache.BadState) as e:
        c.seq_len(s)
    assert e.value.code == lib_code("KV_ERR_BAD_STATE")
    # a class raised alone carries its status and the library's code
    assert kvcache.NoBlocks("x").code == lib_code("KV_ERR_NO_BLOCKS")


def test_no_hard_coded_status_codes_in_the_package():
    for name in sorted(os.listdir(PKG_DIR)):
        if name.endswith(".py"):
            src = open(os.path.join(PKG_DIR, name)).read()
            assert not re.search(r"\bcode\s*=\s*-?\d", src), name
