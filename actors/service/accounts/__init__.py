"""Users, roles, shares and tokens of a shared service, and its audit log."""
