"""What a job is, as its user writes it: the job spec and its settings, and a sweep spec (validated once, pydantic)."""
