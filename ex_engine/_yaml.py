"""YAML reading for ex_engine's files (manifests, tuning files, hardware profiles, the model list).

PyYAML resolves plain scalars by YAML 1.1's rules, under which ``1e-5`` (no dot) is the string
'1e-5', not a number; YAML 1.2 (and most people writing a tolerance or an eps) read it as a float.
``load`` is ``yaml.safe_load`` with YAML 1.2's float rule added, so ``tolerance: {float32: 1e-5}``
means 1e-05 everywhere ex_engine reads YAML.
"""
from __future__ import annotations

import re

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads exponent floats without a dot (1e-5, 3E+8) as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def load(text):
    """The YAML document in ``text`` (str or bytes) as Python objects, by yaml.safe_load's rules
    plus YAML 1.2's exponent floats. Raises yaml.YAMLError on malformed YAML."""
    return yaml.load(text, Loader=_Loader)
