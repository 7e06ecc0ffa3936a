"""Ray actors (thin shells) and, in `actors.engine`, the Ray-free compute core they drive."""
