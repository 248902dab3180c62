"""art-analysis: Attention Run-time Termination toolkit."""
