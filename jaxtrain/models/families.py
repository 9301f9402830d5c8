"""Model families: one registry entry per `model.family`, described by its fields.

The model code reads these fields (which norm, biases or not, rotary or learned positions,
tied embeddings, the MLP's kind) and never a family's name, so a third family is one more
entry here (plus, for Hugging Face interop, a mapping module in jaxtrain/hf/).
"""

from __future__ import annotations

import dataclasses

from jaxtrain.errors import fail

MLP_KINDS = ("gelu", "swiglu")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    doc: str
    norm: str  # "layer" (centred, with bias) or "rms"
    bias: bool  # biases on the attention and MLP projections
    rope: bool  # rotary position embeddings; else learned absolute positions
    tied_embeddings: bool  # the output head is the token embedding table
    mlp: str  # one of MLP_KINDS: "gelu" (up, GELU, down) or "swiglu" (SiLU(gate)·up, down)

    @property
    def gated_mlp(self) -> bool:
        return self.mlp == "swiglu"

    @property
    def takes_experts(self) -> bool:
        """MoE layers (models/moe.py) fit it: their experts are SwiGLU without biases."""
        return self.gated_mlp and not self.bias

    def check(self, head_dim: int) -> None:
        """Raises ConfigError for a model shape this family cannot take."""
        if self.rope and head_dim % 2:
            fail("model.head_dim", head_dim, "RoPE needs an even head_dim")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt2", "GPT-2: LayerNorm, GELU, biases, learned positions, tied embeddings",
           norm="layer", bias=True, rope=False, tied_embeddings=True, mlp="gelu"),
    Family("llama", "Llama: RMSNorm, SwiGLU, no biases, RoPE, separate output head",
           norm="rms", bias=False, rope=True, tied_embeddings=False, mlp="swiglu"),
)}
