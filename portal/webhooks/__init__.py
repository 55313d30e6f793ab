"""One webhook system for every event (billing, sandboxes, alerts): endpoints, delivery
rows, Standard Webhooks signing with rotatable secrets, retries, redelivery.

The apps that own the data build the payloads and call ``deliveries.emit``; this app
imports none of them (only ``portal.accounts`` for the project an endpoint is scoped to).
"""
