from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    """The scheduling adapter: the database read into the scheduler's types, the policy and
    fleet kept between cycles, the digest the cycle leaves for the request form's preview.
    No models: the cycle itself is the control layer's (``portal/control/scheduling.py``)."""

    name = "portal.scheduling"
    label = "scheduling"
