"""Analyses of block-wise decode attention: convergence, threshold sensitivity, misalignment."""
