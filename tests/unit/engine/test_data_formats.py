"""actors.data's formats and tokenization: the format union and its template checks (a template that could blow up
a row is refused, bounded format specs still render), and rows tokenized into labelled examples (prompt-response,
alpaca, text, chat with and without mask_history) against SmolLM2's real tokenizer and its own chat template:
the ids, which labels are targets, a tokenizer's BOS, truncation, and bad chat rows refused naming the field."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from actors.data import (
    AlpacaFormat,
    ChatFormat,
    DataError,
    DataFormat,
    PromptResponseFormat,
    TextFormat,
    tokenize_example,
)
from actors.data.formats import STORED
from tests.helpers.data_formats import GSM8K, targets

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


def test_json_braces_in_a_template_are_told_to_be_doubled() -> None:
    with pytest.raises(ValidationError, match=r"""template 'Return JSON like \{"a": 1\}. Q: \{question\}' reads """
                                              r"""'\{"a": 1\}' as a row field; to write braces as text, double """
                                              r"""them: '\{\{"a": 1\}\}'"""):
        PromptResponseFormat(type="prompt_response", prompt='Return JSON like {"a": 1}. Q: {question}',
                             response=" {answer}")
    doubled = PromptResponseFormat(type="prompt_response", prompt='Return JSON like {{"a": 1}}. Q: {question}',
                                   response=" {answer}")
    assert doubled.prompt.format_map({"question": "x"}) == 'Return JSON like {"a": 1}. Q: x'


def test_bounded_format_specs_still_render() -> None:
    fmt = PromptResponseFormat(type="prompt_response", prompt="{question:>1000}|{question!r:^12.3}|{question:*<6}",
                               response="{answer!s:.1000}")
    row = {"question": "abcd", "answer": "42"}
    assert fmt.prompt.format_map(row) == " " * 996 + "abcd|" + "    'ab     |abcd**"
    assert fmt.response.format_map(row) == "42"


def test_a_response_template_naming_no_field_is_refused_where_a_prompt_may_be_fixed() -> None:
    """`response: answer` (the field's name, not `{answer}`) would make every row's target that word: refused with
    the braced field to write; a fixed prompt (`Write a haiku:`) over a row's response is a real use and is taken;
    a job table's stored spec, accepted before this check, still loads."""
    refused = r"prompt_response\.response\n\s+Value error, template .* names no row field, so every row's target"
    for response, fix in (("answer", "' {answer}'"), (" The answer.", "' {answer}'"), ("{{answer}}", "' {answer}'")):
        with pytest.raises(ValidationError, match=rf"{refused} would be this same text; .* e.g. {re.escape(fix)}"):
            TypeAdapter(DataFormat).validate_python({"type": "prompt_response", "prompt": "Q: {q}",
                                                     "response": response})
    fixed = PromptResponseFormat(type="prompt_response", prompt="Write a haiku:\n", response="{haiku}")
    assert fixed.fields() == {"haiku"}
    prompts_only = PromptResponseFormat(type="prompt_response", prompt="{q}", response="")   # a GRPO job's own reward
    assert prompts_only.fields() == {"q"}
    stored = PromptResponseFormat.model_validate({"type": "prompt_response", "prompt": "q", "response": "answer"},
                                                 context={STORED: True})
    assert stored.response == "answer"


def test_a_prompt_template_that_is_a_rows_field_name_is_refused_at_that_row(tok: Any) -> None:
    """`prompt: question` over rows that have a `question` field: the row's error says to write `{question}`; the
    same word where the rows have no such field is a fixed prompt, taken as written."""
    fmt = PromptResponseFormat(type="prompt_response", prompt="question", response=" {answer}")
    row = {"question": "What is 2+3?", "answer": "5"}
    with pytest.raises(DataError, match=r"^x:3: the prompt template 'question' names no row field, .* the row has a "
                                        r"field 'question': write '\{question\}' to use its value") as error:
        tokenize_example(row, fmt, tok, max_seq_len=512, train_on_prompt=False, source="x", line=3)
    assert error.value.field == "question"
    ex = tokenize_example({"text": "What is 2+3?", "answer": "5"}, fmt, tok, max_seq_len=512, train_on_prompt=False,
                          source="x", line=3)
    assert tok.decode(list(ex.input_ids)) == "question 5" + tok.eos_token


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
