"""A Tinker user's supervised loop equals an aspen job: the real `tinker` SDK against an in-process server
(orchestrator/tinker/), sending `forward_backward` with `cross_entropy` and `optim_step` step by step, trains
exactly the adapter an aspen job trains on the same base with the same settings, and the same loop fused with
another user's loop trains exactly what it trains alone.

The job is aspen's own (actors/engine/job.py on the FusedTrainer, as the isolation tests run it, without Ray):
it reads a JSONL file through its format and the SmolLM2 tokenizer, draws its batches with its seed, and
records what each step trained on; the SDK loop then sends each step's sequences as one call, in the same order.

How a Tinker loop reproduces a job, and why the equality is exact (CPU, float32):
- a job's loss is the MEAN over its step's N target tokens: it backpropagates each token's loss with weight 1
  and divides the adapter's summed gradients by N before clipping (actors/engine/optim.py). Tinker's
  cross_entropy is the SUM of -logprob * weight: the loop sends weight 1/N on each target token (0 on the
  prompt and on the last position, which has no next token). With N a power of two (here every row's answer is
  8 tokens and a batch holds 4 rows: N = 32), scaling by 1/N is exact in floating point and commutes with every
  product and sum of the backward, so the gradients are the job's bit for bit; for another N they would agree
  to float32 rounding only;
- each token's loss and gradient comes from the same chunked head (actors/engine/loss.py), and every product
  rounds per row whatever the number of rows (MKL's reproducible mode, set by actors.engine), so computing the
  head at every position (Tinker returns logprobs for all) instead of at the targets only changes nothing;
- the adapter starts equal: the same initialisation with the same seed (`create_lora_training_client(seed=)`,
  the job's `seed`), alpha 32 as Tinker models have it, no dropout, every linear layer of the decoder;
- the optimizer step is the job's: the same fused AdamW kernel, the norm summed and the clip factor taken the
  same way (actors/engine/interactive_model.py), with the job's learning rate (constant schedule, no warm-up),
  its AdamW's betas and eps, its weight decay and its max_grad_norm as `grad_clip_norm` (which bites here).

The step's loss: the job's is the float32 sum of its N token losses in stream order, divided by N; Tinker's
`loss:sum` is the float32 sum of the same terms (each already times 1/N, exactly) per datum in torch's order,
then over datums. The per-token losses the SDK returns (`elementwise_loss`), summed in the job's order, give the
job's loss bit for bit; `loss:sum` differs only by the order of its float32 additions, bounded below."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.checkpoint.peft_io import adapter_state_dict
from actors.data import Example, load_examples
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from orchestrator.tinker.tinker_routes import TinkerBackend
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tinker_sdk import tinker_in_process

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why

BASE = "tiny-llama"
WINDOW_S = 0.25   # how long a call waits for partners: wide, so that two users' calls sent together meet
KEYS = {"alice-token": "alice", "bob-token": "bob"}
SEED = 7
STEPS = 4
U = 2.0**-24   # float32's unit roundoff


def question_rows(count: int = 12) -> list[dict[str, str]]:
    """Questions of different lengths, each answer 6 digits: with the space before it and the end-of-sequence
    token, 8 target tokens a row (checked on the tokenized rows below)."""
    return [{"question": f"what is {i} times {i + 3}?" + " please" * (i % 4), "answer": f"{i * (i + 3):06d}"}
            for i in range(count)]


def job_spec(data: str) -> JobSpec:
    return JobSpec(name="job", data=data, batch_size=4, max_steps=STEPS, max_seq_len=64, lr=1e-2,
                   lr_schedule="constant", warmup_steps=0, weight_decay=0.1, max_grad_norm=0.5, seed=SEED,
                   format={"type": "prompt_response", "prompt": "Q: {question}\nA:", "response": " {answer}"},
                   lora={"r": 4, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"})


class RecordedBatches:
    """The job's own data cursor, keeping each micro-batch it hands the job."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    @property
    def exhausted(self) -> bool:
        return self.inner.exhausted

    def next_batch(self):
        batch = self.inner.next_batch()
        self.batches.append(batch)
        return batch

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_tokenizer):
    """The aspen job trained to the end: its spec, the batches of its steps, its per-step losses and records,
    its adapter (PEFT names)."""
    data = tmp_path_factory.mktemp("job-data") / "questions.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in question_rows()))
    spec = job_spec(str(data))
    examples = load_examples(spec.data, spec.format, tiny_tokenizer, max_seq_len=spec.max_seq_len).examples
    base = from_module(tiny_model("llama", VOCAB), None)
    trainer = FusedTrainer(base, step_tokens=100_000)
    trained = TrainingJob.create(spec, base, examples, [], seed=spec.seed)
    trained.cursor = recorded = RecordedBatches(trained.cursor)
    trainer.add_job(trained)
    losses = []
    while (report := trainer.train_step()) is not None:
        losses += [result.loss for result in report.results]
    weights = {name: tensor.detach().clone() for name, tensor in adapter_state_dict(trained.adapter).items()}
    (group,) = trained.optimizer.optimizer.param_groups
    adam = {"learning_rate": spec.lr, "beta1": group["betas"][0], "beta2": group["betas"][1], "eps": group["eps"],
            "weight_decay": spec.weight_decay, "grad_clip_norm": spec.max_grad_norm}
    history = list(trained.history)
    trainer.remove_job(spec.name)
    assert len(losses) == STEPS and len(history) == STEPS
    return {"batches": recorded.batches[:STEPS], "losses": losses, "history": history, "weights": weights,
            "adam": adam}


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker_in_process(from_module(tiny_model("llama", VOCAB), None), BASE, tmp_path / "weights", KEYS.get,
                           window_s=WINDOW_S) as served:
        yield served


def target_positions(example: Example) -> list[int]:
    """Input positions whose next token the job learns (its label is not -100)."""
    return [t for t in range(len(example) - 1) if example.labels[t + 1] != -100]


def step_datums(batch: list[Example]) -> tuple[list, int]:
    """A job's micro-batch as one call's datums: each row whole, its next tokens as targets, weight 1/N on the
    job's N target tokens of the step and 0 elsewhere (the prompt, the last position); and N."""
    count = sum(len(target_positions(example)) for example in batch)
    datums = []
    for example in batch:
        ids = list(example.input_ids)
        weights = np.zeros(len(ids), dtype=np.float32)
        weights[target_positions(example)] = 1.0 / count
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(ids),
                                  loss_fn_inputs={"target_tokens": np.array(ids[1:] + [0], dtype=np.int64),
                                                  "weights": weights}))
    return datums, count


def replay_job(url: str, key: str, job: dict, together: threading.Barrier | None = None) -> dict:
    """The job's steps as a Tinker user's loop: per step its loss:sum, its per-token losses summed in the job's
    order (float32, one by one), its target count; the path of its final weights and its model id."""
    client = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
    # the job adapts the decoder's linear layers only: the model leaves the LM head alone too (not the SDK's default)
    training = client.create_lora_training_client(base_model=BASE, rank=4, seed=SEED, train_unembed=False).result()
    out: dict = {"loss_sum": [], "in_job_order": [], "targets": [], "model_id": training.model_id}
    for batch in job["batches"]:
        if together is not None:
            together.wait(timeout=60)
        datums, count = step_datums(batch)
        result = training.forward_backward(datums, "cross_entropy").result()
        total = np.float32(0.0)
        for example, output in zip(batch, result.loss_fn_outputs, strict=True):
            elementwise = output["elementwise_loss"].to_numpy()
            for position in target_positions(example):
                total = np.float32(total + elementwise[position])
        out["loss_sum"].append(result.metrics["loss:sum"])
        out["in_job_order"].append(float(total))
        out["targets"].append(count)
        training.optim_step(types.AdamParams(**job["adam"])).result()
    out["path"] = training.save_weights_for_sampler("final").result().path
    client.close("success").result()
    return out


def other_users_loop(url: str, key: str, together: threading.Barrier) -> str:
    """Another user's loop at the same time: random tokens, all weighted 1; its model id."""
    client = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
    training = client.create_lora_training_client(base_model=BASE, rank=8).result()
    generator = np.random.default_rng(3)
    for _ in range(STEPS):
        together.wait(timeout=60)
        datums = []
        for _ in range(3):
            tokens = generator.integers(0, VOCAB, int(generator.integers(5, 30))).tolist()
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens),
                                      loss_fn_inputs={"target_tokens": np.array(tokens[1:] + [0], dtype=np.int64),
                                                      "weights": np.ones(len(tokens), dtype=np.float32)}))
        training.forward_backward(datums, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    model_id = training.model_id
    client.close("success").result()
    return model_id


def saved_weights(backend: TinkerBackend, path: str) -> dict[str, torch.Tensor]:
    """The adapter a `tinker://<model>/sampler_weights/<name>` path names, as written (PEFT's files)."""
    model_id, _, name = path.removeprefix("tinker://").split("/")
    folder = backend.weights_dir / model_id.replace(":", "-") / "sampler_weights" / name
    return load_file(folder / "adapter_model.safetensors")


def assert_equal_adapters(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(weights) == set(expected) and len(expected) > 0
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), (name, float((weights[name] - tensor).abs().max()))


def gamma(terms: int) -> float:
    """Higham's gamma_(n-1): any order of summing n floats errs by at most this times the sum of magnitudes."""
    return (terms - 1) * U / (1 - (terms - 1) * U)


def test_the_sdks_supervised_loop_trains_an_aspen_jobs_adapter_bit_for_bit(server, job):
    url, backend, _ = server
    assert any(record.grad_norm > job["adam"]["grad_clip_norm"] for record in job["history"]), \
        "clipping never bit: the clipped step is not compared"
    run = replay_job(url, "alice-token", job)
    for count in run["targets"]:   # what makes 1/N exact (module docstring)
        assert count > 0 and count & (count - 1) == 0, run["targets"]
    assert run["in_job_order"] == job["losses"]
    for loss_sum, count, loss in zip(run["loss_sum"], run["targets"], job["losses"], strict=True):
        # the same `count` nonnegative float32 terms summed in two orders: each within gamma of the exact sum
        assert abs(loss_sum - loss) <= 2 * gamma(count) / (1 - gamma(count)) * loss, (loss_sum, loss)
    assert_equal_adapters(saved_weights(backend, run["path"]), job["weights"])
    trained = max(float(t.abs().max()) for name, t in job["weights"].items() if "lora_B" in name)
    assert trained > 0, "B never left zero: nothing was trained"


def test_the_same_loop_fused_with_another_users_trains_the_same_adapter(server, job):
    url, backend, steps = server
    alone = replay_job(url, "alice-token", job)
    del steps[:]
    together = threading.Barrier(2)
    results: dict[str, object] = {}
    threads = [threading.Thread(target=lambda: results.update(alice=replay_job(url, "alice-token", job, together))),
               threading.Thread(target=lambda: results.update(bob=other_users_loop(url, "bob-token", together)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert set(results) == {"alice", "bob"}, "a loop did not finish"
    fused = results["alice"]
    shared = [step for step in steps if step["backward"]
              and set(step["models"]) == {fused["model_id"], results["bob"]}]
    assert shared, f"no forward_backward pass held both users' models: {steps}"
    assert fused["loss_sum"] == alone["loss_sum"] and fused["in_job_order"] == alone["in_job_order"]
    fused_weights = saved_weights(backend, fused["path"])
    assert_equal_adapters(fused_weights, saved_weights(backend, alone["path"]))
    assert_equal_adapters(fused_weights, job["weights"])
