"""A password hasher for the test process only."""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class FastPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """PBKDF2-SHA256 at one iteration. Every test's personas hash four passwords, and at
    Django's 1,000,000 iterations that was about 0.2 s each on CI's two cores: minutes of each
    pass. Its hashes carry their iteration count and read as ordinary ``pbkdf2_sha256``, so
    the servers an end-to-end test starts (default hashers) verify them, and upgrade them at
    sign-in as they would any weaker hash."""

    iterations = 1
