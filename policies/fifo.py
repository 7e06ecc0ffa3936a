"""`fifo`: queued jobs start in submission order on a trainer with their base model, as long as the
trainer's memory budget holds them; a job that does not fit waits, and jobs behind it may start where
they fit (no job is ever started past its trainer's budget)."""

from __future__ import annotations

from policies.base import Decision, Snapshot, Start, Wait, compatible, memory_in_use, no_trainer_reason


class FifoPolicy:
    name = "fifo"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        decisions: list[Decision] = []
        used = {t.id: memory_in_use(t, snapshot.on_trainer(t.id)) for t in snapshot.trainers}
        for job in snapshot.queued():
            candidates = [t for t in snapshot.trainers if compatible(job, t)]
            if not candidates:
                decisions.append(Wait(job.id, no_trainer_reason(job, snapshot.trainers)))
                continue
            need = job.memory_bytes or 0
            fitting = [t for t in candidates if used[t.id] + need <= t.memory_budget_bytes]
            if not fitting:
                free = ", ".join(f"{t.id}: {(t.memory_budget_bytes - used[t.id]) / 2**20:.0f} MiB free"
                                 for t in candidates)
                decisions.append(Wait(job.id, f"waiting for memory: needs {need / 2**20:.0f} MiB ({free})"))
                continue
            trainer = max(fitting, key=lambda t: (t.memory_budget_bytes - used[t.id], -len(snapshot.on_trainer(t.id))))
            used[trainer.id] += need
            decisions.append(Start(job.id, trainer.id))
        return decisions
