"""``python -m gpushare_client``: the same as the ``gpushare`` command."""

from gpushare_client.cli import run

run()
