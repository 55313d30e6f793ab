"""A batch's output kept for its owner: stored as the agents send it (idempotent, trimmed to
BATCH_OUTPUT_MAX_BYTES), read on the page, as a download and through the API; hidden from
anyone outside the sandbox's project."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from portal.accounts.models import ApiToken
from portal.sandboxes import actions
from portal.sandboxes.models import OutputChunk, Sandbox
from portal.sandboxes.output import do_store_output, read_output
from tests.portal.helpers import client_for, place_all, request
from workers import control

pytestmark = pytest.mark.django_db
KIB = 1024


@pytest.fixture
def batch(people: Any, catalog: Any, fleet: Any, sent_tasks: Any) -> Sandbox:
    sandbox = request(people["owner"], people["project"], catalog["dedicated"], catalog["image"],
                      command=("sh", "-c", "make -j4"))  # fmt: skip
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.batch and sandbox.allocation_key
    return sandbox


def test_pieces_are_kept_once_and_trimmed_to_the_cap(batch: Sandbox) -> None:
    key = batch.allocation_key
    with override_settings(BATCH_OUTPUT_MAX_BYTES=256 * KIB):
        for n in range(10):  # 10 x 64 KiB
            do_store_output(key, n * 64 * KIB, bytes([65 + n]) * 64 * KIB, (n + 1) * 64 * KIB)
        assert do_store_output(key, 9 * 64 * KIB, b"J" * 64 * KIB, 640 * KIB) == 0  # redelivered
        assert do_store_output(key, 600 * KIB, b"J" * 40 * KIB + b"K" * 8, 648 * KIB) == 8  # overlap
    kept = OutputChunk.objects.filter(allocation_key=key)
    assert sum(c.end - c.start for c in kept) <= 256 * KIB + 64 * KIB
    view = read_output(batch, None, 1024)
    assert view.data == b"J" * 1016 + b"K" * 8 and view.end == view.total == 640 * KIB + 8
    assert view.kept_from > 0  # the oldest pieces are gone, and the view says from where


def test_a_gap_the_host_dropped_is_counted(batch: Sandbox) -> None:
    do_store_output(batch.allocation_key, 0, b"first\n", 6)
    do_store_output(batch.allocation_key, 1000, b"after a flood\n", 1014)
    view = read_output(batch, 0, 4096)
    assert view.data == b"first\nafter a flood\n" and view.missing == 994


def test_the_control_task_decodes_and_stores(batch: Sandbox) -> None:
    control.TASKS["sandbox_output"](batch.allocation_key, 0, base64.b64encode(b"hello\n").decode(), 6)
    assert read_output(batch).data == b"hello\n"


def test_output_of_a_moved_on_allocation_is_dropped(batch: Sandbox) -> None:
    assert do_store_output("no-such-allocation", 0, b"x", 1) == 0


def test_the_owner_reads_it_through_the_api_during_and_after_the_run(people: Any, batch: Sandbox) -> None:
    do_store_output(batch.allocation_key, 0, b"epoch 1 loss 0.9\n", 17)
    _token, key = ApiToken.issue(people["owner"], "ci", ["read:usage"])
    api = client_for(people["owner"])
    auth = {"Authorization": f"Bearer {key}"}
    during = api.get(f"/api/v1/sandboxes/{batch.pk}/output/", headers=auth).json()
    assert during["text"] == "epoch 1 loss 0.9\n" and during["complete"] is False and during["end"] == 17
    do_store_output(batch.allocation_key, 17, b"epoch 2 loss 0.5\n", 34)
    follow = api.get(f"/api/v1/sandboxes/{batch.pk}/output/", {"offset": during["end"]}, headers=auth).json()
    assert follow["text"] == "epoch 2 loss 0.5\n"
    actions.do_request_stop(batch.pk, people["owner"])
    batch.refresh_from_db()
    actions.do_mark_stopped(batch.allocation_key, timezone.now())
    after = api.get(f"/api/v1/sandboxes/{batch.pk}/output/", headers=auth).json()
    assert after["complete"] is True and after["text"].endswith("epoch 2 loss 0.5\n")


@pytest.mark.parametrize(
    ("params", "field"),
    [({"offset": "-1"}, "offset"), ({"offset": "²"}, "offset"), ({"limit": "0"}, "limit"),
     ({"limit": str(2 * 1024 * 1024)}, "limit"), ({"tail": "1"}, "tail")],
)  # fmt: skip
def test_bad_output_parameters_are_400s(
    people: Any, batch: Sandbox, params: dict[str, str], field: str
) -> None:
    response = client_for(people["owner"]).get(f"/api/v1/sandboxes/{batch.pk}/output/", params)
    assert response.status_code == 400 and field in response.json()


def test_outsiders_read_nothing(people: Any, batch: Sandbox) -> None:
    do_store_output(batch.allocation_key, 0, b"secret results\n", 15)
    outsider = client_for(people["outsider"])
    assert outsider.get(f"/api/v1/sandboxes/{batch.pk}/output/").status_code == 404
    assert outsider.get(f"/sandboxes/{batch.pk}/output.txt").status_code == 404
    assert b"secret results" not in outsider.get(f"/sandboxes/{batch.pk}/").content


def test_the_page_shows_the_tail_as_text_and_the_download_has_it_all(people: Any, batch: Sandbox) -> None:
    do_store_output(batch.allocation_key, 0, b"<script>alert(1)</script>\n\x1b[31mred\x1b[0m\n\xff\xfe\n", 40)
    page = client_for(people["owner"]).get(f"/sandboxes/{batch.pk}/").content.decode()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert(1)" not in page
    download = client_for(people["owner"]).get(f"/sandboxes/{batch.pk}/output.txt")
    assert download["Content-Disposition"].startswith("attachment;")
    assert download.content.startswith(b"<script>alert(1)</script>\n")
