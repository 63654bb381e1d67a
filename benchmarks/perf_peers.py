"""vLLM 0.33.0 fused-MoE times on the H200 (CUDA-graph replay, µs), copied from ../shared/PERF.md
(measured 2026-11-29 in another process: compare ratios with care; vLLM is not installed on the
lent machine, so it cannot run side by side)."""
VLLM_US = {
    ("qwen3-30b-a3b", 1): 30.2, ("qwen3-30b-a3b", 8): 132.4, ("qwen3-30b-a3b", 64): 300.2,
    ("qwen3-30b-a3b", 512): 334.7, ("qwen3-30b-a3b", 4096): 889.4, ("qwen3-30b-a3b", 16384): 2868,
    ("mixtral-8x7b", 1): 182.1, ("mixtral-8x7b", 64): 664.1, ("mixtral-8x7b", 512): 996.1,
    ("mixtral-8x7b", 4096): 5549, ("mixtral-8x7b", 16384): 20818,
    ("deepseek-v2-lite", 1): 37.2, ("deepseek-v2-lite", 64): 288.3, ("deepseek-v2-lite", 512): 310.7,
    ("deepseek-v2-lite", 4096): 1134, ("deepseek-v2-lite", 16384): 4037,
    ("olmoe-1b-7b", 1): 36.2, ("olmoe-1b-7b", 64): 219.4, ("olmoe-1b-7b", 512): 263.8,
    ("olmoe-1b-7b", 4096): 1092, ("olmoe-1b-7b", 16384): 3909,
}
