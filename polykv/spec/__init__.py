"""Speculative decoding over shared documents (issue I; docs/speculative.md).

drafters.py (what to guess), verify.py (what to accept), adaptive.py (how much to guess),
speculator.py (per-agent state for a batch loop). Verification itself runs in
`polykv.pool.agents.AgentBatch.step_verify`. Pure torch: no transformers at import.
"""

from .adaptive import AdaptiveLength, expected_tokens
from .drafters import DraftModel, Drafter, NgramIndex, PromptLookup, SuffixTree, SuffixTreeDrafter, suffix_array
from .speculator import METHODS, SpecConfig, Speculator
from .verify import accept_greedy, accept_sampled, accepted_prefix, residual

__all__ = ["AdaptiveLength", "DraftModel", "Drafter", "METHODS", "NgramIndex", "PromptLookup", "SpecConfig",
           "Speculator", "SuffixTree", "SuffixTreeDrafter", "accept_greedy", "accept_sampled", "accepted_prefix",
           "expected_tokens", "residual", "suffix_array"]
