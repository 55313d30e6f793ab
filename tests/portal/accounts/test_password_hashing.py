"""New passwords are hashed with Argon2; older PBKDF2 hashes still sign in, and are rewritten
as Argon2 then (portal/settings.py PASSWORD_HASHERS). The test process itself hashes with one
PBKDF2 round (tests/hashers.py): these run under the portal's own list."""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher, check_password, make_password
from django.test import override_settings

from portal import settings as portal_settings


def test_new_passwords_are_argon2_and_old_pbkdf2_ones_still_verify_and_upgrade() -> None:
    with override_settings(PASSWORD_HASHERS=portal_settings.PASSWORD_HASHERS):
        new = make_password("correct-horse-battery")
        assert new.startswith("argon2$argon2id$")
        assert check_password("correct-horse-battery", new)
        assert not check_password("wrong-horse", new)

        old = PBKDF2PasswordHasher().encode("correct-horse-battery", "somesalt", iterations=1_000)
        upgraded: list[str] = []
        assert check_password("correct-horse-battery", old, setter=upgraded.append)
        assert upgraded == ["correct-horse-battery"]  # Django's setter stores it again, as Argon2
