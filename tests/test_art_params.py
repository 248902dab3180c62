"""`kernels.art_params.ARTParams` refuses settings the kernel cannot take, naming the field and what it must be."""
from __future__ import annotations

import math

import pytest

from art_analysis.termination import ARTConfig
from kernels.art_params import INT32_MAX, ARTParams


@pytest.mark.parametrize("fields, message", [
    (dict(tau=-1e-3), "tau must be a finite number >= 0, got -0.001"),
    (dict(phi=math.nan), "phi must be a finite number >= 0, got nan"),
    (dict(tau=math.inf), "tau must be a finite number >= 0, got inf"),
    (dict(tau="0.01"), "tau must be a finite number >= 0, got '0.01'"),
    (dict(phi=True), "phi must be a finite number >= 0, got True"),
    (dict(patience=0), r"patience must be an int in \[1, 2147483647\] \(steps\), got 0"),
    (dict(patience=2.5), r"patience must be an int in \[1, 2147483647\] \(steps\), got 2.5"),
    (dict(patience=2 ** 31), r"patience must be an int in \[1, 2147483647\] \(steps\), got 2147483648"),
    (dict(min_steps=-1), r"min_steps must be an int in \[0, 2147483647\] \(steps\), got -1"),
    (dict(min_steps=1.0), r"min_steps must be an int in \[0, 2147483647\] \(steps\), got 1.0"),
    (dict(probe_dims="half"), "probe_dims must be one of"),
    (dict(use_scale=False, use_direction=False), "at least one of use_scale and use_direction must be True"),
])
def test_settings_the_kernel_cannot_take_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ARTParams(**fields)


def test_the_int32_extremes_and_zero_thresholds_are_accepted():
    params = ARTParams(tau=0, phi=0.0, patience=INT32_MAX, min_steps=INT32_MAX)
    assert (params.tau, params.patience, params.min_steps) == (0, INT32_MAX, INT32_MAX)


def test_a_config_whose_patience_does_not_fit_the_kernel_fails_to_convert():
    assert ARTConfig(patience=INT32_MAX).kernel_params().patience == INT32_MAX
    with pytest.raises(ValueError, match="patience must be an int in"):
        ARTConfig(patience=INT32_MAX + 1).kernel_params()
