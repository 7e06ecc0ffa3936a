"""`aspen demo`: fine-tune four LoRA adapters at once on smollm2-135m and show that each learned its task.

The module generates four small tasks itself with seeded random generators (nothing is downloaded):
multi-digit addition, reversing a word spelled letter by letter, reading one field of a JSON object and
rewriting an ISO date. It writes each task's training rows as JSONL (prompt_response format) under
`<output_dir>/data/`, trains the four jobs in fused steps through `train_locally`, then re-attaches every
saved adapter to the same base model and greedy-decodes held-out items of every task with every adapter
and with the base model alone. It prints the accuracy table (rows: base + adapters, columns: tasks),
writes it to `<output_dir>/accuracy.json` and returns 0 when every adapter beats the base model on its
own task. Ctrl-C (or SIGTERM) while it trains checkpoints the jobs and holds them paused in
`<output_dir>/.aspen` (as `aspen run` does), saying that `aspen demo` again trains them anew (it starts over)."""

from __future__ import annotations

import calendar
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actors.data import PromptResponseFormat, tokenize_example
from actors.engine.generate import greedy_generate
from actors.engine.models import DEFAULT_BASE_MODEL, BaseModel
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from actors.spec.run_spec import RunSpec

TRAIN_ROWS = 320
EVAL_ITEMS = 40
TRAIN_SEED = 1234
EVAL_SEED = 98765
DEFAULT_STEPS = 40
LEARNING_RATE = 2e-3
WARMUP_STEPS = 5
BATCH_SIZE = 8
STEP_TOKENS = 2048
LORA = LoraConfig(r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
BASE_ROW = "base model"
DEMO_CONTINUES = "`aspen demo`"   # what its Ctrl-C says continues its jobs

# Common English words; the reversal task uses those of 3 to 5 letters.
WORDS = """
able about above act add after again age ago air all also always and animal answer any apple area arm
around art ask away baby back bad ball bank base bear beat bed before begin bell best big bird black
blue boat body bone book born both box boy bread break bring brown build burn busy buy call came camp
card care carry case cat catch cause cell chair child city class clean clear climb close cloud coat
cold color come cook cool corn cost could count cover cow cross cry cut dance dark day deep desk dog
door down draw dream dress drink drive drop dry duck each early earth east easy eat egg end enjoy
even ever every eye face fact fall farm fast father fear feel field fill find fine fire first fish
five floor flower fly follow food foot forest form four free friend from front fruit full game garden
gate girl give glad glass gold good grass great green ground group grow hair half hand happy hard hat
have head hear heart heat help high hill hold home hope horse hot hour house hunt idea inch iron
island job join jump just keep kind king kitchen know lake land large last late laugh lead learn
leave left leg letter light like line lion list little live long look lost loud love low lucky
""".split()
REVERSE_WORDS = [word for word in WORDS if 3 <= len(word) <= 5]

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena", "Max",
         "Nina", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma", "Vera", "Will", "Yara", "Zoe"]
CITIES = ["Oslo", "Paris", "Rome", "Lima", "Cairo", "Tokyo", "Delhi", "Berlin", "Madrid", "Dublin", "Vienna",
          "Prague", "Seoul", "Quito", "Lagos", "Miami", "Boston", "Denver", "Sydney", "Athens", "Warsaw",
          "Lisbon", "Zurich", "Nairobi"]
JOBS = ["cook", "nurse", "pilot", "baker", "judge", "actor", "coach", "miner", "tailor", "farmer", "singer",
        "doctor", "writer", "lawyer", "driver", "dentist"]


@dataclass(frozen=True)
class Task:
    """A generated task: its prompt_response templates and a function drawing one row from a generator."""

    name: str
    prompt: str
    response: str
    make_row: Callable[[random.Random], dict[str, str]]

    @property
    def format(self) -> PromptResponseFormat:
        return PromptResponseFormat(type="prompt_response", prompt=self.prompt, response=self.response)


def _addition_row(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    if rng.random() < 0.5:
        a, b = b, a
    return {"a": str(a), "b": str(b), "answer": str(a + b)}


def _reverse_row(rng: random.Random) -> dict[str, str]:
    # Letters spaced out (" h o u s e": one token per letter), so reversing needs no knowledge of how
    # the model's word tokens are spelled; reversing whole-word tokens is out of reach in a few steps.
    word = rng.choice(REVERSE_WORDS)
    return {"word": " ".join(word), "answer": " ".join(reversed(word))}


def _json_row(rng: random.Random) -> dict[str, str]:
    record = {"name": rng.choice(NAMES), "city": rng.choice(CITIES), "job": rng.choice(JOBS)}
    keys = list(record)
    rng.shuffle(keys)
    field = rng.choice(keys)
    return {"record": json.dumps({key: record[key] for key in keys}), "field": field, "answer": record[field]}


def _date_row(rng: random.Random) -> dict[str, str]:
    year, month = rng.randint(1950, 2049), rng.randint(1, 12)
    day = rng.randint(1, calendar.monthrange(year, month)[1])
    return {"date": f"{year:04d}-{month:02d}-{day:02d}", "answer": f"{calendar.month_name[month]} {day}, {year}"}


TASKS = [
    Task("addition", "Add: {a}+{b}\nAnswer:", " {answer}", _addition_row),
    Task("reverse", "Reverse: {word}\nAnswer:", " {answer}", _reverse_row),
    Task("json_field", "{record}\nField: {field}\nAnswer:", " {answer}", _json_row),
    Task("date", "Date: {date}\nAnswer:", " {answer}", _date_row),
]


def _prompt_key(task: Task, row: dict[str, str]) -> str:
    return task.prompt.format_map(row)


def held_out_words(words: list[str], share: float = 0.25, seed: int = 7) -> set[str]:
    """The words kept out of the reversal training set (so held-out items are unseen words)."""
    order = sorted(set(words))
    random.Random(seed).shuffle(order)
    return set(order[: int(len(order) * share)])


def make_rows(task: Task, count: int, seed: int, *, exclude: set[str] | None = None,
              train: bool = True) -> list[dict[str, str]]:
    """`count` rows of the task; with `exclude` (prompts), rows whose prompt is in it are redrawn and
    every row is distinct. Reversal rows use only training words when `train`, only held-out words else."""
    rng = random.Random(f"{task.name}-{seed}")
    reserved = held_out_words(REVERSE_WORDS)
    rows: list[dict[str, str]] = []
    seen: set[str] = set(exclude or ())
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 100 * count:
            raise RuntimeError(f"task {task.name}: could not draw {count} distinct rows")
        row = task.make_row(rng)
        if task.name == "reverse" and (row["word"].replace(" ", "") in reserved) == train:
            continue
        key = _prompt_key(task, row)
        if exclude is not None:
            if key in seen:
                continue
            seen.add(key)
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def build_spec(output_dir: Path, data_files: dict[str, Path], steps: int) -> RunSpec:
    warmup = min(WARMUP_STEPS, max(steps - 1, 0))
    jobs = [JobSpec(name=task.name, data=data_files[task.name], format=task.format, lora=LORA,
                    batch_size=BATCH_SIZE, lr=LEARNING_RATE, lr_schedule="linear", warmup_steps=warmup,
                    max_steps=steps, max_seq_len=128, seed=index)
            for index, task in enumerate(TASKS)]
    return RunSpec(base_model=DEFAULT_BASE_MODEL, output_dir=output_dir, step_tokens=STEP_TOKENS,
                   layout="packed", jobs=jobs)


def newline_token_ids(base: BaseModel) -> set[int]:
    """Every token whose text contains a newline (generation stops there)."""
    tokenizer = base.tokenizer
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return {i for i, piece in enumerate(pieces) if "\n" in piece}


@dataclass
class EvalSet:
    """Held-out items of one task, tokenized like the training rows."""

    task: Task
    prompts: list[list[int]]
    answers: list[str]
    max_new_tokens: int


def build_eval_set(task: Task, rows: list[dict[str, str]], base: BaseModel) -> EvalSet:
    prompts, answers, longest = [], [], 0
    for row in rows:
        example = tokenize_example(row, task.format, base.tokenizer, max_seq_len=10_000)
        if example is None:
            raise ValueError(f"task {task.name}: an eval row has no answer token: {row}")
        prompt_length = next(i for i, label in enumerate(example.labels) if label != -100)
        prompts.append(list(example.input_ids[:prompt_length]))
        answers.append(row["answer"])
        longest = max(longest, example.num_targets)  # answer tokens + EOS
    return EvalSet(task, prompts, answers, longest)


def answer_text(base: BaseModel, tokens: list[int], stops: set[int]) -> str | None:
    """The decoded answer, or None when generation never reached EOS or a newline."""
    eos = base.tokenizer.eos_token_id
    for index, token in enumerate(tokens):
        if token in stops:
            text = base.tokenizer.decode(tokens[:index] if token == eos else tokens[: index + 1])
            return text.split("\n", 1)[0].strip()
    return None


def accuracy(base: BaseModel, adapter: str | None, eval_set: EvalSet, stops: set[int]) -> tuple[float, list[str]]:
    outputs = greedy_generate(base, adapter, eval_set.prompts, eval_set.max_new_tokens, stops)
    texts = [answer_text(base, tokens, stops) for tokens in outputs]
    correct = sum(text == expected for text, expected in zip(texts, eval_set.answers, strict=True))
    return correct / len(eval_set.answers), [t if t is not None else "<no stop>" for t in texts]


def format_table(table: dict[str, dict[str, float]], tasks: list[str]) -> str:
    width = max(len(row) for row in table) + 2
    lines = [f"{'accuracy':<{width}}" + "".join(f"{name:>12}" for name in tasks)]
    for row, cells in table.items():
        line = f"{row:<{width}}"
        for name in tasks:
            cell = f"{cells[name]:.0%}"
            if row == name:
                cell = f"[{cell}]"
            line += f"{cell:>12}"
        lines.append(line)
    return "\n".join(lines)


def train_through_service(spec: RunSpec, output_dir: Path, quiet: bool) -> list:
    """Start a service (scheduler, one trainer, a job actor per job) on a local Ray, submit the four
    jobs, follow them to the end, stop the service. Returns the jobs' final records."""
    from actors.service.outputs.job_files import clear_job_folder
    from actors.service.scheduler.config import run_service_config
    from orchestrator.cli.run_commands import _terminate_as_interrupt, checkpointing_on_interrupt
    from orchestrator.client import Client
    from orchestrator.progress import follow_jobs, wait_for_trainers

    spec = spec.model_copy(update={"output_dir": output_dir.resolve()})
    client = Client.local(run_service_config(spec, resume_on_start=False), wait_ready=False)
    _terminate_as_interrupt()   # SIGTERM as Ctrl-C: the jobs checkpointed and held, one line said
    then = (f"{DEMO_CONTINUES} trains its jobs anew (the demo starts over; they are held paused until then: "
            f"aspen status --from {output_dir.resolve()})")
    try:
        with checkpointing_on_interrupt("jobs", then):
            wait_for_trainers(client, quiet=quiet)   # its phases said: loading the base, warming up, ...
            folders = {str(output_dir.resolve() / job.name) for job in spec.jobs}
            for record in client.jobs():   # an earlier demo's jobs in this folder: forgotten, trained anew
                if record.output_dir in folders:
                    client.delete(record.id)
            for folder in folders:   # what an earlier demo left there deleted (the service refuses to train over it)
                clear_job_folder(folder)
            handles = client.submit_run(spec)
            ids = {h.id for h in handles}
            return follow_jobs(lambda: [r for r in client.jobs() if r.id in ids], quiet=quiet)
    finally:   # unfinished jobs held paused (not queued for a service that is gone), saying what to do
        client.shutdown(hold=f"{DEMO_CONTINUES} trains it anew (the demo starts its jobs over)")


def run_demo(output_dir: str | Path = "runs/demo", steps: int | None = None, quiet: bool = False) -> int:
    """Generate the tasks, train the four adapters together, evaluate them; 0 when each beats the base."""
    from actors.checkpoint.peft_io import load_adapter_weights
    from actors.engine.adapter_surgery import add_adapter, remove_adapter
    from actors.engine.models import load_base_model

    started = time.perf_counter()
    output_dir = Path(output_dir)
    steps = DEFAULT_STEPS if steps is None else steps
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    data_files: dict[str, Path] = {}
    eval_rows: dict[str, list[dict[str, str]]] = {}
    for task in TASKS:
        train_rows = make_rows(task, TRAIN_ROWS, TRAIN_SEED)
        data_files[task.name] = write_jsonl(output_dir / "data" / f"{task.name}.jsonl", train_rows)
        train_prompts = {_prompt_key(task, row) for row in train_rows}
        eval_rows[task.name] = make_rows(task, EVAL_ITEMS, EVAL_SEED, exclude=train_prompts, train=False)
    spec = build_spec(output_dir, data_files, steps)

    print(f"aspen demo: 4 LoRA jobs ({', '.join(t.name for t in TASKS)}) on {spec.base_model}, "
          f"{steps} steps each, trained concurrently by the actor system; data in {output_dir / 'data'}")
    records = train_through_service(spec, output_dir, quiet)
    trained = time.perf_counter()
    not_done = [r for r in records if r.state != "completed"]
    if not_done:
        for record in not_done:
            print(f"FAILED: job {record.name} {record.state}: {record.reason}")
        return 1
    if not quiet:
        for record in records:
            losses = json.loads((output_dir / record.name / "metrics.jsonl").read_text().splitlines()[0])["loss"]
            print(f"  {record.name:<12} loss {losses:.3f} -> {record.loss:.3f}")
    from orchestrator.progress import quiet_loading_bars

    quiet_loading_bars(quiet)   # transformers' bar as it loads the base for the evaluation
    base = load_base_model(spec.base_model, dtype=spec.dtype, device=spec.device)
    loaded = time.perf_counter()
    stops = newline_token_ids(base)
    if base.tokenizer.eos_token_id is not None:
        stops.add(base.tokenizer.eos_token_id)
    eval_sets = {task.name: build_eval_set(task, eval_rows[task.name], base) for task in TASKS}
    table: dict[str, dict[str, float]] = {}
    samples: dict[str, dict[str, list[str]]] = {}
    rows: list[tuple[str, str | None]] = [(BASE_ROW, None)] + [(r.name, r.name) for r in records]
    for row, adapter in rows:
        if adapter is not None:
            handle = add_adapter(base.model, adapter, LORA, seed=0)
            load_adapter_weights(handle, output_dir / adapter)
        try:
            table[row], samples[row] = {}, {}
            for name, eval_set in eval_sets.items():
                table[row][name], samples[row][name] = accuracy(base, adapter, eval_set, stops)
        finally:
            if adapter is not None:
                remove_adapter(base.model, adapter)
    evaluated = time.perf_counter()

    task_names = [task.name for task in TASKS]
    print(f"\nexact-match accuracy on {EVAL_ITEMS} held-out items per task (greedy decoding; "
          "[diagonal] = adapter on its own task)")
    print(format_table(table, task_names))
    failed = [name for name in task_names if not table[name][name] > table[BASE_ROW][name]]
    print()
    for name in task_names:
        verdict = "beats" if name not in failed else "does NOT beat"
        print(f"  adapter {name:<12} {verdict} the base model on {name}: "
              f"{table[name][name]:.0%} vs {table[BASE_ROW][name]:.0%}")
    if not quiet:
        print("\nexamples (first held-out item of each task):")
        for name, eval_set in eval_sets.items():
            print(f"  {name:<12} expected {eval_set.answers[0]!r}: base {samples[BASE_ROW][name][0]!r}, "
                  f"adapter {samples[name][name][0]!r}")
    timings = {"service_and_train_s": trained - started, "eval_load_s": loaded - trained,
               "eval_s": evaluated - loaded, "total_s": evaluated - started}
    result = {"base_model": spec.base_model, "steps": steps, "eval_items": EVAL_ITEMS, "tasks": task_names,
              "accuracy": table, "beats_base": {name: name not in failed for name in task_names},
              "seconds": {key: round(value, 1) for key, value in timings.items()}}
    (output_dir / "accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ntimes: service start + training {timings['service_and_train_s']:.0f} s, evaluation "
          f"{timings['eval_load_s'] + timings['eval_s']:.0f} s, total {timings['total_s']:.0f} s; "
          f"table in {output_dir / 'accuracy.json'}")
    if failed:
        print(f"FAILED: {', '.join(failed)} did not beat the base model on its own task")
        return 1
    return 0
