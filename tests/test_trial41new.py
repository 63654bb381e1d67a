"""Session 41's new user's trial (CPU only): the README followed from a clean clone, then off
the happy path. Each test failed before its mend."""
from __future__ import annotations

import numpy as np
import pytest

from ex_engine import ArgumentError
from ex_engine.moe_layer import MoELayer, MoEShape


@pytest.mark.parametrize("renormalize", [None, "no", 2, 1.0])
def test_moe_layer_refuses_a_renormalize_that_is_no_bool_before_drawing(renormalize, monkeypatch):
    # MoELayer took any renormalize; forward then raised topk_softmax's "argument 'renormalize'"
    # (an argument the caller never gave), after the weights were drawn
    from ex_engine import moe_layer
    drawn = []
    monkeypatch.setattr(moe_layer, "random_array", lambda *a, **k: drawn.append(a) or None)
    with pytest.raises(ArgumentError) as e:
        MoELayer(MoEShape("m", 8, 4, 4, 2, renormalize))
    assert e.value.factor == "MoELayer" and e.value.argument == "shape.renormalize"
    assert "bool" in str(e.value) and repr(renormalize) in str(e.value)
    assert drawn == []


@pytest.mark.parametrize("renormalize", [True, False, 0, 1, np.bool_(True)])
def test_moe_layer_takes_a_bool_renormalize(renormalize):
    layer = MoELayer(MoEShape("m", 8, 4, 4, 2, renormalize))
    out, w, ids, _ = layer.forward(layer.hidden_states(3))
    assert out.shape == (3, 8) and ids.shape == (3, 2)
    if renormalize:
        np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
