"""Simulated portal users for tests/bench/test_load.py, run by the ``locust`` CLI.

Locust runs in its own process (gevent patches everything it imports); the test writes the
users' credentials to the JSON file named by ``LOAD_CREDENTIALS``:
``{"users": [{"username", "password", "token", "session", "watch", "projects": [{"slug",
"id"}]}], "active": N, "tiers": {"mps": id, "timeslice": id}, "image": {"id", "name"}}``.

Every user has a sandbox page open (``watch``: a running sandbox of one of their projects).
Its live chart's WebSocket is held by another process (tests/bench/telemetry_clients.py:
gevent users holding sockets would spend the client's CPU); here the page is loaded once and
its status part refreshed as the page does now that state changes are pushed: a slow poll
(PageWatcher, signed in already: ``session``). The first ``active`` users (one in ten) also
work (ActiveUser): each signs in through the login form once, then browses the pages (with
the htmx requests the pages make), requests sandboxes through the form, the API and the
command-line client's API layer, extends and stops them the same three ways (at most two
live at a time, so no project quota is ever the answer) and reads the API as a billing
script would. Requests are named by route, so the statistics group per route. Any answer
but the expected one is a failure.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import time
import uuid
from typing import Any
from urllib.parse import urlencode

from gpushare_client import routes
from gpushare_client.api import Api
from gpushare_client.config import Credentials
from gpushare_client.exits import ClientError
from locust import between, constant_pacing, task
from locust.contrib.fasthttp import FastHttpUser, ResponseContextManager

with open(os.environ["LOAD_CREDENTIALS"]) as _file:
    CONFIG: dict[str, Any] = json.load(_file)
_ACTIVE = itertools.cycle(CONFIG["users"][: CONFIG["active"]])
_WATCHERS = itertools.cycle(CONFIG["users"][CONFIG["active"] :])
# templates/sandboxes/detail.html: the status part's slow poll (pushes and the page's own
# ticking figures do the rest; a watched sandbox runs throughout, so no push comes).
STATUS_POLL_S = 300
SHED_RETRY_S = 5  # portal/overload.py's Retry-After
MAX_LIVE = 2  # per user: with every project's quota far higher, no request is refused
FORM = {"Content-Type": "application/x-www-form-urlencoded"}
HTMX = {"HX-Request": "true"}
CSRF_INPUT = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')
DETAIL = re.compile(r"/sandboxes/(\d+)/$")


def expect(response: ResponseContextManager, *codes: int) -> bool:
    if response.status_code in codes:
        response.success()
        return True
    body = (response.text or "")[:200].replace("\n", " ") if response.status_code else ""
    response.failure(f"{response.status_code} (expected {'/'.join(map(str, codes))}): {body}")
    return False


class PageWatcher(FastHttpUser):
    """A signed-in user with their sandbox's page open, and nothing else."""

    weight = 9
    wait_time = constant_pacing(STATUS_POLL_S)

    def on_start(self) -> None:
        account = next(_WATCHERS)
        self.cookie = {"Cookie": f"sessionid={account['session']}"}
        self.watch: int = account["watch"]
        # The page itself, once; then only what it refreshes. The first refresh comes a random
        # part of the poll later, as pages opened at different times would.
        self.get(f"/sandboxes/{self.watch}/", "/sandboxes/[id]/", self.cookie)
        time.sleep(random.uniform(0, STATUS_POLL_S))

    def get(self, path: str, name: str, headers: dict[str, str]) -> None:
        with self.client.get(path, name=name, headers=headers, catch_response=True) as response:
            expect(response, 200)

    @task
    def status(self) -> None:
        self.get(f"/sandboxes/{self.watch}/status/", "/sandboxes/[id]/status/", {**HTMX, **self.cookie})


class ActiveUser(FastHttpUser):
    fixed_count = CONFIG["active"]
    wait_time = between(1, 5)

    def on_start(self) -> None:
        account = next(_ACTIVE)
        self.username: str = account["username"]
        self.password: str = account["password"]
        self.api = {"Authorization": f"Bearer {account['token']}"}
        self.projects: list[dict[str, Any]] = account["projects"]
        self.live: list[int] = []  # requested, not stopped by this user
        self.seen: list[int] = []  # every sandbox this user requested, newest last
        self.extended: set[int] = set()  # extended once each: the tier's limit stays far
        self.command_line = Api(Credentials(url=self.host or "", token=account["token"]))
        self.sign_in()

    def on_stop(self) -> None:
        self.command_line.close()

    # --- helpers ------------------------------------------------------------------------------

    def csrf(self) -> str:
        return next((c.value or "" for c in self.client.cookiejar if c.name == "csrftoken"), "")

    def form_post(self, path: str, name: str, fields: dict[str, str], *codes: int, htmx: bool = False) -> Any:
        body = urlencode({**fields, "csrfmiddlewaretoken": self.csrf()})
        headers = {**FORM, **(HTMX if htmx else {})}
        with self.client.post(
            path, data=body, headers=headers, name=name, allow_redirects=False, catch_response=True
        ) as response:
            return response if expect(response, *codes) else None

    def get(self, path: str, name: str, headers: dict[str, str] | None = None) -> None:
        with self.client.get(path, name=name, headers=headers, catch_response=True) as response:
            expect(response, 200)

    def api_get(self, path: str, name: str) -> None:
        with self.client.get(path, name=name, headers=self.api, catch_response=True) as response:
            expect(response, 200)

    def sign_in(self) -> None:
        """Through the form; a 503 (counted as the failure it is) is tried again after its
        Retry-After, as a person would, instead of browsing signed out."""
        for _attempt in range(5):
            status = self.sign_in_once()
            if status != 503:
                return
            time.sleep(SHED_RETRY_S)

    def sign_in_once(self) -> int:
        with self.client.get("/login/", name="/login/", catch_response=True) as page:
            if not expect(page, 200):
                return page.status_code
            token = CSRF_INPUT.search(page.text or "")
        fields = {"username": self.username, "password": self.password}
        if token:
            fields["csrfmiddlewaretoken"] = token.group(1)
        with self.client.post(
            "/login/",
            data=urlencode(fields),
            headers=FORM,
            name="/login/",
            allow_redirects=False,
            catch_response=True,
        ) as response:
            if expect(response, 302) and "/login/" in (response.headers.get("Location") or ""):
                response.failure(f"{self.username} was sent back to the login page")
            return response.status_code

    def sandbox_fields(self, tier: str) -> dict[str, str]:
        fields = {"image": CONFIG["image"]["name"], "isolation": "container", "duration_hours": "1"}
        if tier == "mps":
            fields.update(mps_memory_gib="10", mps_thread_pct=str(random.choice((10, 20, 25))))
        return {"tier": tier, **fields}

    def make_room(self) -> None:
        while len(self.live) >= MAX_LIVE:
            self.stop_one()

    # --- pages ----------------------------------------------------------------------------------

    @task(10)
    def sandbox_list(self) -> None:
        self.get("/sandboxes/", "/sandboxes/")

    @task(8)
    def sandbox_rows(self) -> None:  # the list's htmx refresh
        self.get("/sandboxes/", "/sandboxes/ (htmx rows)", HTMX)

    @task(6)
    def sandbox_detail(self) -> None:
        if not self.seen:
            return self.sandbox_list()
        self.get(f"/sandboxes/{random.choice(self.seen[-5:])}/", "/sandboxes/[id]/")

    @task(10)
    def sandbox_status(self) -> None:  # the detail page's htmx poll
        if not self.seen:
            return self.sandbox_rows()
        sandbox = self.live[-1] if self.live else self.seen[-1]
        self.get(f"/sandboxes/{sandbox}/status/", "/sandboxes/[id]/status/", HTMX)

    @task(3)
    def project_list(self) -> None:
        self.get("/projects/", "/projects/")

    @task(3)
    def project_detail(self) -> None:
        self.get(f"/projects/{random.choice(self.projects)['slug']}/", "/projects/[slug]/")

    @task(2)
    def notifications(self) -> None:
        self.get("/notifications/", "/notifications/")

    @task(3)
    def request_form(self) -> None:
        self.get("/sandboxes/new/", "/sandboxes/new/")

    @task(4)
    def preview(self) -> None:  # the form's live answer, as the user changes a field
        fields = self.sandbox_fields(random.choice(("mps", "timeslice")))
        fields.update(
            project=str(random.choice(self.projects)["id"]),
            tier=str(CONFIG["tiers"][fields["tier"]]),
            image=str(CONFIG["image"]["id"]),
        )
        self.form_post("/sandboxes/preview/", "/sandboxes/preview/", fields, 200, htmx=True)

    # --- requests and stops -----------------------------------------------------------------------

    @task(2)
    def request_with_form(self) -> None:
        self.make_room()
        fields = self.sandbox_fields(random.choice(("mps", "timeslice")))
        fields.update(
            project=str(random.choice(self.projects)["id"]),
            tier=str(CONFIG["tiers"][fields["tier"]]),
            image=str(CONFIG["image"]["id"]),
            run="interactive",
        )
        response = self.form_post("/sandboxes/new/", "/sandboxes/new/", fields, 302)
        if response is not None:
            found = DETAIL.search(response.headers.get("Location") or "")
            if found:
                self.live.append(int(found.group(1)))
                self.seen.append(int(found.group(1)))

    @task(2)
    def request_with_api(self) -> None:
        self.make_room()
        body = self.sandbox_fields(random.choice(("mps", "timeslice")))
        body["project"] = random.choice(self.projects)["slug"]
        payload: dict[str, Any] = {k: int(v) if v.isdigit() else v for k, v in body.items()}
        headers = {**self.api, "Idempotency-Key": str(uuid.uuid4())}
        with self.client.post(
            "/api/v1/sandboxes/",
            json=payload,
            headers=headers,
            name="/api/v1/sandboxes/",
            catch_response=True,
        ) as response:
            if expect(response, 201):
                sandbox = int(json.loads(response.text or "{}")["id"])
                self.live.append(sandbox)
                self.seen.append(sandbox)

    @task(3)
    def stop(self) -> None:
        if self.live:
            self.stop_one()

    @task(2)
    def request_with_client(self) -> None:
        """As ``gpushare request``: the preview, then the request (the client's own calls)."""
        self.make_room()
        body = self.sandbox_fields(random.choice(("mps", "timeslice")))
        body["project"] = random.choice(self.projects)["slug"]
        payload: dict[str, Any] = {k: int(v) if v.isdigit() else v for k, v in body.items()}
        if self.client_call(routes.PREVIEW, "client: preview", body=payload) is None:
            return
        sandbox = self.client_call(routes.REQUEST, "client: request", body=payload)
        if sandbox is not None:
            self.live.append(int(sandbox["id"]))
            self.seen.append(int(sandbox["id"]))

    @task(2)
    def extend(self) -> None:
        """Once per sandbox: through the page's form, the API or the client, a third each."""
        sandbox = next((pk for pk in self.live if pk not in self.extended), None)
        if sandbox is None:
            return
        self.extended.add(sandbox)
        way = random.randrange(3)
        if way == 0:
            path = f"/sandboxes/{sandbox}/extend/"
            self.form_post(path, "/sandboxes/[id]/extend/", {"hours": "1"}, 200, htmx=True)
        elif way == 1:
            headers = {**self.api, "Idempotency-Key": str(uuid.uuid4())}
            with self.client.post(
                f"/api/v1/sandboxes/{sandbox}/extend/",
                json={"hours": 1},
                headers=headers,
                name="/api/v1/sandboxes/[id]/extend/",
                catch_response=True,
            ) as response:
                expect(response, 200)
        else:
            self.client_call(routes.EXTEND, "client: extend", body={"hours": 1}, id=sandbox)

    def client_call(self, route: routes.Route, name: str, **kwargs: Any) -> Any:
        """One call of the command-line client's API layer, recorded as locust's own are."""
        started = time.perf_counter()
        answer, problem = None, None
        try:
            answer = self.command_line.call(route, **kwargs)
        except ClientError as exc:
            problem = exc
        self.environment.events.request.fire(
            request_type=route.method,
            name=name,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=0,
            exception=problem,
            context={},
        )
        return answer

    def stop_one(self) -> None:
        sandbox = self.live.pop(0)
        way = random.randrange(3)
        if way == 0:
            self.form_post(f"/sandboxes/{sandbox}/stop/", "/sandboxes/[id]/stop/", {}, 302)
            return
        if way == 1:
            self.client_call(routes.STOP, "client: stop", body={}, id=sandbox)
            return
        headers = {**self.api, "Idempotency-Key": str(uuid.uuid4())}
        with self.client.post(
            f"/api/v1/sandboxes/{sandbox}/stop/",
            headers=headers,
            name="/api/v1/sandboxes/[id]/stop/",
            catch_response=True,
        ) as response:
            expect(response, 200)

    # --- the API, as a billing script reads it ------------------------------------------------------

    @task(4)
    def api_sandboxes(self) -> None:
        self.api_get("/api/v1/sandboxes/", "/api/v1/sandboxes/")

    @task(2)
    def api_usage(self) -> None:
        self.api_get(f"/api/v1/usage/?project={random.choice(self.projects)['slug']}", "/api/v1/usage/")

    @task(1)
    def api_utilization(self) -> None:
        self.api_get("/api/v1/utilization/?by=project", "/api/v1/utilization/")

    @task(1)
    def api_prices(self) -> None:
        self.api_get("/api/v1/prices/", "/api/v1/prices/")

    @task(1)
    def api_invoices(self) -> None:
        self.api_get("/api/v1/invoices/", "/api/v1/invoices/")
