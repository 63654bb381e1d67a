"""ex_engine: hand-written GPU kernels ("factors") as drop-in .so plugins for inference engines.

    from ex_engine import FactorRegistry, moe_fused_gemm, topk_softmax, fused_add_rmsnorm
    reg = FactorRegistry.load("factors/")      # checks every plugin against the GPU

See README.md and docs/factor-contract.md.
"""
from .errors import (ArgumentError, DeviceError, DeviceSideError, DTypeError, FactorError,
                     FactorNotFoundError, KernelError, LayoutError, ShapeError, TensorLayoutError)
from .hardware import Hardware, NoDeviceError
from .ops import default_registry, fused_add_rmsnorm, moe_fused_gemm, set_default_registry, topk_softmax
from .registry import FactorRegistry, WorkspaceAllocationError, WorkspaceSizeError

__version__ = "0.1.0"
__all__ = ["FactorRegistry", "Hardware", "topk_softmax", "fused_add_rmsnorm", "moe_fused_gemm",
           "default_registry", "set_default_registry", "FactorError", "ArgumentError", "DTypeError",
           "ShapeError", "LayoutError", "TensorLayoutError", "DeviceError", "KernelError",
           "DeviceSideError", "FactorNotFoundError", "NoDeviceError", "WorkspaceSizeError",
           "WorkspaceAllocationError"]
