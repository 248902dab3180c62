"""Figures: one module per figure family, each function draws one figure (matplotlib/seaborn only here)."""
