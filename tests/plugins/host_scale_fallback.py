"""Python fallback of the tests' host_scale factor: out = alpha * x."""


def scale(arrays, sizes, params):
    arrays["out"].raw()[...] = arrays["alpha"].raw()[0] * arrays["x"].raw()
