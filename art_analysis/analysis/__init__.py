"""Analyses of block-wise decode attention: convergence, threshold sensitivity, misalignment, and whether walks
keep their lengths across decode steps (``walk_persistence``)."""
