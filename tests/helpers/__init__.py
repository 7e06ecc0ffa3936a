"""Helpers shared by the tests: tiny models, service runs, servers, fakes. No test module imports another."""
