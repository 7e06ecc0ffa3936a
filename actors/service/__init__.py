"""The Ray-free cores of the service: what each actor does, as plain Python objects that tests drive
in-process. The actors in `actors/` are thin shells that add Ray's calls around them."""
