"""The twin: the Alibaba openb cluster run live through the real control plane
(``manage.py twin``, ``make twin``)."""
