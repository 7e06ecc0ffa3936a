"""Replaying a job trace against scheduling policies without a model: the trace, the calibration from a real
run, the simulator."""
