"""Python fallback of the tests' host_scale factor: out = alpha * x."""


def scale(arrays, sizes, params):
    arrays["out"].raw()[...] = arrays["alpha"].raw()[0] * arrays["x"].raw()


def wrong_signature(arrays):
    """A fallback written against another signature (tests: verify reports it as a FAIL)."""
    arrays["out"].raw()[...] = 0
