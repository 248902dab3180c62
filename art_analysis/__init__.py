"""art-analysis: Attention Run-time Termination toolkit.

The most used names are importable from the package itself::

    from art_analysis import blockwise_attention, ARTConfig, stop, sweep, synthetic_cache
"""
from .blockwise import BlockTrace, BlockwiseAttention, blockwise_attention
from .synthetic import synthetic_cache
from .termination import ARTConfig, FixedBudget, MassCoverage, Oracle, StopResult, stop, sweep

__all__ = ["BlockTrace", "BlockwiseAttention", "blockwise_attention", "synthetic_cache", "ARTConfig", "FixedBudget",
           "MassCoverage", "Oracle", "StopResult", "stop", "sweep"]
