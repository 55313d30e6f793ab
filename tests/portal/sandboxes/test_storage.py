"""Persistent storage in the portal: the allowlist, the mounts a launch carries, the usage
the agents report, the owner's warnings and the refusal past the limit."""

from __future__ import annotations

from typing import Any

import pytest

from portal.catalog.models import Storage, StorageVolume, Tier
from portal.catalog.storage import mounts_for, storage_refusal
from portal.console.forms import StorageForm, TierForm
from portal.sandboxes import actions
from portal.sandboxes.models import Notification
from portal.sandboxes.specs import launch_spec
from portal.sandboxes.storage_usage import do_record_storage_usage
from tests.factories import TierFactory
from tests.portal.helpers import client_for, place_all, request, request_form
from wire import uids

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("on_commit_runs")]
GIB = 1024**3


@pytest.fixture
def storage(catalog: Any) -> dict[str, Storage]:
    home = Storage.objects.create(
        name="home", kind="home", directory="homes", mount_path="/home/sandbox", limit_gib=10
    )
    shared = Storage.objects.create(
        name="shared", kind="project", directory="projects", mount_path="/project"
    )
    mnist = Storage.objects.create(
        name="mnist", kind="dataset", directory="datasets/mnist", mount_path="/data/mnist"
    )
    closed = Storage.objects.create(
        name="old", kind="dataset", directory="datasets/old", mount_path="/data/old", active=False
    )
    catalog["dedicated"].storages.set([home, shared, mnist, closed])
    return {"home": home, "shared": shared, "mnist": mnist}


def placed(people: Any, catalog: Any, who: str = "owner", project: str = "project") -> Any:
    sandbox = request(people[who], people[project], catalog["dedicated"], catalog["image"])
    place_all()
    sandbox.refresh_from_db()
    assert sandbox.host is not None
    return sandbox


def test_a_launch_mounts_the_tiers_open_storage_each_owners_own(
    people: Any, catalog: Any, storage: dict[str, Storage], fleet: None
) -> None:
    first = launch_spec(placed(people, catalog))
    by_name = {m.name: m for m in first.mounts}
    assert set(by_name) == {"home", "shared", "mnist"}  # the closed one is not mounted
    home = StorageVolume.objects.get(storage=storage["home"], user=people["owner"])
    assert by_name["home"].source == f"homes/{people['owner'].pk}"
    assert (by_name["home"].target, by_name["home"].read_only) == ("/home/sandbox", False)
    assert by_name["home"].gid == uids.storage_gid(home.pk) and by_name["home"].volume == home.pk
    assert by_name["shared"].source == f"projects/{people['project'].pk}"
    assert (by_name["mnist"].source, by_name["mnist"].read_only, by_name["mnist"].gid) == (
        "datasets/mnist",
        True,
        0,
    )
    # The owner's next sandbox gets the same home; a colleague another, the same project folder.
    again = {m.name: m for m in launch_spec(placed(people, catalog)).mounts}
    assert again["home"] == by_name["home"]
    colleague = {m.name: m for m in launch_spec(placed(people, catalog, "member")).mounts}
    assert colleague["home"].source != by_name["home"].source and colleague["home"].gid != by_name["home"].gid
    assert colleague["shared"] == by_name["shared"]
    # The launch message carries them through JSON, as the agent reads it.
    assert type(first).from_json(first.to_json()).mounts == first.mounts


def test_usage_past_the_limit_warns_then_refuses_gpu_sandboxes_until_files_go(
    people: Any, catalog: Any, storage: dict[str, Storage], fleet: None
) -> None:
    sandbox = placed(people, catalog)
    home = next(
        m for m in mounts_for(catalog["dedicated"], people["owner"], people["project"]) if m.name == "home"
    )

    do_record_storage_usage(sandbox.pk, {home.volume: (9 * GIB + GIB // 2, True)})
    warned = Notification.objects.filter(user=people["owner"], kind="storage")
    assert [n.message for n in warned.all()] == [
        "Your home on home (/home/sandbox) holds 9.5 GiB of its 10 GiB limit: past it, new sandboxes "
        "are refused."
    ]
    assert storage_refusal(catalog["dedicated"], people["owner"], people["project"]) is None
    do_record_storage_usage(sandbox.pk, {home.volume: (9 * GIB + GIB // 2, True)})
    assert warned.count() == 1  # once per crossing

    do_record_storage_usage(sandbox.pk, {home.volume: (11 * GIB, False)})
    assert warned.count() == 2 and "at least 11.0 GiB, over its 10 GiB limit" in warned.first().message  # type: ignore[union-attr]
    with pytest.raises(actions.SandboxRequestError) as refused:
        request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    assert (
        refused.value.field == "tier"
        and "holds 11.0 GiB of its 10 GiB limit: delete files" in refused.value.message
    )
    # Through the form, a form error; a colleague (another home) is not held to it.
    response = client_for(people["owner"]).post("/sandboxes/new/", request_form(people, catalog))
    assert response.status_code == 400 and b"10 GiB limit" in response.content
    request(people["member"], people["project"], catalog["dedicated"], catalog["image"])
    # A CPU-only tier with the same home still starts, to clean up without a GPU.
    cpu: Tier = TierFactory(slug="cpu", sharing_mode="cpu")  # type: ignore[assignment]
    cpu.storages.set([storage["home"]])
    assert storage_refusal(cpu, people["owner"], people["project"]) is None

    do_record_storage_usage(sandbox.pk, {home.volume: (2 * GIB, True)})  # files deleted
    request(people["owner"], people["project"], catalog["dedicated"], catalog["image"])
    do_record_storage_usage(sandbox.pk, {home.volume: (10 * GIB, True)})
    assert warned.count() == 3  # fell back below, so the next crossing warns again


def test_a_report_of_someone_elses_volume_changes_nothing(
    people: Any, catalog: Any, storage: dict[str, Storage], fleet: None
) -> None:
    mine = placed(people, catalog)
    theirs = placed(people, catalog, "outsider", "other_project")
    their_home = next(m for m in launch_spec(theirs).mounts if m.name == "home")
    do_record_storage_usage(mine.pk, {their_home.volume: (50 * GIB, True)})
    assert StorageVolume.objects.get(pk=their_home.volume).used_bytes == 0
    do_record_storage_usage(123456, {their_home.volume: (50 * GIB, True)})  # no such sandbox
    assert StorageVolume.objects.get(pk=their_home.volume).used_bytes == 0


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"directory": "../etc"}, "not a plain path"),
        ({"directory": "/srv/homes"}, "not a plain path"),
        ({"mount_path": "/etc/x"}, "/etc is the sandbox's own"),
        ({"mount_path": "/tmp"}, "/tmp is the sandbox's own"),
        ({"mount_path": "data"}, "not an absolute, normalised path"),
        ({"kind": "dataset", "limit_gib": "5"}, "takes no limit"),
    ],
)
def test_the_storage_form_refuses_what_an_agent_would(db: Any, fields: dict[str, str], error: str) -> None:
    data = {
        "name": "x",
        "kind": "home",
        "directory": "homes",
        "mount_path": "/home/sandbox",
        "limit_gib": "0",
    }
    form = StorageForm({**data, **fields, "active": "on"})
    assert not form.is_valid()
    assert error in str(form.errors.as_data())


def test_a_tier_cannot_mount_two_storages_at_one_path(catalog: Any, storage: dict[str, Storage]) -> None:
    other = Storage.objects.create(name="home2", kind="home", directory="homes2", mount_path="/home/sandbox")
    tier = catalog["dedicated"]
    data = {k: v for k, v in TierForm(instance=tier).initial.items() if v is not None}
    data.update(
        isolation_levels=tier.isolation_levels,
        priority_class=tier.priority_class.pk,
        storages=[storage["home"].pk, other.pk],
    )
    form = TierForm(data, instance=tier)
    assert not form.is_valid()
    assert "would both be mounted at /home/sandbox" in str(form.errors["storages"])


def test_pages_show_the_storage_and_its_usage(
    people: Any, catalog: Any, storage: dict[str, Storage], fleet: None
) -> None:
    sandbox = placed(people, catalog)
    home = next(m for m in launch_spec(sandbox).mounts if m.name == "home")
    do_record_storage_usage(sandbox.pk, {home.volume: (3 * GIB, True)})
    owner = client_for(people["owner"])
    preview = owner.post("/sandboxes/preview/", request_form(people, catalog)).content.decode()
    assert (
        "/home/sandbox" in preview and "3.0 GiB of 10 GiB used" in preview and "read-only dataset" in preview
    )
    project = owner.get(f"/projects/{people['project'].slug}/").content.decode()
    assert 'id="storage"' in project and "3.0 GiB of 10 GiB used" in project
    detail = owner.get(f"/sandboxes/{sandbox.pk}/").content.decode()
    assert "kept when the sandbox stops" in detail and "/project" in detail
    # A colleague sees the project's folder and their own (empty) home, not the owner's.
    colleague = client_for(people["member"]).get(f"/projects/{people['project'].slug}/").content.decode()
    assert "0 KiB of 10 GiB used" in colleague and "3.0 GiB of" not in colleague
