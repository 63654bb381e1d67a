# Builds every factors/<name>.cu into factors/<name>.so, one standalone plugin each; a host
# factor (manifest `memory: host`: its kernel runs on the CPU) is a factors/<name>.c or
# factors/<name>.cpp, built with the host compiler ($(CC) / $(CXX), no nvcc, no GPU code: nvcc
# embeds a .nv_fatbin in every library it links, which the registry refuses for a host factor).
#
#   make                      all factors, for Hopper (sm_90a) plus a portable sm_80 build with PTX
#   make factors/topk_softmax.so                         one factor (or `ex-engine build topk_softmax`)
#   make ARCHS="-gencode=arch=compute_80,code=sm_80"     another set of targets (or `ex-engine
#                                                         build --archs=...`); a later build with
#                                                         other flags rebuilds it (build/flags/)
#   make list | help | clean (clean names any factors/*.so it leaves: one no source builds)
#   variables: NVCC, ARCHS, NVCCFLAGS, EXTRA_NVCCFLAGS (added to both nvcc rules, e.g. -DNAME=1),
#              NVCC_THREADS (nvcc --threads per job; default 1), PYTHON, CUTLASS_INC;
#              for host factors CC, CXX, HOST_CFLAGS, HOST_CXXFLAGS, HOST_LDLIBS
#   The Hopper plugin (moe_fused_gemm_sm90.so: CUTLASS templates) takes 1.5-8.5 minutes on 2 cores
#   (the longer while other jobs share them); the others 5 s to 3 minutes each. Every factor needs sm_80 or newer (ARCHS must name such targets).
#   One name, one source: factors/x.cu beside factors/x.c (or x.cpp) is an error.
#
# factors/<name>_sm90.cu are Hopper-only plugins built on CUTLASS 3.x (wgmma, TMA): they are
# compiled for SM90_ARCHS only (ARCHS does not apply to them), with CUTLASS's headers from the
# pip package nvidia-cutlass, found through $(PYTHON) (`pip install nvidia-cutlass`, or
# `pip install -e '.[build]'`; or pass CUTLASS_INC=/path/to/cutlass/include).
#
# Works with nvcc and no GPU (host factors need only the host compiler).  Each rule prints what
# it builds and for which targets.

NVCC      ?= nvcc
ARCHS     ?= -gencode=arch=compute_90a,code=sm_90a \
             -gencode=arch=compute_80,code=sm_80 \
             -gencode=arch=compute_80,code=compute_80
NVCCFLAGS ?= -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr
EXTRA_NVCCFLAGS ?=
# keep nvcc's own threads within CI's 2 cores when make runs jobs in parallel
NVCC_THREADS ?= 1
PYTHON    ?= python3
SM90_ARCHS ?= -gencode=arch=compute_90a,code=sm_90a
SM90_NVCCFLAGS ?= -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr -DNDEBUG
# CUTLASS include folder (cutlass/ and cute/), from the nvidia-cutlass wheel as $(PYTHON) or,
# failing that, the project's .venv sees it; looked up only when a *_sm90.so is built
CUTLASS_INC ?= $(shell for py in $(PYTHON) .venv/bin/python; do \
    $$py -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))' 2>/dev/null && break; \
    done)

# host factors: plain shared libraries, no CUDA (the library must carry no GPU code)
HOST_CFLAGS   ?= -O2 -Wall
HOST_CXXFLAGS ?= -O2 -Wall -std=c++17
HOST_LDLIBS   ?= -lm

SOURCES := $(sort $(wildcard factors/*.cu))
HOST_C_SOURCES := $(sort $(wildcard factors/*.c))
HOST_CXX_SOURCES := $(sort $(wildcard factors/*.cpp))
PLUGINS := $(sort $(SOURCES:.cu=.so) $(HOST_C_SOURCES:.c=.so) $(HOST_CXX_SOURCES:.cpp=.so))
# a name with two sources (x.cu and x.c): make would build one and ignore the other
STEMS := $(basename $(notdir $(SOURCES) $(HOST_C_SOURCES) $(HOST_CXX_SOURCES)))
CLASHES := $(strip $(foreach s,$(sort $(STEMS)),$(if $(word 2,$(filter $(s),$(STEMS))),$(s))))

# The flags each library was built with, in build/flags/<name>.so.txt, written by its rule once
# the library is built. Where they differ from the flags of this make (or there is no stamp), the
# library is rebuilt, so that a build for other targets (ARCHS=..., `ex-engine build --archs=...`)
# is undone by the next plain `make` (file dates alone kept an sm_80-only library in place), and
# only that library: a library's flags are those of its own rule (ARCHS does not touch the Hopper
# plugin, nor host flags a .cu; CUTLASS_INC is not in them). Nothing is written before a library
# is built (a failed or dry run, make -n or -q, leaves the stamps as they are).
CU_FLAGS := $(NVCC) | $(NVCCFLAGS) | $(EXTRA_NVCCFLAGS) | $(ARCHS)
SM90_FLAGS := $(NVCC) | $(SM90_NVCCFLAGS) | $(EXTRA_NVCCFLAGS) | $(SM90_ARCHS)
C_FLAGS := $(CC) | $(HOST_CFLAGS) | $(HOST_LDLIBS)
CXX_FLAGS := $(CXX) | $(HOST_CXXFLAGS) | $(HOST_LDLIBS)
# the flags of factors/<name>.so, by the rule that builds it
flags_of = $(if $(filter %_sm90.so,$(1)),$(SM90_FLAGS),$(if $(wildcard $(1:.so=.cu)),$(CU_FLAGS),$(if $(wildcard $(1:.so=.c)),$(C_FLAGS),$(CXX_FLAGS))))
FLAGS_DIR := build/flags
# the recipe line that records the flags of the library $@ just built (single-quoted for the shell)
write_stamp = @mkdir -p $(FLAGS_DIR) && printf '%s\n' '$(subst ','\'',$(call flags_of,$@))' > $(FLAGS_DIR)/$(@F).txt
# (the stamps are read through cat: make 4.3's $(file <...) returned a wrong text for one of 200
# bytes or more after another had been read)
define check_flags
ifneq ($$(shell cat $(FLAGS_DIR)/$(notdir $(1)).txt 2>/dev/null),$$(call flags_of,$(1)))
$(1): FORCE
endif
endef
$(foreach p,$(PLUGINS),$(eval $(call check_flags,$(p))))

# The headers each GPU library was built from, as nvcc listed them (-MMD) in build/deps/<name>.so.d:
# a library is rebuilt when one of its own headers changes (an edit of moe_chunked_sm90.cuh no
# longer rebuilds topk_softmax.so). A library without that file yet (never built here, or built
# before it was written) depends on every factors/*.cuh, as all did before.
DEP_DIR := build/deps
dep_flags = -MMD -MP -MT $@ -MF $(DEP_DIR)/$(@F).d
define cuh_deps
ifeq ($$(wildcard $(DEP_DIR)/$(notdir $(1)).d),)
$(1): $$(wildcard factors/*.cuh)
endif
endef
$(foreach p,$(SOURCES:.cu=.so),$(eval $(call cuh_deps,$(p))))
-include $(wildcard $(DEP_DIR)/*.d)
# (those rules come before all's)
.DEFAULT_GOAL := all
# clean beside other goals: one job at a time (with -j, clean deleted what all had just built)
ifneq ($(filter clean,$(MAKECMDGOALS)),)
.NOTPARALLEL:
endif

# a half-written .so (nvcc killed, disk full) is deleted, never left to be loaded
.DELETE_ON_ERROR:
.PHONY: all clean list help check-nvcc check-sources FORCE
all: $(PLUGINS)
FORCE:

help:
	@sed -n '1,/^$$/p' Makefile | sed 's/^# \{0,1\}//'

# A clear word where nvcc is missing, and where a factor name has two sources: the first lines of
# each library's recipe (not phony prerequisites, which made `make -q` report every library out
# of date, whatever was built). A library of a name with two sources is always remade, so that
# the check runs even where the library is up to date.
check_nvcc = @command -v $(NVCC) >/dev/null 2>&1 || { echo "[ex_engine] error: $(NVCC) not found on PATH: install the CUDA toolkit (12.4+) or pass NVCC=/path/to/nvcc" >&2; exit 1; }
check_sources = @if [ -n "$(CLASHES)" ]; then echo "[ex_engine] error: more than one source for $(CLASHES):" \
	    "keep one of factors/<name>.cu (GPU), .c or .cpp (host factor) per name" >&2; exit 1; fi
$(foreach s,$(CLASHES),$(eval factors/$(s).so: FORCE))
check-nvcc:
	$(check_nvcc)
check-sources:
	$(check_sources)

factors/%.so: factors/%.cu include/ex_engine.h
	$(check_sources)
	$(check_nvcc)
	@if [ -z "$(strip $(ARCHS))" ]; then echo "[ex_engine] error: ARCHS is empty: give at least one target of sm_80 or newer, e.g. ARCHS=\"-gencode=arch=compute_80,code=sm_80\"" >&2; exit 1; fi
	@old=$$(printf '%s\n' '$(ARCHS)' | grep -oE '(compute|sm)_[1-7][0-9]a?([^0-9]|$$)' | grep -oE '(compute|sm)_[0-9]+a?' | sort -u | tr '\n' ' '); \
	if [ -n "$$old" ]; then echo "[ex_engine] error: ARCHS names targets older than sm_80 ($${old% }): every factor needs sm_80 or newer, e.g. ARCHS=\"-gencode=arch=compute_80,code=sm_80\"" >&2; exit 1; fi
	@echo "[ex_engine] nvcc $< -> $@ (targets: $(patsubst -gencode=arch=%,%,$(ARCHS)))"
	@mkdir -p $(DEP_DIR); start=$$(date +%s); \
	$(NVCC) $(NVCCFLAGS) $(EXTRA_NVCCFLAGS) $(ARCHS) --threads $(NVCC_THREADS) $(dep_flags) \
	    -Xcompiler -fPIC,-fvisibility=hidden -shared -Iinclude -o $@ $< || exit 1; \
	echo "[ex_engine] built $@ in $$(( $$(date +%s) - start )) s"
	$(write_stamp)

# Hopper-only plugins (a more specific pattern than the rule above, so make prefers it)
factors/%_sm90.so: factors/%_sm90.cu include/ex_engine.h
	$(check_sources)
	$(check_nvcc)
	@if [ -z "$(CUTLASS_INC)" ] || [ ! -f "$(CUTLASS_INC)/cutlass/cutlass.h" ]; then \
	    $(if $(filter command line environment,$(origin CUTLASS_INC)), \
	    echo "[ex_engine] error: $@ needs CUTLASS's headers: CUTLASS_INC='$(CUTLASS_INC)' (given)" \
	         "has no cutlass/cutlass.h." >&2;, \
	    echo "[ex_engine] error: $@ needs CUTLASS's headers, found neither through $(PYTHON) nor" \
	         ".venv/bin/python (CUTLASS_INC='$(CUTLASS_INC)')." >&2;) \
	    echo "[ex_engine]        install them: $(PYTHON) -m pip install nvidia-cutlass" \
	         "(or pip install -e '.[build]'), or pass CUTLASS_INC=<cutlass>/include" >&2; \
	    exit 1; fi
	@echo "[ex_engine] nvcc $< -> $@ (targets: $(patsubst -gencode=arch=%,%,$(SM90_ARCHS)); CUTLASS $(CUTLASS_INC))"
	@mkdir -p $(DEP_DIR); start=$$(date +%s); \
	$(NVCC) $(SM90_NVCCFLAGS) $(EXTRA_NVCCFLAGS) $(SM90_ARCHS) --threads $(NVCC_THREADS) $(dep_flags) \
	    -Xcompiler -fPIC,-fvisibility=hidden -shared -Iinclude -I"$(CUTLASS_INC)" -o $@ $< || exit 1; \
	echo "[ex_engine] built $@ in $$(( $$(date +%s) - start )) s"
	$(write_stamp)

# host factors (memory: host): the host compiler, no nvcc; -fvisibility=hidden as above
# (EX_EXPORT makes ex_abi_version and ex_get_factor visible)
factors/%.so: factors/%.c include/ex_engine.h $(wildcard factors/*.h)
	$(check_sources)
	@echo "[ex_engine] $(CC) $< -> $@ (host factor: no GPU code)"
	@$(CC) $(HOST_CFLAGS) -fPIC -fvisibility=hidden -shared -Iinclude -o $@ $< $(HOST_LDLIBS)
	@echo "[ex_engine] built $@"
	$(write_stamp)

factors/%.so: factors/%.cpp include/ex_engine.h $(wildcard factors/*.h)
	$(check_sources)
	@echo "[ex_engine] $(CXX) $< -> $@ (host factor: no GPU code)"
	@$(CXX) $(HOST_CXXFLAGS) -fPIC -fvisibility=hidden -shared -Iinclude -o $@ $< $(HOST_LDLIBS)
	@echo "[ex_engine] built $@"
	$(write_stamp)

list:
	@echo $(PLUGINS)

# removes the plugins built from factors/*.cu, *.c and *.cpp; a *.so with no source there (a third-party plugin
# dropped in, or one whose source was renamed or deleted) is left in place and named
clean:
	rm -f $(PLUGINS)
	@for so in $(filter-out $(PLUGINS),$(wildcard factors/*.so)); do \
	    echo "[ex_engine] left $$so: no factors/*.cu, *.c or *.cpp builds it (a third-party plugin, or its source was renamed or deleted); remove it by hand if it is stale"; \
	done
