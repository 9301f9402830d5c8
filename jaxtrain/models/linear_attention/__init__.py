"""Linear-attention layers (model.layer_types `linear_attention`): the gated delta rule's
kernels (delta_rule.py) and the Gated DeltaNet layer that runs them (layer.py)."""
