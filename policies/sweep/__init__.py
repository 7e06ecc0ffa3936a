"""A sweep's decisions: its search space, the searchers that suggest trials, and the rules that stop trials early."""
