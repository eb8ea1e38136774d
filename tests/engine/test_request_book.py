"""`RequestBook`: ids, lookups, failed-at-add reporting and the keep_finished bound."""

from types import SimpleNamespace

import pytest

from jpaged.engine.request_book import RequestBook


def _req(rid: str, finished: bool = False):
    return SimpleNamespace(request_id=rid, finished=finished)


def test_settle_reports_done_and_failed_at_add_once_and_retire_keeps_the_newest():
    book = RequestBook(keep_finished=1)
    a, b, bad = _req("a"), _req("b"), _req("bad", finished=True)
    for r in (a, b, bad):
        book.add(r)
    assert book.settle({"a"}, []) == {"a", "bad"}  # the failed one, once
    assert book.settle(set(), []) == set()
    a.finished = b.finished = True
    assert book.settle(set(), ["a", "b"]) == {"a", "b"}
    book.retire()  # finished in order bad, a, b: keep only b
    assert set(book.by_id) == {"b"}
    with pytest.raises(ValueError, match=r"request_id='a'.*keep_finished=1"):
        book.lookup("a")
    assert book.lookup("b") is b


def test_add_refuses_an_id_in_use_and_discard_forgets_without_reporting():
    book = RequestBook(keep_finished=4)
    book.add(_req("x", finished=True))
    with pytest.raises(ValueError, match="request_id='x' is already in use"):
        book.add(_req("x"))
    assert book.discard("x").request_id == "x"
    assert book.discard("x") is None
    assert "x" not in book and book.settle(set(), []) == set()


def test_an_unfinished_request_is_never_retired():
    book = RequestBook(keep_finished=0)
    live = _req("live")
    book.add(live)
    book.settle(set(), ["live"])  # reported as done while a replica still runs it
    book.retire()
    assert book.get("live") is live
