"""Triton kernels and their launchers (imports nothing from art_analysis)."""
