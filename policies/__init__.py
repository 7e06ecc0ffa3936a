"""Pure scheduling decisions and estimators: no Ray, no torch."""
