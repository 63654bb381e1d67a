/*
 * moe_fused_gemm.cu -- factor 2: the routed experts of an MoE layer, the portable plugin
 * (sm_80 and up). The implementation (kernels, configs, launchers, workspace layout) is in
 * moe_fused_gemm.cuh, shared with the Hopper plugin moe_fused_gemm_sm90.cu, which prefers
 * itself on sm_90 (priority 10) and runs this same code for decode/small shapes.
 *
 * Build:  make factors/moe_fused_gemm.so   (sm_90a + sm_80 + compute_80 PTX)
 */
#define EX_PLUGIN_FILE "moe_fused_gemm.so"  // names this library in its messages (ex_plugin.cuh)

#include "moe_fused_gemm.cuh"

using namespace exmoe;

EX_DEFINE_ABI_VERSION();

static ex_factor_t s_factor;

extern "C" EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw) {
    ex_tuning_t tuning;
    if (!moe_portable_init(hw, &tuning)) return nullptr;
    s_factor.abi_version = EX_ABI_VERSION;
    s_factor.factor_id = EX_FACTOR_MOE_FUSED_GEMM;
    s_factor.name = "moe_fused_gemm";
    s_factor.version = MOE_FUSED_GEMM_VERSION;
    s_factor.tuning = tuning;
    s_factor.kernel = moe_kernel;
    s_factor.kernel_fallback = moe_kernel_fallback;
    s_factor.workspace_size = moe_workspace_size;
    s_factor.last_error = explugin::last_error;
    s_factor.priority = 0;
    s_factor.reserved_i32 = 0;
    s_factor.description =
        "routed MoE experts: route + grouped mma.sync GEMMs (gather, fused silu*up) + deterministic combine";
    return &s_factor;
}
