"""The trainer's side: its loop over a step engine, the jobs it holds, their feeds, admission and step log."""
