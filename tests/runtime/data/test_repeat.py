"""RepeatingDataReader: each step served several times, and a resume in the middle of the
repeats serves the rest of them."""

from __future__ import annotations

from typing import Any

from gangs import FakeGang
from runtime import MapDataReader
from runtime.data.repeat import RepeatingDataReader


def reader() -> RepeatingDataReader[Any]:
    inner = MapDataReader(dataset=list(range(6)), batch_size=2, gang=FakeGang(), seed=3)
    return RepeatingDataReader(inner, 3)


def steps(r: RepeatingDataReader[Any], count: int) -> list[list[int]]:
    return [next(r)[0].tolist() for _ in range(count)]


def test_each_step_is_served_times_in_a_row_and_the_epoch_ends_after_the_last() -> None:
    r = reader()
    served = steps(r, 9)
    assert served[0] == served[1] == served[2] != served[3]
    assert sorted(x for step in served[::3] for x in step) == list(range(6))
    try:
        next(r)
    except StopIteration:
        pass
    else:
        raise AssertionError("the epoch did not end")


def test_a_resume_between_repeats_serves_the_rest_of_them() -> None:
    uninterrupted = steps(reader(), 8)
    for stop in range(1, 8):
        first = reader()
        head = steps(first, stop)
        resumed = reader()
        resumed.load_state_dict(first.state_dict())
        assert head + steps(resumed, 8 - stop) == uninterrupted, stop
