"""TEMPLATE Python fallback of my_op: out = silu(x), computed in float32 as the kernel does.

The registry calls it when no plugin serves a call (no GPU, NumPy arrays, or both C paths
declined), and `ex-engine verify` compares the plugin against it. To use it, copy it into a
module your PYTHONPATH reaches (e.g. myfactors/my_op.py, with myfactors/__init__.py) and name
it in the manifest: `fallback: myfactors.my_op:silu`. The registry imports it when it loads the
factor's library (a fallback that does not import, or cannot be called as
fn(arrays, sizes, params), refuses the library: `ex-engine list-factors --why` says why), or at
the first call that needs it. With the manifest alone (no library built yet) a call on NumPy
arrays runs it: a way to check the manifest and the fallback on a CPU before the kernel exists.

arrays: {manifest array name: TensorRef}; .load_f32() reads an array's values as float32 (exact
for float16/bfloat16), .store(values) writes an output rounded to its dtype, .xp() is numpy or
cupy (whichever holds the array), .raw() the array itself (bfloat16 as its uint16 bits).
sizes: the bound sizes ({"N": ...}); params: the parameters, defaults filled in (none here).
It writes the outputs in place; it may return the device flags it would have set (see
docs/factor-contract.md, `fallback`).
"""


import numpy as np


def silu(arrays, sizes, params):
    x = arrays["x"].load_f32()
    xp = arrays["x"].xp()
    with np.errstate(over="ignore"):   # exp(-x) is inf below x = -88: x / inf = -0, as the kernel gives
        arrays["out"].store(x / (1.0 + xp.exp(-x)))
