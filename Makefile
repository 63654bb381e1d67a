# Builds every factors/<name>.cu into factors/<name>.so, one standalone plugin each.
#
#   make                      all factors, for Hopper (sm_90a) plus a portable sm_80 build with PTX
#   make ARCHS="-gencode=arch=compute_80,code=sm_80"     another set of targets
#   make factors/topk_softmax.so                         one factor
#   make clean
#
# Works with nvcc and no GPU.  Each rule prints what it builds and for which targets.

NVCC      ?= nvcc
ARCHS     ?= -gencode=arch=compute_90a,code=sm_90a \
             -gencode=arch=compute_80,code=sm_80 \
             -gencode=arch=compute_80,code=compute_80
NVCCFLAGS ?= -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr
EXTRA_NVCCFLAGS ?=
# keep nvcc's own threads within CI's 2 cores when make runs jobs in parallel
NVCC_THREADS ?= 1

SOURCES := $(sort $(wildcard factors/*.cu))
PLUGINS := $(SOURCES:.cu=.so)

.PHONY: all clean list
all: $(PLUGINS)

factors/%.so: factors/%.cu include/ex_engine.h $(wildcard factors/*.cuh)
	@echo "[ex_engine] nvcc $< -> $@ (targets: $(patsubst -gencode=arch=%,%,$(ARCHS)))"
	@start=$$(date +%s); \
	$(NVCC) $(NVCCFLAGS) $(EXTRA_NVCCFLAGS) $(ARCHS) --threads $(NVCC_THREADS) \
	    -Xcompiler -fPIC,-fvisibility=hidden -shared -Iinclude -o $@ $< || exit 1; \
	echo "[ex_engine] built $@ in $$(( $$(date +%s) - start )) s"

list:
	@echo $(PLUGINS)

clean:
	rm -f $(PLUGINS)
