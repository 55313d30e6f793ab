from django.urls import path

from portal.notifications import email_views

urlpatterns = [
    path("account/notifications/", email_views.notification_email, name="notification-email"),
]
