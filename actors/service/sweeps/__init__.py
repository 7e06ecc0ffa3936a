"""Sweeps over a service's jobs: the book of sweeps, one sweep's driver and its bookkeeping."""
