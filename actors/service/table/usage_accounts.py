"""What each user's jobs used, from the job table: the tokens, step-seconds and GPU-seconds of every fused step
a job took part in (booked per job), summed per user for accounts, quotas and fair share."""

from __future__ import annotations

from actors.service.table.table_connection import TableConnection, reads


class UsageAccounts:
    """The usage columns of a job table's `jobs` rows, and the sums per user over them and its progress rows."""

    def __init__(self, connection: TableConnection):
        self.connection = connection
        self.db = connection.db

    def add(self, job_id: str, tokens: int, step_seconds: float, gpu_seconds: float) -> None:
        """A fused step's share of a job: its real tokens, its share of the step's time by those tokens, and
        that time the GPUs the step ran on."""
        with self.connection.transaction():
            self.db.execute("UPDATE jobs SET account_tokens = account_tokens + ?, step_seconds = step_seconds + ?, "
                            "gpu_seconds = gpu_seconds + ? WHERE id = ?", (tokens, step_seconds, gpu_seconds, job_id))

    @reads
    def accounts(self) -> dict[str | None, dict[str, float]]:
        """Each user's jobs and what they used (None: an operator's jobs): trained tokens, step-seconds and
        GPU-seconds, summed over every fused step their jobs took part in."""
        rows = self.db.execute("SELECT user, COUNT(*), SUM(account_tokens), SUM(step_seconds), SUM(gpu_seconds) "
                               "FROM jobs GROUP BY user")
        return {user: {"jobs": jobs, "tokens": int(tokens or 0), "step_seconds": float(seconds or 0.0),
                       "gpu_seconds": float(gpu or 0.0)} for user, jobs, tokens, seconds, gpu in rows}

    def keep_deleted(self, job_id: str) -> None:
        """Before the job's row is deleted: its usage is added to its user's usage of deleted jobs (`ever_used`)."""
        self.db.execute("INSERT INTO usage_deleted (user, tokens, step_seconds, gpu_seconds) SELECT COALESCE(user, "
                        "''), account_tokens, step_seconds, gpu_seconds FROM jobs WHERE id = ? AND (account_tokens > 0 "
                        "OR step_seconds > 0 OR gpu_seconds > 0) ON CONFLICT(user) DO UPDATE SET tokens = tokens + "
                        "excluded.tokens, step_seconds = step_seconds + excluded.step_seconds, gpu_seconds = "
                        "gpu_seconds + excluded.gpu_seconds", (job_id,))

    @reads
    def ever_used(self) -> list[dict]:
        """What each user's jobs used, deleted jobs' included (user "": an operator's jobs; `jobs`: those in the
        table): what the Prometheus
        counters count, which never go down, across a restart of the service too (a deleted job's usage leaves
        `accounts`)."""
        used = {(user or ""): usage for user, usage in self.accounts().items()}
        for user, tokens, seconds, gpu in self.db.execute("SELECT user, tokens, step_seconds, gpu_seconds FROM "
                                                          "usage_deleted"):
            row = used.setdefault(user, {"tokens": 0, "step_seconds": 0.0, "gpu_seconds": 0.0})
            row.update(tokens=row["tokens"] + tokens, step_seconds=row["step_seconds"] + seconds,
                       gpu_seconds=row["gpu_seconds"] + gpu)
        return [{"user": user, "jobs": usage.get("jobs", 0), "tokens": usage["tokens"],
                 "step_seconds": usage["step_seconds"], "gpu_seconds": usage["gpu_seconds"]}
                for user, usage in sorted(used.items())]

    @reads
    def tokens_by_user(self, since: float) -> dict[str | None, int]:
        """The tokens each user's jobs trained since the time `since` (None: an operator's jobs)."""
        rows = self.db.execute("SELECT jobs.user, SUM(progress.tokens) FROM progress JOIN jobs ON progress.job_id = "
                               "jobs.id WHERE progress.time >= ? AND progress.tokens IS NOT NULL GROUP BY jobs.user",
                               (since,))
        return {user: int(total or 0) for user, total in rows}

    @reads
    def tokens_fall_below(self, user: str, since: float, limit: int) -> float | None:
        """The time of the user's step row since `since` whose ageing out (with those before it) leaves fewer than
        `limit` of their tokens trained since then (asked where they trained `limit` or more; None: no rows)."""
        row = self.db.execute(
            "SELECT time FROM (SELECT progress.time AS time, SUM(progress.tokens) OVER (ORDER BY progress.time ROWS "
            "UNBOUNDED PRECEDING) AS aged, SUM(progress.tokens) OVER () AS total FROM progress JOIN jobs ON "
            "progress.job_id = jobs.id WHERE jobs.user = ? AND progress.time >= ? AND progress.tokens IS NOT NULL) "
            "WHERE total - aged < ? ORDER BY time LIMIT 1", (user, since, limit)).fetchone()
        return None if row is None else float(row[0])

    @reads
    def unfinished_of(self, user: str) -> dict[str, int]:
        """How many of the user's jobs are in each unfinished state."""
        rows = self.db.execute("SELECT state, COUNT(*) FROM jobs WHERE user = ? AND state IN ('queued', 'running', "
                               "'paused') GROUP BY state", (user,))
        return dict(rows)
