"""The identity servers the single sign-on tests run against, each started for the test:

- ``Directory``: OpenLDAP's slapd (Debian's package) on a loopback port, its database in the
  test's folder, people under ou=people and groupOfNames groups under ou=groups;
- ``Provider``: the OpenID Connect provider of ``tests/identity/idp`` (django-oidc-provider)
  served by Django's own server on a loopback port, with its own SQLite database.

Neither is a mock: the portal's backends speak LDAP and OpenID Connect to them over TCP.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.platform import free_port
from tests.workers.engines import require_engine

ROOT = Path(__file__).resolve().parents[2]
BASE_DN = "dc=example,dc=test"
ADMIN_DN = f"cn=admin,{BASE_DN}"
ADMIN_PASSWORD = "directory-admin-secret"
SCHEMAS = ("core", "cosine", "inetorgperson", "nis")


def ssha(password: str) -> str:
    """An OpenLDAP {SSHA} userPassword, as slappasswd makes it."""
    salt = secrets.token_bytes(8)
    return "{SSHA}" + base64.b64encode(hashlib.sha1(password.encode() + salt).digest() + salt).decode()  # noqa: S324 - slapd's scheme


def wait_until(ready: object, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not start within {seconds:g} s")


class Directory:
    """slapd with ``people`` ({uid: password}) and ``groups`` ({cn: [uid, ...]})."""

    def __init__(self, folder: Path, people: dict[str, str], groups: dict[str, list[str]]) -> None:
        self.folder = folder
        self.port = free_port()
        self.uri = f"ldap://127.0.0.1:{self.port}"
        (folder / "data").mkdir(parents=True)
        self.config = folder / "slapd.conf"
        self.config.write_text(
            "\n".join(
                [
                    *(f"include /etc/ldap/schema/{name}.schema" for name in SCHEMAS),
                    "modulepath /usr/lib/ldap",
                    "moduleload back_mdb",
                    f"pidfile {folder}/slapd.pid",
                    "database mdb",
                    "maxsize 10485760",
                    f'suffix "{BASE_DN}"',
                    f'rootdn "{ADMIN_DN}"',
                    f"rootpw {ssha(ADMIN_PASSWORD)}",
                    f"directory {folder}/data",
                    "",
                ]
            )
        )
        entries = [
            f"dn: {BASE_DN}\nobjectClass: dcObject\nobjectClass: organization\ndc: example\no: Example\n",
            f"dn: ou=people,{BASE_DN}\nobjectClass: organizationalUnit\nou: people\n",
            f"dn: ou=groups,{BASE_DN}\nobjectClass: organizationalUnit\nou: groups\n",
            *(
                f"dn: {self.person_dn(uid)}\nobjectClass: inetOrgPerson\nuid: {uid}\ncn: {uid.capitalize()}\n"
                f"sn: Tester\ngivenName: {uid.capitalize()}\nmail: {uid}@example.test\n"
                f"userPassword: {ssha(password)}\n"
                for uid, password in people.items()
            ),
            *(
                f"dn: {self.group_dn(cn)}\nobjectClass: groupOfNames\ncn: {cn}\n"
                + "".join(f"member: {self.person_dn(uid)}\n" for uid in members)
                for cn, members in groups.items()
            ),
        ]
        (folder / "data.ldif").write_text("\n".join(entries))
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def person_dn(uid: str) -> str:
        return f"uid={uid},ou=people,{BASE_DN}"

    @staticmethod
    def group_dn(cn: str) -> str:
        return f"cn={cn},ou=groups,{BASE_DN}"

    def start(self) -> None:
        subprocess.run(
            ["slapadd", "-f", str(self.config), "-l", str(self.folder / "data.ldif")],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        log = (self.folder / "slapd.log").open("wb")
        # -d: stay in the foreground (the test owns the process), logging connections.
        self.proc = subprocess.Popen(
            ["slapd", "-f", str(self.config), "-h", f"{self.uri}/", "-d", "256"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_until(self._answers, 30, "slapd")

    def _answers(self) -> bool:
        import ldap

        try:
            conn = ldap.initialize(self.uri)
            conn.simple_bind_s(ADMIN_DN, ADMIN_PASSWORD)
            conn.unbind_s()
            return True
        except ldap.SERVER_DOWN:
            return False

    def remove_member(self, cn: str, uid: str) -> None:
        """Take ``uid`` out of group ``cn``, as the directory's admin would."""
        import ldap

        conn = ldap.initialize(self.uri)
        conn.simple_bind_s(ADMIN_DN, ADMIN_PASSWORD)
        conn.modify_s(self.group_dn(cn), [(ldap.MOD_DELETE, "member", [self.person_dn(uid).encode()])])
        conn.unbind_s()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=15)

    def settings_env(self) -> dict[str, str]:
        """The portal's environment for this directory (README "Single sign-on")."""
        return {
            "LDAP_SERVER_URI": self.uri,
            "LDAP_USER_SEARCH_BASE": f"ou=people,{BASE_DN}",
            "LDAP_GROUP_SEARCH_BASE": f"ou=groups,{BASE_DN}",
            "LDAP_BIND_DN": ADMIN_DN,
            "LDAP_BIND_PASSWORD": ADMIN_PASSWORD,
        }


@contextmanager
def running_directory(
    folder: Path, people: dict[str, str], groups: dict[str, list[str]]
) -> Iterator[Directory]:
    require_engine(shutil.which("slapd") is not None, "OpenLDAP's slapd (apt-get install slapd)")
    directory = Directory(folder, people, groups)
    with _stopped_after(directory, folder / "slapd.log"):
        directory.start()
        yield directory


class Provider:
    """The test OpenID Connect provider, set up for one portal callback URL."""

    CLIENT_ID = "gpushare-portal"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.secret = secrets.token_urlsafe(24)
        self.env = {
            **os.environ,
            "IDP_DATABASE": str(folder / "idp.sqlite3"),
            "IDP_URL": f"{self.url}/openid",
            "PYTHONPATH": str(ROOT),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def control(self, *args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "tests.identity.idp.control", *args],
            cwd=ROOT, env=self.env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip

    def start(self, portal_callback: str) -> None:
        self.control("setup", portal_callback, self.CLIENT_ID, self.secret)
        log = (self.folder / "idp.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{self.port}", "--noreload"],
            cwd=ROOT, env={**self.env, "DJANGO_SETTINGS_MODULE": "tests.identity.idp.settings"},
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_until(self._answers, 60, "the OpenID Connect provider")

    def _answers(self) -> bool:
        try:
            discovery = f"{self.url}/openid/.well-known/openid-configuration"
            with urllib.request.urlopen(discovery, timeout=2) as r:  # noqa: S310 - our loopback URL
                return r.status == 200
        except OSError:
            return False

    def user(self, username: str, password: str, *groups: str) -> None:
        self.control("user", username, password, f"{username}@example.test", *groups)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=15)

    def settings_env(self) -> dict[str, str]:
        """The portal's environment for this provider (README "Single sign-on")."""
        openid = f"{self.url}/openid"
        return {
            "OIDC_RP_CLIENT_ID": self.CLIENT_ID,
            "OIDC_RP_CLIENT_SECRET": self.secret,
            "OIDC_OP_AUTHORIZATION_ENDPOINT": f"{openid}/authorize",
            "OIDC_OP_TOKEN_ENDPOINT": f"{openid}/token",
            "OIDC_OP_USER_ENDPOINT": f"{openid}/userinfo",
            "OIDC_OP_JWKS_ENDPOINT": f"{openid}/jwks",
            "OIDC_PROVIDER_NAME": "Example University",
        }


@contextmanager
def running_provider(folder: Path) -> Iterator[Provider]:
    """A provider to ``start`` once the portal's callback URL is known (its port is chosen
    first, so the portal can be started with ``settings_env`` before it)."""
    folder.mkdir(parents=True, exist_ok=True)
    provider = Provider(folder)
    with _stopped_after(provider, folder / "idp.log"):
        yield provider


@contextmanager
def _stopped_after(server: Directory | Provider, log: Path) -> Iterator[None]:
    """Stop ``server`` at the end; on a failure, show the end of its log first."""
    try:
        yield
    except BaseException:
        sys.stderr.write(log.read_text(errors="replace")[-3000:] if log.exists() else "")
        raise
    finally:
        server.stop()
