"""What crosses between the portal and the GPU hosts, in one neutral place.

Both halves import from here and neither is imported by it (an import-linter contract): the
launch message (``spec``, ``storage``), the uid ranges sandboxes run under (``uids``), the
Celery app with its queues and task names (``celery``, ``dispatch``), agents' liveness
(``liveness``), the live telemetry messages (``telemetry``), the terminal and app relay
(``relay``), XID classes (``xids``), byte sizes (``sizes``), and the configuration both read
from the environment (``env``, ``config``, ``embedded_redis``). A GPU host installs the
agent (``workers``) and this; the portal installs everything.
"""
