#!/usr/bin/env python3
"""Enforce the module walls and header tiers (docs/design.md, "Walls").

    scripts/check-walls.py --public "kvcache/kv_view.h ..." --internal "kvcache/kv_lib.h ..."
    scripts/check-walls.py --self-test

The Makefile passes the header lists (make check-walls; make test runs it).
Rules, each reported with the file, the line and the rule broken:

  upward     a module includes a header of a module it does not depend on
             (kvcache <- allocator <- {attention, connector} <- binding:
             attention and connector are siblings, neither uses the other)
  private    a module includes another module's private header (*_int.h, or
             any header of another module that is neither public nor
             library-internal)
  internal   a library-internal header (kv_lib.h, kv_mem.h, an *_hd.h) is
             included by a public header (it would not exist in an installed
             tree)
  installed  a public (installed) header declares a kv__ name: internals
             live in *_int.h, *_hd.h or the library-internal tier
  public     a public header includes a header that is not public
  umbrella   include/kvcache/kv.h does not include every public header once
  style      a module includes <kvcache/...> (modules use "kv_x.h"), or a
             quoted header that exists nowhere in the tree
  backend    `#if KV_HAVE_CUDA` / `KV_HAVE_RDMA` outside a backend boundary
             header (*_cuda_int.h, *_verbs_int.h)
  tests      an integration test includes a module header directly instead
             of <kvcache/...>
  nodiscard  a public function returning kv_status is not marked KV_NODISCARD
             (a failed call writes no output, so its status must be read)

The compiler already refuses an upward include (each module is compiled
with only the folders below it); this script also catches what an include
path cannot: private headers of lower modules, and the tier rules.
"""
import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

MODULES = ["kvcache", "allocator", "attention", "connector", "binding"]
# What each module may use (a DAG, not a line: every arrow is a real use).
DEPENDS = {
    "kvcache": set(),
    "allocator": {"kvcache"},
    "attention": {"kvcache", "allocator"},
    "connector": {"kvcache", "allocator"},
    "binding": {"kvcache", "allocator", "attention", "connector"},
}
INTERNAL_NAME_RE = re.compile(r"\bkv__\w+")
UMBRELLA = "include/kvcache/kv.h"
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
BACKEND_IF_RE = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif)\b.*\bKV_HAVE_(CUDA|RDMA)\b")
BOUNDARY_RE = re.compile(r"_(cuda|verbs)_int\.h$")
SOURCE_EXT = (".c", ".h", ".cu")
API_STATUS_RE = re.compile(r"^\s*KV_API\b(.*?)\bkv_status\s+(kv_\w+)\s*\(")


def module_files(root, mod):
    """Every source file of a module, its subfolders (a module's parts) included."""
    d = root / mod
    if not d.is_dir():
        return []
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name.endswith(SOURCE_EXT))


def declarations(text):
    """The text without comments and string literals (what declares names)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def includes(path):
    for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        m = INCLUDE_RE.match(line)
        if m:
            yield no, m.group(1), m.group(2)


def check(root, public, internal):
    """Return a list of (rule, message) violations."""
    errs = []
    public = {p.strip() for p in public if p.strip()}
    internal = {p.strip() for p in internal if p.strip()}
    # where each header name lives: name -> module
    home = {}
    for mod in MODULES:
        for p in module_files(root, mod):
            if p.suffix == ".h":
                home.setdefault(p.name, mod)
    public_names = {Path(p).name for p in public}
    internal_names = {Path(p).name for p in internal}

    for mod in MODULES:
        for path in module_files(root, mod):
            rel = str(path.relative_to(root))
            is_public = rel in public
            for no, kind, name in includes(path):
                where = f"{rel}:{no}"
                if kind == "<":
                    if name.startswith("kvcache/"):
                        errs.append(("style", f"{where}: a module includes <{name}>; "
                                     f"use \"{Path(name).name}\" (modules see their own folders)"))
                    continue
                if (path.parent / name).is_file() or (root / mod / name).is_file():
                    target_mod = mod
                elif name in home:
                    target_mod = home[name]
                else:
                    errs.append(("style", f"{where}: \"{name}\" exists in no module"))
                    continue
                trel = next((str(q.relative_to(root)) for q in module_files(root, target_mod)
                             if q.name == name), f"{target_mod}/{name}")
                if target_mod != mod and target_mod not in DEPENDS[mod]:
                    errs.append(("upward", f"{where}: {mod}/ includes \"{name}\" of {target_mod}/, "
                                 f"a module it does not depend on"))
                    continue
                if target_mod != mod:
                    if name.endswith("_int.h") or (trel not in public and trel not in internal):
                        errs.append(("private", f"{where}: {mod}/ reaches into {trel}, a private "
                                     f"header of {target_mod}/"))
                        continue
                if is_public:
                    if trel in internal:
                        errs.append(("internal", f"{where}: public header includes the "
                                     f"library-internal {trel} (not installed)"))
                    elif trel not in public:
                        errs.append(("public", f"{where}: public header includes {trel}, "
                                     f"which is not public"))
            if is_public:
                for no, line in enumerate(declarations(path.read_text(errors="replace"))
                                          .splitlines(), 1):
                    for m in INTERNAL_NAME_RE.finditer(line):
                        errs.append(("installed", f"{rel}:{no}: the installed header declares "
                                     f"{m.group(0)} (internals go in *_int.h / *_hd.h)"))
                for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    m = API_STATUS_RE.match(line)
                    if m and "KV_NODISCARD" not in m.group(1):
                        errs.append(("nodiscard", f"{rel}:{no}: {m.group(2)} returns kv_status "
                                     f"without KV_NODISCARD"))
            if not BOUNDARY_RE.search(path.name):
                for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if BACKEND_IF_RE.match(line):
                        errs.append(("backend", f"{rel}:{no}: `{line.strip()}` outside a backend "
                                     f"boundary header (*_cuda_int.h, *_verbs_int.h)"))

    umb = root / UMBRELLA
    if not umb.is_file():
        errs.append(("umbrella", f"{UMBRELLA} is missing"))
    else:
        got = [name for _, kind, name in includes(umb) if kind == '"']
        want = sorted(public_names - {Path(UMBRELLA).name})
        for name in want:
            if got.count(name) != 1:
                errs.append(("umbrella", f"{UMBRELLA} includes \"{name}\" {got.count(name)} "
                             f"times (want once)"))
        for name in got:
            if name not in public_names:
                errs.append(("umbrella", f"{UMBRELLA} includes \"{name}\", which is not public"))

    integ = root / "tests" / "integration"
    if integ.is_dir():
        for path in sorted(integ.glob("*.c")):
            for no, kind, name in includes(path):
                if kind == '"' and (name in home or name in internal_names):
                    errs.append(("tests", f"tests/integration/{path.name}:{no}: includes "
                                 f"\"{name}\" directly; integration tests use <kvcache/...> only"))
    return errs


# ---------------------------------------------------------------- self-test --

def self_test():
    """Build small trees that each break one rule and check each is caught;
    the clean tree must pass."""
    base = {
        "kvcache/kv_status.h": "",
        "kvcache/kv_view.h": '#include "kv_status.h"\n'
                             "KV_API KV_NODISCARD kv_status kv_view_g(int x);\n",
        "kvcache/kv_lib.h": '#include "kv_status.h"\n',
        "kvcache/kv_view_int.h": '#include "kv_view.h"\n',
        "kvcache/kv_view.c": '#include "kv_view_int.h"\n#include "kv_lib.h"\n',
        "allocator/kv_pool.h": '#include "kv_status.h"\n',
        "allocator/kv_pool.c": '#include "kv_pool.h"\n#include "kv_lib.h"\n',
        "allocator/kv_pool_cuda_int.h": "#if KV_HAVE_CUDA\n#endif\n",
        "include/kvcache/kv.h": '#include "kv_status.h"\n#include "kv_view.h"\n'
                                '#include "kv_pool.h"\n',
        "tests/integration/test_x.c": "#include <kvcache/kv.h>\n",
    }
    public = ["kvcache/kv_status.h", "kvcache/kv_view.h", "allocator/kv_pool.h", UMBRELLA]
    internal = ["kvcache/kv_lib.h"]
    cases = [
        ("clean", {}, None),
        ("upward", {"kvcache/kv_view.c": '#include "kv_pool.h"\n'}, "upward"),
        ("private", {"allocator/kv_pool.c": '#include "kv_view_int.h"\n'}, "private"),
        ("internal", {"allocator/kv_pool.h": '#include "kv_lib.h"\n'}, "internal"),
        ("umbrella", {"include/kvcache/kv.h": '#include "kv_status.h"\n'}, "umbrella"),
        ("style", {"allocator/kv_pool.c": "#include <kvcache/kv.h>\n"}, "style"),
        ("backend", {"allocator/kv_pool.c": "#if KV_HAVE_CUDA\n#endif\n"}, "backend"),
        ("tests", {"tests/integration/test_x.c": '#include "kv_pool.h"\n'}, "tests"),
        ("nodiscard", {"kvcache/kv_view.h": "KV_API kv_status kv_view_f(int x);\n"}, "nodiscard"),
        ("sibling", {"connector/plan/kv_plan.c": '#include "kv_attn.h"\n',
                     "attention/kv_attn.h": '#include "kv_status.h"\n'}, "upward"),
        ("installed", {"kvcache/kv_view.h": '#include "kv_status.h"\n'
                       "int kv__view_secret(void);\n"}, "installed"),
    ]
    ok = True
    for name, changes, want in cases:
        tmp = Path(tempfile.mkdtemp(prefix="kv-walls-"))
        try:
            for rel, text in {**base, **changes}.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_text(text)
            rules = {r for r, _ in check(tmp, public, internal)}
            if want is None and rules:
                print(f"check-walls self-test: clean tree reported {sorted(rules)}")
                ok = False
            elif want is not None and rules != {want}:
                print(f"check-walls self-test: case '{name}' reported {sorted(rules)}, "
                      f"want exactly ['{want}']")
                ok = False
        finally:
            shutil.rmtree(tmp)
    if ok:
        print(f"check-walls self-test: {len(cases) - 1} broken trees caught, clean tree passes")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--public", default="", help="space-separated public headers")
    ap.add_argument("--internal", default="", help="space-separated library-internal headers")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    errs = check(Path(a.root), a.public.split(), a.internal.split())
    for rule, msg in errs:
        print(f"walls [{rule}]: {msg}")
    if errs:
        print(f"check-walls: {len(errs)} violation(s)")
        return 1
    n = sum(len(module_files(Path(a.root), m)) for m in MODULES)
    print(f"check-walls: {n} module files, {len(a.public.split())} public headers: walls hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
