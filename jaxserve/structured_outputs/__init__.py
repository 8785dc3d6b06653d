"""Structured outputs (constrained decoding) with xgrammar.

    params.py    StructuredOutputsParams: what a request asks for (vLLM's fields)
    compiler.py  GrammarService: spec → xgrammar grammar, validated at once, compiled on a
                 thread pool and cached per (kind, spec)
    matcher.py   SeqGrammar: one sequence's matcher, advanced on the host per accepted token
    bitmask.py   the step's packed token bitmask for the scheduled rows

The bitmask is applied inside the jitted sampler (jaxserve/runner/grammar_mask.py).
"""

from jaxserve.structured_outputs_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
