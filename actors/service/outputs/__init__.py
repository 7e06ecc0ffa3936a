"""A job's outputs on its trainer: metrics files, uploads to storage URIs, experiment tracking."""
