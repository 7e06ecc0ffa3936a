"""actors.data's examples into batches: an Example's invariants, the evaluation split (split_eval: its sizes,
seeded and repeatable) and the data cursor (DataCursor: deterministic shuffled epochs that wrap or run out, its
state saved as JSON and restored mid-epoch, lengths peeked without moving)."""

from __future__ import annotations

import json

import pytest

from actors.data import DataCursor, DataError, Example, split_eval

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


def test_one_cursor_loaded_again_and_again_gives_a_fresh_cursors_batches_and_shuffles_once(monkeypatch) -> None:
    """A job actor loads each fetch's position into one cursor: every load (another seed, another epoch, back)
    gives the batches a fresh cursor at that state gives; an epoch's order is shuffled once, not per load."""
    import actors.data.batches as batches

    examples = make_examples(13)
    cursors = {seed: DataCursor(examples, 5, seed=seed) for seed in (11, 12)}
    states = []   # the two seeds' positions interleaved: each load changes the seed, within one epoch or across
    for _ in range(4):
        for cursor in cursors.values():
            states.append(cursor.state_dict())
            cursor.next_batch()
    reused = DataCursor(examples, 5, seed=0)
    for state in states + states[::-1]:
        reused.load_state_dict(state)
        fresh = DataCursor(examples, 5, seed=0)
        fresh.load_state_dict(state)
        assert ids(reused.next_batch()) == ids(fresh.next_batch())

    shuffles = []

    class CountingRandom(batches.random.Random):
        def shuffle(self, x) -> None:
            shuffles.append(len(x))
            super().shuffle(x)

    monkeypatch.setattr(batches.random, "Random", CountingRandom)
    for _ in range(5):   # the same position fetched again and again
        reused.load_state_dict(states[2])
        reused.next_batch()
    assert len(shuffles) <= 1, shuffles


def test_cursor_peek_lengths() -> None:
    examples = make_examples(9)
    cursor = DataCursor(examples, 4, seed=5)
    peeked = cursor.peek_lengths(3)
    assert cursor.examples_seen == 0 and cursor.position == 0
    assert len(peeked) == 12
    assert cursor.peek_lengths() == peeked[:4]
    actual = [len(ex) for _ in range(3) for ex in cursor.next_batch() or []]
    assert actual == peeked
