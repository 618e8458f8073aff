"""`Requirements`: what a method needs to run, declared once as one frozen value (docs/extending.md).

A method says here which inputs it reads beyond keys, values and positions, over which heads its
budget is shared, and the cache modes it runs in. The cache and the model integration read this
value (`Method.requirements`), and nothing else, to decide what to hand a method and how to run
the model for it:

- inputs (a frozenset of `INPUTS`):
  - "queries": the layer's post-RoPE queries (`Tokens.queries`);
  - "pre_rope_keys": the keys before the rotary embedding (`Tokens.pre_rope()`: a cache computes
    them from the kept keys and positions);
  - "attention_mass": the attention every token received (`Tokens.attention_mass`), which a
    prefill computes fused with its own attention;
  - "hidden_states": the hidden states the layer's attention module receives, after the layer's
    input norm, for the tokens handed over (`Tokens.hidden_states`), which the model integration
    captures while such a method runs;
  - "reconstruction": the queries of a forward that reconstructs the context after its prefill
    (KVzip), which the model integration runs (`integration.reconstruction`); needs "queries",
    runs in mode "prefill" only, and a plain forward's own queries are refused.
- budget_scope (one of `BUDGET_SCOPES`):
  - "head": `budget` bounds every KV head (most methods);
  - "layer": `budget` is the mean over a layer's KV heads, shared out unevenly (AdaKV): a head keeps
    anywhere from none to every token, so a cache stores such a layer ragged (`ragged.RaggedSummary`);
  - "model": one budget over every compressed layer of a model (AdaKV with scope "model"): in mode
    "prefill" a cache compresses the layers together once each holds the whole context
    (`compress_layers`); a stream gives each layer its share of it (`Method.layer_budget`).
- modes: the cache modes the method runs in, among "prefill", "chunked", "decode", in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..names import MODES

INPUTS = ("queries", "pre_rope_keys", "attention_mass", "hidden_states", "reconstruction")
BUDGET_SCOPES = ("head", "layer", "model")


@dataclass(frozen=True)
class Requirements:
    """What a method needs (module docstring); checked when built, so a method cannot declare what no cache can give."""

    inputs: frozenset[str] = frozenset()
    budget_scope: str = "head"
    modes: tuple[str, ...] = MODES

    def __post_init__(self):
        inputs = frozenset(self.inputs)
        unknown = sorted(inputs - set(INPUTS))
        if unknown:
            raise ValueError(f"inputs must be among {INPUTS}, got {unknown}")
        object.__setattr__(self, "inputs", inputs)
        if self.budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"budget_scope must be one of {BUDGET_SCOPES}, got {self.budget_scope!r}")
        modes = tuple(self.modes)
        if not modes or any(m not in MODES for m in modes) or list(modes) != [m for m in MODES if m in modes]:
            raise ValueError(f"modes must be a non-empty selection of {MODES}, in that order, got {self.modes!r}")
        object.__setattr__(self, "modes", modes)
        if "reconstruction" in inputs and ("queries" not in inputs or modes != ("prefill",)):
            raise ValueError("a method scored by a reconstruction forward reads its queries and runs in mode 'prefill' only: declare "
                             f"inputs with 'queries' and modes=('prefill',), got inputs {sorted(inputs)} and modes {modes}")
        if "reconstruction" in inputs and inputs & {"attention_mass", "hidden_states"}:
            raise ValueError(f"a reconstruction forward hands a method its queries only, not {sorted(inputs & {'attention_mass', 'hidden_states'})}")

    def needs(self, name: str) -> bool:
        """Whether the method reads input `name` (one of `INPUTS`)."""
        if name not in INPUTS:
            raise ValueError(f"unknown input {name!r}; inputs are {INPUTS}")
        return name in self.inputs

    @property
    def compresses_a_recorded_prefill(self) -> bool:
        """Whether a recorded full prefill of the context (keys, values, queries and attention mass,
        `integration.capture.capture_qkv`) holds everything the method reads in prefill mode: not for a method scored by a
        reconstruction forward, nor for one that reads hidden states, which a recording does not keep; those run the
        context's forward themselves."""
        return not self.inputs & {"reconstruction", "hidden_states"}

    @property
    def ragged(self) -> bool:
        """Whether the heads of a layer keep different numbers of slots (budget_scope "layer" or "model")."""
        return self.budget_scope != "head"
