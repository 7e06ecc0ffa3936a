"""A pipeline trainer (the base cut into stages over several devices) behind the trainer loop's step engine."""
