"""YAML reading for ex_engine's files (manifests, tuning files, hardware profiles, the model list).

PyYAML resolves plain scalars by YAML 1.1's rules, under which a float needs a dot and a signed
exponent: ``1e-5``, ``1.0e5`` and ``3E8`` are strings, not numbers; YAML 1.2 (and most people
writing a tolerance or an eps) read them as floats. ``load`` is ``yaml.safe_load`` plus YAML
1.2's core-schema float pattern ``[-+]?(.[0-9]+|[0-9]+(.[0-9]*)?)([eE][-+]?[0-9]+)?``, tried
after PyYAML's own resolvers (integers stay integers), so ``tolerance: {float32: 1e-5}`` means
1e-05 everywhere ex_engine reads YAML.
"""
from __future__ import annotations

import re

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2's floats (1e-5, 1.0e5, 3E8) as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+0123456789."))


def load(text):
    """The YAML document in ``text`` (str or bytes) as Python objects, by yaml.safe_load's rules
    plus YAML 1.2's floats. Raises yaml.YAMLError on malformed YAML, also where PyYAML's own
    constructors raise ValueError (a timestamp such as 2024-13-01)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except ValueError as exc:   # a scalar its resolver matched but its constructor refused
        raise yaml.constructor.ConstructorError(None, None, f"{type(exc).__name__}: {exc}") from exc
