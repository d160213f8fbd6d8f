"""Imports every built-in schedule module so its @register line runs."""

from pipeplan.sim.schedules import gpipe, interleaved, one_f_one_b, v_shape, zb_2p, zero_bubble  # noqa: F401
