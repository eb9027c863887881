# kvcache - one GNU Makefile for the library, tests, tools and benchmarks.
#
#   make demo            install missing deps, build, run the prefill -> decode demo
#   make tour            the command-line tour (scripts/demo.sh)
#   make test            install missing deps, build, run every test suite
#   make bench           benchmarks as JSON lines (bench/results.jsonl)
#   make fuzz            build the libFuzzer targets (clang)
#   make example         the tiny engine, GQA and MLA, on the Python package: one process, then two
#   make install PREFIX=/opt/kv
#
# Options: SANITIZE=address|undefined|thread|address,undefined  CUDA=auto|0|1
#          DEBUG=1 (-O0; pool invariant walk + page-table sequence checks after every op;
#                   uninitialized locals pattern-filled where the compiler can)
#          RDMA=auto|0|1  WERROR=1 (default when CI is set)  BUILD=dir  V=1 (show commands)
#          MALLOC=jemalloc|libc (libc: no jemalloc, as the sanitizer builds; what the Python
#          package loads, since a dlopen'ed jemalloc cannot get its initial-exec TLS)

PREFIX    ?= /usr/local
CUDA      ?= auto
RDMA      ?= auto
SANITIZE  ?=
MALLOC    ?= jemalloc
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
CLANG     ?= clang
WERROR    ?= $(if $(CI),1,0)
V         ?= 0
Q         := $(if $(filter 1,$(V)),,@)
JOBS      ?= $(shell nproc 2>/dev/null || echo 2)

comma := ,
DEBUG ?= 0
BUILD ?= build$(if $(SANITIZE),-$(subst $(comma),-,$(SANITIZE)))$(if $(filter 1,$(DEBUG)),-debug)$(if $(filter libc,$(MALLOC)),-libc)

ifeq ($(CUDA),auto)
HAVE_CUDA := $(if $(NVCC),1,0)
else
HAVE_CUDA := $(CUDA)
endif
ifeq ($(RDMA),auto)
HAVE_RDMA := $(if $(wildcard /usr/include/infiniband/verbs.h),1,0)
else
HAVE_RDMA := $(RDMA)
endif

MODULES  := kvcache allocator attention connector binding
WARN     := -std=c11 -Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes \
            -Wmissing-prototypes -Wformat=2 -Wundef -Wimplicit-fallthrough
ifeq ($(WERROR),1)
WARN     += -Werror
endif
ifeq ($(DEBUG),1)
# Debug: no optimization; the pool's full invariant walk and the page table's
# per-sequence checks (held ids, no duplicates, counts) after every op.
OPT      ?= -O0 -g
DEBUG_DEFS := -DKV_DEBUG_CHECKS
# Uninitialized locals filled with a fixed pattern (gcc 0xFE, clang 0xAA), so
# code or a test that reads a field nobody wrote fails on every machine, not
# only where the stack happens to hold garbage. gcc (>= 12) zeroes struct
# padding under this flag where clang (>= 8) pattern-fills it: a test that
# compares padding passes under gcc, which is why make check-compares refuses
# struct memcmp in tests/. The compiler is probed once per make invocation;
# one without the flag builds without it.
AUTO_INIT := $(shell $(CC) -ftrivial-auto-var-init=pattern -Werror -x c -c /dev/null \
               -o /dev/null >/dev/null 2>&1 && echo -ftrivial-auto-var-init=pattern)
DEBUG_CFLAGS := $(AUTO_INIT)
else
OPT      ?= -O2 -g
endif
# The walls (docs/design.md): each module is compiled with only its own folder
# and the folders below it on the include path, so an upward include does not
# compile; scripts/check-walls.py catches what the path cannot (another
# module's private *_int.h, a public header including an internal one).
# The modules form a DAG, not a line: attention and connector are siblings
# on allocator (neither uses the other); binding sees them all.
inc_kvcache   := -Ikvcache
inc_allocator := $(inc_kvcache) -Iallocator
inc_attention := $(inc_allocator) -Iattention
# A module's parts are its subfolders (connector/plan, pack, offload,
# transport): one module, one include path each.
mod_dirs = -I$(1) $(patsubst %/,-I%,$(wildcard $(1)/*/))
inc_connector := $(inc_allocator) $(call mod_dirs,connector)
inc_binding   := $(inc_allocator) -Iattention $(call mod_dirs,connector) -Ibinding
# Tests, tools and benchmarks see every module and the umbrella <kvcache/kv.h>.
INCLUDES := $(inc_binding) -Iinclude
# The module of a source path "allocator/kv_arena" -> its include flags.
mod_inc = $(inc_$(firstword $(subst /, ,$(1))))
# The kernel modules parallelize with OpenMP (gcc's libgomp).
OMP_MODULES := attention connector
mod_cflags = $(if $(filter $(OMP_MODULES),$(firstword $(subst /, ,$(1)))),-fopenmp)
DEFS     := -D_GNU_SOURCE -DKV_HAVE_CUDA=$(HAVE_CUDA) -DKV_HAVE_RDMA=$(HAVE_RDMA) $(DEBUG_DEFS)
BASECFLAGS = $(WARN) $(OPT) $(DEBUG_CFLAGS) -fPIC -fvisibility=hidden -pthread -MMD -MP $(DEFS) \
             $(SAN_FLAGS) $(CFLAGS)
ALLCFLAGS  = $(BASECFLAGS) $(INCLUDES)

LIBS := -lxxhash -lgomp -lm -lpthread
ifneq ($(SANITIZE),)
SAN_FLAGS := -fsanitize=$(SANITIZE) -fno-omit-frame-pointer -fno-sanitize-recover=all \
             -DKV_USE_LIBC_MALLOC
else ifeq ($(MALLOC),libc)
SAN_FLAGS := -DKV_USE_LIBC_MALLOC
else
LIBS := -ljemalloc $(LIBS)
endif
ifeq ($(HAVE_CUDA),1)
# The CUDA runtime is linked statically: libkvcache.so then loads on hosts
# without the CUDA toolkit (only the driver, libcuda, is needed at run time,
# and without it CUDA calls fail cleanly with KV_ERR_UNSUPPORTED).
LIBS += -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
BASECFLAGS += -I$(CUDA_HOME)/include
endif
# The verbs library is linked only once verbs code (*_verbs.c) exists. The
# transport connects QPs from exchanged GIDs/QPNs itself: no librdmacm.
ifeq ($(HAVE_RDMA)$(if $(filter %_verbs.c,$(foreach m,$(MODULES),$(wildcard $(m)/*.c $(m)/*/*.c))),y),1y)
LIBS += -libverbs
endif

# XXH3 on x86-64 goes through libxxhash's own CPU dispatcher
# (XXH3_64bits_dispatch in xxh_x86dispatch.h: SSE2, AVX2 or AVX-512; see
# kvcache/kv_xxh3.c). A shared library links even with that symbol missing
# and fails only when loaded, so a probe program must compile and link
# against -lxxhash first, once per build folder, or the build stops here.
XXH_PROBE := $(if $(filter x86_64-%,$(shell $(CC) -dumpmachine)),$(BUILD)/xxhash-dispatch.ok)

# Machine code for sm_80 (A100) and sm_90 (H100/H200), plus compute_90 PTX so
# a newer GPU can JIT; scripts/check-cuda-build.py checks all three are in
# every fat binary of the library.
NVCCFLAGS ?= -O2 -std=c++17 -gencode arch=compute_80,code=sm_80 \
             -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVCC_ALL   = $(NVCCFLAGS) -Xcompiler -fPIC,-fvisibility=hidden -DKV_HAVE_CUDA=1
# Device code takes none of a build's flavour (no sanitizer, debug, malloc or
# RDMA flag reaches nvcc), so every build folder with the same nvcc and flags
# links the same objects, compiled once into build-cu-<checksum of the
# command> rather than once per flavour: kv_attn_cuda.cu alone is ~30 s of
# nvcc, and .ci/run builds six flavours. Objects are written under a
# temporary name and renamed, so two builds at once never link a half file.
CU_OBJ    := build-cu-$(shell printf '%s' '$(NVCC) $(NVCC_ALL)' | cksum | cut -d' ' -f1)

# Backend sources: *_cuda.c / *.cu only with CUDA, *_verbs.c only with RDMA.
SRC_ALL := $(foreach m,$(MODULES),$(wildcard $(m)/*.c $(m)/*/*.c))
SRC     := $(filter-out $(if $(filter 1,$(HAVE_CUDA)),,%_cuda.c) \
                        $(if $(filter 1,$(HAVE_RDMA)),,%_verbs.c),$(SRC_ALL))
CU_SRC  := $(if $(filter 1,$(HAVE_CUDA)),$(foreach m,$(MODULES),$(wildcard $(m)/*.cu $(m)/*/*.cu)))
OBJ     := $(SRC:%.c=$(BUILD)/obj/%.o) $(CU_SRC:%.cu=$(CU_OBJ)/%.cu.o)
# Header tiers (kvcache/kv_lib.h): library-internal headers of the core, used
# by every module and never installed; module-private *_int.h (incl. the CUDA
# boundaries); everything else is public, installed in include/kvcache/ with
# the umbrella include/kvcache/kv.h.
LIB_HEADERS := kvcache/kv_lib.h kvcache/kv_mem.h kvcache/kv_cuda_lib.h kvcache/kv_wire.h \
               kvcache/kv_stream.h
# The *_hd.h tier: addressing and conversions shared by .c and .cu
# (__host__ __device__), used across modules like the library-internal tier,
# never installed: the installed API is only what we mean to keep stable.
HD_HEADERS := $(foreach m,$(MODULES),$(wildcard $(m)/*_hd.h $(m)/*/*_hd.h))
HEADERS := $(filter-out %_int.h %_hd.h $(LIB_HEADERS),$(foreach m,$(MODULES),$(wildcard $(m)/*.h $(m)/*/*.h))) \
           include/kvcache/kv.h
# The public headers as installed, in the build tree: integration tests
# compile against this directory alone (-I$(BUILD)/include), as a user would.
STAGED := $(BUILD)/include/kvcache/.stamp

TEST_COMMON := $(wildcard tests/common/*.c)
# A test binary is compiled from several sources in one command, so its -MMD
# file lists only the last one's headers: the shared test headers are named
# as prerequisites instead (a change to one rebuilds every test).
TEST_HDRS   := $(wildcard tests/common/*.h)
TEST_DEFS   := -Itests/common -DKV_TEST_DATA_DIR='"$(CURDIR)/tests/data"'
# Tests over the software verbs device (tests/softverbs): built only with
# RDMA, and only they link it (never tests/common: integration tests see
# public headers alone).
SOFTVERBS   := tests/softverbs/kvt_softverbs.c
VERBS_TESTS := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,\
                 $(wildcard tests/unit/test_softverbs*.c tests/unit/test_xport_rdma*.c))
# Tests over the CUDA double (tests/softcuda): the offload tier's device
# caches on the CPU; only they link it.
SOFTCUDA    := tests/softcuda/kvt_softcuda.c
CUDA_DOUBLE_TESTS := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(wildcard tests/unit/test_offload_dev*.c))
# The unit tests' shared sources, compiled once per build folder into
# $(BUILD)/tests/obj and linked into each binary that needs them, not
# compiled again into every one (44 binaries, five flavours in .ci/run).
# Integration tests still compile tests/common themselves: they see the
# staged public headers alone.
TEST_COMMON_OBJ := $(TEST_COMMON:%.c=$(BUILD)/tests/obj/%.o)
SOFTVERBS_OBJ   := $(SOFTVERBS:%.c=$(BUILD)/tests/obj/%.o)
SOFTCUDA_OBJ    := $(SOFTCUDA:%.c=$(BUILD)/tests/obj/%.o)
UNIT_TESTS  := $(filter-out $(if $(filter 1,$(HAVE_RDMA)),,$(VERBS_TESTS)),\
                 $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(wildcard tests/unit/test_*.c)))
INTEG_TESTS := $(patsubst tests/integration/%.c,$(BUILD)/tests/%,$(wildcard tests/integration/test_*.c))
TESTS       := $(UNIT_TESTS) $(INTEG_TESTS)
BENCH_SRC   := $(wildcard tools/bench/*.c)
DEMO_SRC    := $(wildcard tools/kvdemo/*.c)
CLI_SRC     := $(wildcard tools/kvcache/*.c)
GPU_TESTS   := $(patsubst tests/gpu/%.c,$(BUILD)/gpu/%,$(wildcard tests/gpu/test_gpu_*.c))
FUZZ_SRC    := $(wildcard tests/fuzz/fuzz_*.c)
# fuzz_rdma_info needs the verbs header's enums: built where RDMA is.
FUZZ_BINS   := $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,\
                 $(filter-out $(if $(filter 1,$(HAVE_RDMA)),,tests/fuzz/fuzz_rdma_info.c),$(FUZZ_SRC)))

LIB_A  := $(BUILD)/libkvcache.a
LIB_SO := $(BUILD)/libkvcache.so
CLI    := $(BUILD)/kvcache
DEMO   := $(BUILD)/kvdemo
BENCH  := $(BUILD)/kvbench

.PHONY: all lib print-cu-objs deps test tests pytest example gpu-tests demo tour bench fuzz install clean format cppcheck info \
        check-walls check-compares headers
all: lib $(CLI) $(DEMO)
lib: $(LIB_A) $(LIB_SO)

deps:
	@scripts/deps.sh

info:
	@echo "CUDA=$(HAVE_CUDA) (nvcc: $(or $(NVCC),none)) RDMA=$(HAVE_RDMA) SANITIZE=$(or $(SANITIZE),none) BUILD=$(BUILD)"

$(BUILD)/xxhash-dispatch.ok:
	@mkdir -p $(dir $@)
	$(Q)printf '#include <xxh_x86dispatch.h>\nint main(void) { return XXH3_64bits_dispatch("", 0) == 0; }\n' \
	    > $(BUILD)/xxhash-dispatch.c
	$(Q)$(CC) -o $(BUILD)/xxhash-dispatch $(BUILD)/xxhash-dispatch.c -lxxhash \
	    2> $(BUILD)/xxhash-dispatch.log || { cat $(BUILD)/xxhash-dispatch.log >&2; \
	    echo "kvcache: this libxxhash has no XXH3_64bits_dispatch (xxh_x86dispatch.h, built" \
	         "with its x86 dispatcher, as Debian 12's libxxhash-dev 0.8.1 is): see the error above" >&2; \
	    exit 1; }
	$(Q)touch $@

$(OBJ): | $(XXH_PROBE)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  CC     $<')
	$(Q)$(CC) $(BASECFLAGS) $(call mod_inc,$*) $(call mod_cflags,$*) -c $< -o $@

$(CU_OBJ)/%.cu.o: %.cu $(foreach m,$(MODULES),$(wildcard $(m)/*.h $(m)/*/*.h))
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  NVCC   $< ($(CU_OBJ))')
	$(Q)$(NVCC) $(NVCC_ALL) $(call mod_inc,$*) -c $< -o $@.$$$$.o && mv -f $@.$$$$.o $@

$(LIB_A): $(OBJ)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  AR     $@')
	$(Q)rm -f $@ && $(AR) rcs $@ $^

SONAME := libkvcache.so.$(shell sed -n 's/^\#define KV_VERSION_MAJOR \([0-9]*\)/\1/p' kvcache/kv_version.h)

$(LIB_SO): $(OBJ)
	@$(if $(Q),echo '  LD     $@')
	$(Q)$(CC) -shared -Wl,-soname,$(SONAME) -o $@ $^ $(SAN_FLAGS) $(LIBS)
	$(Q)ln -sf libkvcache.so $(BUILD)/$(SONAME)

$(BUILD)/tests/obj/%.o: %.c $(TEST_HDRS) | $(XXH_PROBE)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  CC     $<')
	$(Q)$(CC) $(ALLCFLAGS) $(TEST_DEFS) -c $< -o $@

$(BUILD)/tests/%: tests/unit/%.c $(TEST_COMMON_OBJ) $(TEST_HDRS) $(LIB_A)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  TEST   $@')
	$(Q)$(CC) $(ALLCFLAGS) $(TEST_DEFS) -o $@ $< $(TEST_COMMON_OBJ) $(LIB_A) -lcmocka $(LIBS)

# A static pattern rule: it wins over the generic unit-test rule above.
$(SOFTVERBS_OBJ): tests/softverbs/kvt_softverbs.h
$(VERBS_TESTS): $(BUILD)/tests/%: tests/unit/%.c $(SOFTVERBS_OBJ) tests/softverbs/kvt_softverbs.h \
                $(TEST_COMMON_OBJ) $(TEST_HDRS) $(LIB_A)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  TEST   $@')
	$(Q)$(CC) $(ALLCFLAGS) $(TEST_DEFS) -Itests/softverbs -o $@ $< $(SOFTVERBS_OBJ) $(TEST_COMMON_OBJ) \
	    $(LIB_A) -lcmocka $(LIBS)

$(SOFTCUDA_OBJ): tests/softcuda/kvt_softcuda.h
$(CUDA_DOUBLE_TESTS): $(BUILD)/tests/%: tests/unit/%.c $(SOFTCUDA_OBJ) tests/softcuda/kvt_softcuda.h \
                      $(TEST_COMMON_OBJ) $(TEST_HDRS) $(LIB_A)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  TEST   $@')
	$(Q)$(CC) $(ALLCFLAGS) $(TEST_DEFS) -Itests/softcuda -o $@ $< $(SOFTCUDA_OBJ) $(TEST_COMMON_OBJ) \
	    $(LIB_A) -lcmocka $(LIBS)

$(STAGED): $(HEADERS)
	@rm -rf $(dir $@) && mkdir -p $(dir $@)
	$(Q)cp $(HEADERS) $(dir $@) && touch $@

# Integration tests use the public API only: compiled against the staged
# public headers alone and linked against the shared library.
$(BUILD)/tests/%: tests/integration/%.c $(TEST_COMMON) $(TEST_HDRS) $(LIB_SO) $(STAGED)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  TEST   $@')
	$(Q)$(CC) $(BASECFLAGS) -I$(BUILD)/include $(TEST_DEFS) -o $@ $< $(TEST_COMMON) -L$(BUILD) \
	    -Wl,-rpath,'$$ORIGIN/..' -lkvcache -lcmocka $(LIBS)

$(CLI): $(CLI_SRC) tools/kvcache/cli.h $(LIB_A)
	@$(if $(Q),echo '  LD     $@')
	$(Q)$(CC) $(ALLCFLAGS) -o $@ $(CLI_SRC) $(LIB_A) $(LIBS)
# It was one file, tools/kvcache.c, which a build tree from then still names in
# $(BUILD)/kvcache.d until the next link rewrites it (as tools/kvdemo.c below).
tools/kvcache.c:

# The demo sees the public headers only, as installed (-I$(BUILD)/include).
$(DEMO): $(DEMO_SRC) tools/kvdemo/kvdemo.h $(LIB_A) $(STAGED)
	@$(if $(Q),echo '  LD     $@')
	$(Q)$(CC) $(BASECFLAGS) -I$(BUILD)/include -o $@ $(DEMO_SRC) $(LIB_A) $(LIBS)
# It was one file, tools/kvdemo.c, which a build tree from then still names in
# $(BUILD)/kvdemo.d until the next link rewrites it (-MP's idiom, for a source).
tools/kvdemo.c:

# A second peer on kvdemo decode's port (tests/cli/test_peers.sh).
$(BUILD)/tests/kvdemo_intruder: tests/cli/kvdemo_intruder.c $(LIB_A) $(STAGED)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  TEST   $@')
	$(Q)$(CC) $(BASECFLAGS) -I$(BUILD)/include -o $@ $< $(LIB_A) $(LIBS)

$(BENCH): $(BENCH_SRC) $(wildcard tools/bench/*.h) $(LIB_A)
	@$(if $(Q),echo '  LD     $@')
	$(Q)$(CC) $(ALLCFLAGS) -Itools/bench -o $@ $(BENCH_SRC) $(LIB_A) $(LIBS)

tests: $(TESTS)

# GPU tests: built with CUDA, run by scripts/gpu-check.sh where a GPU exists.
$(BUILD)/gpu/%: tests/gpu/%.c tests/gpu/gpu_test.h $(LIB_A)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  GPU    $@')
	$(Q)$(CC) $(ALLCFLAGS) $(TEST_DEFS) -Itests/gpu -o $@ $< $(LIB_A) $(LIBS)

gpu-tests: $(GPU_TESTS)

headers: $(STAGED)

# The nvcc objects this build links (.ci/run's CUDA build check).
print-cu-objs:
	@echo $(filter %.cu.o,$(OBJ))

# The module walls and header tiers (docs/design.md); --self-test first proves
# the checker fails on a tree that breaks each rule.
check-walls:
	@python3 scripts/check-walls.py --self-test
	@python3 scripts/check-walls.py --public "$(HEADERS)" --internal "$(LIB_HEADERS) $(HD_HEADERS)"

# No struct compared as bytes in the tests (padding is indeterminate; the
# debug build's pattern fill cannot expose it under gcc, which zeroes padding).
check-compares:
	@python3 scripts/check-test-compares.py --self-test
	@python3 scripts/check-test-compares.py tests

# Test binaries `make test` leaves out, by name (TEST_SKIP="test_a test_b"):
# .ci/run's debug stage skips the transport suites, which have no debug-only
# checks (KV_DEBUG_CHECKS guards the pool, page tables, offload tier and
# layer-by-layer trackers) and run in the release, ASan and TSan stages.
TEST_SKIP ?=
# The longest binaries start first (run-tests.sh runs KV_TEST_JOBS at once
# and starts them in the order given): started last, alphabetically, one of
# them kept a core busy alone for up to 17 s of a CI stage. By their times
# in the release, debug and ASan stages; the rest follow in name order.
TEST_FIRST := test_grid_devidx test_cache_model test_xport_edges test_grid test_plan test_pack \
              test_xport_rdma test_attn_mla test_xport_rdma_oom test_attn_opts test_xport_tcp \
              test_oom_async test_block_pool test_attn
TEST_ORDER  = $(foreach t,$(TEST_FIRST),$(filter $(BUILD)/tests/$(t),$(TESTS))) \
              $(filter-out $(addprefix $(BUILD)/tests/,$(TEST_FIRST)),$(TESTS))
test: deps check-walls check-compares
	@$(MAKE) --no-print-directory -j$(JOBS) tests $(CLI) $(DEMO) $(BUILD)/tests/kvdemo_intruder
	@scripts/run-tests.sh $(filter-out $(addprefix $(BUILD)/tests/,$(TEST_SKIP)),$(TEST_ORDER))
	@tests/cli/test_args.sh $(BUILD)
	@tests/cli/test_peers.sh $(BUILD)
	$(if $(SANITIZE)$(filter 1,$(DEBUG)),,@tests/cli/test_watchdog.sh $(BUILD))
	$(if $(SANITIZE)$(filter 1,$(DEBUG)),,@$(MAKE) --no-print-directory pytest)

# The tiny engine on the Python package (examples/tiny_engine.py): continuous
# batching, prefix reuse, a fork, every token checked against an unpaged run;
# then the same engine split in a prefill and a decode process, its KV moving
# layer by layer over the TCP transport (examples/disagg_engine.py). Each
# runs the GQA model, then the MLA one (a K-only latent cache, decode_mla).
EXAMPLE_PY = KVCACHE_LIBRARY=$(CURDIR)/build-libc/libkvcache.so /usr/bin/python3
example: deps
	@$(MAKE) --no-print-directory -j$(JOBS) MALLOC=libc SANITIZE= DEBUG=0 BUILD=build-libc lib
	@$(EXAMPLE_PY) examples/tiny_engine.py --model gqa
	@echo
	@$(EXAMPLE_PY) examples/tiny_engine.py --model mla
	@echo
	@$(EXAMPLE_PY) examples/disagg_engine.py --model gqa
	@echo
	@$(EXAMPLE_PY) examples/disagg_engine.py --model mla

# The Python package (python/kvcache) over its library flavour: MALLOC=libc,
# because jemalloc's initial-exec TLS cannot be had by a dlopen'ed library
# (python/README.md). Run from the tree: no install needed.
PY_LIB := build-libc/libkvcache.so
pytest: deps
	@$(MAKE) --no-print-directory -j$(JOBS) MALLOC=libc SANITIZE= DEBUG=0 BUILD=build-libc lib
	@echo "  PYTEST tests/python ($(PY_LIB))"
	@cd python && KVCACHE_LIBRARY=$(CURDIR)/$(PY_LIB) /usr/bin/python3 -m pytest -q \
	    -p no:cacheprovider ../tests/python

# The demo: a disaggregated prefill -> decode run (tools/kvdemo/): two
# processes on loopback, every byte and every attention output checked.
# DEMO_ARGS go to kvdemo (DEMO_ARGS="--transport shm": over shared memory).
demo: deps
	@$(MAKE) --no-print-directory -j$(JOBS) $(DEMO)
	@$(DEMO) $(DEMO_ARGS)

# The command-line tour (scripts/demo.sh: views, a cache, its exports).
tour: deps
	@$(MAKE) --no-print-directory -j$(JOBS) $(CLI)
	@scripts/demo.sh $(CLI)

# kvbench (every C case with its baselines), then the PyTorch/NumPy peers through
# the Python package, then the package's call overhead against C
# (scripts/bench_peers.py installs python3-torch/python3-numpy if missing).
# BENCH_ARGS go to kvbench, PEERS_ARGS to bench_peers.py (PEERS=0 skips it).
PEERS ?= 1
bench: deps
	@$(MAKE) --no-print-directory -j$(JOBS) $(BENCH) BUILD=$(BUILD)
	@$(MAKE) --no-print-directory -j$(JOBS) MALLOC=libc SANITIZE= DEBUG=0 BUILD=build-libc lib
	@scripts/bench.sh $(BENCH) $(BENCH_ARGS)
	@if [ "$(PEERS)" != 0 ]; then scripts/bench_peers.py $(PEERS_ARGS); fi
	@/usr/bin/python3 scripts/bench_python.py --kvbench $(BENCH)

# libFuzzer targets: the library's CPU sources rebuilt with clang's fuzzer
# coverage + ASan/UBSan, each source compiled once into $(BUILD)/fuzz/obj
# (-fsanitize=fuzzer-no-link) and linked into every target that needs it
# (not recompiled per target: the stage's build time).
FUZZ_CFLAGS := -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
               -DKV_USE_LIBC_MALLOC -D_GNU_SOURCE -DKV_HAVE_CUDA=0 -DKV_HAVE_RDMA=0 $(inc_kvcache)
FUZZ_OBJ_CFLAGS := $(subst -fsanitize=fuzzer$(comma),-fsanitize=fuzzer-no-link$(comma),$(FUZZ_CFLAGS)) \
                   $(inc_binding) -fopenmp -Wno-unknown-pragmas
FUZZ_LINK := -fopenmp -lxxhash -lm -lpthread
FUZZ_ALL_SRC := $(filter-out %_cuda.c %_verbs.c,$(foreach m,$(MODULES),$(wildcard $(m)/*.c $(m)/*/*.c)))
FUZZ_CORE_SRC := $(filter-out %_cuda.c %_verbs.c,$(wildcard kvcache/*.c))
fuzz_objs = $(patsubst %.c,$(BUILD)/fuzz/obj/%.o,$(1))
$(BUILD)/fuzz/obj/%.o: %.c $(XXH_PROBE)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  FUZZCC $<')
	$(Q)$(CLANG) $(FUZZ_OBJ_CFLAGS) -MMD -MP -c -o $@ $<

# The view, DLPack import and CPU quota targets: the core module only.
$(BUILD)/fuzz/%: tests/fuzz/%.c tests/fuzz/fuzz_check.h $(wildcard kvcache/*.h) $(call fuzz_objs,$(FUZZ_CORE_SRC))
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  FUZZ   $@')
	$(Q)$(CLANG) $(FUZZ_CFLAGS) -o $@ $< $(call fuzz_objs,$(FUZZ_CORE_SRC)) $(FUZZ_LINK)

# fuzz_unpack, fuzz_xport_rx, fuzz_xport_shm_rx, fuzz_xport_probe, fuzz_xlayer_rx,
# fuzz_attn_args (the attention and write kernels), fuzz_grid_devidx (their
# device-index bodies on the emulated grid) and fuzz_layout_codec
# (which plans what it decodes) reach past the core: every
# module's CPU sources, OpenMP (libomp); the transport target also the
# raw-peer helpers.
FUZZ_CONNECTOR := $(BUILD)/fuzz/fuzz_unpack $(BUILD)/fuzz/fuzz_xport_rx $(BUILD)/fuzz/fuzz_xlayer_rx \
                  $(BUILD)/fuzz/fuzz_xport_shm_rx $(BUILD)/fuzz/fuzz_xport_probe \
                  $(BUILD)/fuzz/fuzz_layout_codec $(BUILD)/fuzz/fuzz_attn_args \
                  $(BUILD)/fuzz/fuzz_grid_devidx
$(FUZZ_CONNECTOR): $(BUILD)/fuzz/%: tests/fuzz/%.c $(call fuzz_objs,$(FUZZ_ALL_SRC)) \
                   $(foreach m,$(MODULES),$(wildcard $(m)/*.h $(m)/*/*.h)) \
                   tests/common/kvt_xport_raw.h tests/fuzz/fuzz_xport.h tests/fuzz/fuzz_check.h \
                   tests/fuzz/fuzz_cache.h
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  FUZZ   $@')
	$(Q)$(CLANG) $(FUZZ_CFLAGS) $(inc_binding) -Itests/common -fopenmp -Wno-unknown-pragmas \
	    -o $@ $< $(call fuzz_objs,$(FUZZ_ALL_SRC)) $(FUZZ_LINK)

# fuzz_rdma_info: the RDMA INFO decoder (pure code in a *_verbs.c file, only
# the verbs header's enums; nothing from libibverbs is linked), with the
# core module.
$(BUILD)/fuzz/fuzz_rdma_info: tests/fuzz/fuzz_rdma_info.c connector/transport/kv_xport_rdma_info_verbs.c \
                              $(wildcard connector/transport/*.h) $(call fuzz_objs,$(FUZZ_CORE_SRC))
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  FUZZ   $@')
	$(Q)$(CLANG) $(FUZZ_CFLAGS) -UKV_HAVE_RDMA -DKV_HAVE_RDMA=1 $(inc_binding) -o $@ $< connector/transport/kv_xport_rdma_info_verbs.c \
	    $(call fuzz_objs,$(FUZZ_CORE_SRC)) $(FUZZ_LINK)

fuzz: deps
	@$(MAKE) --no-print-directory -j$(JOBS) $(FUZZ_BINS)

install: lib
	install -d $(DESTDIR)$(PREFIX)/include/kvcache $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 $(HEADERS) $(DESTDIR)$(PREFIX)/include/kvcache/
	install -m 644 $(LIB_A) $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(LIB_SO) $(DESTDIR)$(PREFIX)/lib/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(PREFIX)/lib/libkvcache.so
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBS@|$(LIBS)|' -e 's|@VERSION@|$(shell sed -n 's/^#define KV_VERSION_STRING "\(.*\)"/\1/p' kvcache/kv_version.h)|' \
	    scripts/kvcache.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/kvcache.pc

format:
	clang-format -i $(foreach m,$(MODULES),$(wildcard $(m)/*.[ch] $(m)/*.cu $(m)/*/*.[ch] $(m)/*/*.cu)) include/kvcache/*.h \
	    tools/kvcache/*.[ch] tools/kvdemo/*.[ch] tools/bench/*.[ch] \
	    tests/*/*.[ch]

cppcheck:
	cppcheck --std=c11 --enable=warning,performance,portability --error-exitcode=1 \
	    --inline-suppr -q $(INCLUDES) $(DEFS) -Itools/kvcache -Itools/bench -Itools/kvdemo \
	    $(foreach m,$(MODULES),$(m)) tools

clean:
	rm -rf build build-*

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
