"""Set up and change the test provider from the test, as its operator would:

    python -m tests.identity.idp.control setup PORTAL_CALLBACK CLIENT_ID CLIENT_SECRET
    python -m tests.identity.idp.control user USERNAME PASSWORD EMAIL [GROUP...]

``user`` makes or updates a user and sets their groups to exactly those named.
"""

import os
import sys

import django

os.environ["DJANGO_SETTINGS_MODULE"] = "tests.identity.idp.settings"
django.setup()

from django.contrib.auth.models import Group, User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from oidc_provider.models import Client, ResponseType  # noqa: E402


def setup(callback: str, client_id: str, secret: str) -> None:
    call_command("migrate", verbosity=0)
    call_command("creatersakey")
    client = Client.objects.create(
        name="gpushare",
        client_type="confidential",
        client_id=client_id,
        client_secret=secret,
        jwt_alg="RS256",
        require_consent=False,
    )
    client.redirect_uris = [callback]
    client.save()
    client.response_types.add(ResponseType.objects.get(value="code"))


def user(username: str, password: str, email: str, *groups: str) -> None:
    person, _ = User.objects.get_or_create(username=username)
    if not person.check_password(password):  # a new password would end their session here
        person.set_password(password)
    person.email = email
    person.first_name = username.capitalize()
    person.save()
    person.groups.set([Group.objects.get_or_create(name=name)[0] for name in groups])


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "setup":
        setup(*args)
    else:
        user(*args)
