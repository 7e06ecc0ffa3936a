"""The scheduler's side: decision rounds, submissions, the contained policy, which trainers run where, and
the job actor's data core."""
