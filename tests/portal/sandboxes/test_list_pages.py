"""The sandbox list shows a page of rows, newest first, with links to the older ones (every open
list refreshes its page every few seconds: a page is what it re-renders)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from portal.sandboxes import views
from tests.portal.helpers import client_for, request

pytestmark = [pytest.mark.django_db]


def _ids(html: str) -> list[int]:
    return [int(pk) for pk in re.findall(r'href="/sandboxes/(\d+)/"', html)]


def test_pages_go_from_newest_to_oldest(people: Any, catalog: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(views, "LIST_PAGE_ROWS", 2)
    ask = (people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    made = [request(*ask).pk for _ in range(5)]
    owner = client_for(people["owner"])

    first = owner.get("/sandboxes/").content.decode()
    assert _ids(first) == made[::-1][:2]
    assert 'href="?page=2" rel="next"' in first and 'rel="prev"' not in first
    assert 'hx-get="/sandboxes/?page=1"' in first  # the refresh stays on its page

    second = owner.get("/sandboxes/?page=2").content.decode()
    assert _ids(second) == made[::-1][2:4]
    assert 'rel="prev"' in second and 'href="?page=3" rel="next"' in second

    last_rows = owner.get("/sandboxes/?page=3", HTTP_HX_REQUEST="true").content.decode()
    assert _ids(last_rows) == made[:1]
    assert "<html" not in last_rows  # the rows alone, as the refresh swaps them in


def test_a_page_past_the_last_is_empty_and_no_page_number_is_a_400(people: Any, catalog: Any) -> None:
    owner = client_for(people["owner"])
    assert "No sandboxes yet" in owner.get("/sandboxes/?page=7").content.decode()
    for bad in ("0", "-1", "two", "1e3", "99999999", "<script>"):
        answer = owner.get("/sandboxes/", {"page": bad})
        assert answer.status_code == 400, bad
        assert answer["Content-Type"].startswith("text/plain")
        assert b"page: a whole number" in answer.content and b"<script>" not in answer.content
